"""``--model timm/<name>``: the harness builds timm's models by name (no weights), sized for the
data, and trains them; the inits work on them with no hints."""

import json

import pytest
import torch

timm = pytest.importorskip("timm")

import structinit  # noqa: E402
from structinit.harness.cli.main import main as cli  # noqa: E402


def test_create_model_builds_timm_models_sized_for_the_data():
    model = structinit.create_model("timm/vit_tiny_patch16_224", num_classes=10, img_size=32, patch_size=4)
    assert isinstance(model, timm.models.vision_transformer.VisionTransformer)
    assert tuple(model.patch_embed.grid_size) == (8, 8) and model.num_classes == 10
    structinit.init_(model, "impulse", seed=0)
    fid = structinit.impulse_fidelity(model)
    assert bool((fid["hit"] == 1).all())
    # a CNN takes any image size and has no img_size argument: it is built without it
    cnn = structinit.create_model("timm/resnet18", num_classes=10, img_size=32, in_chans=1)
    assert cnn(torch.randn(2, 1, 32, 32)).shape == (2, 10)


def test_unknown_timm_name_is_a_clear_error():
    with pytest.raises(ValueError, match=r"model='timm/vit_tiny_patch99'.*timm has no model.*similar names: vit_"):
        structinit.create_model("timm/vit_tiny_patch99")


def test_structinit_train_and_compare_take_a_timm_model(tmp_path, capsys):
    small = '{"patch_size": 2, "embed_dim": 48, "depth": 2, "num_heads": 2}'
    args = ["--recipe", "digits", "--model", "timm/vit_tiny_patch16_224", "--set", f"model_kwargs={small}",
            "--epochs", "2", "--no-progress"]
    assert cli(["train", *args, "--init", "impulse", "--out", str(tmp_path / "one")]) in (0, None)
    result = json.loads((tmp_path / "one" / "result.json").read_text())
    assert result["config"]["model"] == "timm/vit_tiny_patch16_224" and 0.1 < result["final"]["test_acc"] <= 1
    out = str(tmp_path / "cmp")
    assert cli(["compare", *args, "--inits", "pytorch,mimetic", "--seeds", "1", "--out", out]) in (0, None)
    summary = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    assert set(summary) >= {"pytorch", "mimetic"}


def test_a_timm_vit_whose_patch_is_larger_than_the_image_is_refused_naming_the_model(tmp_path, capsys):
    """timm's vit_tiny_patch16_224 on the 8×8 digits: its 16-pixel patch leaves no token. The
    error names --model and the patch_size that fixes it (it named --init's grid=(0, 0))."""
    args = ["train", "--recipe", "digits", "--model", "timm/vit_tiny_patch16_224", "--out", str(tmp_path / "run"),
            "--no-progress"]
    assert cli(args) == 2
    assert capsys.readouterr().err == (
        "structinit train: error: model='timm/vit_tiny_patch16_224' (--model): its patch, 16 (patch_embed.proj), is "
        "larger than the 8x8 image and leaves no token; pass a smaller patch_size in model_kwargs, e.g. "
        "model_kwargs={'patch_size': 2} (--set \"model_kwargs={'patch_size': 2}\")\n")
    assert not (tmp_path / "run" / "checkpoint.pt").exists()

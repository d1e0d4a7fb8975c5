"""bench/sweep.py's own logic on models built here (the registries it sweeps need the zoo venv):
each outcome it can report, its table and summary, and a sweep that resumes from its file."""

import inspect
import json

import pytest
import sweep
import sweep_models
import torch
from styled_vit import StyledViT
from test_traced_attention import ScatteredRows
from torch import nn


def _refused():
    model = StyledViT("raw-linear")
    model.attns[1] = ScatteredRows(48, 3)
    return model


def test_each_outcome_is_told_apart_on_the_models_own_maps():
    written = sweep.run_one("styled", "here", lambda: StyledViT("einsum"))
    assert [(r.scheme, r.outcome) for r in written] == [("impulse", "written"), ("mimetic", "written")]
    assert all(r.own_map is not None and r.own_map >= 0.95 for r in written[:1])
    refused = sweep.run_one("scattered-rows", "here", _refused)
    assert {r.outcome for r in refused} == {"refused"} and "evenly strided blocks" in refused[0].reason
    none = sweep.run_one("mlp", "here", lambda: nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 10)))
    assert {r.outcome for r in none} == {"no-attention"}
    text = sweep.table(written + refused + none)
    assert text.splitlines()[-1] == ("sweep: 2/4 as expected, 0 silent, 0 tracebacks "
                                     "(0 written with no map of 3 or more keys to check)")


def test_a_model_with_maps_structinit_cannot_read_is_swept_not_counted_as_one_without_attention():
    from test_survey import _PooledKeysNet  # a 64×16 map: keys pooled by a strided convolution

    rows = sweep.run_one("pooled-keys", "here", _PooledKeysNet)
    assert {r.outcome for r in rows} == {"refused"} and "64×16 softmax map" in rows[1].reason


def test_a_survey_that_raises_is_a_traceback_and_a_build_that_raises_is_the_packages(monkeypatch):
    import structinit.adapters.survey as survey

    def broken(model):
        raise RuntimeError("shape '[4, 12, 48]' is invalid")
    monkeypatch.setattr(survey, "attention_survey", broken)
    rows = sweep.run_one("styled", "here", lambda: StyledViT("einsum"))
    assert {r.outcome for r in rows} == {"traceback"} and "is invalid (test_sweep_bench.py:" in rows[0].reason
    unbuilt = sweep.run_one("unbuilt", "here", _needs_natten)
    assert {r.outcome for r in unbuilt} == {"build-failed"} and rows[0].reason.startswith("RuntimeError")


def _needs_natten():
    raise ImportError("this model needs the natten library")


def test_a_write_whose_own_maps_miss_is_silent(monkeypatch):
    # as if the maps showed too little of the write
    monkeypatch.setattr(sweep, "own_map", lambda model, scheme, call=None: 0.4)
    assert {r.outcome for r in sweep.run_one("styled", "here", lambda: StyledViT("einsum"))} == {"silent"}


def test_smallest_picks_the_smallest_sounding_name():
    assert sweep.smallest(["vit_base_patch16_224", "vit_tiny_patch16_224", "vit_small_patch16_224"]) == \
        "vit_tiny_patch16_224"
    assert sweep.smallest(["caformer_b36", "caformer_m36", "caformer_s18"]) == "caformer_s18"  # a size before a depth
    assert sweep.smallest(["levit_384_s8", "levit_128"]) == "levit_128"  # s8 is a stride, not a size


def test_a_saved_sweep_is_printed_again_and_not_rerun(tmp_path, capsys):
    rows = sweep.run_one("styled", "here", lambda: StyledViT("einsum"))
    path = tmp_path / "sweep.json"
    sweep._save(str(path), rows)
    assert sweep.main(["--from", str(path)]) == 0
    assert "| styled | here | impulse | written | 1.00 |  |" in capsys.readouterr().out
    assert [r["outcome"] for r in json.loads(path.read_text())["rows"]] == ["written", "written"]
    torch.testing.assert_close(torch.tensor(rows[0].own_map), torch.tensor(1.0))


def test_the_summary_counts_each_scheme_per_package_from_the_saved_rows(tmp_path, capsys):
    rows = [sweep.Row("a", "here", "impulse", "written", 1.0), sweep.Row("a", "here", "mimetic", "expected"),
            sweep.Row("b", "here", "impulse", "refused"), sweep.Row("b", "here", "mimetic", "unverified"),
            sweep.Row("c", "here", "impulse", "no-attention"), sweep.Row("c", "here", "mimetic", "no-attention"),
            sweep.Row("d", "here", "impulse", "written", 1.0, call="x, grid_thw"),
            sweep.Row("d", "here", "mimetic", "written", 1.0, call="x, grid_thw"),
            sweep.Row("e", "here", "impulse", "too-large"), sweep.Row("e", "here", "mimetic", "too-large")]
    path = tmp_path / "sweep.json"
    sweep._save(str(path), rows)
    assert sweep.main(["--from", str(path), "--summary"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "| here | 3 | 2 (2 written, 0 refused for the mechanism) | 2 (1 written, 1 refused for the mechanism) "
        "| 0 | 0 | 1 | 1 | 1 |")


class _Tower(nn.Module):
    """A forward in Qwen-VL's convention: packed patches and each image's grid (the test model of
    tests/test_example_inputs.py), with the config fields a processor reads."""

    def __init__(self):
        super().__init__()
        from layout_models import PackedTower

        self.inner = PackedTower()
        self.config = type("Config", (), {"in_channels": 3, "patch_size": 2, "spatial_merge_size": 2})()

    def forward(self, hidden_states, grid_thw):
        return self.inner(hidden_states, grid_thw)


def test_a_tower_that_takes_packed_patches_is_called_as_its_processor_would_and_checked_in_that_call():
    call = sweep.tower_call(_Tower())
    assert set(call) == {"hidden_states", "grid_thw"} and call["hidden_states"].shape == (64, 12)
    assert call["grid_thw"].tolist() == [[1, 8, 8]]
    assert sweep.tower_call(StyledViT("einsum")) is None  # images alone: left to the probe
    rows = sweep.run_one("tower", "transformers", _Tower, schemes=("mimetic",))
    assert [(r.outcome, r.call) for r in rows] == [("written", "hidden_states, grid_thw")]
    assert rows[0].own_map >= 0.5


class _NaViT(nn.Module):
    """SigLIP-2's convention: padded patches, each image's (h, w) and a mask of the real ones."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(12, 48)
        self.attn = nn.MultiheadAttention(48, 3, batch_first=True)

    def forward(self, pixel_values, pixel_attention_mask=None, spatial_shapes=None):
        x = self.embed(pixel_values)
        return self.attn(x, x, x, key_padding_mask=pixel_attention_mask == 0)[0]


def test_a_navit_forward_is_called_with_padded_patches_their_shapes_and_mask():
    call = sweep.tower_call(_NaViT())
    assert call["pixel_values"].shape == (1, 64, 12) and call["spatial_shapes"].tolist() == [[8, 8]]
    assert call["pixel_attention_mask"].shape == (1, 64)


class _VideoTower(StyledViT):
    """X-CLIP's convention: a clip's frames as a batch of images, the batch a whole number of
    clips (its config's ``num_frames``)."""

    def __init__(self):
        super().__init__("raw-linear")
        self.config = type("Config", (), {"num_frames": 4, "image_size": 16})()

    def forward(self, pixel_values):
        if pixel_values.shape[0] % self.config.num_frames:
            raise RuntimeError("shape '[0, 4, 48]' is invalid")
        return super().forward(pixel_values)


def test_a_video_tower_is_called_with_one_clips_frames():
    call = sweep.tower_call(_VideoTower())
    assert call["pixel_values"].shape == (4, 3, 16, 16)


class _ClipTower(_VideoTower):
    """VideoPrism's convention: ``pixel_values_videos``, one (frames, C, H, W) clip per sample."""

    def forward(self, pixel_values_videos=None):
        b, t = pixel_values_videos.shape[:2]
        return StyledViT.forward(self, pixel_values_videos.flatten(0, 1)).reshape(b, t, -1).mean(1)


class _FlattenedTower(nn.Module):
    """Pix2Struct's convention: each patch's 1-based row and column ids, then its pixels."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(12, 48)
        self.rows, self.cols = nn.Embedding(9, 48), nn.Embedding(9, 48)
        self.attn = nn.MultiheadAttention(48, 3, batch_first=True)

    def forward(self, flattened_patches=None, attention_mask=None):
        ids = flattened_patches[..., :2].long()
        x = self.embed(flattened_patches[..., 2:]) + self.rows(ids[..., 0]) + self.cols(ids[..., 1])
        return self.attn(x, x, x, key_padding_mask=attention_mask == 0)[0]


def test_a_clip_tower_and_a_flattened_patch_tower_are_called_as_their_processors_would():
    assert sweep.tower_call(_ClipTower())["pixel_values_videos"].shape == (1, 4, 3, 16, 16)
    call = sweep.tower_call(_FlattenedTower())
    patches = call["flattened_patches"]
    assert patches.shape == (1, 64, 14) and call["attention_mask"].shape == (1, 64)
    assert patches[0, :, 0].long().tolist() == [r for r in range(1, 9) for _ in range(8)]  # rows, then columns
    assert patches[0, :, 1].long().tolist() == list(range(1, 9)) * 8


class _BatchedPatchTower(nn.Module):
    """PaddleOCR-VL's convention: (1, T, C, p, p) patches for a patch convolution and an optional
    ``grid_thw``, without which the forward cannot tell the images apart."""

    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"num_channels": 3, "patch_size": 2})()
        self.conv, self.attn = nn.Conv2d(3, 48, 2, stride=2), nn.MultiheadAttention(48, 3, batch_first=True)
        self.embed = nn.Linear(12, 48)

    def forward(self, pixel_values, grid_thw=None):
        if grid_thw is None or pixel_values.ndim != 5:
            raise ValueError("patches and their grid_thw, please")
        x = self.conv(pixel_values[0]).flatten(1)[None]
        return self.attn(x, x, x)[0]


class _RowOfPatchesTower(_BatchedPatchTower):
    """MiniCPM-V's convention: the patches side by side in one (1, C, p, T·p) row, and each image's
    (h, w) as optional ``target_sizes``."""

    def forward(self, pixel_values, target_sizes=None):
        if target_sizes is None or pixel_values.ndim != 4 or pixel_values.shape[-2] != 2:
            raise ValueError("a row of patches and their target_sizes, please")
        t = pixel_values.shape[-1] // 2
        x = self.embed(pixel_values.reshape(1, 3, 2, t, 2).permute(0, 3, 1, 2, 4).reshape(1, t, 12))
        return self.attn(x, x, x)[0]


def test_towers_whose_grid_argument_is_optional_are_called_with_their_patches_and_grid():
    call = sweep.tower_call(_BatchedPatchTower())
    assert call["pixel_values"].shape == (1, 64, 3, 2, 2) and call["grid_thw"].tolist() == [[1, 8, 8]]
    call = sweep.tower_call(_RowOfPatchesTower())
    assert call["pixel_values"].shape == (1, 3, 2, 128) and call["target_sizes"].tolist() == [[8, 8]]


def test_a_config_of_strided_stages_is_shrunk_to_an_image_whose_last_stage_holds_a_kernel():
    from sweep_models import shrink

    class Config:  # PVT's sizes: stages downsampled 4, 2, 2 and 2 times
        def __init__(self):
            self.image_size, self.strides, self.hidden_size = 224, (4, 2, 2, 2), 512

    config = Config()
    shrink(config)
    assert config.image_size == 128 and config.image_size // 32 == 4  # a 4×4 last stage, where 64 px gave 2×2


def test_the_summary_counts_transformers_vision_architectures_across_both_inits(tmp_path, capsys):
    rows = [sweep.Row("a.vision", "transformers", "impulse", "written", 1.0),
            sweep.Row("a.vision", "transformers", "mimetic", "refused", reason="no adapter"),
            sweep.Row("b.vision", "transformers", "impulse", "expected", reason="reads token ids"),
            sweep.Row("b.vision", "transformers", "mimetic", "too-large")]
    path = tmp_path / "sweep.json"
    sweep._save(str(path), rows)
    assert sweep.main(["--from", str(path), "--summary"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "transformers vision architectures (towers and image classifiers, both inits): 2/3 as expected (66.7 %)")


def test_a_sweep_resumed_from_its_file_says_which_rows_it_kept(tmp_path, capsys, monkeypatch):
    """Rows an earlier sweep finished are kept, not run again, and said so: a rerun after a fix
    that writes to the same file would otherwise print the old rows as if new."""
    path = tmp_path / "sweep.json"
    sweep._save(str(path), [sweep.Row("kept", "timm", s, "refused", reason="old") for s in sweep.SCHEMES])
    monkeypatch.setattr(sweep, "timm_entries", lambda: [("kept", None), ("new", None)])
    monkeypatch.setattr(sweep, "run_one", lambda name, package, build, schemes: [
        sweep.Row(name, package, s, "no-attention") for s in schemes])
    assert sweep.main(["--packages", "timm", "--out", str(path)]) == 0
    err = capsys.readouterr().err
    assert "kept impulse: refused | kept mimetic: refused (kept from --out)" in err
    assert "new impulse: no-attention | new mimetic: no-attention\n" in err
    assert f"1 model(s) not run again: their rows were kept from {path}" in err
    assert [r["model"] for r in json.loads(path.read_text())["rows"]] == ["kept", "kept", "new", "new"]


def test_a_sweep_of_some_models_into_a_file_keeps_the_files_other_rows(tmp_path, monkeypatch):
    """``--only`` into an existing ``--out`` file reruns the models named and leaves every other
    model's rows in the file, in the sweep's order (it wrote the models run alone, dropping the rest)."""
    path = tmp_path / "sweep.json"
    old = [sweep.Row(name, "timm", s, "refused", reason="old") for name in ("a", "b", "c") for s in sweep.SCHEMES]
    sweep._save(str(path), [r for r in old if r.model != "b"])  # b's rows deleted, to run it again
    monkeypatch.setattr(sweep, "timm_entries", lambda: [("a", None), ("b", None), ("c", None)])
    monkeypatch.setattr(sweep, "run_one", lambda name, package, build, schemes: [
        sweep.Row(name, package, s, "written", own_map=1.0) for s in schemes])
    assert sweep.main(["--packages", "timm", "--only", "b", "--out", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(r["model"], r["outcome"]) for r in rows] == [
        ("a", "refused"), ("a", "refused"), ("b", "written"), ("b", "written"), ("c", "refused"), ("c", "refused")]


class _Wrapper(nn.Module):
    """A class that takes another network (MAE's and DINO's convention): no model of an image batch."""

    def __init__(self, *, encoder, num_classes=10):
        super().__init__()
        self.encoder = encoder


class _Broken(nn.Module):
    """A class that builds from the usual sizes but whose forward fails on an image batch."""

    def __init__(self, *, image_size, patch_size, num_classes, dim):
        super().__init__()
        self.embed = nn.Linear(3 * patch_size**2, dim)

    def forward(self, img):
        return self.embed(img)  # the pixels, not the patches: a shape error


def test_a_vit_pytorch_class_that_needs_a_network_is_left_out_and_one_that_fails_is_build_failed():
    assert not sweep_models._vp_is_image_model(_Wrapper) and sweep_models._vp_is_image_model(_Broken)
    rows = sweep.run_one("broken.Broken", "vit_pytorch", lambda: sweep_models._vp_build(_Broken, "broken.Broken"))
    assert {r.outcome for r in rows} == {"build-failed"}
    assert rows[0].reason.startswith("RuntimeError: forward on (2, 3, 32, 32): RuntimeError: mat1 and mat2")


def test_vit_pytorch_sizes_are_filled_by_name_suffix_and_cut_per_stage():
    empty = inspect.Parameter.empty
    assert sweep_models._vp_fill("dim", empty) == 64 and sweep_models._vp_fill("sm_enc_mlp_dim", 2048) == 128
    assert sweep_models._vp_fill("s1_depth", 1) == 1 and sweep_models._vp_fill("depth", (2, 2, 8, 2)) == (2, 2, 2, 2)
    assert sweep_models._vp_fill("specialize_qkv_depth", None) is None  # an option left off, not a size
    assert sweep_models._vp_fill("use_glu", True) is None and sweep_models._vp_fill("pool", "cls") is None


def test_the_sweep_takes_vit_pytorch_as_a_package_and_refuses_one_it_does_not_know(monkeypatch, capsys):
    monkeypatch.setattr(sweep, "vit_pytorch_entries", lambda: [("vit.ViT", None)])
    monkeypatch.setattr(sweep, "run_one", lambda name, package, build, schemes: [
        sweep.Row(name, package, s, "written", own_map=1.0) for s in schemes])
    assert sweep.main(["--packages", "vit_pytorch"]) == 0
    assert "| vit.ViT | vit_pytorch | impulse | written | 1.00 |  |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        sweep.main(["--packages", "vitpytorch"])


class _PatchPlaces(_NaViT):
    """Gemma 4's convention: flat patches and each patch's (x, y), every one of them required."""

    def forward(self, pixel_values, pixel_position_ids):
        assert pixel_position_ids.shape == (*pixel_values.shape[:2], 2)
        return self.attn(*(self.embed(pixel_values),) * 3)[0]


def test_a_forward_that_takes_each_patchs_place_is_called_with_its_grid_in_x_y_order():
    call = sweep.tower_call(_PatchPlaces())
    assert call["pixel_values"].shape == (1, 64, 12) and "spatial_shapes" not in call
    assert call["pixel_position_ids"][0, :3].tolist() == [[0, 0], [1, 0], [2, 0]]  # x runs along a row first


def test_the_zoo_pages_sweep_numbers_are_those_of_the_committed_runs():
    """docs/results/zoo.md quotes each sweep's table rows and last lines: they must be what
    ``bench/sweep.py --from <file> --summary`` (and the run's own last line) says of the data."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    page = " ".join((root / "docs/results/zoo.md").read_text().split())  # lines wrapped anywhere
    for name in ("timm", "transformers", "transformers-w64", "vit_pytorch"):
        rows = [sweep.Row(**r) for r in json.loads((root / f"docs/results/data/sweep/{name}.json").read_text())["rows"]]
        last = sweep.summary(rows).split(" (")[0]  # as quoted: without the count of writes with no map to check
        assert f"`{last}`" in page, (name, last)
        for line in sweep.summary_table(rows).splitlines():
            if line.startswith("| ") and not line.startswith("| package") and name != "transformers-w64":
                assert line in page, (name, line)  # the table shows width 96
            elif line.startswith("transformers vision"):
                assert line.split(": ", 1)[1] in page, (name, line)

"""Reading finished runs back: the init rebuilt exactly, the trained weights loaded strictly,
and clear errors for folders and files that are not what a run leaves."""

import json

import pytest
import torch

from structinit.harness.finished import find_runs, load_run, load_trained_weights, models_of
from structinit.harness.recipes import recipe
from structinit.harness.run.checkpoint import WEIGHTS, save_weights
from structinit.harness.tasks import train
from structinit.models import create_model


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "impulse" / "seed0"
    train(recipe("digits", out_dir=str(out), epochs=1, train_size=128, init="impulse"), progress=False)
    return out


def test_models_of_a_run_are_its_init_and_its_final_weights(finished):
    run = load_run(finished)
    assert run.label == "impulse seed 0" and run.config.init == "impulse"
    initial, trained = models_of(run, (1, 8, 8), 10)
    from structinit.harness.run.checkpoint import init_fingerprint, load_weights

    assert init_fingerprint(initial) == run.result["init_fingerprint"]
    weights, _ = load_weights(finished / WEIGHTS)
    for name, value in trained.state_dict().items():
        assert torch.equal(value, weights[name])
    assert not torch.equal(initial.head.weight, trained.head.weight)


def test_find_runs_reads_a_comparison_folder_or_one_run(finished):
    assert [r.path for r in find_runs(finished.parent.parent)] == [finished]
    assert [r.path for r in find_runs(finished)] == [finished]


def test_folders_that_are_not_runs_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        load_run(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"has no result.json: it is not a finished run"):
        load_run(tmp_path)
    (tmp_path / "result.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"result.json: not readable JSON"):
        load_run(tmp_path)
    (tmp_path / "result.json").write_text(json.dumps({"config": {}}))
    with pytest.raises(ValueError, match=r"not a structinit result \(missing final, history, seed\)"):
        load_run(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"holds no finished run"):
        find_runs(empty)


def test_weights_of_another_architecture_name_the_keys(tmp_path):
    other = create_model("vit_micro_patch2_16")
    save_weights(tmp_path / WEIGHTS, other.state_dict())
    target = create_model("vit_cpu_patch2_8", in_chans=1, img_size=8)
    with pytest.raises(ValueError, match=r"another architecture than VisionTransformer \(.*other shape: "):
        load_trained_weights(target, tmp_path / WEIGHTS)
    state = other.state_dict()
    del state["head.bias"]
    save_weights(tmp_path / "partial.safetensors", state)
    with pytest.raises(ValueError, match=r"missing: head.bias"):
        load_trained_weights(create_model("vit_micro_patch2_16"), tmp_path / "partial.safetensors")


def test_a_swin_run_reads_its_classes_from_its_head_and_shows_its_windows(tmp_path):
    """Swin's classifier is head.fc (timm's layout): the run still gives its classes and maps."""
    from structinit.harness.cli.main import main

    out = tmp_path / "swin" / "seed0"
    cfg = recipe("digits", out_dir=str(out), epochs=1, train_size=64, model="swin_cpu_patch2_32",
                 init="impulse", init_options={"layers": (0, 1, 2, 3)})  # 8×8 digits: the last stage is 1×1
    train(cfg, progress=False)
    run = load_run(out)
    assert run.num_classes == 10
    assert main(["attention", "--run", str(out), "--layers", "0", "--out", str(tmp_path / "figs")]) == 0
    assert (tmp_path / "figs" / "before_after.png").is_file()
    save_weights(tmp_path / "bare" / WEIGHTS, {"blocks.0.weight": torch.zeros(2, 2)})
    (tmp_path / "bare" / "result.json").write_text((out / "result.json").read_text())
    with pytest.raises(ValueError, match=r"none of head\.weight, head\.fc\.weight, .*number of classes is unknown"):
        _ = load_run(tmp_path / "bare").num_classes


def test_weights_copied_in_from_another_run_are_refused(finished, tmp_path):
    """A run folder whose model.safetensors came from another run (same architecture, another
    init) is refused by the fingerprint in the file's header, not drawn beside the wrong init."""
    import shutil

    other = tmp_path / "pytorch" / "seed0"
    train(recipe("digits", out_dir=str(other), epochs=1, train_size=128, init="pytorch"), progress=False)
    mixed = tmp_path / "mixed"
    shutil.copytree(finished, mixed)
    shutil.copy(other / WEIGHTS, mixed / WEIGHTS)
    with pytest.raises(ValueError, match=r"trained from another init .* than the run's result.json records"):
        models_of(load_run(mixed), (1, 8, 8), 10)
    models_of(load_run(finished), (1, 8, 8), 10)  # its own weights still load

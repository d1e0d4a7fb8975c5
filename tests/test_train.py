"""The training harness on the embedded digits set: learning, exact resume after a real kill,
non-finite loss handling, distributed data parallel on CPU, checkpoints, metrics, compare."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from run_helpers import kill_then_resume
from structinit.harness.compare import compare
from structinit.harness.config import ImageConfig
from structinit.harness.errors import NonFiniteLossError
from structinit.harness.recipes import recipe
from structinit.harness.run.checkpoint import load_checkpoint, save_checkpoint
from structinit.harness.run.optim import cosine_lr
from structinit.harness.specs import parse_init_spec, parse_literal, split_init_specs
from structinit.harness.tasks import train

ROOT = Path(__file__).resolve().parents[1]


def digits(tmp_path: Path, **kw) -> ImageConfig:
    """The digits recipe on all 1,437 training images (the recipe itself uses 300)."""
    return recipe("digits", out_dir=str(tmp_path / "run"), **{"epochs": 3, "train_size": None, **kw})


def states_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_digits_learns_and_writes_run_files(tmp_path):
    result = train(digits(tmp_path, epochs=6, init="impulse"), progress=False)
    run = tmp_path / "run"
    assert result["final"]["test_acc"] > 0.5  # 10 classes: chance is 0.1
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == list(range(1, 7))
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    header = (run / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"epoch", "train_loss", "test_acc", "images_per_s"} <= set(header)
    saved = json.loads((run / "result.json").read_text())
    assert saved["config"]["init"] == "impulse" and saved["versions"]["torch"] == torch.__version__
    assert saved["epochs_done"] == 6 and saved["wall_s"] > 0


def test_same_seed_same_run_bit_identical(tmp_path):
    a = train(digits(tmp_path / "a", epochs=2), progress=False)
    b = train(digits(tmp_path / "b", epochs=2), progress=False)
    assert a["final"] == b["final"]
    assert states_equal(load_checkpoint(tmp_path / "a/run/checkpoint.pt")["model"],
                        load_checkpoint(tmp_path / "b/run/checkpoint.pt")["model"])


def test_existing_run_needs_resume_and_same_config(tmp_path):
    cfg = digits(tmp_path, epochs=1)
    train(cfg, progress=False)
    with pytest.raises(FileExistsError, match="resume"):
        train(cfg, progress=False)
    assert train(cfg, resume=True, progress=False)["epochs_done"] == 1  # finished: returned as is
    changed = digits(tmp_path, epochs=1, lr=5e-3)
    with pytest.raises(ValueError, match="lr"):
        train(changed, resume=True, progress=False)


def test_resume_refuses_a_run_whose_init_changed_since(tmp_path, monkeypatch):
    """The checkpoint records a fingerprint of the initial weights: when an init's defaults
    change, an old run with the same spelled-out config is not silently resumed or reused."""
    from structinit.functional import AnalyticSolver

    cfg = digits(tmp_path, epochs=1, init="impulse")
    first = train(cfg, progress=False)
    assert len(first["init_fingerprint"]) == 64
    assert train(cfg, resume=True, progress=False)["final"] == first["final"]  # unchanged: reused
    monkeypatch.setitem(AnalyticSolver.__init__.__kwdefaults__, "target_mass", 0.6)  # "a new default"
    with pytest.raises(ValueError, match=r"checkpoint\.pt was trained from different initial weights"):
        train(cfg, resume=True, progress=False)


def _cli(out: Path, epochs: int) -> list[str]:
    # Small batches make each epoch of 720 images 45 steps: long enough to be killed in the middle.
    return [sys.executable, "-m", "structinit", "train", "--recipe", "digits", "--init", "impulse",
            "--epochs", str(epochs), "--batch-size", "16", "--set", "train_size=720", "--out", str(out),
            "--no-progress"]


def test_killed_run_resumes_to_bit_identical_weights(tmp_path):
    """Kill a real training process (SIGKILL) in the middle of an epoch, resume it, and get
    exactly the weights of a run that was never interrupted."""
    epochs = 4
    killed, done, ref = kill_then_resume(lambda out: _cli(out, epochs), tmp_path, ROOT, pause=0.5)  # mid-epoch 3
    assert killed["epoch"] < epochs, "the process finished before it could be killed"
    assert done["epoch"] == epochs
    # The resumed process started at the checkpoint's step, not from scratch: training is
    # deterministic, so a restart from step 0 would reach the same weights too.
    assert 0 < killed["step"] and done["starts"] == [0, killed["step"]] and ref["starts"] == [0]
    assert json.loads((tmp_path / "victim/result.json").read_text())["starts"] == [0, killed["step"]]
    assert states_equal(done["model"], ref["model"])
    assert [r["epoch"] for r in done["history"]] == list(range(1, epochs + 1))
    lines = (tmp_path / "victim/metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == list(range(1, epochs + 1))  # no duplicates


def test_a_run_with_ema_interrupted_and_resumed_ends_with_the_uninterrupted_runs_ema(tmp_path, monkeypatch):
    """The weight average is part of what a resume restores: a run with EMA stopped in the
    middle of epoch 2 (Ctrl-C's KeyboardInterrupt, raised by the step) and resumed from its
    epoch-1 checkpoint exports the bit-identical model_ema.safetensors of a run never stopped
    (an average restarted from the resumed weights would differ)."""
    from safetensors.torch import load_file

    from structinit.harness.run import lifecycle

    kw = {"epochs": 3, "train_size": 128, "ema_decay": 0.9, "eval_every": 3}  # 2 steps an epoch
    train(digits(tmp_path / "whole", **kw), progress=False)

    class StoppedAtStep3(lifecycle.TrainStep):
        def __call__(self, step, x, y):
            if step == 3:
                raise KeyboardInterrupt
            return super().__call__(step, x, y)

    cfg = digits(tmp_path / "stopped", **kw)
    with monkeypatch.context() as patch:
        patch.setattr(lifecycle, "TrainStep", StoppedAtStep3)
        with pytest.raises(KeyboardInterrupt):
            train(cfg, progress=False)
    kept = load_checkpoint(tmp_path / "stopped/run/checkpoint.pt")
    assert (kept["epoch"], kept["step"]) == (1, 2) and kept["ema"] is not None
    done = train(cfg, resume=True, progress=False)
    assert done["starts"] == [0, 2]
    ema, whole = (load_file(tmp_path / d / "run/model_ema.safetensors") for d in ("stopped", "whole"))
    assert states_equal(ema, whole)
    assert states_equal(load_file(tmp_path / "stopped/run/model.safetensors"),
                        load_file(tmp_path / "whole/run/model.safetensors"))


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    # Epoch 1 warms up at a flat, tiny lr; from epoch 2 the "cosine decay" runs from lr up to an
    # absurd min_lr (min_lr > lr), without clipping, so the loss blows up in epoch 2.
    cfg = digits(tmp_path, epochs=3, warmup_epochs=1, warmup_lr=1e-6, lr=1e-6, min_lr=1e12, grad_clip=None)
    with pytest.raises(NonFiniteLossError, match="not finite"):
        train(cfg, progress=False)
    saved = load_checkpoint(tmp_path / "run/checkpoint.pt")
    assert saved["epoch"] == 1
    assert all(torch.isfinite(v).all() for v in saved["model"].values() if v.dtype.is_floating_point)


PATCH_16 = ("model='convmixer_cpu_128_6' (--model): its patch, 16 (stem), is larger than the 8x8 image and leaves no "
            "token; pass a smaller patch_size in model_kwargs, e.g. model_kwargs={'patch_size': 2} (--set "
            "\"model_kwargs={'patch_size': 2}\")")


def test_a_patch_larger_than_the_image_is_refused_naming_the_model_and_its_patch_size(tmp_path, capsys):
    """A 16-pixel patch on the 8×8 digits leaves no token: the error names --model and the
    patch_size that fixes it (it was a convolution's RuntimeError in the first step here, and
    an init's riddle 'grid=(0, 0)' with a ViT of timm's), before anything is trained."""
    from structinit.harness.cli import main as cli

    cfg = digits(tmp_path, model="convmixer_cpu_128_6", model_kwargs={"patch_size": 16}, epochs=1)
    with pytest.raises(ValueError) as refused:
        train(cfg, progress=False)
    assert str(refused.value) == PATCH_16 and not (tmp_path / "run/checkpoint.pt").exists()
    args = ["train", "--recipe", "digits", "--model", "convmixer_cpu_128_6", "--set",
            "model_kwargs={'patch_size': 16}", "--out", str(tmp_path / "cli"), "--no-progress"]
    assert cli.main(args) == 2
    assert capsys.readouterr().err == f"structinit train: error: {PATCH_16}\n"


def test_any_first_convolution_larger_than_the_image_is_refused():
    from torch import nn

    from structinit.harness.run.lifecycle import check_fits_image

    wide = nn.Sequential(nn.Conv2d(1, 4, 9), nn.Flatten())
    with pytest.raises(ValueError, match=r"model='wide' \(--model\): its first convolution, 0 \(9 kernel, stride 1\), "
                                         r"is larger than the 8x8 image"):
        check_fits_image("wide", wide, 8, 1)
    check_fits_image("wide", wide, 9, 1)  # one output pixel: it fits
    check_fits_image("padded", nn.Sequential(nn.Conv2d(1, 4, 9, padding=1)), 8, 1)
    check_fits_image("same", nn.Sequential(nn.Conv2d(1, 4, 9, padding="same")), 8, 1)
    check_fits_image("on tokens", nn.Sequential(nn.Conv2d(32, 32, 9)), 8, 1)  # not a convolution of the image
    patch = nn.Sequential(nn.Conv2d(3, 8, (4, 16), stride=(4, 16)))
    with pytest.raises(ValueError, match=r"its patch, 4x16 \(0\), is larger than the 32x8 image.*'patch_size': 2\}"):
        check_fits_image("tall", patch, (32, 8), 3)


def test_checkpoint_atomic_and_safe(tmp_path):
    path = tmp_path / "ck.pt"
    save_checkpoint(path, {"a": torch.arange(3), "n": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]  # no temporary left behind
    assert torch.equal(load_checkpoint(path)["a"], torch.arange(3))
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(ValueError, match=r"ck\.pt"):
        load_checkpoint(path)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"x": Evil()}, path)
    with pytest.raises(ValueError, match="not a readable"):
        load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match=r"missing\.pt"):
        load_checkpoint(tmp_path / "missing.pt")


def test_distributed_two_processes_gloo(tmp_path):
    """Two processes under torchrun train what one process trains: without augmentation each
    step's two half-batches are the one-process batch, so the loss curves and the accuracy
    agree up to the order of floating-point sums."""
    args = ["-m", "structinit", "train", "--recipe", "digits", "--epochs", "4", "--set", "train_size=None",
            "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, *args, "--out", str(tmp_path / "one")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args[1:],
           "--out", str(tmp_path / "ddp")]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("result.json") == 1  # only rank 0 reports
    ddp, ref = (json.loads((tmp_path / name / "result.json").read_text()) for name in ("ddp", "one"))
    assert ddp["world_size"] == 2 and ref["world_size"] == 1
    losses = [(a["train_loss"], b["train_loss"]) for a, b in zip(ddp["history"], ref["history"])]
    assert len(losses) == 4 and all(abs(a - b) < 1e-3 * b for a, b in losses), losses
    assert abs(ddp["final"]["test_acc"] - ref["final"]["test_acc"]) <= 0.01 and ref["final"]["test_acc"] > 0.5


def test_cosine_schedule_shape():
    cfg = ImageConfig(lr=1.0, min_lr=0.1, warmup_lr=0.0)
    assert cosine_lr(0, 100, 10, cfg) == 0.0
    assert cosine_lr(10, 100, 10, cfg) == pytest.approx(1.0)
    assert cosine_lr(55, 100, 10, cfg) == pytest.approx(0.55)
    assert cosine_lr(100, 100, 10, cfg) == pytest.approx(0.1)


def test_compare_resumes_without_redoing_finished_runs(tmp_path, capsys):
    base = recipe("digits", epochs=2, train_size=None)
    out = tmp_path / "cmp"
    first = compare(base, ["pytorch", "impulse:target_mass=0.3"], [0, 1], out, progress=False)
    said = capsys.readouterr().out
    assert "== 4 runs (2 inits × 2 seeds), 0 already finished" in said
    assert "== 3 runs left, about" in said and "== 1 run left, about" in said  # the estimate, after each run
    assert set(first) == {"pytorch", "impulse:target_mass=0.3"}
    assert len(first["pytorch"]["accs"]) == 2 and (out / "accuracy.png").stat().st_size > 1000
    finished = out / "pytorch/seed0/result.json"
    stamp = finished.stat().st_mtime_ns
    (out / "pytorch/seed1/result.json").unlink()  # as if killed after its last checkpoint
    capsys.readouterr()
    again = compare(base, ["pytorch", "impulse:target_mass=0.3"], [0, 1], out, progress=False)
    said = capsys.readouterr().out
    assert "== 4 runs (2 inits × 2 seeds), 3 already finished" in said and "left, about" not in said
    assert finished.stat().st_mtime_ns == stamp
    assert again["pytorch"]["accs"] == first["pytorch"]["accs"]
    assert "± " in (out / "summary.md").read_text()


def test_parse_init_spec():
    assert parse_init_spec("impulse:target_mass=0.3,solver=gd,offsets=enumerated") == (
        "impulse", {"target_mass": 0.3, "solver": "gd", "offsets": "enumerated"})
    # commas inside brackets belong to the value
    assert parse_init_spec("impulse:layers=(0,1,2),pe_scale=1.0,offsets=[(0,1),(1,0)]") == (
        "impulse", {"layers": (0, 1, 2), "pe_scale": 1.0, "offsets": [(0, 1), (1, 0)]})


def test_parse_literal_is_what_cli_and_specs_read():
    assert parse_literal("0.3") == 0.3 and parse_literal("None") is None and parse_literal("(0,1)") == (0, 1)
    assert parse_literal("gd") == "gd" and parse_literal("'3'") == "3" and parse_literal("1e-3") == 1e-3
    assert parse_literal("{[1]: 2}") == "{[1]: 2}"  # unhashable key: kept as text, not a crash
    assert parse_init_spec("impulse:pe_scale=2,solver=gd")[1] == {"pe_scale": parse_literal("2"), "solver": "gd"}


def test_split_init_specs():
    assert split_init_specs("pytorch,impulse:pe_scale=1.0,layers=(0,1,2),target_mass=0.3,mimetic") == [
        "pytorch", "impulse:pe_scale=1.0,layers=(0,1,2),target_mass=0.3", "mimetic"]
    assert split_init_specs("impulse:layers=(0,1,2)") == ["impulse:layers=(0,1,2)"]
    assert split_init_specs("impulse:pe_scale=2.0;impulse:target_mass=0.3") == [
        "impulse:pe_scale=2.0", "impulse:target_mass=0.3"]
    assert split_init_specs("pytorch,,timm,") == ["pytorch", "timm"]
    with pytest.raises(ValueError, match="'pe_scale=2' follows no 'scheme:'"):
        split_init_specs("pytorch,pe_scale=2")


def test_compare_checks_every_spec_before_training(tmp_path):
    base = recipe("digits", epochs=1, train_size=None)
    with pytest.raises(ValueError, match="unknown scheme 'bogus'"):
        compare(base, ["pytorch", "bogus"], [0], tmp_path / "cmp", progress=False)
    with pytest.raises(ValueError, match="expected name:key=value"):
        compare(base, ["pytorch", "impulse:pe_scale"], [0], tmp_path / "cmp", progress=False)
    assert not (tmp_path / "cmp").exists()  # nothing was trained
    assert parse_init_spec("timm") == ("timm", {})
    with pytest.raises(ValueError, match="key=value"):
        parse_init_spec("impulse:oops")


@pytest.mark.parametrize(("spec", "message"), [
    # a misspelt option: an OptionError (a ValueError) that names it and lists the valid ones
    ("impulse:target_mas=0.3", r"'impulse:target_mas=0\.3': .*unknown option.*target_mas; valid: target_mass"),
    # a bad value: the option and the value it got
    ("impulse:pe_scale=abc", r"init spec 'impulse:pe_scale=abc': .*pe_scale='abc'"),
    ("impulse:solver=gd,stepz=10", r"init spec 'impulse:solver=gd,stepz=10': .*unknown option.*stepz"),
    ("impulse:target_mass=2.0", r"target_mass=2\.0: expected a number in \(0, 1\)"),
])
def test_compare_plans_every_spec_before_the_first_run(tmp_path, spec, message):
    """Each spec is planned (checked and computed, not written) on the model its run would
    build, so a bad option in the last spec fails before the first spec trains."""
    base = recipe("digits", epochs=1, train_size=None)
    with pytest.raises(ValueError, match=message):
        compare(base, ["pytorch", spec], [0, 1], tmp_path / "cmp", progress=False)
    assert not (tmp_path / "cmp").exists()  # no run folder was created


def test_spec_labels_are_single_folder_names():
    from structinit.harness.specs import spec_label

    assert spec_label("impulse:pe_scale=2,layers=(0,1)") == "impulse_pe_scale-2_layers-(0_1)"
    label = spec_label("covariance_transfer:source=runs/cm/pytorch/seed0/model.safetensors")
    assert "/" not in label and label == "covariance_transfer_source-runs+cm+pytorch+seed0+model.safetensors"


def test_ctrl_c_in_a_command_is_one_line_and_exit_130(monkeypatch, capsys):
    from structinit.harness.cli import main as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_train", interrupted)
    assert cli.main(["train", "--recipe", "digits"]) == 130
    assert capsys.readouterr().err.strip() == ("structinit train: interrupted; the last finished epoch is kept: run "
                                               "it again with --resume to continue")


@pytest.mark.parametrize("sig,code,said", [(15, 143, "terminated (SIGTERM)")])
def test_a_signal_stops_a_run_in_one_line_and_it_resumes(tmp_path, sig, code, said):
    """SIGTERM (as Ctrl-C, whose path the test above takes) stops a training process with its own
    exit status and one line that says what was kept, no traceback; --resume then finishes the run."""
    import signal

    from run_helpers import wait_for_rows

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "run"
    proc = subprocess.Popen(_cli(out, 4), env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    assert wait_for_rows(out / "metrics.jsonl", 1), "the run wrote no epoch"
    proc.send_signal(signal.Signals(sig))
    _, err = proc.communicate(timeout=60)
    last = err.strip().splitlines()[-1]
    assert proc.returncode == code and "Traceback" not in err
    assert last == f"structinit train: {said}; the last finished epoch is kept: run it again with --resume to continue"
    kept = load_checkpoint(out / "checkpoint.pt")
    assert 1 <= kept["epoch"] < 4
    done = subprocess.run([*_cli(out, 4), "--resume"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and load_checkpoint(out / "checkpoint.pt")["starts"] == [0, kept["step"]]


def test_two_ranks_take_disjoint_halves_that_make_the_one_process_batch():
    """What the two-process test above cannot see: each rank's batch is its own half, the halves
    never overlap, and together they are exactly the batch one process takes at that step."""
    from structinit.data import ArrayDataset
    from structinit.harness.run.device import Placement
    from structinit.harness.tasks.image import ImageTask

    n, batch = 96, 16
    images = torch.randint(0, 256, (n, 1, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    data = ArrayDataset(images, torch.arange(n) % 10, [str(k) for k in range(10)], "random", (0.5,), (0.25,))
    cfg = recipe("digits", batch_size=batch, augment="none", epochs=2)

    def steps(world: int, rank: int) -> list[list[tuple]]:
        task = ImageTask(cfg)
        task.check()  # as a run does first: it builds the augmentation
        where = Placement(world, rank, torch.device("cpu"))
        task.place(data, {}, where)
        chunk = task.schedule()[0][1]  # the second epoch: another order than the first
        return [[tuple(row.tolist()) for row in x.flatten(1)] for x, _ in task.batches(chunk, where)]

    one, first, second = steps(1, 0), steps(2, 0), steps(2, 1)
    assert len(one) == len(first) == len(second) == n // batch
    for whole, a, b in zip(one, first, second):
        assert len(a) == len(b) == batch // 2 and not set(a) & set(b)
        assert sorted(a + b) == sorted(whole)

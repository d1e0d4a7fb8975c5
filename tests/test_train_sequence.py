"""The sequence-task training path (harness/train_sequence.py), its compare and CLI: runs
that learn, exact resume after a SIGKILL, checkpoints and metric files, and clear errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from run_helpers import kill_then_resume
from structinit.harness.cli.main import main
from structinit.harness.compare import compare
from structinit.harness.config import SequenceConfig
from structinit.harness.recipes import sequence_recipe
from structinit.harness.run.checkpoint import load_checkpoint
from structinit.harness.run.optim import param_groups
from structinit.harness.tasks import train as train_sequence

ROOT = Path(__file__).resolve().parents[1]


def cfg(tmp_path, **kw) -> SequenceConfig:
    base = dict(model="gpt_seq_2x64", task="copy", task_options={"length": 4, "vocab": 4}, steps=60,
                batch_size=16, eval_every=20, heldout_size=64, warmup_steps=5, lr=3e-3, out_dir=str(tmp_path / "run"))
    return sequence_recipe("seq-cpu", **{**base, **kw})


def test_a_transformer_learns_to_copy_and_the_run_folder_is_complete(tmp_path):
    result = train_sequence(cfg(tmp_path, init="mimetic", steps=120), progress=False)
    assert result["final"]["holdout_acc"] > 0.9  # a 4-token copy is easy; chance is 1/4
    assert 0 <= result["final"]["holdout_exact"] <= result["final"]["holdout_acc"]
    assert [r["step"] for r in result["history"]] == [20, 40, 60, 80, 100, 120]
    run = tmp_path / "run"
    for name in ("checkpoint.pt", "metrics.jsonl", "metrics.csv", "model.safetensors", "result.json"):
        assert (run / name).is_file(), name
    assert json.loads((run / "result.json").read_text())["task_options"] == {"length": 4, "vocab": 4}
    assert load_checkpoint(run / "checkpoint.pt")["finished"]


def test_same_seed_gives_identical_runs_and_another_seed_differs(tmp_path):
    a = train_sequence(cfg(tmp_path, out_dir=str(tmp_path / "a"), steps=20), progress=False)
    b = train_sequence(cfg(tmp_path, out_dir=str(tmp_path / "b"), steps=20), progress=False)
    c = train_sequence(cfg(tmp_path, out_dir=str(tmp_path / "c"), steps=20, seed=1), progress=False)
    assert a["final"] == b["final"] and a["init_fingerprint"] == b["init_fingerprint"]
    assert c["init_fingerprint"] != a["init_fingerprint"]


def _cli(out: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "structinit", "train", "--task", "copy:length=6,vocab=6", "--model",
            "gpt_seq_2x64", "--init", "mimetic", "--steps", str(steps), "--eval-every", "25", "--batch-size", "32",
            "--set", "heldout_size=32", "--out", str(out), "--no-progress"]


def test_killed_run_resumes_to_bit_identical_weights(tmp_path):
    steps = 200
    killed, done, ref = kill_then_resume(lambda out: _cli(out, steps), tmp_path, ROOT)
    killed_at = killed["step"]
    assert killed_at < steps, "the process finished before it could be killed"
    assert done["step"] == steps
    # started at the checkpoint's step: a restart from step 0 would reach the same weights too
    assert 0 < killed_at and done["starts"] == [0, killed_at] and ref["starts"] == [0]
    assert all(torch.equal(done["model"][k], ref["model"][k]) for k in ref["model"])
    lines = (tmp_path / "victim/metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(25, steps + 1, 25))


def test_existing_run_needs_resume_and_the_same_config(tmp_path):
    train_sequence(cfg(tmp_path, steps=20), progress=False)
    with pytest.raises(FileExistsError, match="resume"):
        train_sequence(cfg(tmp_path, steps=20), progress=False)
    with pytest.raises(ValueError):
        train_sequence(cfg(tmp_path, steps=20, task_options={"length": 5, "vocab": 4}), resume=True, progress=False)


def test_no_weight_decay_on_a_log_d_and_position_embeddings():
    pytest.importorskip("mambapy")
    from structinit.models import create_model

    model = create_model("mamba_seq_2x64", vocab_size=8)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    skipped = {names[id(p)] for p in no_decay["params"]}
    assert {n for n in names.values() if n.endswith(("A_log", ".D"))} <= skipped
    assert not any(names[id(p)].endswith(("A_log", ".D")) for p in decay["params"])
    gpt = create_model("gpt_seq_2x64", vocab_size=8, max_len=16)
    _, no_decay = param_groups(gpt, 0.1)
    assert any(p is gpt.pos_embed for p in no_decay["params"])


def test_compare_on_a_task_summarises_and_resumes(tmp_path):
    base = cfg(tmp_path, steps=40)
    summary = compare(base, ["default", "mimetic"], [0, 1], tmp_path / "cmp", progress=False)
    assert set(summary) == {"default", "mimetic"} and summary["mimetic"]["metric"] == "holdout_acc"
    for name in ("summary.md", "summary.json", "accuracy.png", "report.html"):
        assert (tmp_path / "cmp" / name).is_file(), name
    page = (tmp_path / "cmp/report.html").read_text()
    assert "layers of a sequence model" in page and "on the task <code>copy" in page and "40 steps" in page
    assert "Vision Transformer" not in page and "Attention maps" not in page
    stamp = (tmp_path / "cmp/mimetic/seed1/result.json").stat().st_mtime_ns
    again = compare(base, ["default", "mimetic"], [0, 1], tmp_path / "cmp", progress=False)
    assert again == summary and (tmp_path / "cmp/mimetic/seed1/result.json").stat().st_mtime_ns == stamp


def test_compare_checks_every_spec_on_the_task_model_before_training(tmp_path):
    with pytest.raises(ValueError, match="alpah"):
        compare(cfg(tmp_path), ["default", "mimetic:alpah=1"], [0], tmp_path / "cmp", progress=False)
    assert not (tmp_path / "cmp/default").exists()


@pytest.mark.parametrize("argv, message", [
    (["--task", "copy:length=0"], "length"),
    (["--task", "sort"], "sort"),
    (["--task", "copy", "--dataset", "cifar10"], "--dataset applies to image runs, not to --task runs"),
    (["--task", "copy", "--recipe", "digits"], "a recipe for image runs, not for --task runs"),
    (["--recipe", "seq-cpu"], "a recipe for --task runs, not for image runs; add --task"),
    (["--steps", "5"], "--steps applies to --task runs, not to image runs"),
    (["--task", "copy", "--set", "epochs=3"], "no training option 'epochs'"),
    (["--task", "copy", "--set", "task_options={}"], "is set by --task"),
    (["--task", "copy", "--steps", "0"], "steps"),
])
def test_cli_errors_are_one_line_with_exit_2(tmp_path, capsys, argv, message):
    assert main(["train", *argv, "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("structinit train: error:") and message in err, err


def _sequence_benchmark():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "sequence_benchmark.py"
    spec = importlib.util.spec_from_file_location("sequence_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_run_of_the_sequence_benchmark_has_a_valid_init_spec(tmp_path):
    """The benchmark's grid is checked before hours of training: each (setting, model, init)
    it will run plans its init on the model that run builds (an SSM-only option on the
    Transformer once stopped it after the first Mamba setting)."""
    from structinit.harness.compare import check_specs

    bench = _sequence_benchmark()
    assert "mimetic:conv_identity=True" in bench.ABLATION
    assert not set(bench.ABLATION) & set(bench.inits_of("gpt_seq_2x64", bench.INITS, bench.ABLATION))
    assert set(bench.ABLATION) <= set(bench.inits_of("mamba_seq_2x64", bench.INITS, bench.ABLATION))
    for task, settings in bench.SETTINGS.items():
        for i, options in enumerate(settings):
            for model in bench.MODELS:
                base = sequence_recipe("seq-cpu", model=model, task=task, task_options=options)
                # the main grid everywhere; the ablation where it runs (the longest setting, Mamba)
                ssm = bench.ABLATION if i == len(settings) - 1 else bench.SSM_INITS
                inits = bench.inits_of(model, bench.INITS, ssm)
                assert set(check_specs(base, inits, [0], tmp_path)) == set(inits)


def test_sequence_benchmark_table_counts_the_seeds_that_solve_a_setting():
    """MQAR runs are bimodal, so the table counts the seeds at ≥ 90 % next to mean ± std."""
    bench = _sequence_benchmark()
    row = {"task": "mqar", "options": {"pairs": 4, "length": 32}, "seq_len": 32, "model": "mamba_seq_2x64",
           "init": "mimetic", "acc": [0.998, 0.389, 0.9], "exact": [0.99, 0.0, 0.5], "minutes": 1.5}
    line = bench.table([row]).splitlines()[2]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:5] == ["mqar", "pairs=4, length=32", "32", "mamba_seq_2x64", "mimetic"]
    assert cells[5] == "76.2 ± 32.7" and cells[7] == "100, 39, 90"
    assert cells[8] == "2/3" and cells[9] == "1.5"

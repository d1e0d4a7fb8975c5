"""Training options beyond the defaults: EMA, precision, torch.compile, recipes and the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import structinit
from structinit.harness.cli import main as cli
from structinit.harness.recipes import RECIPES, recipe
from structinit.harness.run import device
from structinit.harness.run.checkpoint import load_checkpoint
from structinit.harness.run.device import precision_name, resolve_precision
from structinit.harness.run.optim import EMA
from structinit.harness.tasks import train


def digits(tmp_path: Path, **kw):
    return recipe("digits", out_dir=str(tmp_path / "run"), **{"epochs": 2, "train_size": None, **kw})


def test_ema_tracks_weights_and_is_evaluated(tmp_path):
    result = train(digits(tmp_path, ema_decay=0.9), progress=False)
    assert "ema_test_acc" in result["final"]
    saved = load_checkpoint(tmp_path / "run/checkpoint.pt")
    w, e = saved["model"]["head.weight"], saved["ema"]["head.weight"]
    assert not torch.equal(w, e) and (w - e).abs().max() < w.abs().max()


def test_ema_update_formula():
    model = torch.nn.Linear(2, 2)
    ema = EMA(model, decay=0.75)
    old = ema.state["weight"].clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(model)
    torch.testing.assert_close(ema.state["weight"], 0.75 * old + 0.25 * model.weight)


def auto_here() -> str:
    """What precision='auto' resolves to on this machine's CPU (the function under test in
    test_auto_precision_reads_the_cpu_flags)."""
    return precision_name(resolve_precision("auto", torch.device("cpu")))


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_the_training_step_computes_in_the_precision_asked_for(tmp_path, precision, dtype):
    """Inside the model's own training steps every linear layer's output has the dtype of the
    precision asked for: fp16 computes in float16, not in bf16 in its place (which the run's
    record and the test below cannot tell from fp16)."""
    computed: set[torch.dtype] = set()

    def record(module, args, output):
        if module.training and isinstance(module, torch.nn.Linear):
            computed.add(output.dtype)

    hook = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        result = train(digits(tmp_path, precision=precision, epochs=1, train_size=128), progress=False)
    finally:
        hook.remove()
    assert result["precision"] == precision and computed == {dtype}


@pytest.fixture(scope="module")
def fp32_weights(tmp_path_factory):
    """The weights of the reduced-precision tests' run in fp32 (one run for both)."""
    folder = tmp_path_factory.mktemp("fp32")
    assert train(digits(folder, precision="fp32", epochs=2), progress=False)["precision"] == "fp32"
    return load_checkpoint(folder / "run/checkpoint.pt")["model"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_trains(tmp_path, precision, fp32_weights):
    """The run records the precision it ran in, and that precision changed the arithmetic: the
    same seed in fp32 ends with other weights."""
    result = train(digits(tmp_path, precision=precision, epochs=2), progress=False)
    assert result["precision"] == precision and result["device"]["type"] == "cpu"
    assert result["final"]["test_acc"] > 0.3 and all(torch.isfinite(torch.tensor(list(result["final"].values()))))
    low = load_checkpoint(tmp_path / "run/checkpoint.pt")["model"]
    assert not torch.equal(low["head.weight"], fp32_weights["head.weight"])


def test_precision_resolution():
    cpu = torch.device("cpu")
    assert resolve_precision("fp32", cpu) is None
    assert resolve_precision("bf16", cpu) is torch.bfloat16 and resolve_precision("fp16", cpu) is torch.float16
    with pytest.raises(ValueError, match="precision='half'"):
        resolve_precision("half", cpu)


CPU_FLAGS = "fpu vme sse sse2 avx avx2 avx512f avx512bw avx512_vnni"


@pytest.mark.parametrize("flags, auto", [
    (CPU_FLAGS, None),  # AVX-512 without its BF16 extension: fp32
    (f"{CPU_FLAGS} avx512_bf16", torch.bfloat16),
    (f"{CPU_FLAGS} amx_bf16 amx_tile", torch.bfloat16),
    (None, None),  # no /proc/cpuinfo (not Linux): fp32
])
def test_auto_precision_reads_the_cpu_flags(tmp_path, monkeypatch, flags, auto):
    """auto is bf16 exactly on a CPU with native bf16 (AVX-512 BF16 or AMX), else fp32: the
    real function, reading a /proc/cpuinfo written here for each kind of CPU."""
    cpuinfo = tmp_path / "cpuinfo"
    if flags is not None:
        cpuinfo.write_text("".join(f"processor\t: {i}\nmodel name\t: Some CPU\nflags\t\t: {flags}\n\n"
                                   for i in range(2)))
    monkeypatch.setattr(device, "CPUINFO", cpuinfo)
    assert resolve_precision("auto", torch.device("cpu")) is auto


def test_result_records_what_ran(tmp_path):
    result = train(digits(tmp_path, precision="auto", epochs=1), progress=False)
    assert result["precision"] == auto_here()
    assert result["device"]["threads"] == torch.get_num_threads() and result["device"]["name"]
    assert result["versions"]["torch"] == torch.__version__ and result["versions"]["cuda"] == torch.version.cuda


def test_recipes_are_complete_and_overridable():
    assert set(RECIPES) >= {"paper-cifar", "cpu-cifar", "digits"}
    paper = recipe("paper-cifar")
    assert (paper.model, paper.batch_size, paper.epochs, paper.eps, paper.weight_decay) == (
        "vit_tiny_patch2_32", 512, 200, 1e-3, 0.01)
    assert (paper.grad_clip, paper.warmup_epochs, paper.min_lr, paper.augment) == (3.0, 10, 1e-6, "flip,ra2-9-0.5")
    assert recipe("cpu-cifar", epochs=3).epochs == 3
    with pytest.raises(TypeError, match="unknown training option"):
        recipe("digits", epochz=3)
    c16, c8 = recipe("cpu-cifar16"), recipe("cpu-cifar")  # the 16×16-token twin keeps the held-out protocol
    assert structinit.create_model(c16.model).patch_embed.grid_size == (16, 16)
    assert (c16.dataset, c16.train_size, c16.holdout, c16.holdout_mode) == (c8.dataset, c8.train_size, c8.holdout,
                                                                            c8.holdout_mode)
    with pytest.raises(ValueError, match=r"unknown recipe .nope.; valid names: cpu-cifar, .*digits, paper"):
        recipe("nope")
    assert list(RECIPES)[:3] == ["paper-cifar", "cpu-cifar", "digits"] and "digits" in RECIPES


def test_cli_train_maps_flags_and_resumes(tmp_path, capsys):
    out = tmp_path / "cli"
    args = ["train", "--recipe", "digits", "--init", "impulse:target_mass=0.3", "--epochs", "1", "--lr", "0.003",
            "--set", "warmup_epochs=0.5", "--set", "train_size=None", "--out", str(out), "--no-progress"]
    assert cli.main(args) == 0
    config = json.loads((out / "result.json").read_text())["config"]
    assert (config["init"], config["init_options"], config["lr"], config["warmup_epochs"], config["train_size"]) == (
        "impulse", {"target_mass": 0.3}, 0.003, 0.5, None)
    assert "result.json" in capsys.readouterr().out
    assert cli.main(args) == 2  # the run exists: one line naming the flag that continues it
    assert capsys.readouterr().err == (f"structinit train: error: {out / 'checkpoint.pt'} exists: pass --resume or "
                                       "choose another --out\n")
    assert cli.main([*args, "--resume"]) == 0


@pytest.mark.skipif(os.environ.get("STRUCTINIT_SKIP_COMPILE") == "1", reason="compile disabled")
def test_torch_compile_trains_what_eager_trains(tmp_path):
    """torch.compile (on CPU it needs a C++ toolchain) must train the same model as the eager
    run of the same config: same start, same losses and weights up to the rounding of fused
    kernels (measured: 4e-7 relative on the loss, 1.5e-4 on any weight after two epochs)."""
    eager = train(digits(tmp_path / "eager"), progress=False)
    compiled = train(digits(tmp_path / "compiled", compile=True), progress=False)
    assert compiled["init_fingerprint"] == eager["init_fingerprint"]
    for e, c in zip(eager["history"], compiled["history"], strict=True):
        assert c["train_loss"] == pytest.approx(e["train_loss"], rel=1e-5)
    assert compiled["final"]["test_loss"] == pytest.approx(eager["final"]["test_loss"], rel=1e-4)
    assert compiled["final"]["test_acc"] == pytest.approx(eager["final"]["test_acc"], abs=0.01)
    a = load_checkpoint(tmp_path / "eager/run/checkpoint.pt")["model"]
    b = load_checkpoint(tmp_path / "compiled/run/checkpoint.pt")["model"]
    assert b.keys() == a.keys()  # the plain module's keys, not _orig_mod.*
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=2e-3, msg=lambda m, key=key: f"{key}: {m}")


def test_demo_rows_are_fidelity_summaries():
    from structinit.analysis import fidelity_summary, impulse_fidelity
    from structinit.analysis.fidelity import fidelity_rows, format_fidelity_table
    from structinit.models import create_model
    from structinit.schemes import init_

    inits = [("impulse analytic", "impulse", {"solver": "analytic"}), ("pytorch", "pytorch", {})]
    impulse, pytorch = fidelity_rows("vit_cpu_patch2_8", inits, seed=3)
    expected = fidelity_summary(impulse_fidelity(init_(create_model("vit_cpu_patch2_8"), "impulse", seed=3,
                                                       solver="analytic")))
    assert (impulse.mass_first, impulse.hit_first, impulse.mass_mean, impulse.hit_mean) == (
        expected.mass_first, expected.hit_first, expected.mass_mean, expected.hit_mean)
    assert impulse.hit_mean > pytorch.hit_mean  # the impulse is placed; a default init is at chance
    assert "| impulse analytic |" in format_fidelity_table([impulse, pytorch], "t")


def test_resume_compares_what_ran_not_how_it_was_spelt(tmp_path):
    """precision='auto' is resolved per machine: a run made with auto resumes under the
    precision auto became here (a benchmark that pins it keeps its finished runs), and is
    refused under another."""
    ran = auto_here()
    first = train(digits(tmp_path, precision="auto", epochs=1), progress=False)
    again = train(digits(tmp_path, precision=ran, epochs=1), resume=True, progress=False)
    assert again["final"] == first["final"] and again["config"]["precision"] == "auto"  # the finished run, as it was
    with pytest.raises(ValueError, match=r"different configuration \(precision differ\)"):
        train(digits(tmp_path, precision="fp16", epochs=1), resume=True, progress=False)


def test_paper_cifar_scores_the_whole_test_set_of_the_users_copy():
    # A user's CIFAR-10 is exact in all 10,000 test images: the recipe scores them all (every 10
    # epochs and at the end); a prefix is for copies that are exact only up to some image.
    from structinit.harness.recipes import recipe

    cfg = recipe("paper-cifar")
    assert cfg.test_prefix is None and cfg.test_every == 1 and cfg.eval_every == 10

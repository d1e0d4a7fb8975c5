"""scripts/gpu_check.sh on the CPU (it must skip the CUDA steps, saying so, and still measure a
tiny throughput), and bench/gpu_throughput.py's FLOP counting, peak table and step."""

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "bench"))  # the benchmarks import their shared timing module by name
    try:
        spec = importlib.util.spec_from_file_location("gpu_throughput", ROOT / "bench" / "gpu_throughput.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclass looks its module up there
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("gpu_throughput", None)
        sys.path.remove(str(ROOT / "bench"))


def _table(text: str) -> list[list[str]]:
    """The markdown table in ``text`` as rows of cells, the header first (the separator dropped)."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines if not line.startswith("|---")]


def _bare_python(bin_dir: Path) -> Path:
    """A ``python-bare`` command in ``bin_dir``: this interpreter with its packages (torch) but
    without site processing, so structinit is not installed, as in a GPU image's own python3."""
    site_packages = sysconfig.get_paths()["purelib"]
    bin_dir.mkdir()
    shim = bin_dir / "python-bare"
    shim.write_text(f'#!/bin/sh\nPYTHONPATH="$PYTHONPATH:{site_packages}" exec "{sys.executable}" -S "$@"\n')
    shim.chmod(0o755)
    return shim


def test_gpu_check_on_the_cpu_skips_the_cuda_steps_and_measures_throughput(tmp_path, bench):
    # The interpreter is a command on PATH that lacks an installed structinit: the script finds
    # it and puts the checkout on PYTHONPATH (a GPU image's python3 ran the bench scripts so).
    shim = _bare_python(tmp_path / "bin")
    assert subprocess.run([str(shim), "-c", "import structinit"], capture_output=True, cwd=tmp_path).returncode != 0
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_QUICK": "1", "GPU_CHECK_PYTHON": shim.name,
           "PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    if torch.cuda.is_available() or shutil.which("nvidia-smi"):
        env["GPU_CHECK_DEVICE"] = "cpu"  # on a GPU host, still the CPU path this test is about
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for step in ("cuda-tests", "paper-cifar-bf16", "paper-cifar-bf16-compile"):
        assert f"SKIPPED {step}: needs CUDA" in done.stdout
    assert "a tiny CPU measurement instead" in done.stdout
    assert (out / "device.txt").read_text().count("torch.cuda.is_available()") == 1

    header, *rows = _table((out / "throughput.md").read_text())
    assert header == bench.COLUMNS
    assert rows and all(len(row) == len(header) for row in rows)
    rate = float(rows[0][header.index("images/s")].replace(",", ""))
    assert math.isfinite(rate) and rate > 0
    assert rows[0][header.index("% of bf16 peak")] == "peak unknown"
    assert float(rows[0][header.index("GFLOP/image (fwd+bwd)")]) > 0

    summary = (out / "summary.md").read_text()
    assert "| throughput | ok |" in summary and "| cuda-tests | skipped |" in summary
    assert "All steps that ran passed." in summary


def test_flops_of_a_linear_layer(bench):
    """nn.Linear(a, b) on a batch of n: forward 2nab; the backward adds 2nab for the weight's
    gradient and 2nab for the input's, when the input needs one."""
    n, a, b = 3, 5, 7
    layer = nn.Linear(a, b)
    x, y = torch.randn(n, a), torch.randint(0, b, (n,))
    with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
        layer(x)
    assert counter.get_total_flops() == 2 * n * a * b
    assert bench.train_flops(layer, x, y) == 4 * n * a * b
    assert bench.train_flops(layer, x.requires_grad_(), y) == 6 * n * a * b


def test_flops_of_the_paper_model_match_the_closed_form(bench):
    """ViT-Ti/2 on 32×32: patch conv, then per layer 12·N·D² MACs in the linear maps and 2·N²·D in
    attention, and the head; backward twice the forward except the patch conv (no input gradient)."""
    n, d, depth, patch, classes = 256, 192, 12, 2, 10
    conv = n * 3 * patch * patch * d
    forward = 2 * (conv + depth * (12 * n * d * d + 2 * n * n * d) + d * classes)
    flops, shape = bench.flops_per_image(bench.MODELS["vit_tiny_patch2_32"])
    assert shape == (3, 32, 32)
    assert flops == 3 * forward - 2 * conv


@pytest.mark.parametrize(("name", "peak"), [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.4),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA L4", 121.0),
    ("NVIDIA L40S", None), ("NVIDIA H100 NVL", None), ("NVIDIA GeForce RTX 4090", None),
])
def test_peak_lookup(bench, name, peak):
    assert bench.peak_tflops(name)[1] == peak


def test_a_row_shows_its_share_of_the_peak(bench):
    row = {"label": "m", "batch": 4, "input": (3, 32, 32), "mode": "eager", "images_per_s": 1000.0,
           "flops_per_image": 1e9, "warmup_s": 1.0, "peak_memory_gib": None}
    cells = _table(bench.table_row(row, peak=10.0))[0]
    assert cells[bench.COLUMNS.index("TFLOP/s")] == "1"
    assert cells[bench.COLUMNS.index("% of bf16 peak")] == "10.0 %"
    assert _table(bench.table_row(row, peak=None))[0][bench.COLUMNS.index("% of bf16 peak")] == "peak unknown"


def test_gpu_check_names_a_missing_interpreter(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_CHECK_PYTHON": "no-such-python-3"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1
    assert "GPU_CHECK_PYTHON=no-such-python-3: no such interpreter" in done.stderr


def test_pipeline_rows_time_the_harness_step(tmp_path, bench, monkeypatch):
    calls = []
    original = bench.Augment.__call__

    def counted(self, x, generator=None):
        calls.append(x.dtype)
        return original(self, x, generator)

    monkeypatch.setattr(bench.Augment, "__call__", counted)
    out = tmp_path / "rows.json"
    assert bench.main(["--device", "cpu", "--models", "vit_micro_patch2_16:8", "--steps", "2", "--warmup", "1",
                       "--no-compile", "--pipeline", "flip,ra2-9-0.5", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["eager", "eager + pipeline"]
    assert all(r["images_per_s"] > 0 for r in rows)
    # the plain row's one fixed batch (augment "none"), then one fresh augmentation of the uint8
    # batch per step of the pipeline row: 1 warm-up + 2 timed
    assert calls == [torch.uint8] * (1 + 3)


def test_pipeline_with_a_bad_augmentation_stops_before_measuring(tmp_path, bench, capsys):
    out = tmp_path / "rows.json"
    with pytest.raises(SystemExit, match=r"--pipeline 'flips': Augment\.parse: unknown token 'flips'"):
        bench.main(["--device", "cpu", "--models", "vit_micro_patch2_16:8", "--no-compile", "--pipeline", "flips",
                    "--json", str(out)])
    assert not out.exists() and "Training throughput" not in capsys.readouterr().out


def test_the_benchmark_times_the_training_loops_own_batches_and_step(tmp_path, bench):
    # One epoch through `structinit train`'s loop, then the benchmark's image_step on the same
    # config and images: the same batches (permutation, RandAugment, flips) and the same step
    # give the same mean loss and bit-identical weights.
    from safetensors.torch import load_file

    from structinit.harness.recipes import recipe
    from structinit.harness.run.device import Placement
    from structinit.harness.run.lifecycle import run_task
    from structinit.harness.tasks.image import ImageTask, image_step, load_data

    cfg = recipe("digits", epochs=1, augment="flip,ra2-9-0.5", seed=3, out_dir=str(tmp_path / "run"))
    result = run_task(ImageTask(cfg), progress=False)
    train_ds, _ = load_data(cfg)
    task, step = image_step(cfg, train_ds, torch.device("cpu"))  # what the benchmark times
    cpu = Placement(1, 0, torch.device("cpu"))
    losses = [float(step(i, x, y)[0]) for i, (x, y) in enumerate(task.batches(task.schedule()[0][0], cpu))]
    assert len(losses) == task.steps == 300 // 64
    assert sum(losses) / len(losses) == pytest.approx(result["history"][0]["train_loss"], rel=1e-6)
    weights = load_file(tmp_path / "run" / "model.safetensors")
    assert weights.keys() == step.model.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in step.model.state_dict().items())


def test_the_loop_comparisons_step_trains_what_the_loop_trains(tmp_path, bench):
    # --loop times the step ``structinit train`` takes, not a copy of it: the same batches
    # through the same step make the same weights as a run of the loop.
    from safetensors.torch import load_file

    from structinit.harness.recipes import recipe
    from structinit.harness.tasks import train
    from structinit.harness.tasks.image import load_data

    cfg = recipe("digits", epochs=2, train_size=128, out_dir=str(tmp_path / "run"))
    train(cfg, progress=False)
    trained = load_file(tmp_path / "run" / "model.safetensors")
    data, _ = load_data(cfg)
    rates, model = bench.step_rates(cfg, data, epochs=2, keep_model=True)
    assert len(rates) == 2 and all(r > 0 for r in rates)
    mine = model.state_dict()
    assert trained.keys() == mine.keys()
    for name, value in trained.items():
        torch.testing.assert_close(mine[name], value, rtol=0, atol=0, msg=name)


def test_the_benchmarks_step_settings_are_the_recipes(bench):
    # The step is paper-cifar's: the benchmark sets only the model, its batch, the data it
    # makes up and how long it runs; the loss, clipping and optimiser stay the recipe's.
    from structinit.harness.recipes import recipe

    paper = recipe("paper-cifar").to_dict()
    mine = bench.bench_config(bench.MODELS["vit_tiny_patch2_32"], False, "impulse", "none").to_dict()
    changed = {k for k in paper if mine[k] != paper[k]}
    assert changed <= {"model", "model_kwargs", "batch_size", "compile", "init", "augment", "precision", "epochs",
                       "warmup_epochs", "data_dir", "test_prefix", "test_every", "cpu_prefetch"}, changed
    assert {"label_smoothing", "grad_clip", "lr", "weight_decay"} <= paper.keys() - changed

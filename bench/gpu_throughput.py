"""Training throughput of the harness's own step (``TrainStep``, as ``structinit train`` takes
it): images/s eager and under ``torch.compile``, FLOPs per image (forward + backward), TFLOP/s
and the share of the card's dense bf16 peak (:data:`PEAKS`, or ``--peak-tflops``).
``--pipeline AUGMENT`` adds a row whose batches come from ``ImageTask.batches``. Instead,
``--loop`` (CPU) times the step against the whole ``structinit train`` loop, fp32 and bf16, and
``--augment-only`` times each augmentation alone.

    .venv/bin/python bench/gpu_throughput.py                                  # cuda, the default models
    .venv/bin/python bench/gpu_throughput.py --models vit_tiny_patch2_32 --pipeline flip,ra2-9-0.5  # paper-cifar's step
    .venv/bin/python bench/gpu_throughput.py --device cpu --models vit_micro_patch2_16:16 --steps 3 --warmup 1 \\
        --no-compile                                                          # a smoke run on the CPU
    .venv/bin/python bench/gpu_throughput.py --from docs/results/data/gpu/h100-throughput.json  # a saved table
    .venv/bin/python bench/gpu_throughput.py --loop                           # CPU: step against loop
    .venv/bin/python bench/gpu_throughput.py --device cpu --augment-only      # the augmentations alone

``--models`` takes names from :data:`MODELS` or any registered structinit ViT (``vit_*``), each
with an optional ``:batch``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from common import DATA_DIR, markdown, median_seconds
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import structinit
from structinit.augment import Augment
from structinit.data import load_dataset, stratified_subset
from structinit.data.datasets import ArrayDataset
from structinit.harness.config import COMPILE_MODES, ImageConfig
from structinit.harness.recipes import recipe
from structinit.harness.run.device import Placement, resolve_precision
from structinit.harness.tasks import train
from structinit.harness.tasks.image import image_step


@dataclass(frozen=True)
class Spec:
    """One model of the table: a registered structinit model with overrides, and its batch."""

    label: str
    model: str
    batch: int
    overrides: dict = field(default_factory=dict)


# The paper's CIFAR model first; then ImageNet-size ViT-S/16 and ViT-B/16 (S/16 is B/16 at D 384, 6 heads).
MODELS = {
    "vit_tiny_patch2_32": Spec("ViT-Ti/2 (paper)", "vit_tiny_patch2_32", 512),
    "vit_small_patch16_224": Spec("ViT-S/16", "vit_base_patch16_224", 256, {"embed_dim": 384, "num_heads": 6}),
    "vit_base_patch16_224": Spec("ViT-B/16", "vit_base_patch16_224", 128),
}
DEFAULT_MODELS = ",".join(MODELS)
AUGMENTS = ("crop4", "flip", "crop4,flip", "ra2-9-0.5", "ra2-9-0.5,crop4,flip")  # --augment-only's
LOOP_MODELS = "vit_tiny_patch4_32,vit_cpu_patch4_32"  # --loop's: cpu-cifar's ViT and a smaller one

# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s from the vendor's datasheets, matched
# against torch.cuda.get_device_name() in order, the first match wins. NVL parts and other cards
# have no entry: their peak is unknown here (give it with --peak-tflops).
PEAKS: list[tuple[str, str, float | None]] = [
    (r"NVL", "NVL part", None),
    (r"H100.*PCIe", "H100 PCIe", 756.0),
    (r"H100", "H100 SXM", 989.4),
    (r"H200", "H200", 989.4),
    (r"A100", "A100", 312.0),
    (r"\bL4\b", "L4", 121.0),
]
COLUMNS = ["model", "batch", "input", "mode", "images/s", "GFLOP/image (fwd+bwd)", "TFLOP/s",
           "% of bf16 peak", "warm-up s", "peak memory GiB"]


def peak_tflops(device_name: str) -> tuple[str | None, float | None]:
    """(the card it was matched as, its dense bf16 peak in TFLOP/s), or (None, None) if unknown."""
    for pattern, card, peak in PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return (card, peak) if peak is not None else (None, None)
    return None, None


def parse_models(text: str) -> list[Spec]:
    """``name[:batch],…`` → specs; a name not in MODELS is a registered structinit ViT (batch 64)."""
    vits = [name for name in structinit.list_models() if name.startswith("vit_")]
    specs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, batch = item.partition(":")
        if name in MODELS:
            spec = MODELS[name]
        elif name in vits:
            spec = Spec(name, name, 64)
        else:
            raise SystemExit(f"--models: unknown model {name!r}; choose from {', '.join(MODELS)} "
                             f"or a registered structinit ViT ({', '.join(vits)})")
        specs.append(Spec(spec.label, spec.model, int(batch), spec.overrides) if batch else spec)
    return specs


def input_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(channels, height, width) of one image the model takes."""
    proj = model.patch_embed.proj
    return (proj.in_channels, *model.patch_embed.img_size)


def train_flops(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    """FLOPs of one forward and backward pass of ``model`` on ``inputs`` with a cross-entropy loss,
    as FlopCounterMode counts them (matrix products and convolutions; attention through the math
    kernel, so that every backend counts the same products)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(inputs), targets).backward()
    return counter.get_total_flops()


def flops_per_image(spec: Spec, batch: int = 2) -> tuple[float, tuple[int, int, int]]:
    """(forward + backward FLOPs of one image, the image's shape), counted on the meta device
    (no memory, no compute)."""
    with torch.device("meta"):
        model = structinit.create_model(spec.model, **spec.overrides)
        x = torch.empty(batch, *input_shape(model))
        y = torch.zeros(batch, dtype=torch.long)
    return train_flops(model, x, y) / batch, input_shape(model)


def input_shape_and_classes(spec: Spec) -> tuple[tuple[int, int, int], int]:
    """(the image shape, the class count) of ``spec``'s model, read on the meta device."""
    with torch.device("meta"):
        model = structinit.create_model(spec.model, **spec.overrides)
    return input_shape(model), model.head.out_features


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_config(spec: Spec, compile: bool, init: str, augment: str, cpu_prefetch: int = 0,
                 aug_workers: int = 0, compile_mode: str = "default") -> ImageConfig:
    """``paper-cifar`` in bf16 at ``spec``'s model and batch, one epoch (half of it warm-up)."""
    return recipe("paper-cifar", model=spec.model, model_kwargs=dict(spec.overrides), batch_size=spec.batch,
                  compile=compile, init=init, augment=augment, precision="bf16", epochs=1, warmup_epochs=0.5,
                  data_dir=None, test_prefix=None, test_every=1, cpu_prefetch=cpu_prefetch, aug_workers=aug_workers,
                  compile_mode=compile_mode)


def wait_at(start_file: Path, timeout_s: float = 600.0) -> None:
    """Say this process is warm (``<start_file>.ready.<pid>``), then wait until ``start_file``
    exists: concurrent processes time the same window (the caller creates it once all are warm)."""
    Path(f"{start_file}.ready.{os.getpid()}").touch()
    deadline = time.monotonic() + timeout_s
    while not start_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"--start-file {start_file}: not created within {timeout_s:g} s")
        time.sleep(0.01)


def measure(spec: Spec, device: torch.device, compile: bool, steps: int, warmup: int, init: str,
            pipeline: str | None = None, start_file: Path | None = None, cpu_prefetch: int = 0,
            aug_workers: int = 0, compile_mode: str = "default") -> dict:
    """images/s, warm-up seconds and peak memory of the harness's training step on ``spec``.

    Without ``pipeline`` the step trains on one fixed batch (the model and the optimiser
    alone); with it (an augmentation spec) each step takes the next batch of
    :meth:`ImageTask.batches`, augmented on the device (or on the CPU: ``cpu_prefetch`` batches
    ahead in a thread, or in ``aug_workers`` processes). Either way ``warmup`` steps run first
    (compiling), then ``steps`` steps are timed as the training loop runs them: queued without
    waiting, with one synchronisation at the end."""
    shape, classes = input_shape_and_classes(spec)
    generator = torch.Generator().manual_seed(0)
    n = spec.batch * (warmup + steps)
    images = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, classes, (n,), generator=generator)
    data = ArrayDataset(images, labels, [str(k) for k in range(classes)], "random", (0.5,) * shape[0],
                        (0.25,) * shape[0])
    cfg = bench_config(spec, compile, init, pipeline or "none", cpu_prefetch if pipeline else 0,
                       aug_workers if pipeline else 0, compile_mode)
    task, train_step = image_step(cfg, data, device)
    batches = task.batches(task.schedule()[0][0], Placement(1, 0, device))
    if pipeline is None:
        batches = iter([next(batches)] * (warmup + steps))
    losses = []

    def run(count: int) -> float:
        """Seconds of ``count`` steps, queued, then one synchronisation."""
        start = time.perf_counter()
        for _, (x, y) in zip(range(count), batches):
            losses.append(train_step(len(losses), x, y)[0])
        synchronize(device)
        return time.perf_counter() - start

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        warm_s = run(warmup)
        if start_file is not None:
            wait_at(start_file)
        seconds = run(steps)
    finally:
        task.close()
    if not all(math.isfinite(float(v)) for v in losses):
        raise FloatingPointError(f"{spec.label}: a training loss is not finite")
    memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"images_per_s": steps * spec.batch / seconds, "warmup_s": warm_s, "peak_memory_gib": memory}


def step_rates(cfg, ds, epochs: int, keep_model: bool = False):
    """Images/s per epoch of the run's own step on its own batches (on the CPU), and nothing
    more; with ``keep_model`` also the model it trained (tests compare it with the loop's)."""
    device = torch.device("cpu")
    task, step = image_step(cfg.__class__(**{**cfg.to_dict(), "epochs": epochs}), ds, device)
    chunks, _, _ = task.schedule()
    rates = []
    for chunk in chunks:
        start, seen = time.perf_counter(), 0
        for i, (x, y) in zip(range(chunk.first, chunk.last), task.batches(chunk, Placement(1, 0, device))):
            step(i, x, y)
            seen += len(x)
        rates.append(seen / (time.perf_counter() - start))
    return (rates, step.model) if keep_model else rates


def loop_rates(cfg, epochs: int) -> list[float]:
    """Images/s per epoch of ``structinit.train``, which adds the metrics, the progress
    accounting and a checkpoint each epoch to the step (its history's own count)."""
    with tempfile.TemporaryDirectory() as tmp:
        run = train(cfg.__class__(**{**cfg.to_dict(), "epochs": epochs, "out_dir": str(Path(tmp) / "r"),
                                     "eval_every": 10**6}), progress=False)
    return [row["images_per_s"] for row in run["history"]]


def loop_tables(args) -> None:
    """--loop: per model and precision, the step's images/s against the whole loop's, on the
    same CIFAR-10 images in memory, no augmentation; medians over the epochs after the first."""
    torch.set_num_threads(2)
    ds = stratified_subset(load_dataset("cifar10", args.data_dir, "train"), args.images, seed=0)
    names = [spec.model for spec in parse_models(args.models or LOOP_MODELS)]
    print(f"default precision on this CPU: {resolve_precision('auto', torch.device('cpu'))}\n")
    print(markdown(["model", "precision", "step (img/s)", "loop (img/s)", "loop's cost beyond its step"], "llrrr"))
    rates = {}
    for name in names:
        for precision in ("fp32", "bf16"):
            # A 256-image holdout keeps the loop's one end-of-run evaluation short.
            cfg = recipe("cpu-cifar", model=name, precision=precision, augment="none", train_size=args.images,
                         data_dir=args.data_dir, holdout=256)
            bare, whole = [], []
            for _ in range(args.repeats):  # alternate so both see the same machine state
                bare += step_rates(cfg, ds, args.epochs)[1:]
                whole += loop_rates(cfg, args.epochs)[1:]
            s, w = statistics.median(bare), statistics.median(whole)
            rates[(name, precision)] = w
            print(f"| {name} | {precision} | {s:.0f} | {w:.0f} | {100 * (s / w - 1):+.1f}% |", flush=True)
    ratios = [[name, f"{rates[(name, 'bf16')] / rates[(name, 'fp32')]:.2f}×"] for name in names]
    print("\n" + markdown(["model", "bf16 / fp32 (loop)"], "lr", ratios))


def augment_table(specs: list[Spec], device: torch.device, steps: int, warmup: int) -> str:
    """--augment-only: images/s of each of :data:`AUGMENTS` alone, on a random uint8 batch of
    each model's batch size and image shape on ``device``; the median of ``steps`` calls."""
    rows = []
    for spec in specs:
        shape, _ = input_shape_and_classes(spec)
        x = torch.randint(0, 256, (spec.batch, *shape), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        x = x.to(device)
        for spec_text in AUGMENTS:
            augment, generator = Augment.parse(spec_text), torch.Generator().manual_seed(0)
            seconds = median_seconds(lambda: augment(x, generator), steps, warmup, sync=lambda: synchronize(device))
            rows.append([spec.label, spec.batch, spec_text, f"{spec.batch / seconds:,.0f}", f"{1000 * seconds:.2f}"])
    return markdown(["model", "batch", "augment", "images/s", "ms/batch"], "lrlrr", rows)


def _fmt(value: float | None) -> str:
    """Three significant digits (whole numbers from 100 up), or a dash for no value."""
    if value is None:
        return "–"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def table_row(row: dict, peak: float | None) -> str:
    """One markdown row; a row with a ``status`` (skipped, out of memory, error) says it instead of numbers."""
    c, h, w = row["input"]
    head = [row["label"], str(row["batch"]), f"{h}×{w}×{c}", row["mode"]]
    if "status" in row:
        return "| " + " | ".join([*head, row["status"], *["–"] * (len(COLUMNS) - len(head) - 1)]) + " |"
    tflops = row["images_per_s"] * row["flops_per_image"] / 1e12
    share = "peak unknown" if peak is None else f"{100 * tflops / peak:.1f} %"
    cells = [_fmt(row["images_per_s"]), _fmt(row["flops_per_image"] / 1e9), _fmt(tflops), share,
             _fmt(row["warmup_s"]), _fmt(row["peak_memory_gib"])]
    return "| " + " | ".join([*head, *cells]) + " |"


def throughput_table(rows: list[dict], header: str, peak: float | None) -> str:
    return "\n".join([header, "", markdown(COLUMNS, "l" * len(COLUMNS)), *(table_row(r, peak) for r in rows)]) + "\n"


def device_header(device: torch.device, card: str | None, peak: float | None, args) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    cuda = f", CUDA {torch.version.cuda}" if device.type == "cuda" else ""
    peak_text = f"dense bf16 peak {peak:g} TFLOP/s ({card})" if peak is not None else "peak unknown"
    return (f"Training throughput on {name} (torch {torch.__version__}{cuda}; {peak_text}): the harness's "
            f"training step (forward + backward + fused AdamW on CUDA, bf16 autocast), {args.steps} steps queued "
            f"after {args.warmup} warm-up steps, init {args.init}."
            + (f" Rows '+ pipeline' take their batches from the harness (ImageTask.batches): {args.pipeline} on "
               "uint8 images (on the device, or on the CPU where the row says so), then normalisation."
               if args.pipeline else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--models", default=None,
                   help=f"name[:batch],… (default {DEFAULT_MODELS}; with --loop {LOOP_MODELS})")
    p.add_argument("--steps", type=int, default=20, help="timed steps per cell")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile happens here)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager only")
    p.add_argument("--init", default="impulse", help="the structinit scheme the models get")
    p.add_argument("--peak-tflops", type=float, default=None, help="the card's dense bf16 peak, if not in PEAKS")
    p.add_argument("--budget-s", type=float, default=None, help="start no new cell after this many seconds")
    p.add_argument("--pipeline", default=None, metavar="AUGMENT",
                   help="also time the harness's whole step with this augmentation (e.g. flip,ra2-9-0.5)")
    p.add_argument("--pipeline-only", action="store_true", help="time only the --pipeline row")
    p.add_argument("--cpu-prefetch", type=int, default=0, metavar="N",
                   help="the --pipeline row augments on the CPU, N batches ahead (the harness's cpu_prefetch)")
    p.add_argument("--aug-workers", default="0", metavar="N[,N…]",
                   help="a --pipeline row for each N: augmented in N worker processes (the harness's aug_workers; "
                   "0: on the device, or --cpu-prefetch's thread)")
    p.add_argument("--no-eager", dest="eager", action="store_false", help="no eager rows (with compile)")
    p.add_argument("--compile-modes", default="default", metavar="MODE[,MODE…]",
                   help="a compiled row for each of torch.compile's modes (e.g. default,reduce-overhead: CUDA "
                   "graphs); the --pipeline rows take the first")
    p.add_argument("--start-file", type=Path, default=None, metavar="PATH",
                   help="after warming up, write PATH.ready.<pid> and time only once PATH exists (to time "
                   "concurrent processes over one window)")
    p.add_argument("--out", type=Path, default=None, help="write the table here (markdown), again after every row")
    p.add_argument("--json", type=Path, default=None, help="write the rows here (JSON)")
    p.add_argument("--from", dest="saved", type=Path, default=None, metavar="JSON",
                   help="print the table of a saved --json run (measures nothing)")
    p.add_argument("--loop", action="store_true",
                   help="CPU: the step against the whole `structinit train` loop, fp32 and bf16, on CIFAR-10")
    p.add_argument("--data-dir", default=DATA_DIR, help="--loop: the folder that holds cifar-10-batches-py")
    p.add_argument("--images", type=int, default=2048, help="--loop: training images")
    p.add_argument("--epochs", type=int, default=3, help="--loop: epochs per measurement (the first is not counted)")
    p.add_argument("--repeats", type=int, default=2, help="--loop: measurements of each, step and loop alternating")
    p.add_argument("--augment-only", action="store_true",
                   help="time each augmentation of AUGMENTS alone on a uint8 batch of each model's batch and shape")
    args = p.parse_args(argv)
    if args.saved is not None:
        saved = json.loads(args.saved.read_text())
        print(throughput_table(saved["rows"], saved["header"], saved["peak_tflops"]), end="")
        return 0
    if args.loop:
        loop_tables(args)
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch {torch.__version__} sees no CUDA device; use --device cpu")
    specs = parse_models(args.models or DEFAULT_MODELS)
    if args.augment_only:
        print(f"uint8 batches on {device}, {torch.get_num_threads()} CPU threads, torch {torch.__version__}\n")
        print(augment_table(specs, device, args.steps, args.warmup))
        return 0
    if (args.pipeline_only or args.cpu_prefetch) and args.pipeline is None:
        raise SystemExit("--pipeline-only and --cpu-prefetch are about the --pipeline row: give --pipeline AUGMENT too")
    if args.cpu_prefetch < 0:
        raise SystemExit(f"--cpu-prefetch {args.cpu_prefetch}: expected N ≥ 0 batches ahead")
    try:
        workers_list = [int(w) for w in args.aug_workers.split(",")]
    except ValueError:
        workers_list = [-1]
    if any(w < 0 for w in workers_list) or len(set(workers_list)) != len(workers_list):
        raise SystemExit(f"--aug-workers {args.aug_workers}: expected distinct counts ≥ 0, e.g. 0,8")
    compile_modes = [m.strip() for m in args.compile_modes.split(",")]
    if not compile_modes or any(m not in COMPILE_MODES for m in compile_modes):
        raise SystemExit(f"--compile-modes {args.compile_modes}: expected modes from {', '.join(COMPILE_MODES)}")
    if args.pipeline is not None:
        try:
            Augment.parse(args.pipeline)
        except ValueError as error:
            raise SystemExit(f"--pipeline {args.pipeline!r}: {error}") from None
    card, peak = peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else (None, None)
    if args.peak_tflops is not None:
        card, peak = "--peak-tflops", args.peak_tflops
    header = device_header(device, card, peak, args)
    print(header, flush=True)
    compiled = {("compile" if m == "default" else f"compile ({m})"): m for m in compile_modes}
    first = ["eager", *list(compiled)[:1]] if args.compile else ["eager"]
    if not args.eager and args.compile:
        first = first[1:]
    pipelines = []  # (mode, workers): the harness's whole step, in the first compile mode (or eager)
    if args.pipeline is not None:
        for workers in workers_list:
            where = (f", {workers} workers" if workers else f", CPU {args.cpu_prefetch} ahead" if args.cpu_prefetch
                     else "")
            pipelines.append((f"{first[-1]} + pipeline{where}", workers))
    # the step alone, with its batches, then the other compile modes (last: --budget-s cuts those first)
    modes = [] if args.pipeline_only else first
    modes = [*modes, *(mode for mode, _ in pipelines)]
    if not args.pipeline_only and args.compile:
        modes += list(compiled)[1:]
    workers_of = dict(pipelines)
    counted = [flops_per_image(spec) for spec in specs]  # (FLOPs per image, image shape)
    cells, failed, start = {}, False, time.perf_counter()
    text = throughput_table([], header, peak)
    for m, mode in enumerate(modes):  # every eager cell first: they are quick; --budget-s cuts the compiled ones
        for i, (spec, (flops, shape)) in enumerate(zip(specs, counted)):
            row = {"label": spec.label, "model": spec.model, "overrides": spec.overrides, "batch": spec.batch,
                   "input": shape, "mode": mode, "flops_per_image": flops}
            if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                row["status"] = f"skipped (past --budget-s {args.budget_s:g})"
            else:
                try:
                    row |= measure(spec, device, mode.startswith("compile"), args.steps, args.warmup, args.init,
                                   args.pipeline if "+ pipeline" in mode else None, args.start_file,
                                   args.cpu_prefetch, workers_of.get(mode, 0),
                                   compiled.get(mode.split(" + ")[0], "default"))
                except torch.OutOfMemoryError:
                    row["status"] = "out of memory"
                except Exception as error:  # one bad cell fails the run, the others are still measured
                    row["status"] = f"error: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
                    failed = True
                finally:  # the next cell compiles and allocates afresh
                    torch._dynamo.reset()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            print(table_row(row, peak), flush=True)
            cells[i, m] = row
            rows = [cells[key] for key in sorted(cells)]  # in the order of --models, eager before compile
            text = throughput_table(rows, header, peak)
            if args.out is not None:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(text)
            if args.json is not None:
                args.json.write_text(json.dumps({"header": header, "peak_tflops": peak, "rows": rows}, indent=1))
    print("\n" + text, end="")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

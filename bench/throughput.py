"""Training throughput on the CPU: the harness's own step against the whole training loop, in one run.

Both columns run the same code. *Step* calls the run's
:class:`~structinit.harness.run.step.TrainStep` (the function ``structinit train`` calls each
step: schedule, forward under autocast, label-smoothed loss, backward, clipping, AdamW) on the
batches of :meth:`ImageTask.batches <structinit.harness.tasks.image.ImageTask.batches>`, built
by :func:`~structinit.harness.tasks.image.image_step` as ``train`` builds them, and nothing
else. *Loop* is ``structinit.train`` itself, which adds the metrics, the progress accounting and
a checkpoint each epoch. Same model, data (CIFAR-10 images in memory) and precision; no
augmentation. Measurements alternate between the two to share the machine's noise; images/s
are medians over the epochs after the first.

    .venv/bin/python bench/throughput.py
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import DATA_DIR

from structinit.data import load_dataset, stratified_subset
from structinit.harness.recipes import recipe
from structinit.harness.run.device import Placement, resolve_precision
from structinit.harness.tasks import train
from structinit.harness.tasks.image import image_step


def step_rates(cfg, ds, epochs: int, keep_model: bool = False):
    """Images/s per epoch of the run's own step on its own batches, and nothing more; with
    ``keep_model`` also the model it trained (tests compare it with the loop's)."""
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
    """Images/s per epoch of ``structinit.train`` (its history's own count)."""
    with tempfile.TemporaryDirectory() as tmp:
        run = train(cfg.__class__(**{**cfg.to_dict(), "epochs": epochs, "out_dir": str(Path(tmp) / "r"),
                                     "eval_every": 10**6}), progress=False)
    return [row["images_per_s"] for row in run["history"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=DATA_DIR)
    ap.add_argument("--models", default="vit_tiny_patch4_32,vit_cpu_patch4_32")
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(2)
    ds = stratified_subset(load_dataset("cifar10", args.data_dir, "train"), args.images, seed=0)
    print(f"default precision on this CPU: {resolve_precision('auto', torch.device('cpu'))}\n")
    print("| model | precision | step (img/s) | loop (img/s) | loop's cost beyond its step |")
    print("|---|---|---:|---:|---:|")
    rates = {}
    for name in args.models.split(","):
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
    print("\n| model | bf16 / fp32 (loop) |\n|---|---:|")
    for name in args.models.split(","):
        print(f"| {name} | {rates[(name, 'bf16')] / rates[(name, 'fp32')]:.2f}× |")


if __name__ == "__main__":
    main()

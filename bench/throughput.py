"""Training throughput of the harness against a minimal plain PyTorch loop, in one run.

Same model, batch, data (CIFAR-10 images in memory), optimiser, loss (label smoothing),
gradient clipping and precision; no augmentation in either. The plain loop is the
shortest correct loop; the harness is ``structinit.train`` (schedule, metrics, progress
accounting, checkpoint each epoch). Measurements alternate between the two to share the
machine's noise; images/s are medians over epochs after the first.

    .venv/bin/python bench/throughput.py
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from structinit.data import load_dataset, stratified_subset
from structinit.harness.recipes import recipe
from structinit.harness.run.device import resolve_precision
from structinit.harness.run.optim import param_groups
from structinit.harness.tasks import train
from structinit.harness.tasks.image import plan_model


def plain_loop(cfg, ds, epochs: int) -> list[float]:
    """Images/s per epoch of the minimal loop."""
    device = torch.device("cpu")
    dtype = resolve_precision(cfg.precision, device)
    model, plan = plan_model(cfg, ds.image_shape, ds.num_classes)
    plan.commit()
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, eps=cfg.eps)
    images, labels = ds.images, ds.labels
    mean = torch.tensor(ds.mean).view(1, -1, 1, 1)
    std = torch.tensor(ds.std).view(1, -1, 1, 1)
    steps = len(images) // cfg.batch_size
    rates = []
    for epoch in range(epochs):
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(epoch))
        start = time.perf_counter()
        for i in range(steps):
            idx = order[i * cfg.batch_size : (i + 1) * cfg.batch_size]
            x = (images[idx].float() / 255 - mean) / std
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                logits = model(x)
            loss = F.cross_entropy(logits.float(), labels[idx], label_smoothing=cfg.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
        rates.append(steps * cfg.batch_size / (time.perf_counter() - start))
    return rates


def harness(cfg, epochs: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        run = train(cfg.__class__(**{**cfg.to_dict(), "epochs": epochs, "out_dir": str(Path(tmp) / "r"),
                                     "eval_every": 10**6}), progress=False)
    return [row["images_per_s"] for row in run["history"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default="../shared/datasets")
    ap.add_argument("--models", default="vit_tiny_patch4_32,vit_cpu_patch4_32")
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(2)
    ds = stratified_subset(load_dataset("cifar10", args.data_dir, "train"), args.images, seed=0)
    print(f"default precision on this CPU: {resolve_precision('auto', torch.device('cpu'))}\n")
    print("| model | precision | plain loop (img/s) | harness (img/s) | harness overhead |")
    print("|---|---|---:|---:|---:|")
    rates = {}
    for name in args.models.split(","):
        for precision in ("fp32", "bf16"):
            # A 256-image holdout keeps the harness's one end-of-run evaluation short.
            cfg = recipe("cpu-cifar", model=name, precision=precision, augment="none", train_size=args.images,
                         data_dir=args.data_dir, holdout=256)
            plain, ours = [], []
            for _ in range(args.repeats):  # alternate so both see the same machine state
                plain += plain_loop(cfg, ds, args.epochs)[1:]
                ours += harness(cfg, args.epochs)[1:]
            p, h = statistics.median(plain), statistics.median(ours)
            rates[(name, precision)] = h
            print(f"| {name} | {precision} | {p:.0f} | {h:.0f} | {100 * (p / h - 1):+.1f}% |", flush=True)
    print("\n| model | bf16 / fp32 (harness) |\n|---|---:|")
    for name in args.models.split(","):
        print(f"| {name} | {rates[(name, 'bf16')] / rates[(name, 'fp32')]:.2f}× |")


if __name__ == "__main__":
    main()

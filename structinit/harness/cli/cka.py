"""``structinit cka``: do two trained models learn different representations?

    structinit cka runs/compare-cpu-cifar/impulse/seed0 runs/compare-cpu-cifar/pytorch/seed0

Linear CKA (minibatch, unbiased; :func:`structinit.cka_matrix`) between every layer of run A
and every layer of run B, on the same test images of A's dataset: a layer is the tokens its
attention receives (a Swin layer's windows of each image together; for an MLP-Mixer, its
token-mixing MLP), flattened per image. ``--at-init`` compares the two models as they were
initialised instead. Writes ``cka.png`` (heat map), ``cka.json`` and prints the matrix.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from structinit.analysis import cka_figure, cka_matrix
from structinit.harness.cli.flags import UsageError, out_path
from structinit.harness.errors import user_input
from structinit.harness.finished import load_run, models_of
from structinit.harness.run.checkpoint import atomic_write_bytes
from structinit.harness.run.folder import check_out_dir
from structinit.harness.tasks.image import test_images

COMMAND = "cka"
HELP = "layer-by-layer linear CKA between two finished runs (after training, or --at-init)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_a", help="a finished run folder")
    p.add_argument("run_b", help="another finished run folder (the same dataset)")
    p.add_argument("--images", type=int, default=512, help="test images of run A's dataset (default 512)")
    p.add_argument("--batch-size", dest="batch_size", type=int, default=64, help="minibatch, ≥ 4 (default 64)")
    p.add_argument("--at-init", action="store_true", help="compare the models at initialisation")
    p.add_argument("--data-dir", dest="data_dir", default=None, help="where run A's dataset is (default: its own)")
    p.add_argument("--out", default=None, type=out_path, help="output folder (default runs/cka-<A>-vs-<B>)")


def run(args: argparse.Namespace) -> int:
    with user_input("runs"):  # the two positional runs: no flag names them
        runs = [load_run(args.run_a), load_run(args.run_b)]
    names = ["-".join(r.path.resolve().parts[-2:]) for r in runs]  # the run's folder and the one above it
    out = Path(args.out or f"runs/cka-{names[0]}-vs-{names[1]}")
    with user_input("out_dir"):
        check_out_dir(out)
    cfg = runs[0].config
    other = runs[1].config
    if other.dataset != cfg.dataset:
        raise UsageError(f"{args.run_b} trained on {other.dataset}, {args.run_a} on {cfg.dataset}: CKA compares two "
                         "models on the same images; pass two runs of one dataset")
    if args.images < 4:
        raise UsageError(f"--images {args.images}: CKA needs at least 4 test images (its unbiased estimator needs "
                         "n > 3); pass --images 4 or more")
    images, _, _ = test_images(cfg.dataset, args.data_dir or cfg.data_dir, args.images)
    models = []
    for r in runs:
        with user_input("runs"):  # the two positional runs: no flag names them
            initial, trained = models_of(r, tuple(images.shape[1:]), r.num_classes)
        models.append(initial if args.at_init else trained)
    with user_input("batch_size"):
        matrix = cka_matrix(models[0], models[1], images, batch_size=args.batch_size)
    when = "at init" if args.at_init else "after training"
    labels = [r.label for r in runs]
    out.mkdir(parents=True, exist_ok=True)
    cka_figure(matrix, label_a=labels[0], label_b=labels[1], path=out / "cka.png",
               title=f"linear CKA {when}, {len(images)} test images of {cfg.dataset}")
    record = json.dumps({"runs": [str(r.path) for r in runs], "labels": labels, "when": when,
                         "images": len(images), "matrix": matrix.tolist()}, indent=1)
    atomic_write_bytes(out / "cka.json", lambda f: f.write(record.encode()))
    header = "| A \\ B | " + " | ".join(f"layer {j}" for j in range(matrix.shape[1])) + " |"
    rows = [f"| layer {i} | " + " | ".join(f"{float(v):.3f}" for v in row) + " |" for i, row in enumerate(matrix)]
    print(f"linear CKA {when}: A = {labels[0]}, B = {labels[1]}\n{header}\n|---|"
          + "---:|" * matrix.shape[1] + "\n" + "\n".join(rows))
    print(f"diagonal mean {float(torch.diagonal(matrix).mean()):.3f} → {out}/cka.png, cka.json")
    return 0


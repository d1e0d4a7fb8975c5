"""The empirical side of the Lipschitz certificate (docs/results/lipschitz.md): PGD's lower
bound on the local ℓ₂ Lipschitz constant (:func:`structinit.empirical_lipschitz`) of each
finished run's network under the given comparison folders, at init and trained, on the first
``--images`` CIFAR-10 test images in the model's input space. A Cayley network declares a bound
of 1 (``model.lipschitz_bound``), so its every estimate must be ≤ 1.

    OMP_NUM_THREADS=2 .venv/bin/python bench/lipschitz_check.py runs/lip-cayley runs/lip-plain
"""

from __future__ import annotations

import argparse
import statistics

from common import DATA_DIR

from structinit.analysis.certify import empirical_lipschitz
from structinit.data import load_dataset
from structinit.harness.finished import find_runs, models_of


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", help="compare folders (or run folders) of KWLarge runs")
    ap.add_argument("--data-dir", default=DATA_DIR)
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    print(f"PGD lower bound on the local Lipschitz constant, {args.images} test images, {args.steps} steps, "
          "input (normalised) space\n")
    print("| network | declared bound | at init (mean over seeds) | trained (per seed) | trained max |")
    print("|---|---:|---:|---|---:|")
    tests = {}
    for folder in args.folders:
        runs = find_runs(folder)
        cfg = runs[0].config
        if cfg.dataset not in tests:
            tests[cfg.dataset] = load_dataset(cfg.dataset, args.data_dir, "test")
        test = tests[cfg.dataset]  # KWLarge has no `head` to read the class count from: the dataset gives it
        x = test.normalised(args.images)
        init_l, trained_l, bound = [], [], None
        for run in runs:
            initial, trained = models_of(run, tuple(x.shape[1:]), test.num_classes)
            bound = getattr(trained, "lipschitz_bound", None)
            init_l.append(empirical_lipschitz(initial.eval(), x, steps=args.steps, seed=run.result["seed"]))
            trained_l.append(empirical_lipschitz(trained.eval(), x, steps=args.steps, seed=run.result["seed"]))
        kind = cfg.model_kwargs.get("conv", "cayley")
        print(f"| {cfg.model} ({kind}) | {'none' if bound is None else bound} | {statistics.fmean(init_l):.3f} | "
              f"{', '.join(f'{v:.3f}' for v in trained_l)} | {max(trained_l):.3f} |", flush=True)


if __name__ == "__main__":
    main()

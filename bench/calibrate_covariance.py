"""Calibrate the ``covariance`` conv init's defaults (σ₀, v_σ) from trained ConvMixers.

For each trained run, every depthwise layer's filter covariance Σ̂_l = FᵀF/h is fitted by
the init's family, trace-normalised G_σ ⊗ G_σ (``fit_kronecker_sigma``): σ_l and the relative
Frobenius residual say how wide the learned filters' spatial correlation is and how well a
separable Gaussian describes it. The per-layer σ_l, averaged over runs, give the depth
schedule σ_l = σ₀ + v_σ · l/(D − 1) by least squares (``fit_depth_schedule``). The table also
gives tr Σ̂_l / (1/3): the trained filters' total variance against PyTorch's default.

    OMP_NUM_THREADS=1 .venv/bin/python bench/calibrate_covariance.py runs/cm/pytorch
"""

from __future__ import annotations

import argparse
import statistics

from structinit.adapters.conv import find_depthwise_convs
from structinit.functional.conv_filters import estimate_covariance, fit_depth_schedule, fit_kronecker_sigma
from structinit.harness.config import ImageConfig
from structinit.harness.finished import find_runs, load_trained_weights
from structinit.harness.run.checkpoint import WEIGHTS, load_weights
from structinit.models import create_model

DEFAULT_TRACE = 1 / 3  # PyTorch's default depthwise init: k² taps of variance 1/(3k²)


def layer_fits(run) -> list[dict]:
    cfg: ImageConfig = run.config
    tensors, _ = load_weights(run.path / WEIGHTS)
    in_chans = int(tensors["stem.weight"].shape[1]) if "stem.weight" in tensors else 3  # ConvMixer's stem
    model = create_model(cfg.model, num_classes=run.num_classes, in_chans=in_chans, **cfg.model_kwargs)
    load_trained_weights(model, run.path / WEIGHTS)
    rows = []
    for layer, (name, conv) in enumerate(find_depthwise_convs(model)):
        cov = estimate_covariance(conv.weight)
        sigma, residual = fit_kronecker_sigma(cov)
        rows.append({"layer": layer, "name": name, "sigma": sigma, "residual": residual,
                     "trace_ratio": float(cov.trace()) / DEFAULT_TRACE})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", help="run folders, or comparison folders holding seed<k> runs")
    args = parser.parse_args()
    runs = [run for folder in args.folders for run in find_runs(folder)]
    fits = [layer_fits(run) for run in runs]
    depth = len(fits[0])
    if any(len(f) != depth for f in fits):
        raise SystemExit("the runs have different depths; calibrate one architecture at a time")
    print(f"{len(runs)} trained run(s): {', '.join(str(r.path) for r in runs)}\n")
    print("| layer | σ_l (mean over runs) | σ_l per run | fit residual (mean) | tr Σ̂ / default |")
    print("|---:|---:|---|---:|---:|")
    sigmas = []
    for layer in range(depth):
        per_run = [f[layer] for f in fits]
        s = statistics.fmean(r["sigma"] for r in per_run)
        sigmas.append(s)
        each = ", ".join(f"{r['sigma']:.3f}" for r in per_run)
        print(f"| {layer} | {s:.3f} | {each} | "
              f"{statistics.fmean(r['residual'] for r in per_run):.3f} | "
              f"{statistics.fmean(r['trace_ratio'] for r in per_run):.2f} |")
    sigma0, v_sigma = fit_depth_schedule(sigmas)
    print(f"\nleast-squares schedule: sigma0={sigma0:.3f}, v_sigma={v_sigma:.3f} "
          f"(σ from {sigma0:.3f} at layer 0 to {sigma0 + v_sigma:.3f} at layer {depth - 1})")


if __name__ == "__main__":
    main()

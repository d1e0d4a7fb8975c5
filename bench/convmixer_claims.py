"""The ConvMixer results of a finished ``cpu-cifar-convmixer`` comparison (docs/results/convmixer.md):
every init's accuracy and the claims (:data:`CLAIMS`), each with its difference's standard error
(√(s₁²/n₁ + s₂²/n₂)) and a verdict ("within noise": under two standard errors); or, with
``--calibrate``, the ``covariance`` init's defaults (σ₀, v_σ) fitted to the trained runs'
depthwise filters (``fit_kronecker_sigma`` per layer, ``fit_depth_schedule`` over depth).

    .venv/bin/python bench/convmixer_claims.py runs/cm
    .venv/bin/python bench/convmixer_claims.py --calibrate runs/cm/pytorch
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from common import markdown

from structinit.adapters.conv import find_depthwise_convs
from structinit.functional.conv_filters import estimate_covariance, fit_depth_schedule, fit_kronecker_sigma
from structinit.harness.finished import find_runs, load_trained_weights
from structinit.harness.run.checkpoint import WEIGHTS, load_weights
from structinit.harness.summary import mean_std
from structinit.models import create_model

LEARNED = "pytorch"
CLAIMS = (  # (claim, a, b, test on the difference of means a − b in points)
    ("frozen impulse within 1 point of learned", "impulse:frozen=True", LEARNED, lambda d: abs(d) <= 1.0),
    ("covariance ≥ default (both trainable)", "covariance", LEARNED, lambda d: d >= 0.0),
    ("covariance beats default when frozen", "covariance:frozen=True", "random:frozen=True", lambda d: d > 0.0),
)


def load_rows(folder: Path) -> dict[str, list[float]]:
    """Init spec → held-out accuracies (%) of its finished seeds, in seed order."""
    rows: dict[str, list[float]] = {}
    for run in find_runs(folder):
        rows.setdefault(run.spec, []).append(100 * run.result["final"]["holdout_acc"])
    return rows


def _short(spec: str) -> str:
    """The transfer's source path is long and machine-specific: the table names the init only."""
    return "covariance_transfer" if spec.startswith("covariance_transfer") else spec


def table(rows: dict[str, list[float]]) -> str:
    base = statistics.fmean(rows[LEARNED]) if LEARNED in rows else None
    lines = []
    for spec, values in sorted(rows.items(), key=lambda kv: -statistics.fmean(kv[1])):
        s = mean_std(values)
        delta = "" if base is None or spec == LEARNED else f"{s['mean'] - base:+.2f}"
        lines.append([_short(spec), f"{s['mean']:.2f} ± {s['std']:.2f}", ", ".join(f"{v:.2f}" for v in values), delta])
    return markdown(["init", "held-out accuracy % (mean ± std)", "per seed", "Δ vs learned"], "lrlr", lines)


def claims(rows: dict[str, list[float]]) -> str:
    lines = []
    for text, a, b, test in CLAIMS:
        if a not in rows or b not in rows:
            lines.append(f"| {text} | | | | | not measured ({a if a not in rows else b} missing) |")
            continue
        sa, sb = mean_std(rows[a]), mean_std(rows[b])
        diff = sa["mean"] - sb["mean"]
        se = math.sqrt(sa["std"] ** 2 / len(rows[a]) + sb["std"] ** 2 / len(rows[b]))
        verdict = "holds" if test(diff) else "fails"
        if abs(diff) < 2 * se:
            verdict += " (within noise)"
        lines.append(f"| {text} | {sa['mean']:.2f} | {sb['mean']:.2f} | {diff:+.2f} | {se:.2f} | {verdict} |")
    return "\n".join([markdown(["claim", "a", "b", "a − b (points)", "std. error", "verdict"], "lrrrrl"), *lines])


DEFAULT_TRACE = 1 / 3  # PyTorch's default depthwise init: k² taps of variance 1/(3k²)


def layer_fits(run) -> list[dict]:
    """Per depthwise layer of the run's trained model: σ_l, the fit's residual and tr Σ̂_l / default."""
    cfg = run.config
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


def calibrate(folders: list[Path]) -> str:
    """The per-layer fits, averaged over the runs in ``folders``, and the depth schedule through them."""
    runs = [run for folder in folders for run in find_runs(folder)]
    fits = [layer_fits(run) for run in runs]
    depth = len(fits[0])
    if any(len(f) != depth for f in fits):
        raise SystemExit("the runs have different depths; calibrate one architecture at a time")
    rows, sigmas = [], []
    for layer in range(depth):
        per_run = [f[layer] for f in fits]
        sigmas.append(statistics.fmean(r["sigma"] for r in per_run))
        rows.append([layer, f"{sigmas[-1]:.3f}", ", ".join(f"{r['sigma']:.3f}" for r in per_run),
                     f"{statistics.fmean(r['residual'] for r in per_run):.3f}",
                     f"{statistics.fmean(r['trace_ratio'] for r in per_run):.2f}"])
    sigma0, v_sigma = fit_depth_schedule(sigmas)
    return "\n".join([
        f"{len(runs)} trained run(s): {', '.join(str(r.path) for r in runs)}\n",
        markdown(["layer", "σ_l (mean over runs)", "σ_l per run", "fit residual (mean)", "tr Σ̂ / default"], "rrlrr",
                 rows),
        f"\nleast-squares schedule: sigma0={sigma0:.3f}, v_sigma={v_sigma:.3f} "
        f"(σ from {sigma0:.3f} at layer 0 to {sigma0 + v_sigma:.3f} at layer {depth - 1})"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", type=Path, nargs="+",
                    help="the compare folder of the cpu-cifar-convmixer runs (--calibrate: run or compare folders)")
    ap.add_argument("--calibrate", action="store_true", help="fit the covariance init's defaults instead")
    args = ap.parse_args()
    if args.calibrate:
        print(calibrate(args.folders))
        return
    if len(args.folders) > 1:
        ap.error("the claims read one comparison folder")
    rows = load_rows(args.folders[0])  # find_runs: a clear error if the folder holds no finished run
    print(table(rows), "", claims(rows), sep="\n")


if __name__ == "__main__":
    main()

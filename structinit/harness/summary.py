"""What a set of runs amounts to: the metric a run is judged on, mean ± std over seeds, and
the comparison's table. ``compare``, ``ablate`` and the report summarise with these."""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["format_summary", "mean_std", "primary_metric", "summarise"]


def primary_metric(final: dict[str, float]) -> str:
    """The metric a run is judged on: held-out accuracy if there is one, else test accuracy."""
    for key in ("holdout_acc", "test_acc"):
        if key in final:
            return key
    raise ValueError(f"no evaluation accuracy in {sorted(final)}")


# Robustness metrics of runs with certify_eps: (summary key, suffix of the split's metric, column title).
_ROBUST = (("cert", "cert_acc", "certified % (mean ± std)"), ("pgd", "pgd_acc", "PGD % (mean ± std)"))


def mean_std(values: list[float], key: str = "accs") -> dict[str, Any]:
    """``{key: values, "mean": …, "std": …}``; the std of one value is 0."""
    return {key: values, "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def summarise(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """Per init spec: the primary metric's accuracies over seeds with mean and std, the seeds
    and wall times; runs trained with ``certify_eps`` also get ``cert`` and ``pgd`` (the same
    split's certified and PGD accuracy, when every seed has them)."""
    table = {}
    for spec, results in runs.items():
        metric = primary_metric(results[0]["final"])
        accs = [r["final"][metric] for r in results]
        table[spec] = {"metric": metric, **mean_std(accs),
                       "seeds": [r["seed"] for r in results], "wall_s": [r["wall_s"] for r in results]}
        split = metric.removesuffix("_acc")
        for key, suffix, _ in _ROBUST:
            values = [r["final"].get(f"{split}_{suffix}") for r in results]
            if all(v is not None for v in values):
                table[spec][key] = mean_std(values)
    return table


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a markdown table; certified and PGD columns appear when some run has them."""
    robust = [(key, title) for key, _, title in _ROBUST if any(key in s for s in summary.values())]
    extra_head = "".join(f" {title} |" for _, title in robust)
    lines = [f"| init | metric | accuracy % (mean ± std) |{extra_head} per seed | minutes per run |",
             "|---|---|---:|" + "---:|" * len(robust) + "---|---:|"]
    for spec, s in summary.items():
        per_seed = ", ".join(f"{100 * a:.2f}" for a in s["accs"])
        minutes = statistics.fmean(s["wall_s"]) / 60
        extra = "".join(f" {100 * s[key]['mean']:.2f} ± {100 * s[key]['std']:.2f} |" if key in s else " — |"
                        for key, _ in robust)
        lines.append(f"| {spec} | {s['metric']} | {100 * s['mean']:.2f} ± {100 * s['std']:.2f} |{extra} "
                     f"{per_seed} | {minutes:.1f} |")
    return "\n".join(lines) + "\n"



"""What a set of runs amounts to: the metric a run is judged on, mean ± std over seeds, and
the comparison's table. ``compare``, ``ablate`` and the report summarise with these."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["final_accuracy", "format_stat", "format_summary", "mean_std", "paired_gains", "primary_metric",
           "seed_accuracies", "seed_gains", "summarise"]


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


def final_accuracy(result: dict[str, Any]) -> float:
    """A run's ``result.json`` read to one number: its primary metric at the end."""
    return result["final"][primary_metric(result["final"])]


def seed_accuracies(out_dir: str | Path, inits: list[str] | None = None,
                    value: Callable[[dict[str, Any]], Any] = final_accuracy) -> dict[str, dict[int, Any]]:
    """``{init: {seed: accuracy}}`` of every finished run of a comparison folder.

    Reads ``<out_dir>/<init>/seed<N>/result.json`` (the layout ``compare`` writes), each read to
    one number by ``value`` (default: the primary metric at the end, :func:`final_accuracy`);
    ``inits`` restricts and orders the specs (default: every folder, sorted).
    A run still training has no ``result.json`` and is left out. Raises FileNotFoundError,
    naming the path, where ``out_dir`` is not a folder.
    """
    out = Path(out_dir)
    if not out.is_dir():
        raise FileNotFoundError(f"out_dir {str(out)!r}: no such folder; expected a comparison's runs "
                                "(<init>/seed<N>/result.json), as structinit compare --out writes")
    names = inits if inits is not None else sorted(p.name for p in out.iterdir() if p.is_dir())
    table: dict[str, dict[int, float]] = {}
    for init in names:
        for path in sorted((out / init).glob("seed*/result.json")):
            table.setdefault(init, {})[int(path.parent.name.removeprefix("seed"))] = value(json.loads(path.read_text()))
    return table


def seed_gains(by_init: dict[str, dict[int, float]], init: str, base: str = "pytorch") -> dict[int, float]:
    """{seed: accuracy of ``init`` minus that of ``base``} for every seed that both ran."""
    common = sorted(set(by_init.get(init, {})) & set(by_init.get(base, {})))
    return {s: by_init[init][s] - by_init[base][s] for s in common}


def paired_gains(by_init: dict[str, dict[int, float]], init: str, base: str = "pytorch") -> list[float]:
    """Per seed that both ran: accuracy of ``init`` minus that of ``base`` (paired by seed)."""
    return list(seed_gains(by_init, init, base).values())


def format_stat(values: list[float]) -> str:
    """Fractions as percentage points: ``"mean ± std"``, the mean alone for one value, ``–`` for none."""
    if not values:
        return "–"
    spread = f" ± {100 * statistics.stdev(values):.2f}" if len(values) > 1 else ""
    return f"{100 * statistics.fmean(values):.2f}{spread}"

"""The registry sweep: structinit's attention inits, with no hints, on one small model of every
module family of timm, every vision architecture of transformers (image classifiers and the
vision towers of multimodal models) and every 2-D image model class of vit-pytorch, and on
transformers' language models for mimetic. Per model × scheme: the outcome, the model's own maps
after the write, and the reason of a refusal.

    .venv-zoo/bin/python bench/sweep.py --packages timm,transformers --out sweep.json
    .venv-zoo/bin/python bench/sweep.py --packages vit_pytorch --out sweep_vp.json
    .venv-zoo/bin/python bench/sweep.py --from sweep.json          # the table again, from the data

A vision tower whose forward takes packed patches and their grid sizes is handed one call of
it (``example_inputs=``, :func:`tower_call`), as a user with its processor would; every other
model gets no hints. A timm family still over :data:`MAX_PARAMETERS` at its smallest is built
with 2 blocks where it takes ``depth``. A vit-pytorch class is built from its signature at
32 px (:func:`sweep_models.vit_pytorch_entries`); one that fails to build or to run on a
(2, 3, 32, 32) batch is "build-failed", with its error.

A written init is checked on the maps the model computes itself: impulse's argmax hit on the
position-only input (``structinit.impulse_fidelity(model)``), mimetic's diagonal strength in the
model's own logits on a probe (its softmax's input, else its log-probabilities). "silent" is a write whose own maps
miss, by the bars the library's own checks hold a write to: a head hit below
``structinit.schemes.checks.MIN_HEAD_HIT`` (0.95), or a diagonal strength below ``MIN_DIAGONAL_SHARE`` (0.5)
of the written one in some head. A refusal is "expected" when its
reason names a mechanism no init of its kind can shape (:data:`MECHANISMS`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback
import warnings
from dataclasses import asdict, dataclass

import torch
from sweep_models import (  # noqa: F401 (smallest, tower_call: the sweep's API, tested here)
    MAX_PARAMETERS,
    smallest,
    timm_entries,
    tower_call,
    transformers_entries,
    vit_pytorch_entries,
)

SCHEMES = ("impulse", "mimetic")
# each package the sweep knows, and the function that lists its models, by name: looked up when called
PACKAGES = {"timm": "timm_entries", "transformers": "transformers_entries", "vit_pytorch": "vit_pytorch_entries"}
# Refusal reasons that name what the scheme cannot realise on that layer, by words in the message.
MECHANISMS = {
    "impulse": ("reads token ids", "grouped-query", "no softmax(q kᵀ) map", "linear or factorised",
                "q and k are normalised", "rotated by position", "masks each token's logit on itself",
                "no attention layer found", "tokens carry no position", "without biasing other pairs",
                "not self-attention over its tokens", "the layer is causal", "no product of projections of one token",
                # rotary positions with no content-free channel in q and k to carry the impulse
                "it has no learned q and k biases, and no affine LayerNorm"),
    "mimetic": ("no softmax(q kᵀ) map", "linear or factorised", "no attention layer found",
                "not self-attention over its tokens", "the value path is not linear",
                "no product of projections of one token"),
}
@dataclass
class Row:
    model: str
    package: str
    scheme: str
    outcome: str  # written, silent, unverified, refused, expected, traceback, no-attention, too-large, build-failed
    own_map: float | None = None
    reason: str = ""
    call: str = ""  # the forward's arguments the sweep handed over as example_inputs, when images do not do


class _Timeout(BaseException):  # not an Exception: the code under test must not swallow it
    pass


def _alarm(signum, frame):
    raise _Timeout


def own_map(model, scheme: str, call: dict | None = None) -> float:
    """The write as the model's own maps show it (module doc): impulse's smallest head hit on
    the position-only input; for mimetic, the smallest ratio, over the heads whose written q kᵀ
    has a diagonal strength of at least 1 on a probe (a layer with none, or with fewer than 3 keys,
    counts 1 when its maps are those of the written q kᵀ within 1e-3, or those plus a logit term the
    same for two images (a position bias of its own), else 0), of the strength in
    the model's own logits (its softmax's input; where that cannot be read, the log of its map
    against the log of the map the adapter models: :func:`structinit.schemes.checks.diagonals`)
    to the written one (a head whose truncation leaves no diagonal promises none)."""
    import structinit
    from structinit.adapters.logit_transforms import POSITION_BIAS
    from structinit.adapters.observe import observe, real_maps
    from structinit.adapters.provenance_tokens import call_rows
    from structinit.adapters.survey import ModelSurvey
    from structinit.schemes.checks import diagonals

    survey = ModelSurvey(model, example_inputs=call)  # the probe the init's own survey takes, and its layers
    written = set(structinit.get_record(model, "init")["layers"])  # not those it left alone (a layer never called)
    chosen = [i for i, (name, _) in enumerate(survey.layers()) if name in written]
    if scheme == "impulse":
        return float(torch.nan_to_num(structinit.impulse_fidelity(survey, layers=chosen)["hit"], nan=1.0).min())
    layers, inputs = [survey.layers()[i] for i in chosen], survey.probe
    calls, _ = observe(model, inputs, [(ad.module, ad.input_module, ad) for _, ad in layers])
    ratios = []
    for (name, ad), real in zip(layers, real_maps(model, inputs, layers, calls)):
        call = calls[ad.module]
        x = call_rows(call, real.probs.shape[-1], real.probs.shape[0])
        if x is None:
            continue
        terms = ad.call_terms(call.args, call.kwargs, x)
        written, own = diagonals(ad, real, x, terms) if x.shape[-2] >= 3 else (torch.zeros(0), None)
        ratios += [float(own[h] / written[h]) for h in range(len(written)) if written[h] >= 1.0]
        if not bool((written >= 1.0).any()):  # no diagonal to measure: the maps must be the written q kᵀ's,
            verdict = survey.attention.verdict(name)  # or those plus a term the same for two images (its own bias)
            biased = verdict is not None and verdict.code == POSITION_BIAS
            ratios.append(1.0 if biased or _maps_gap(ad, real, x, terms) <= 1e-3 else 0.0)
    if not ratios:
        raise ValueError("no layer's maps could be read on the tokens it was judged on")
    return min(ratios)


@torch.no_grad()
def _maps_gap(ad, real, x: torch.Tensor, terms) -> float:
    """The largest difference between one layer's own maps ``real`` and the maps the adapter
    gives its tokens ``x`` (inf when they do not have the same size)."""
    ours = ad.attention_probs(x.float(), terms)
    if real.probs.numel() != ours.numel():
        return float("inf")
    return float((real.probs.reshape(ours.shape).float() - ours).abs().max())


def run_one(name: str, package: str, build, schemes=SCHEMES, seconds: int = 180) -> list[Row]:
    import structinit
    from structinit.adapters.survey import attention_survey

    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        try:
            torch.manual_seed(0)
            model = build().eval()
            call = tower_call(model) if package == "transformers" else None
        except _Timeout:
            raise
        except Exception as err:  # the package could not build it small: not structinit's to judge
            return [Row(name, package, s, "build-failed", reason=f"{type(err).__name__}: {str(err)[:120]}")
                    for s in schemes]
        size = sum(p.numel() for p in model.parameters())
        if size > MAX_PARAMETERS:  # the family's smallest entry point is still large: a CPU sweep skips it
            return [Row(name, package, s, "too-large", reason=f"{size / 1e6:.0f}M parameters") for s in schemes]
        try:
            survey = attention_survey(model)
        except _Timeout:
            raise
        except Exception as err:  # structinit's own survey failed: a traceback, whichever scheme is asked
            return [Row(name, package, s, "traceback", reason=_where(err)) for s in schemes]
        if not (survey.verdicts or survey.unknown or survey.pooling or survey.unread):  # unread: maps it cannot read
            return [Row(name, package, s, "no-attention") for s in schemes]
        return [_one_scheme(structinit, model, name, package, scheme, call) for scheme in schemes]
    except _Timeout:
        return [Row(name, package, s, "timeout", reason=f"over {seconds} s") for s in schemes]
    finally:
        signal.alarm(0)


def _where(err: Exception) -> str:
    """An exception in one line: its type, its message and where it was raised."""
    where = traceback.extract_tb(err.__traceback__)[-1]
    return f"{type(err).__name__}: {str(err)[:160]} ({where.filename.split('/')[-1]}:{where.lineno})"


def _one_scheme(structinit, model, name, package, scheme, call: dict | None = None) -> Row:
    import copy

    target = copy.deepcopy(model)
    given = {} if call is None else {"example_inputs": call}
    said = ", ".join(given.get("example_inputs", {}))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            structinit.init_(target, scheme, seed=0, **given)
    except ValueError as err:
        reason = str(err).split("; nothing was written")[0][:300]
        expected = any(words in str(err) for words in MECHANISMS[scheme])
        return Row(name, package, scheme, "expected" if expected else "refused", reason=reason, call=said)
    except _Timeout:
        raise
    except Exception as err:
        return Row(name, package, scheme, "traceback", call=said, reason=_where(err))
    try:
        score = own_map(target, scheme, call)
    except Exception as err:  # written, but its maps cannot be read: not verified, and said so
        why = f"own maps unreadable: {type(err).__name__}: {err}"
        return Row(name, package, scheme, "unverified", reason=why[:200], call=said)
    from structinit.schemes.checks import MIN_DIAGONAL_SHARE, MIN_HEAD_HIT

    ok = score >= (MIN_HEAD_HIT if scheme == "impulse" else MIN_DIAGONAL_SHARE)  # the library's own bars
    return Row(name, package, scheme, "written" if ok else "silent", score, call=said)


def summary(rows: list[Row]) -> str:
    counted = [r for r in rows if r.outcome not in ("no-attention", *_UNMEASURED)]
    good = sum(r.outcome in ("written", "expected") for r in counted)
    silent = sum(r.outcome == "silent" for r in counted)
    tracebacks = sum(r.outcome == "traceback" for r in counted)
    unverified = sum(r.outcome == "unverified" for r in counted)
    return (f"sweep: {good}/{len(counted)} as expected, {silent} silent, {tracebacks} tracebacks "
            f"({unverified} written with no map of 3 or more keys to check)")


def group_of(row: Row) -> str:
    """The table's group of a row: its package (timm, vit_pytorch), or transformers' image
    classifiers, vision towers and language models (as :func:`transformers_entries` builds them)."""
    if row.package != "transformers":
        return row.package
    if row.model.endswith(".vision"):
        return "transformers: vision towers"
    from transformers.models.auto import modeling_auto as auto

    classifier = row.model in auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES
    return f"transformers: {'image classifiers' if classifier else 'language models'}"


def summary_table(rows: list[Row]) -> str:
    """Markdown, one line per group (:func:`group_of`): families with attention, and per scheme
    how many behave as expected (written on their own maps, or refused for a mechanism), silent
    writes, tracebacks, writes with no map to check, the families called with an example input
    (:func:`tower_call`), and those not measured (the package could not build them small, or
    they are too large for a CPU sweep)."""
    lines = ["| package | families with attention | " + " | ".join(f"{s} as expected" for s in SCHEMES)
             + " | silent | tracebacks | written, no map to check | called with example_inputs"
             " | not built or too large |",
             "|---|" + "---:|" * (len(SCHEMES) + 6)]
    for group in dict.fromkeys(group_of(r) for r in rows):
        mine_all = [r for r in rows if group_of(r) == group]
        counted = [r for r in mine_all if r.outcome not in ("no-attention", *_UNMEASURED)]
        cells = []
        for scheme in SCHEMES:
            mine = [r for r in counted if r.scheme == scheme]
            written = sum(r.outcome == "written" for r in mine)
            expected = sum(r.outcome == "expected" for r in mine)
            cells.append(f"{written + expected} ({written} written, {expected} refused for the mechanism)")
        called = len({r.model for r in counted if r.call})
        unmeasured = len({r.model for r in mine_all if r.outcome in _UNMEASURED})
        lines.append(f"| {group} | {len({r.model for r in counted})} | " + " | ".join(cells) + " | "
                     + " | ".join(str(sum(r.outcome == o for r in counted)) for o in ("silent", "traceback",
                                                                                     "unverified"))
                     + f" | {called} | {unmeasured} |")
    vision = [r for r in rows if group_of(r) in ("transformers: vision towers", "transformers: image classifiers")
              and r.outcome not in ("no-attention", *_UNMEASURED)]
    if vision:  # the architectures the vision goal counts: towers and classifiers, both inits
        good = sum(r.outcome in ("written", "expected") for r in vision)
        lines += ["", f"transformers vision architectures (towers and image classifiers, both inits): "
                      f"{good}/{len(vision)} as expected ({100 * good / len(vision):.1f} %)"]
    return "\n".join(lines)


_UNMEASURED = ("build-failed", "timeout", "too-large")


def table(rows: list[Row]) -> str:
    lines = ["| model | package | scheme | outcome | own-map | reason |", "|---|---|---|---|---:|---|"]
    for r in rows:
        score = "" if r.own_map is None else f"{r.own_map:.2f}"
        given = f" (called with example_inputs: {r.call})" if r.call else ""
        lines.append(f"| {r.model} | {r.package} | {r.scheme} | {r.outcome} | {score} | "
                     f"{r.reason.replace('|', '/')}{given} |")
    per = {p: summary([r for r in rows if r.package == p]) for p in dict.fromkeys(r.package for r in rows)}
    return "\n".join(lines + [""] + [f"{p}: {s}" for p, s in per.items()] + [summary(rows)])


def _save(path: str, rows: list[Row]) -> None:
    """Atomically: a sweep killed while writing keeps its last complete file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"rows": [asdict(r) for r in rows]}, f, indent=0)
    os.replace(tmp, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--packages", default="timm,transformers", help=f"comma-separated, of {', '.join(PACKAGES)}")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--width", type=int, default=96, help="transformers' hidden size")
    parser.add_argument("--only", default="", help="comma-separated model names to run")
    parser.add_argument("--skip", default="", help="comma-separated model names to leave out (said in the table)")
    parser.add_argument("--out", help="write the rows as JSON here (and resume from it)")
    parser.add_argument("--from", dest="source", help="print the table of a saved sweep")
    parser.add_argument("--summary", action="store_true", help="with --from: one line per package and kind")
    args = parser.parse_args(argv)
    if args.source:
        saved = [Row(**r) for r in json.load(open(args.source))["rows"]]
        print(summary_table(saved) if args.summary else table(saved))
        return 0
    schemes = tuple(args.schemes.split(","))
    done: dict[tuple[str, str], list[Row]] = {}
    if args.out and os.path.exists(args.out):  # a sweep stopped midway resumes where it was
        for r in json.load(open(args.out))["rows"]:
            done.setdefault((r["model"], r["package"]), []).append(Row(**r))
    entries = []
    for package in args.packages.split(","):
        if package not in PACKAGES:
            parser.error(f"no package {package!r}: the sweep knows {', '.join(PACKAGES)}")
        found = transformers_entries(args.width) if package == "transformers" else globals()[PACKAGES[package]]()
        entries += [(name, package, build) for name, build in found]
    only, skip = set(filter(None, args.only.split(","))), set(filter(None, args.skip.split(",")))
    rows, kept, saved = [], 0, dict(done)  # saved: every model's rows for --out, the file's others left in it
    order = [(n, p) for n, p, _ in entries]  # --out in the sweep's order, then rows of models it no longer lists
    for name, package, build in entries:
        if only and name not in only:
            continue
        if name in skip:
            rows += [Row(name, package, s, "too-large", reason="left out with --skip") for s in schemes]
            saved[(name, package)] = rows[-len(schemes):]
            continue
        got = done.get((name, package))
        kept, tag = kept + (got is not None), " (kept from --out)" if got is not None else ""
        got = saved[(name, package)] = got or run_one(name, package, build, schemes)
        rows += got
        print(" | ".join(f"{r.model} {r.scheme}: {r.outcome}" for r in got) + tag, file=sys.stderr, flush=True)
        if args.out:
            _save(args.out, [r for key in order + [k for k in saved if k not in order] for r in saved.get(key, [])])
    if kept:  # a rerun after a fix must not pass off the old rows as new ones
        print(f"{kept} model(s) not run again: their rows were kept from {args.out}, where an earlier sweep had "
              "finished them; delete it (or write elsewhere) to run them again", file=sys.stderr)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

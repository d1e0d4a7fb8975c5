"""Golden fingerprints: stored references for every registered init scheme and for the
analytic solver's unsigned kernel, in ``tests/golden/scheme_weights.json``.

A fingerprint of a tensor is its shape and dtype, Σx, Σx², Σ|x| (in float64) and the values at
a few fixed flat indices (:func:`sample_indices`). It changes with any change of a scheme's
defaults (a constant, a scale, a seed stream, an ordering), yet not with the last-bit noise
that BLAS, LAPACK or the thread count leave on float32 weights: values are compared with rtol 1e-5 and atol 1e-6, and
Σx (which can cancel to ~0) with an absolute tolerance of rtol·Σ|x|.

Regenerate the file after an *intended* change (a new default, a new scheme, a model built
differently), review the diff, and commit it with the change::

    OMP_NUM_THREADS=1 .venv/bin/python tests/test_golden_weights.py --regenerate
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import structinit

GOLDEN = Path(__file__).parent / "golden" / "scheme_weights.json"
RTOL, ATOL = 1e-5, 1e-6
SAMPLES = 8
REGENERATE = "OMP_NUM_THREADS=1 .venv/bin/python tests/test_golden_weights.py --regenerate"


# --------------------------------------------------------------------------- fingerprints
def sample_indices(numel: int) -> list[int]:
    """SAMPLES flat indices spread over the tensor by a fixed multiplicative hash (not the
    torch RNG, so the choice is the same on every machine and torch version)."""
    picked = []
    for i in range(SAMPLES):
        j = (i * 2654435761 + 97) % numel
        if j not in picked:
            picked.append(j)
    return picked


def _num(x: float) -> float:
    return float(f"{x:.10g}")


def fingerprint(t: torch.Tensor) -> dict:
    flat = t.detach().reshape(-1).double().cpu()
    fp = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
    if flat.numel() == 0:
        return fp
    fp.update(sum=_num(flat.sum()), sum_sq=_num((flat * flat).sum()), sum_abs=_num(flat.abs().sum()),
              at=[_num(flat[j]) for j in sample_indices(flat.numel())])
    return fp


def fingerprints(tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    return {name: fingerprint(t) for name, t in tensors.items()}


def _close(expected: float, got: float, atol: float) -> bool:
    return abs(got - expected) <= atol + RTOL * abs(expected)


def differences(expected: dict[str, dict], got: dict[str, dict]) -> list[str]:
    """One line per tensor and statistic that differs: 'tensor: statistic expected …, got …'."""
    out = [f"{name}: missing (the reference has it)" for name in expected if name not in got]
    out += [f"{name}: not in the reference (a new tensor)" for name in got if name not in expected]
    for name in (n for n in expected if n in got):
        ref, fp = expected[name], got[name]
        for key in ("shape", "dtype"):
            if ref[key] != fp[key]:
                out.append(f"{name}: {key} expected {ref[key]}, got {fp[key]}")
        if ref["shape"] != fp["shape"] or "sum" not in ref:
            continue
        for key in ("sum", "sum_sq", "sum_abs"):
            # Σx can cancel to ~0: its float noise is relative to Σ|x|, not to Σx itself
            atol = ATOL + RTOL * ref["sum_abs"] if key == "sum" else ATOL
            if not _close(ref[key], fp[key], atol):
                out.append(f"{name}: {key} expected {ref[key]!r}, got {fp[key]!r}")
        for j, ref_v, v in zip(sample_indices(math.prod(ref["shape"])), ref["at"], fp["at"]):
            if not _close(ref_v, v, ATOL):
                out.append(f"{name}: value at flat index {j} expected {ref_v!r}, got {v!r}")
    return out


# --------------------------------------------------------------------------- the scheme cases
@dataclass(frozen=True)
class Case:
    """``scheme`` with ``options`` (and ``seed=0``) on ``model``, built after
    ``torch.manual_seed(MODEL_SEED)``.
    ``target`` is the registration it covers (``structinit.schemes(target)``)."""

    id: str
    model: str
    scheme: str
    target: str
    options: dict = field(default_factory=dict)


def _source_state_dict() -> dict[str, torch.Tensor]:
    """A fixed 'trained' source for covariance_transfer: a ConvMixer as built from seed 1."""
    torch.manual_seed(1)
    return structinit.create_model("convmixer_cpu_128_6").state_dict()


# Models are built from another seed than the schemes' seed=0, so that a scheme whose seed-0 draws
# happened to repeat the constructor's could not pass as writing nothing.
MODEL_SEED = 1234
VIT, CONVMIXER = "vit_micro_patch2_16", "convmixer_cpu_128_6"
MODEL_SCHEMES = ("default", "jax", "kaiming_uniform", "pytorch", "timm", "trunc_normal", "xavier", "xavier_fused")
CONV_SCHEMES = ("box", "covariance", "gaussian", "impulse", "orthogonal", "random", "softmax")

CASES: list[Case] = [
    Case("vit/impulse", VIT, "impulse", "attention"),
    Case("vit/impulse-gd20", VIT, "impulse", "attention", dict(solver="gd", steps=20)),
    Case("vit/impulse-closed_form", VIT, "impulse", "attention", dict(solver="closed_form")),
    Case("vit/mimetic", VIT, "mimetic", "attention"),
    # the patch embedding is the ViT's one full conv (the Cayley kernel on ConvMixer's takes seconds)
    Case("vit/orthogonal-cayley", VIT, "orthogonal", "conv", dict(variant="cayley")),
    *(Case(f"vit/{s}", VIT, s, "model") for s in MODEL_SCHEMES),
    *(Case(f"convmixer/{s}", CONVMIXER, s, "conv") for s in CONV_SCHEMES),
    Case("convmixer/covariance_transfer", CONVMIXER, "covariance_transfer", "conv", dict(source=_source_state_dict)),
    *(Case(f"convmixer/{s}", CONVMIXER, s, "model") for s in MODEL_SCHEMES),
    Case("convit/impulse", "convit_cpu_patch2_32", "impulse", "attention"),
    Case("convit/mimetic", "convit_cpu_patch2_32", "mimetic", "attention"),
    Case("gpt/mimetic", "gpt_seq_2x64", "mimetic", "attention"),
    Case("mamba/mimetic", "mamba_seq_2x64", "mimetic", "ssm"),
    Case("mixer/impulse", "mixer_cpu_patch4_32", "impulse", "token_mixing"),
    Case("mixer/mimetic", "mixer_cpu_patch4_32", "mimetic", "token_mixing"),
    Case("swin/impulse", "swin_cpu_patch2_32", "impulse", "attention"),  # the relative-bias route
    Case("swin/timm", "swin_cpu_patch2_32", "timm", "model"),  # baselines write the bias tables too
]


def built_weights(model: str) -> dict[str, torch.Tensor]:
    """The state dict of ``model`` as built after ``torch.manual_seed(MODEL_SEED)``, before any scheme."""
    torch.manual_seed(MODEL_SEED)
    return structinit.create_model(model).state_dict()


def scheme_weights(case: Case) -> dict[str, torch.Tensor]:
    """The state dict of ``case.model`` after ``init_(model, case.scheme, seed=0, **options)``."""
    options = {k: v() if callable(v) else v for k, v in case.options.items()}
    torch.manual_seed(MODEL_SEED)  # model construction draws from the global RNG
    model = structinit.create_model(case.model)
    structinit.init_(model, case.scheme, seed=0, **options)
    return model.state_dict()


# --------------------------------------------------------------------------- other references
def unsigned_kernel_factors() -> dict[str, torch.Tensor]:
    """The analytic solver's unsigned kernel (``signed=False``) on LN(sin-cos) of an 8×8 grid,
    D = 64, two heads of 32 (the setting published results were measured with)."""
    from impulse_helpers import ln_sincos
    from structinit.functional.impulse_solvers import LayerSpec, make_impulse_solver

    grid, offsets = (8, 8), ((0, 0), (1, -1))
    solver = make_impulse_solver("analytic", signed=False)
    solved = solver.solve(ln_sincos(grid, 64), grid, [LayerSpec(offsets, 32, 32**-0.5)], None)
    return {"wq": solved[0].wq, "wk": solved[0].wk}


REFERENCES: dict[str, Callable[[], dict[str, torch.Tensor]]] = {
    "unsigned_analytic_kernel": unsigned_kernel_factors,
}


# --------------------------------------------------------------------------- the file
def load() -> dict:
    if not GOLDEN.exists():
        raise FileNotFoundError(f"{GOLDEN} is missing; create it with: {REGENERATE}")
    return json.loads(GOLDEN.read_text())


def failure(kind: str, name: str, diffs: list[str], limit: int = 20) -> str:
    more = f"\n  … and {len(diffs) - limit} more" if len(diffs) > limit else ""
    return (f"{kind} {name!r} differs from {GOLDEN.name} in {len(diffs)} statistic(s):\n  "
            + "\n  ".join(diffs[:limit]) + more
            + f"\nIf the change is intended, regenerate the reference ({REGENERATE}) and commit the diff.")


def _dump(data: dict) -> str:
    """JSON with one line per tensor, so a regenerated file diffs tensor by tensor."""
    lines = ["{"]
    sections = list(data.items())
    for i, (section, entries) in enumerate(sections):
        if not isinstance(entries, dict):
            lines.append(f"  {json.dumps(section)}: {json.dumps(entries)}{',' if i < len(sections) - 1 else ''}")
            continue
        lines.append(f"  {json.dumps(section)}: {{")
        for j, (key, tensors) in enumerate(entries.items()):
            lines.append(f"    {json.dumps(key)}: {{")
            rows = [f"      {json.dumps(n)}: {json.dumps(fp, separators=(',', ':'))}" for n, fp in tensors.items()]
            lines.append(",\n".join(rows))
            lines.append("    }" + ("," if j < len(entries) - 1 else ""))
        lines.append("  }" + ("," if i < len(sections) - 1 else ""))
    lines.append("}")
    return "\n".join(lines) + "\n"


def expected_scheme(golden: dict, case: Case) -> dict[str, dict]:
    """The reference fingerprints of ``case``: those of its model as built, updated by the
    tensors the scheme changed (the file stores only these, per case; null for a tensor the
    scheme removed from the state dict, as a parametrization does)."""
    merged = {**golden["models"][case.model], **golden["schemes"][case.id]}
    return {name: fp for name, fp in merged.items() if fp is not None}


def regenerate() -> None:
    models = {m: fingerprints(built_weights(m)) for m in sorted({c.model for c in CASES})}
    schemes = {}
    for case in CASES:
        built = models[case.model]
        got = fingerprints(scheme_weights(case))
        changed = {name: fp for name, fp in got.items() if fp != built.get(name)}
        schemes[case.id] = {**changed, **{name: None for name in built if name not in got}}
    data = {
        "about": f"Fingerprints of init weights (models built after torch.manual_seed({MODEL_SEED}), schemes with "
                 "seed=0): 'models' as built, 'schemes' the tensors each case changes (null: removed). See "
                 "tests/golden_helpers.py. Regenerate: " + REGENERATE,
        "models": models,
        "schemes": schemes,
        "references": {name: fingerprints(make()) for name, make in REFERENCES.items()},
    }
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(_dump(data))
    print(f"wrote {GOLDEN} ({len(models)} models, {len(CASES)} scheme cases, {len(REFERENCES)} references)")

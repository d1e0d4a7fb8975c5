"""The same seed's weights on other CPU code paths: each init's largest difference between the
default path and MKL's AVX2 and SSE4.2 paths and ATen's unvectorised kernels. A decomposition
that is unique only up to signs or rotations (an SVD, an eigendecomposition) shows here as an
O(1) difference; what is left when there is none is rounding.

    .venv/bin/python bench/cpu_paths.py                 # the table (a process per path)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from common import markdown

import structinit

# (label, model, scheme, options): the inits whose weights come out of a decomposition
CASES = [
    ("covariance filters", "convmixer_cpu_128_6", "covariance", {}),
    ("impulse, closed form", "vit_micro_patch2_16", "impulse", {"solver": "closed_form"}),
    ("impulse (analytic, default)", "vit_micro_patch2_16", "impulse", {}),
    ("mimetic", "vit_micro_patch2_16", "mimetic", {}),
    ("mimetic Mamba", "mamba_seq_2x64", "mimetic", {}),
]
PATHS = {
    "MKL_ENABLE_INSTRUCTIONS=AVX2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "MKL_ENABLE_INSTRUCTIONS=SSE4_2": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "ATEN_CPU_CAPABILITY=default": {"ATEN_CPU_CAPABILITY": "default"},
}


def weights(out: Path) -> None:
    """Every case's state dict after init_ with seed 0, saved to ``out``."""
    saved = {}
    for label, model_name, scheme, options in CASES:
        torch.manual_seed(0)
        model = structinit.create_model(model_name)
        structinit.init_(model, scheme, seed=0, **options)
        saved[label] = model.state_dict()
    torch.save(saved, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--save", type=Path, help=argparse.SUPPRESS)  # a child process: save the weights here
    args = p.parse_args(argv)
    if args.save is not None:
        weights(args.save)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for name, env in {"default": {}, **PATHS}.items():
            runs[name] = Path(tmp) / f"{len(runs)}.pt"
            subprocess.run([sys.executable, __file__, "--save", str(runs[name])], env={**os.environ, **env},
                           check=True)
        got = {name: torch.load(path, weights_only=True) for name, path in runs.items()}
    rows = []
    for label, *_ in CASES:
        base = got["default"][label]
        diffs = [max(float((got[name][label][k].double() - v.double()).abs().max()) for k, v in base.items())
                 for name in PATHS]
        rows.append([label, *(f"{d:.1e}" for d in diffs)])
    print(f"torch {torch.__version__}; largest |Δ| of any weight against the default path, seed 0\n")
    print(markdown(["init", *PATHS], "l" + "r" * len(PATHS), rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

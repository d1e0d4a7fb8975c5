"""What checking every write against the model's own forward costs: for a few ViTs, the
seconds of ``structinit.init_`` (impulse and mimetic), of its parts that run the model (the
probe that judges each attention layer before the write, the check after it), and of one plain
forward of a probe image, side by side in one run, with the checks' share of the init.

    .venv/bin/python bench/check_cost.py                # the table of docs/results/zoo.md
    .venv/bin/python bench/check_cost.py --repeats 5

Each figure is the median of ``--repeats`` runs after one warm-up (``bench/common.py``), on a
fresh copy of the model (a model keeps what its probe found, so a second init on the same model
skips the first probe).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
from common import median_seconds

import structinit
from structinit.adapters.probe import probe_inputs
from structinit.adapters.registry import attention_survey, candidate_layers
from structinit.schemes.registry import plan_init

MODELS = {  # name → (structinit model, kwargs)
    "ViT-Ti/2 at 32 px (256 tokens)": ("vit_tiny_patch2_32", {}),
    "ViT-Ti/4 at 32 px (64 tokens)": ("vit_tiny_patch4_32", {}),
    "ViT-S/16 at 224 px (196 tokens)": ("vit_tiny_patch4_32", dict(img_size=224, patch_size=16, embed_dim=384,
                                                                   num_heads=6)),
}


def row(label: str, name: str, kwargs: dict, scheme: str, repeats: int) -> str:
    torch.manual_seed(0)
    base = structinit.create_model(name, **kwargs).eval()
    candidates, _ = candidate_layers(base)
    images = probe_inputs(base, candidates)

    def forward():
        with torch.no_grad():
            base(images[:1])

    def survey():
        attention_survey(copy.deepcopy(base))

    def init():
        structinit.init_(copy.deepcopy(base), scheme, seed=0)

    def checks_after():
        model = copy.deepcopy(base)
        plan = plan_init(model, scheme, seed=0)
        plan.checks, checks = [], plan.checks
        plan.commit()
        start = time.perf_counter()
        for check in checks:
            check()
        return time.perf_counter() - start

    t_forward, t_survey, t_init = (median_seconds(f, repeats) for f in (forward, survey, init))
    t_after = statistics.median(checks_after() for _ in range(repeats))
    share = (t_survey + t_after) / t_init
    return (f"| {label} | `{scheme}` | {t_init:.3f} | {t_survey:.3f} | {t_after:.3f} | {t_forward:.3f} | "
            f"{share:.0%} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs per figure (the median is shown)")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    print("| model | scheme | init_ s | probe before s | check after s | one forward s | checks' share of init_ |")
    print("|---|---|---:|---:|---:|---:|---:|")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for label, (name, kwargs) in MODELS.items():
            for scheme in ("impulse", "mimetic"):
                print(row(label, name, kwargs, scheme, args.repeats), flush=True)


if __name__ == "__main__":
    main()

"""Certified robustness as an option of the image task (Trockman & Kolter, ICLR 2021): the
loss choice, the hinge margin, and certified and PGD accuracy measured in pixel space.
:mod:`structinit.harness.tasks.image` calls these; the maths is in
:mod:`structinit.analysis.certify`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from structinit.analysis.certify import pgd_l2_accuracy
from structinit.harness.errors import user_input
from structinit.utils import check_number, derived_generator

if TYPE_CHECKING:
    from structinit.harness.config import TrainConfig
    from structinit.harness.run.device import Placement

__all__ = ["LOSSES", "PGD_EXAMPLES", "PGD_STEPS", "check_certified_options", "hinge_margin", "input_lipschitz",
           "model_lipschitz", "pgd_accuracy", "pixel_cert_threshold"]

LOSSES = ("ce", "hinge")
# The PGD evaluation (certify_eps set, final evaluation only): ℓ₂ PGD with this many steps of
# ε/4 (Trockman & Kolter's evaluation) on the first PGD_EXAMPLES images of each split; it costs
# about 3·PGD_STEPS forward passes per image, so a 10,000-image split is subsampled.
PGD_STEPS = 10
PGD_EXAMPLES = 1000
# The paper's hinge margin (the Trockman & Kolter repo's multi_margin_loss default), used when
# certify_eps is not set.
PAPER_HINGE_MARGIN = 0.5


def check_certified_options(cfg: TrainConfig) -> None:
    """Check ``loss``, ``certify_eps`` and ``hinge_margin`` of ``cfg`` (input errors naming the
    field, the value and the fix)."""
    with user_input("loss"):
        if cfg.loss not in LOSSES:
            raise ValueError(f"loss={cfg.loss!r}: expected 'ce' (cross-entropy) or 'hinge' (the multi-class hinge "
                             "loss of certified training)")
    _check_positive("certify_eps", cfg.certify_eps, "an ℓ₂ radius > 0 in pixel space [0, 1], e.g. 36/255 ≈ 0.1412, "
                    "or None for no certification")
    _check_positive("hinge_margin", cfg.hinge_margin, "a margin > 0, or None for the default "
                    "(√2·certify_eps/min(std), else 0.5)")
    with user_input("hinge_margin"):
        if cfg.hinge_margin is not None:
            if cfg.loss != "hinge":
                raise ValueError(f"hinge_margin={cfg.hinge_margin!r} applies to loss='hinge' only (loss={cfg.loss!r}); "
                                 "set loss='hinge' or leave hinge_margin at None")


def _check_positive(name: str, value: object, expected: str) -> None:
    with user_input(name):
        if value is not None:
            try:
                check_number(name, value, low=0, low_open=True)
            except (TypeError, ValueError):
                raise ValueError(f"{name}={value!r}: expected {expected}") from None


def input_lipschitz(std: torch.Tensor | tuple[float, ...]) -> float:
    """The ℓ₂ Lipschitz constant of the harness's input normalisation x ↦ (x − mean)/std from
    pixels in [0, 1]: a diagonal map with entries 1/std_c, so its operator norm is
    1/min_c std_c. A model that is L-Lipschitz on normalised inputs is L/min(std)-Lipschitz in
    pixel space (exactly the bound of the composition; the paper mean-centres only, std = 1).

    Examples:
        >>> round(input_lipschitz((0.5, 0.25, 1.0)), 6)
        4.0
    """
    values = std.flatten().tolist() if isinstance(std, torch.Tensor) else list(std)
    return 1.0 / min(values)


def pixel_cert_threshold(eps: float, model_lipschitz: float, std) -> float:
    """The logit margin that certifies a prediction at ℓ₂ radius ``eps`` in pixel space [0, 1]
    for a model that is ``model_lipschitz``-Lipschitz on normalised inputs:
    √2·ε·L_model·(1/min std) (:func:`structinit.analysis.certify.certified_accuracy` with
    lipschitz = L_model/min(std))."""
    return math.sqrt(2) * eps * model_lipschitz * input_lipschitz(std)


def model_lipschitz(model: nn.Module) -> float | None:
    """The ℓ₂ Lipschitz bound a model declares (``model.lipschitz_bound``, e.g. 1.0 for the
    Cayley KWLarge), or None: a model without a proven bound gets no certificate, only PGD."""
    bound = getattr(model, "lipschitz_bound", None)
    return None if bound is None else float(bound)


def hinge_margin(cfg: TrainConfig, std) -> float:
    """The margin of the hinge loss: ``cfg.hinge_margin``, or by default the margin that
    certifies at ``certify_eps`` a 1-Lipschitz model in pixel space, √2·ε/min(std) (the margin
    ≈ √2·ε·L recipe of Trockman & Kolter, with L the normalisation's Lipschitz constant), or
    without ``certify_eps`` the paper's constant 0.5."""
    if cfg.hinge_margin is not None:
        return float(cfg.hinge_margin)
    if cfg.certify_eps is not None:
        return pixel_cert_threshold(cfg.certify_eps, 1.0, std)
    return PAPER_HINGE_MARGIN


def pgd_accuracy(model, images, labels, mean, std, eps, batch_size, where: Placement, seed: int) -> float:
    """ℓ₂ PGD accuracy at radius ``eps`` in pixel space (:func:`structinit.analysis.certify.
    pgd_l2_accuracy`, PGD_STEPS steps, fp32) over the first PGD_EXAMPLES images (this rank's
    share), reduced over ranks; the random starts come from ``seed``."""
    model.eval()
    idx = torch.arange(where.rank, min(len(images), PGD_EXAMPLES), where.world, device=images.device)
    gen = derived_generator(seed, 2)  # 2: the attack's random starts
    right = 0.0
    for start in range(0, len(idx), batch_size):
        b = idx[start : start + batch_size]
        x = images[b].float() / 255
        acc = pgd_l2_accuracy(model, x, labels[b], eps, steps=PGD_STEPS, preprocess=lambda t: (t - mean) / std,
                              clamp=(0.0, 1.0), generator=gen)
        right += acc * len(b)
    totals = where.all_reduce(torch.tensor([right, float(len(idx))], dtype=torch.float64, device=images.device))
    model.train()
    return float(totals[0] / totals[1].clamp_min(1))

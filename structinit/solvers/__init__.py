"""Pure maths: from a pseudo input (position-only tokens) and per-head offsets to per-head
query/key factors ``Wq, Wk`` of shape (heads, D, r), with logits ``x Wq[h] Wk[h]ᵀ xᵀ``."""

from structinit.solvers.analytic import (
    analytic_qk,
    axis_kernel,
    calibrate_logit_scale,
    impulse_qk,
    ridge_readout,
)
from structinit.solvers.closed_form import closed_form_qk
from structinit.solvers.gd import gd_qk
from structinit.solvers.pseudo import PSEUDO_INPUTS, pseudo_input

__all__ = [
    "PSEUDO_INPUTS", "analytic_qk", "axis_kernel", "calibrate_logit_scale", "closed_form_qk",
    "gd_qk", "impulse_qk", "pseudo_input", "ridge_readout",
]

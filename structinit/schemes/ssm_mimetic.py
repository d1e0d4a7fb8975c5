"""Mimetic initialisation of selective state-space layers (Mamba-1; Trockman et al. 2024,
arXiv 2410.11135), target 'ssm'; the maths is in :mod:`structinit.functional.ssm`.

``init_(model, 'mimetic')`` picks this scheme for a model with SSM layers and no attention
(:func:`~structinit.schemes.registry.resolve_scheme`); the attention scheme of the same name
stays ``structinit.mimetic_init_``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from structinit.adapters.registry import select_layers
from structinit.adapters.ssm import find_ssm_layers
from structinit.adapters.survey import ModelSurvey
from structinit.functional.mimetic import NOISE
from structinit.functional.ssm import mimetic_bc, softplus_inverse
from structinit.schemes import mimetic as _attention_mimetic  # noqa: F401  registers attention 'mimetic' first
from structinit.schemes.plan import Plan
from structinit.schemes.registry import register_planner
from structinit.utils import check_choice, check_number, make_generator
from structinit.utils.checks import check_bool

# exp(a_log) must be a normal, finite float32 (A = −exp(A_log) is computed in float32 by mambapy).
A_LOG_RANGE = (-87.0, 88.0)


def plan_ssm_mimetic(
    survey: ModelSurvey,
    *,
    a_log: float | None = -8.0,
    delta: float | None = 1.0,
    dt_weight_scale: float = 0.0,
    bc: bool = True,
    alpha: float = 0.7,
    beta: float = 0.7,
    noise: str = "uniform",
    conv_identity: bool = False,
    layers: Iterable[int] | None = None,
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> Plan:
    r"""Mimetic initialisation of every chosen SSM (Mamba-1) layer: make the selective scan
    start as causal linear attention whose queries and keys correlate.

    * **No decay** ("A → I"): ``A_log`` ← ``a_log`` everywhere (default −8: |A| ≈ 3.4e-4, so
      with Δ = 1 a state keeps exp(−|A|·L) ≈ 0.98 of itself over 64 tokens, 0.92 over 256).
      Must lie in [−87, 88] (exp(a_log) a finite, nonzero float32); ``None`` switches this
      part off and keeps ``A_log`` as built (Mamba's A_n = −n).
    * **Step Δ ≈ ``delta``** (> 0, default 1): ``dt_proj.bias`` ← softplus⁻¹(Δ);
      ``dt_proj.weight`` ← 0 (``dt_weight_scale`` = 0, default) or U(±``dt_weight_scale``), so the
      input-dependent part of Δ starts at or near zero but stays trainable. ``delta=None``
      switches this part off and keeps ``dt_proj`` as built (then ``dt_weight_scale`` must stay 0).
    * **B/C** (``bc``, default True): W_Cᵀ W_B = rank-N truncation of α Z + β I, W_C ≠ W_B
      (:func:`~structinit.functional.ssm.mimetic_bc`; a fresh Z per layer). Needs d_state ≤ d_inner.
      α = β = 0.7 is the attention mimetic's W_q W_kᵀ setting (the paper's constants were not
      published). The benchmark's ablation (``bench/sequence_benchmark.py --ablation``, results
      in ``docs/results/sequence.md``) cannot tell it from ``bc=False``, α = 0 or α = 1: the
      effect comes from A and Δ. It stays on because no variant beat it, and α > 0 keeps W_C ≠ W_B (α = 0 gives
      W_C = W_B = the first N channels).
    * **Conv ≈ identity** (``conv_identity``, default False): the depthwise ``conv1d`` passes
      the current token through: last tap 1, the other taps 0, bias 0. The paper reports it
      interacts differently with Mamba-1 and Mamba-2, hence the switch. Off by default because
      it hurts copying in the same ablation.

    Everything else keeps what it has: D (1 in mambapy), in/out projections, the dt rows of
    ``x_proj``, norms and embeddings. ``layers`` picks SSM layers by index (module order).
    Random draws (Z, the dt weight) come from ``generator``/``seed``.

    Examples:
        >>> from mambapy.mamba import Mamba, MambaConfig
        >>> model = Mamba(MambaConfig(d_model=16, n_layers=2))
        >>> _ = structinit.init_(model, "mimetic", seed=0)   # SSM layers, no attention: this scheme
    """
    a_log, delta, dt_weight_scale = _check_options(a_log, delta, dt_weight_scale, bc, alpha, beta, noise,
                                                   conv_identity)
    chosen = select_layers(find_ssm_layers(survey.model), layers, "SSM")
    if bc:
        _check_bc_fits(chosen)
    # float64; a delta too large for the model's dtype is caught by the registry
    dt_bias = None if delta is None else softplus_inverse(delta)
    gen = make_generator(generator, seed)
    plan = Plan()
    for _, ad in chosen:
        if a_log is not None:
            plan.add([(ad.A_log, torch.full_like(ad.A_log, a_log))])
        if dt_bias is not None:
            plan.add(_dt_writes(ad, dt_bias, dt_weight_scale, gen))
        if bc:
            w_b, w_c = mimetic_bc(ad.d_inner, ad.d_state, alpha, beta, noise=noise, generator=gen)
            plan.add([(ad.w_b, w_b), (ad.w_c, w_c)])
        if conv_identity:
            _plan_conv_identity(plan, ad)
    return plan


def _check_options(a_log, delta, dt_weight_scale, bc, alpha, beta, noise, conv_identity):
    """The checks of :func:`plan_ssm_mimetic`'s options, which read no layer: (a_log, delta,
    dt_weight_scale) as numbers."""
    if a_log is not None:
        a_log = check_number("a_log", a_log, low=A_LOG_RANGE[0], high=A_LOG_RANGE[1])
    if delta is not None:
        delta = check_number("delta", delta, low=0, low_open=True)
    dt_weight_scale = check_number("dt_weight_scale", dt_weight_scale, low=0)
    if delta is None and dt_weight_scale > 0:
        raise ValueError(f"dt_weight_scale={dt_weight_scale} with delta=None: the Δ part is switched off, so "
                         "dt_proj keeps its weights as built; pass a delta (e.g. 1.0) or leave dt_weight_scale at 0")
    check_bool("bc", bc)
    check_number("alpha", alpha)
    check_number("beta", beta)
    check_choice("noise", noise, NOISE)
    check_bool("conv_identity", conv_identity)
    if a_log is None and delta is None and not bc and not conv_identity:
        raise ValueError("a_log=None, delta=None, bc=False, conv_identity=False: every part of the SSM mimetic init "
                         "is switched off, so it would write nothing; switch at least one on (e.g. a_log=-8.0)")
    return a_log, delta, dt_weight_scale


def _check_bc_fits(chosen) -> None:
    """Refuse bc=True on a chosen SSM layer whose scan would not use, or whose width cannot
    hold, the planned W_Cᵀ W_B."""
    for name, ad in chosen:
        if ad.normalises_bc:
            raise ValueError(f"bc=True: SSM layer {name!r} normalises B and C after x_proj (mambapy's "
                             "inner_layernorms=True), so the scan would not use the planned W_Cᵀ W_B; pass "
                             "bc=False, or build the model with inner_layernorms=False")
        if ad.d_state > ad.d_inner:
            raise ValueError(f"d_state={ad.d_state}: SSM layer {name!r} has d_state > d_inner = {ad.d_inner}, "
                             f"so W_Cᵀ W_B (rank ≤ d_inner) cannot hold a rank-{ad.d_state} truncation of αZ + "
                             "βI; pass bc=False to keep B/C as built, or build the model with d_state ≤ "
                             "expand·d_model")


def _dt_writes(ad, dt_bias: torch.Tensor, dt_weight_scale: float, gen: torch.Generator):
    """Δ ≈ delta: dt_proj's bias softplus⁻¹(delta), its weight 0 or U(±dt_weight_scale)."""
    if dt_weight_scale > 0:
        w = (torch.rand(ad.dt_weight.shape, generator=gen, dtype=torch.float64) * 2 - 1) * dt_weight_scale
    else:
        w = torch.zeros_like(ad.dt_weight)
    return [(ad.dt_bias, torch.full(ad.dt_bias.shape, float(dt_bias), dtype=torch.float64)), (ad.dt_weight, w)]


def _plan_conv_identity(plan: Plan, ad) -> None:
    """The depthwise conv passes the current token through: last tap 1, the other taps and the bias 0."""
    taps = torch.zeros_like(ad.conv_weight)
    taps[..., -1] = 1
    plan.add([(ad.conv_weight, taps)])
    if ad.conv_bias is not None:
        plan.add([(ad.conv_bias, torch.zeros_like(ad.conv_bias))])


ssm_mimetic_init_ = register_planner("mimetic", plan_ssm_mimetic, target="ssm", function_name="ssm_mimetic_init_")

__all__ = ["plan_ssm_mimetic", "ssm_mimetic_init_"]

"""Schemes for depthwise convs (target 'conv'; :func:`structinit.adapters.find_depthwise_convs`):
hand-made filters ('impulse', 'box', 'gaussian', 'random', 'softmax') and Gaussian filter
covariances (Trockman et al. 2023: 'covariance', closed form; 'covariance_transfer', from a
trained model). Only depthwise conv weights are written: their biases, the pointwise convs,
the stem and the norms keep what they had.

Every scheme takes ``frozen`` (default False): True sets ``requires_grad=False`` on each
depthwise weight, so the training harness leaves it out of the optimizer (no state, never
updated); False sets it back to True. Any kernel size works, odd or even (ConvMixer pads
'same' either way). 'impulse' here is the conv scheme; ``init_(model, 'impulse')`` picks it for
a model with depthwise convs and no attention (see :func:`~structinit.schemes.registry.resolve_scheme`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.nn.utils import parametrize

from structinit.adapters import find_depthwise_convs, is_depthwise
from structinit.adapters.survey import ModelSurvey
from structinit.functional import conv_filters as cf
from structinit.schemes import impulse as _attention_impulse  # noqa: F401  registers attention 'impulse' first
from structinit.schemes.plan import Plan
from structinit.schemes.registry import register_planner
from structinit.utils import check_number, make_generator
from structinit.utils.checks import check_bool

Filters = Callable[[int, int, nn.Conv2d, torch.Generator], torch.Tensor]  # (layer, depth, conv, g) → weight


class SoftmaxTaps(nn.Module):
    """Parametrisation w = softmax over the k² taps of each channel's logits (C, 1, k, k)."""

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.flatten(1), dim=1).view_as(logits)


def _plan(model: nn.Module, make: Filters, frozen: bool, gen: torch.Generator, softmax: bool = False) -> Plan:
    """Plan ``conv.weight ← make(layer, depth, conv, gen)`` for every depthwise conv (softmax: the
    logits of a :class:`SoftmaxTaps` weight) and its ``requires_grad``. A conv parametrised
    before is made plain first (at commit)."""
    check_bool("frozen", frozen)
    convs = find_depthwise_convs(model)
    plan = Plan()
    for i, (_, conv) in enumerate(convs):
        value = make(i, len(convs), conv, gen)
        if not torch.isfinite(value).all():
            raise ValueError("the planned filters hold NaN/inf; check the numeric options (they may be far too "
                             "large)")
        if softmax or parametrize.is_parametrized(conv, "weight"):
            def act(conv=conv, value=value):
                if parametrize.is_parametrized(conv, "weight"):
                    parametrize.remove_parametrizations(conv, "weight", leave_parametrized=False)
                if softmax:
                    parametrize.register_parametrization(conv, "weight", SoftmaxTaps())
                target = conv.parametrizations.weight.original if softmax else conv.weight
                with torch.no_grad():
                    target.copy_(value)
                target.requires_grad_(not frozen)
            plan.actions.append(act)
        else:
            plan.add([(conv.weight, value.to(conv.weight.dtype))])
            plan.actions.append(lambda conv=conv: conv.weight.requires_grad_(not frozen))
    return plan


def _size(conv: nn.Conv2d) -> tuple[int, int]:
    return conv.out_channels, conv.kernel_size[0]


def plan_conv_impulse(survey: ModelSurvey, *, num_filters: int | None = None, norm: str = "sum", frozen: bool = False,
                      generator: torch.Generator | None = None, seed: int | None = None) -> Plan:
    """Each depthwise filter one tap at a random position: 1 (``norm='sum'``) or 1/√3
    (``norm='variance'``, PyTorch's default total variance). ``num_filters`` = n shares n
    filters, channel c using filter c % n (:func:`~structinit.functional.impulse_filters`).

    Examples:
        >>> m = structinit.create_model("convmixer_256_8", dim=8, depth=2)
        >>> _ = structinit.init_(m, "impulse", seed=0)  # depthwise convs, no attention: this scheme
    """
    model = survey.model
    return _plan(model, lambda i, d, c, g: cf.impulse_filters(*_size(c), num_filters=num_filters, norm=norm,
                                                           generator=g), frozen, make_generator(generator, seed))


def plan_box(survey: ModelSurvey, *, taps: int = 3, num_filters: int | None = None, norm: str = "sum",
             frozen: bool = False, generator: torch.Generator | None = None, seed: int | None = None) -> Plan:
    """Each depthwise filter ``taps`` = N random distinct taps of 1/N (``norm='sum'``) or
    1/√(3N) (``norm='variance'``), the rest 0 (:func:`~structinit.functional.box_filters`)."""
    model = survey.model
    return _plan(model, lambda i, d, c, g: cf.box_filters(*_size(c), taps=taps, num_filters=num_filters, norm=norm,
                                                       generator=g), frozen, make_generator(generator, seed))


def plan_gaussian(survey: ModelSurvey, *, sigma: float = 1.0, num_filters: int | None = None, norm: str = "sum",
                  frozen: bool = False, generator: torch.Generator | None = None, seed: int | None = None) -> Plan:
    """Each depthwise filter an isotropic Gaussian blob of width ``sigma`` (taps) centred on a
    random tap (:func:`~structinit.functional.gaussian_filters`)."""
    model = survey.model
    return _plan(model, lambda i, d, c, g: cf.gaussian_filters(*_size(c), sigma=sigma, num_filters=num_filters,
                                                            norm=norm, generator=g), frozen,
                 make_generator(generator, seed))


def plan_random(survey: ModelSurvey, *, num_filters: int | None = None, frozen: bool = False,
                generator: torch.Generator | None = None, seed: int | None = None) -> Plan:
    """PyTorch's default depthwise init U(±1/k) drawn from ``generator``/``seed``, with optional
    sharing (``num_filters``) and freezing: the baseline of the frozen-filter experiments."""
    model = survey.model
    return _plan(model, lambda i, d, c, g: cf.random_filters(*_size(c), num_filters=num_filters, generator=g),
                 frozen, make_generator(generator, seed))


def plan_softmax(survey: ModelSurvey, *, std: float = 1.0, frozen: bool = False,
                 generator: torch.Generator | None = None, seed: int | None = None) -> Plan:
    """Depthwise filters parametrised as w = softmax(logits) over each filter's k² taps, applied
    in every forward pass (``torch.nn.utils.parametrize``: the trained tensor is
    ``<conv>.parametrizations.weight.original``, so the state-dict keys change). Logits ~
    N(0, ``std``²). Each filter is positive and sums to 1. This reconstructs the 2024 code's
    softmax filters from their description; the logit init is our choice. Another conv scheme
    applied later removes the parametrisation first."""
    model = survey.model
    check_number("std", std, low=0)
    gen = make_generator(generator, seed)

    def make(i, d, conv, g):
        c, k = _size(conv)
        return torch.randn(c, 1, k, k, generator=g) * std

    return _plan(model, make, frozen, gen, softmax=True)


def plan_covariance(survey: ModelSurvey, *, sigma0: float = 0.52, v_sigma: float = 0.32, trace: float = 1 / 3,
                    frozen: bool = False, generator: torch.Generator | None = None, seed: int | None = None) -> Plan:
    """Learning-free covariance init: layer l of D draws its filters i.i.d. from N(0, Σ_l),
    Σ_l = c · G_σ ⊗ G_σ with σ_l = ``sigma0`` + ``v_sigma`` · l/(D − 1) and tr Σ_l = ``trace``
    (1/3: PyTorch's default total variance) (:func:`~structinit.functional.gaussian_kronecker_covariance`).

    The family is a reconstruction, not the paper's exact formula (which could not be
    verified). The defaults are calibrated once, from the depthwise filters of three trained
    ``convmixer_cpu_128_6`` (recipe ``cpu-cifar-convmixer``, init ``pytorch``, seeds 0–2): each
    layer's Σ̂ = FᵀF/h was fitted by the family (:func:`~structinit.functional.fit_kronecker_sigma`),
    and σ₀ = 0.52, v_σ = 0.32 are the least-squares line through the fitted σ_l
    (:func:`~structinit.functional.fit_depth_schedule`): the learned filters correlate over more
    taps with depth. The trained filters carry more than the default total variance; ``trace``
    keeps the default's 1/3, as the init is meant to change the shape, not the scale. The
    fitted values are in ``docs/results/convmixer.md``; reproduce them with
    ``bench/convmixer_claims.py --calibrate runs/cm/pytorch``.
    """
    model = survey.model
    check_number("sigma0", sigma0, low=0, low_open=True)
    check_number("v_sigma", v_sigma)
    check_number("trace", trace, low=0, low_open=True)
    gen = make_generator(generator, seed)

    def make(i, d, conv, g):
        c, k = _size(conv)
        cov = cf.gaussian_kronecker_covariance(k, cf.depth_sigma(i, d, sigma0, v_sigma), trace=trace)
        return cf.sample_filters(cov, c, generator=g)

    return _plan(model, make, frozen, gen)


SourceType = nn.Module | Mapping | str | os.PathLike


def source_covariances(source: SourceType) -> list[torch.Tensor]:
    """Σ̂ = FᵀF/h of each depthwise layer of a trained model, in order. ``source``: a model (its
    depthwise convs), a state dict, or a path to a ``.safetensors`` file. From a state dict the
    depthwise weights are the (C, 1, k, k) tensors with C > 1 whose (C, k) is the most common
    such pair (a grayscale stem (h, 1, p, p) is thus left out when p ≠ k)."""
    if isinstance(source, nn.Module):
        return [cf.estimate_covariance(c.weight.detach()) for _, c in find_depthwise_convs(source)]
    if isinstance(source, (str, os.PathLike)):
        if not os.path.isfile(source):
            raise ValueError(f"source={str(source)!r}: no such file; pass a trained model, its state dict or a "
                             ".safetensors file")
        from safetensors.torch import load_file  # the harness extra; only needed for a path

        source = load_file(str(source))
    if not isinstance(source, Mapping):
        raise ValueError(f"source: expected a model, a state dict or a .safetensors path, got {type(source).__name__}")
    weights = [v for k, v in source.items() if isinstance(v, torch.Tensor) and v.dim() == 4 and v.shape[0] > 1
               and v.shape[1] == 1 and v.shape[2] == v.shape[3] and k.endswith(("weight", "original"))]
    if not weights:
        raise ValueError("source: the state dict has no depthwise conv weight (a (C, 1, k, k) tensor with C > 1); "
                         "pass the state dict of a trained ConvMixer/ConvNeXt")
    pairs = [(w.shape[0], w.shape[2]) for w in weights]
    common = max(set(pairs), key=pairs.count)
    return [cf.estimate_covariance(w) for w, p in zip(weights, pairs) if p == common]


def plan_covariance_transfer(survey: ModelSurvey, *, source: SourceType | None = None, trace: float | None = None,
                             resize: bool = True, frozen: bool = False, generator: torch.Generator | None = None,
                             seed: int | None = None) -> Plan:
    """Covariance transfer: estimate Σ̂_s = FᵀF/h for every depthwise layer of a trained
    ``source`` (:func:`source_covariances`), map target layer l to source layer
    round(l (D_s − 1)/(D_t − 1)) (:func:`~structinit.functional.relative_depth_map`), resize Σ̂
    to the target kernel if it differs (``resize``; :func:`~structinit.functional.resize_covariance`),
    rescale to tr Σ = ``trace`` unless None (keep the source's scale), and draw N(0, Σ) filters."""
    model = survey.model
    if source is None:
        raise ValueError("source=None: covariance_transfer needs source=<trained model, state dict or .safetensors "
                         "path>")
    check_number("trace", trace, low=0, low_open=True, allow_none=True)
    check_bool("resize", resize)
    covs = source_covariances(source)
    gen = make_generator(generator, seed)
    targets = find_depthwise_convs(model)
    mapping = cf.relative_depth_map(len(covs), len(targets))

    def make(i, d, conv, g):
        c, k = _size(conv)
        cov = covs[mapping[i]]
        k_src = round(cov.shape[0] ** 0.5)
        if k_src != k:
            if not resize:
                raise ValueError(f"resize=False: source kernel {k_src}×{k_src} differs from target kernel {k}×{k}; "
                                 "pass resize=True or a source with the target's kernel size")
            cov = cf.resize_covariance(cov, k)
        if trace is not None:
            if float(cov.trace()) <= 0:
                raise ValueError(f"source: layer {mapping[i]} has all-zero filters; trace={trace} cannot rescale it")
            cov = cov * (trace / float(cov.trace()))
        return cf.sample_filters(cov, c, generator=g)

    return _plan(model, make, frozen, gen)


conv_impulse_init_ = register_planner("impulse", plan_conv_impulse, target="conv", function_name="conv_impulse_init_")
conv_box_init_ = register_planner("box", plan_box, target="conv", function_name="conv_box_init_")
conv_gaussian_init_ = register_planner("gaussian", plan_gaussian, target="conv", function_name="conv_gaussian_init_")
conv_random_init_ = register_planner("random", plan_random, target="conv", function_name="conv_random_init_")
conv_softmax_init_ = register_planner("softmax", plan_softmax, target="conv", function_name="conv_softmax_init_")
covariance_init_ = register_planner("covariance", plan_covariance, target="conv")
covariance_transfer_init_ = register_planner("covariance_transfer", plan_covariance_transfer, target="conv")

__all__ = ["SoftmaxTaps", "conv_box_init_", "conv_gaussian_init_", "conv_impulse_init_", "conv_random_init_",
           "conv_softmax_init_", "covariance_init_", "covariance_transfer_init_", "is_depthwise", "plan_box",
           "plan_conv_impulse", "plan_covariance", "plan_covariance_transfer", "plan_gaussian", "plan_random",
           "plan_softmax", "source_covariances"]

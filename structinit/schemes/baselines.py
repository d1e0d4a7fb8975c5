"""Baseline initialisations: PyTorch defaults, timm, JAX/ViT-original, Xavier variants, and
parametrised truncated-normal / Kaiming-uniform, and 'default' (the constructor's own init,
nothing written). All but 'default' write every Linear / Conv / norm weight
of the model, plus the learned position embedding and prefix tokens wherever the model keeps
them (timm's ``pos_embed`` / ``cls_token`` / ``reg_token``, Hugging Face's
``embeddings.position_embeddings`` / ``cls_token`` …) and every relative position bias table
(Swin, BEiT: trunc-normal 0.02); a fixed (``requires_grad=False``) position embedding is left alone."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from structinit.adapters.position import named_discovery
from structinit.adapters.relative import TABLE
from structinit.adapters.survey import ModelSurvey
from structinit.schemes.plan import Plan
from structinit.schemes.records import get_record
from structinit.schemes.registry import register_planner
from structinit.utils import check_choice, check_number, make_generator

WeightFn = Callable[[str, tuple[int, ...], torch.Generator], torch.Tensor]

# Public classes in place of torch's private bases (_ConvNd, _NormBase); Lazy* variants and
# SyncBatchNorm subclass these.
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_NORM = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
         nn.SyncBatchNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


def _empty(shape) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32)


def _fans(shape) -> tuple[int, int]:
    receptive = math.prod(shape[2:]) if len(shape) > 2 else 1
    return shape[1] * receptive, shape[0] * receptive


def torch_default_weight(shape, g) -> torch.Tensor:
    """``nn.Linear`` / ``nn.ConvNd`` default: Kaiming-uniform with a = √5, i.e. U(±1/√fan_in)."""
    return nn.init.kaiming_uniform_(_empty(shape), a=math.sqrt(5), generator=g)


def torch_default_bias(shape, fan_in: int, g) -> torch.Tensor:
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
    return nn.init.uniform_(_empty(shape), -bound, bound, generator=g)


def xavier_uniform(shape, g) -> torch.Tensor:
    return nn.init.xavier_uniform_(_empty(shape), generator=g)


def lecun_normal(shape, g) -> torch.Tensor:
    """Truncated normal (±2σ) with variance 1/fan_in after truncation (JAX's lecun_normal)."""
    std = math.sqrt(1.0 / _fans(shape)[0]) / 0.87962566103423978
    return nn.init.trunc_normal_(_empty(shape), std=std, a=-2 * std, b=2 * std, generator=g)


def _fused_blocks(survey: ModelSurvey) -> dict[int, int]:
    """id(weight) → number of stacked blocks for fused q/k/v weights: every attention whose
    adapter's q, k and v views slice one weight (timm's qkv, ``nn.MultiheadAttention``'s
    in_proj, vit-pytorch's to_qkv, …). By the adapters' names and shapes: no forward."""
    out = {}
    for _, adapter in survey.candidates:
        views = [adapter.linear_views()[c][0] for c in "qkv"]
        bases = {id(w._base) for w in views if w._base is not None}
        if len(bases) == 1 and all(w._base is not None for w in views):
            out[bases.pop()] = 3
    return out


def _plan_weights(
    survey: ModelSurvey, gen: torch.Generator, weight: WeightFn, bias: Callable[[str, int], torch.Tensor],
    conv: WeightFn | None = None, per_block: bool = False, pos_embed_std: float = 0.02,
    prefix: Callable[[tuple[int, ...]], torch.Tensor] | None = None,
) -> Plan:
    """Plan writes for all Linear-like weights (``weight(name, shape, g)``), their biases
    (``bias(name, size)``), conv weights (``conv`` or PyTorch's default), norms (1, 0),
    learned position embedding (trunc-normal ``pos_embed_std``) and prefix tokens; the plan
    also clears the attention layers' impulse records (:func:`_finish`)."""
    model, plan, fused = survey.model, Plan(), _fused_blocks(survey)

    def linear_like(name, w, b):
        blocks = fused.get(id(w), 1) if per_block else 1
        parts = [weight(name, (w.shape[0] // blocks, *w.shape[1:]), gen) for _ in range(blocks)]
        plan.add([(w, torch.cat(parts, 0))])
        if b is not None:
            plan.add([(b, bias(name, b.shape[0]))])

    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            linear_like(name, m.weight, m.bias)
        elif isinstance(m, nn.MultiheadAttention):
            if m.in_proj_weight is not None:
                linear_like(name + ".in_proj", m.in_proj_weight, m.in_proj_bias)
            else:
                for w in (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight):
                    linear_like(name + ".in_proj", w, None)
                if m.in_proj_bias is not None:
                    plan.add([(m.in_proj_bias, torch.zeros_like(m.in_proj_bias))])
        elif isinstance(m, _CONV):
            w = (conv or (lambda n, s, g: torch_default_weight(s, g)))(name, tuple(m.weight.shape), gen)
            plan.add([(m.weight, w)])
            if m.bias is not None:
                b = (torch_default_bias(m.bias.shape, _fans(m.weight.shape)[0], gen) if conv is None
                     else torch.zeros(m.bias.shape))
                plan.add([(m.bias, b)])
        elif isinstance(m, _NORM):
            if getattr(m, "weight", None) is not None:
                plan.add([(m.weight, torch.ones(m.weight.shape))])
            if getattr(m, "bias", None) is not None:
                plan.add([(m.bias, torch.zeros(m.bias.shape))])
    pos, tokens = _position_and_prefix(model)
    if pos is not None:
        plan.add([(pos, nn.init.trunc_normal_(_empty(pos.shape), std=pos_embed_std, a=-2, b=2, generator=gen))])
    for t in tokens:
        value = prefix(tuple(t.shape)) if prefix else nn.init.normal_(_empty(t.shape), std=1e-6, generator=gen)
        plan.add([(t, value)])
    _plan_relative_tables(model, plan, gen)
    return _finish(model, plan)


def _plan_relative_tables(model: nn.Module, plan: Plan, gen: torch.Generator) -> None:
    """Every learned relative position bias table (Swin, BEiT), once each ← trunc-normal 0.02, the
    init of Swin's and BEiT's authors (and timm's), whatever the scheme does to the weights."""
    found = {}
    for m in model.modules():
        table = getattr(m, TABLE, None)
        if isinstance(table, nn.Parameter) and table.requires_grad:
            found.setdefault(id(table), table)
    for table in found.values():
        plan.add([(table, nn.init.trunc_normal_(_empty(table.shape), std=0.02, a=-2, b=2, generator=gen))])


def _position_and_prefix(model: nn.Module) -> tuple[nn.Parameter | None, list[nn.Parameter]]:
    """The learned position embedding (None if fixed or absent) and the learned prefix-token
    parameters (class, distillation, register), wherever the model keeps them
    (the finders' names: timm, Hugging Face, generic; a whole-model scheme runs no forward)."""
    found = named_discovery(model)
    pos = found.pos_embed if isinstance(found.pos_embed, nn.Parameter) and found.pos_embed.requires_grad else None
    return pos, [t for _, t in found.prefix_tokens if isinstance(t, nn.Parameter)]


def _post_order(module: nn.Module):
    for child in module.children():
        yield from _post_order(child)
    yield module


def _finish(model: nn.Module, plan: Plan) -> Plan:
    """``plan``, also clearing the impulse records of the attention layers it rewrites."""
    for m in model.modules():
        if get_record(m, "impulse") is not None:
            plan.records.append((m, "impulse", None))
    return plan


def _reset(module: nn.Module) -> None:
    """A module's own default init. ``nn.MultiheadAttention`` has no public
    ``reset_parameters``: its ``_reset_parameters`` is the only way to it (the one use of a
    private torch method in structinit)."""
    reset = getattr(module, "reset_parameters", None)
    if reset is None and isinstance(module, nn.MultiheadAttention):
        reset = module._reset_parameters
    if callable(reset):
        reset()


def _zero_bias(name, size):
    return torch.zeros(size)


def plan_pytorch(survey: ModelSurvey, *, generator: torch.Generator | None = None, seed: int | None = None) -> Plan:
    """PyTorch's own defaults: every module's ``reset_parameters`` (Linear/Conv Kaiming-uniform
    a = √5 with U(±1/√fan_in) bias, LayerNorm 1/0, MultiheadAttention Xavier + zero bias),
    run on a forked RNG seeded from ``generator``/``seed``; learned ``pos_embed`` ← N(0, 0.02²)
    and prefix tokens ← 0, as timm builds them before its own init (timm's ``weight_init='skip'``)."""
    model = survey.model
    gen = make_generator(generator, seed)
    seed_value = int(torch.randint(2**62, (1,), generator=gen))
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})

    def reset_all() -> None:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed_value)
            # Children before parents, as at construction: nn.MultiheadAttention zeroes its
            # out_proj bias *after* out_proj has drawn its own.
            for m in _post_order(model):
                _reset(m)

    # The resets write the model themselves, so they run at commit (undone if one raises).
    plan = Plan(actions=[reset_all], touched=[*model.parameters(), *model.buffers()])
    pos, tokens = _position_and_prefix(model)
    if pos is not None:
        plan.add([(pos, torch.randn(pos.shape, generator=gen) * 0.02)])
    for t in tokens:
        plan.add([(t, torch.zeros(t.shape))])
    _plan_relative_tables(model, plan, gen)
    return _finish(model, plan)


pytorch_init_ = register_planner("pytorch", plan_pytorch)


def plan_timm(survey: ModelSurvey, *, generator: torch.Generator | None = None, seed: int | None = None) -> Plan:
    """timm's ViT default: every Linear trunc-normal(std 0.02, cut at ±2) with zero bias;
    patch-embedding conv at PyTorch's default; learned ``pos_embed`` trunc-normal 0.02;
    ``cls_token`` N(0, 1e-6²)."""
    return _plan_weights(survey, make_generator(generator, seed), _trunc(0.02), _zero_bias)


timm_init_ = register_planner("timm", plan_timm)


def _trunc(std: float, a: float = -2.0, b: float = 2.0) -> WeightFn:
    """N(0, std²) truncated to [a, b]: torch's sampler where [a, b] holds over 30 % of the mass (the
    usual case), else the inverse CDF, since torch's rejection sampling all but stops there."""
    lo, hi = (0.5 * math.erfc(-x / (std * math.sqrt(2))) for x in (a, b))
    if hi - lo > 0.3:
        return lambda name, shape, g: nn.init.trunc_normal_(_empty(shape), std=std, a=a, b=b, generator=g)
    if not hi - lo > 1e-12:
        raise ValueError(f"a={a}, b={b}: the interval holds {hi - lo:.1e} of N(0, std²) at std={std}, too little to "
                         "draw from; move it within a few std of 0")

    def draw(name, shape, g):
        u = lo + (hi - lo) * torch.rand(shape, generator=g, dtype=torch.float64)
        return (std * torch.special.ndtri(u)).clamp(a, b).float()
    return draw


def plan_jax(survey: ModelSurvey, *, generator: torch.Generator | None = None, seed: int | None = None) -> Plan:
    """The original JAX ViT init (timm's ``weight_init='jax'``): Linear Xavier-uniform (the fused
    qkv as one matrix), zero bias except N(0, 1e-6²) in MLPs; zero ``head``; LeCun-normal
    patch-embedding conv with zero bias; ``pos_embed`` trunc-normal 0.02."""
    gen = make_generator(generator, seed)

    def weight(name, shape, g):
        return torch.zeros(shape) if name == "head" or name.startswith("head.") else xavier_uniform(shape, g)

    def bias(name, size):
        if "mlp" in name and not (name == "head" or name.startswith("head.")):
            return nn.init.normal_(_empty((size,)), std=1e-6, generator=gen)
        return torch.zeros(size)

    return _plan_weights(survey, gen, weight, bias, conv=lambda n, s, g: lecun_normal(s, g))


jax_init_ = register_planner("jax", plan_jax)


def plan_xavier_fused(
    survey: ModelSurvey, *, generator: torch.Generator | None = None, seed: int | None = None
) -> Plan:
    """Xavier-uniform on every Linear, the fused qkv (3D×D) treated as one matrix, so each of q,
    k, v gets std √(2/(D+3D)) — smaller than a separate D×D projection would. Zero biases."""
    return _plan_weights(survey, make_generator(generator, seed), lambda n, s, g: xavier_uniform(s, g), _zero_bias)


xavier_fused_init_ = register_planner("xavier_fused", plan_xavier_fused)


def plan_xavier(survey: ModelSurvey, *, generator: torch.Generator | None = None, seed: int | None = None) -> Plan:
    """Xavier-uniform on every Linear, with fused q/k/v weights initialised block by block so that
    each projection gets std √(2/(D+D)), as if it were its own Linear. Zero biases."""
    return _plan_weights(survey, make_generator(generator, seed), lambda n, s, g: xavier_uniform(s, g), _zero_bias,
                         per_block=True)


xavier_init_ = register_planner("xavier", plan_xavier)


def plan_trunc_normal(survey: ModelSurvey, *, std: float = 0.02, a: float = -2.0, b: float = 2.0,
                       generator: torch.Generator | None = None, seed: int | None = None) -> Plan:
    """Every Linear weight from N(0, std²) truncated to [a, b] (absolute bounds, as in
    ``nn.init.trunc_normal_``); zero biases; other modules as in :func:`timm_init_`."""
    check_number("std", std, low=0, low_open=True)
    a, b = check_number("a", a), check_number("b", b)
    if not a < b:
        raise ValueError(f"a={a}, b={b}: the truncation bounds need a < b")
    return _plan_weights(survey, make_generator(generator, seed), _trunc(std, a, b), _zero_bias)


trunc_normal_init_ = register_planner("trunc_normal", plan_trunc_normal)


def plan_kaiming_uniform(survey: ModelSurvey, *, a: float = math.sqrt(5), mode: str = "fan_in",
                          nonlinearity: str = "leaky_relu", generator: torch.Generator | None = None,
                          seed: int | None = None) -> Plan:
    """Every Linear weight Kaiming-uniform with the given ``a``/``mode``/``nonlinearity``
    (defaults = PyTorch's Linear); zero biases; other modules as in :func:`timm_init_`."""
    check_choice("mode", mode, ("fan_in", "fan_out"))
    a = check_number("a", a)  # a float: calculate_gain refuses numpy's
    try:
        nn.init.calculate_gain(nonlinearity, a)
    except ValueError as err:
        raise ValueError(f"nonlinearity={nonlinearity!r}: {err}; use e.g. 'leaky_relu', 'relu' or 'linear'") from err

    def weight(name, shape, g):
        return nn.init.kaiming_uniform_(_empty(shape), a=a, mode=mode, nonlinearity=nonlinearity, generator=g)

    return _plan_weights(survey, make_generator(generator, seed), weight, _zero_bias)


kaiming_uniform_init_ = register_planner("kaiming_uniform", plan_kaiming_uniform)


def plan_default(survey: ModelSurvey, *, generator: torch.Generator | None = None, seed: int | None = None) -> Plan:
    """Writes nothing: the model keeps the init its own constructor drew. In the harness that is
    the constructor run under ``torch.manual_seed(init_seed)``, so the weights are those of the
    model's published init as its code implements it (e.g. mambapy's Mamba: A_log = log(1…N),
    dt bias = softplus⁻¹ of Δ log-uniform in [1e-3, 0.1], D = 1), reproducible from ``init_seed``.
    'pytorch' is not that: it re-runs every module's ``reset_parameters`` and so replaces
    mambapy's special dt bias with nn.Linear's default.

    ``generator`` and ``seed`` are accepted (every scheme takes them) and checked, but nothing is
    drawn, so they change nothing and the global RNG is not touched.

    Examples:
        >>> model = structinit.create_model("vit_micro_patch2_16")
        >>> _ = structinit.init_(model, "default", seed=0)   # model unchanged
    """
    return Plan()


default_init_ = register_planner("default", plan_default)

"""``impulse`` for attention that rotates q and k by position (2-D RoPE).

Such a layer has no position in its tokens, so the impulse goes into the part of q and k that
does not depend on the content, and head h's logit between query i and key j becomes the
rotated product of two constants,

    L(Δ) = Σ_f A_f cos(ω_f·Δ − φ_f),    Δ = p_j − p_i,

which :func:`structinit.functional.rope_impulse_terms` (bands that turn with rows or columns)
or :func:`~structinit.functional.rope_impulse_terms_2d` (bands that turn with both: mixed or
1-D RoPE) makes peak at the head's offset and only there, with ``target_mass`` on the target
for every query whose target is on the grid. Pair f of q holds (√(A_f/s), 0) and of k
√(A_f/s)·(cos φ_f, −sin φ_f), s being the softmax scale; pairs not chosen and channels no pair
turns are 0. The content-free constants come from:

- **the q/k biases** (``solver='rotary'``), when both are learned parameters: W_q = W_k = 0,
  q = b_q and k = b_k for every token;
- **a channel of the pre-norm** (``solver='rotary-norm'``) otherwise (EVA's k bias is a zero
  buffer that is neither learned nor saved; DINOv3 and RvT have no k bias): the affine
  LayerNorm whose output only this layer reads (:mod:`structinit.adapters.prenorm`) gets
  γ_c = 0, β_c = 1 on its last channel c, so that channel is 1 for every token, and W_q, W_k
  read that channel alone (q/k biases 0). The value projection still reads every channel.

The maps are then the impulse exactly, on any image; training moves W_q and W_k away from 0
(their gradient is not 0). A layer with neither (no learned q/k biases and no such norm) is
refused, pointing to ``mimetic``.
"""

from __future__ import annotations

import torch

from structinit.adapters import TokenLayout
from structinit.adapters.prenorm import InputNorm, input_norms
from structinit.adapters.probe import probe_at
from structinit.adapters.registry import candidate_layers
from structinit.adapters.rotary import Rotary
from structinit.adapters.survey import ModelSurvey
from structinit.adapters.verify import survey_attention
from structinit.functional.rope import rope_impulse_terms, rope_impulse_terms_2d
from structinit.functional.targets import Offset, check_kernel_size
from structinit.schemes.impulse_request import ImpulseRequest, Placed, resolve_offsets
from structinit.schemes.plan import Plan
from structinit.schemes.relative_impulse import check_relative_options
from structinit.utils import make_generator
from structinit.utils.state import in_parameters

__all__ = ["ROTARY_SOLVER", "plan_rope_impulse", "rotary_at_grid"]

ROTARY_SOLVER, ROTARY_NORM_SOLVER = "rotary", "rotary-norm"
_STILL = 1e-6  # |ω| below this: the band does not turn with that axis (float32 tables)


def rope_constants(freqs: torch.Tensor, pairs, offset: Offset, grid: tuple[int, int], head_dim: int, scale: float,
                   target_mass: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k), each (head_dim,) float64: the content-free q and k of one head whose impulse is at
    ``offset`` and whose bands turn at ``freqs`` (F, 2) = (ω_y, ω_x), from the axial solver when
    every band turns with one axis at most, the 2-D one otherwise."""
    turns = freqs.abs() > _STILL
    if bool((turns.sum(1) <= 1).all()):
        axes = [1 if bool(t[1]) else 0 for t in turns]
        amplitudes, phases = rope_impulse_terms(freqs.abs().max(1).values * freqs.sum(1).sign(), axes, offset, grid,
                                                target_mass)
    else:
        amplitudes, phases = rope_impulse_terms_2d(freqs, offset, grid, target_mass)
    size = (amplitudes / scale).sqrt()
    q, k = torch.zeros(head_dim, dtype=torch.float64), torch.zeros(head_dim, dtype=torch.float64)
    for f, (c0, c1) in enumerate(pairs):
        q[c0] = size[f]
        k[c0], k[c1] = size[f] * torch.cos(phases[f]), -size[f] * torch.sin(phases[f])
    return q, k


def _carriers(survey: ModelSurvey, chosen) -> list[InputNorm | None]:
    """Per layer: None where its q/k biases carry the constants, else its pre-norm; a
    ValueError naming the first layer that has neither."""
    views = [ad.linear_views() for _, ad in chosen]
    # learned biases (saved with the model) can carry the constants; a buffer such as EVA's zero k bias cannot
    by_bias = [in_parameters(ad.module, v["q"][1]) and in_parameters(ad.module, v["k"][1])
               for v, (_, ad) in zip(views, chosen)]
    if all(by_bias):
        return [None] * len(chosen)
    inputs = survey.probe
    norms = [None] * len(chosen) if inputs is None else input_norms(survey.model, chosen, inputs)
    for (name, ad), biased, norm in zip(chosen, by_bias, norms):
        if not biased and (norm is None or norm.readers or norm.module.weight.shape[0] != ad.dim):
            why = (f"its pre-norm {norm.name!r} is also read by {', '.join(norm.readers)}" if norm and norm.readers
                   else "no affine LayerNorm (with a bias) feeds it")
            raise ValueError(
                f"impulse cannot set the attention of layer {name!r} ({type(ad.module).__name__}): it rotates q and "
                "k by position (RoPE), and the impulse is written into a part of q and k that does not depend on "
                f"the content; it has no learned q and k biases, and {why} whose channel could carry it; nothing "
                "was written. Build the model with learned qkv biases (qkv_bias=True), or use 'mimetic', which "
                "needs no position channel")
    return [None if biased else norm for biased, norm in zip(by_bias, norms)]


def rotary_at_grid(survey: ModelSurvey, chosen, grid: tuple[int, int]) -> list:
    """``chosen`` (name, adapter) with each layer's rotation as the model computes it now, on
    images whose patches make ``grid``: a model that builds its RoPE at each call (vit-pytorch's
    RvT, DINOv3) turns by other angles on another grid, one that states no image size was
    probed at a guessed one, and learned angles (mixed RoPE) move in training. A ValueError
    when the model cannot be probed so."""
    if all(ad.rotary is not None and tuple(ad.rotary.grid) == tuple(grid) for _, ad in chosen):
        return list(chosen)  # the survey's own probe made that grid: its angles are the model's now
    model = survey.model
    inputs = probe_at(model, grid) if survey.example is None else survey.example  # a caller's input fixes the grid
    if inputs is None:
        raise ValueError(f"grid={grid}: the model's rotation depends on its input, and structinit cannot tell its "
                         "patch size to build images of that grid (no patch_size, no patch convolution)")
    names = [n for n, _ in chosen]
    found = [(n, ad) for n, ad in candidate_layers(model)[0] if n in names]
    again = survey_attention(model, found, [inputs])  # a new forward: the angles of now, on this grid
    if not again.probed:
        raise ValueError(f"grid={grid}: the model's rotation depends on its input, and its forward does not take "
                         f"images of {tuple(inputs.shape[-2:])} px, whose patches make that grid; pass the grid of "
                         "patch tokens its images make")
    out = []
    for name, _ in chosen:
        verdict = again.verdict(name)
        rotary = None if verdict is None else verdict.adapter.rotary
        if rotary is None or tuple(rotary.grid) != tuple(grid):
            got = "no rotation" if rotary is None else f"a rotation for a {rotary.grid[0]}×{rotary.grid[1]} grid"
            raise ValueError(f"grid={grid}: on images of that many patches, layer {name!r} received {got}; pass the "
                             "grid of patch tokens the model is trained on")
        out.append((name, verdict.adapter))
    return out


def plan_rope_impulse(survey: ModelSurvey, plan: Plan, chosen, per_layer: list[list[Offset]],
                      target_mass: float) -> None:
    """Add to ``plan`` the writes of every chosen layer: the content-free q and k of head h at
    offset ``per_layer[i][h]``, through the q/k biases or a pre-norm channel (module doc), with
    the layer's record (``solver='rotary'`` or ``'rotary-norm'``)."""
    carriers = _carriers(survey, chosen)
    memo: dict = {}  # layers share rotations and offsets: each (head's rotation, offset) is solved once

    def solved(rotary: Rotary, h: int, offset: Offset, head_dim: int, scale: float):
        freqs = rotary.frequencies()[rotary.head(h)]
        key = (tuple(freqs.flatten().tolist()), rotary.pairs, rotary.grid, offset, head_dim, scale)
        if key not in memo:
            memo[key] = rope_constants(freqs, rotary.pairs, offset, rotary.grid, head_dim, scale, target_mass)
        return memo[key]

    for (_, ad), offsets, norm in zip(chosen, per_layer, carriers):
        rotary = ad.rotary
        heads = [solved(rotary, h, tuple(o), ad.head_dim, ad.scale) for h, o in enumerate(offsets)]
        q = torch.stack([c for c, _ in heads])  # (heads, head_dim)
        k = torch.stack([c for _, c in heads])
        record = {"offsets": [tuple(o) for o in offsets], "grid": rotary.grid,
                  "num_prefix_tokens": rotary.num_prefix_tokens, "solver": ROTARY_SOLVER}
        wq = torch.zeros(ad.num_heads, ad.dim, ad.head_dim, dtype=torch.float64)
        if norm is None:
            plan.add_qk(ad, wq, wq, q, k, record=record)
            continue
        channel = ad.dim - 1
        wk = torch.zeros_like(wq)
        wq[:, channel], wk[:, channel] = q, k
        plan.add_qk(ad, wq, wk, record=record | {"solver": ROTARY_NORM_SOLVER, "norm": norm.name,
                                                 "channel": channel})
        weight, bias = norm.module.weight, norm.module.bias
        plan.add([(weight[channel:channel + 1], torch.zeros(1)), (bias[channel:channel + 1], torch.ones(1))])


def plan_on_rotary(request: ImpulseRequest, plan: Plan) -> Placed:
    """The rotary carrier (module doc). A rotation the model hands its layers is read again
    first, on the grid asked for (a learned RoPE's angles move in training, and the survey's
    probe may be of another size)."""
    chosen = request.chosen
    check_relative_options(chosen, request.solver, request.solver_options, {
        "num_prefix_tokens": request.num_prefix_tokens, "pos_embed": request.pos_embed,
        "reserve": request.reserve_given},
        carrier="the rotation of q and k (RoPE), which impulse sets through content-free q and k")
    if request.grid is not None or any(ad.rotary_received for _, ad in chosen):
        grid = tuple(request.grid) if request.grid is not None else chosen[0][1].rotary.grid
        chosen = rotary_at_grid(request.survey, chosen, grid)
    layouts = [TokenLayout(ad.rotary.grid, ad.rotary.num_prefix_tokens) for _, ad in chosen]
    for lay in layouts:
        check_kernel_size(request.kernel_size, lay.grid)
    gen = make_generator(request.generator, request.seed)
    offsets = "random" if request.offsets is None else request.offsets
    per_layer = resolve_offsets(chosen, offsets, request.kernel_size, request.per_layer_offsets, gen)
    plan_rope_impulse(request.survey, plan, chosen, per_layer, request.solver_obj.target_mass)
    return Placed(chosen, layouts, per_layer, gen)

"""The output side of an attention module, as :mod:`structinit.adapters.provenance` reads it:
which entries of its parameters project each head channel of the context (map · v), found by
running the module again with the context replaced by labelled constants; and, where no
projection does, the mechanism in words (a nonlinearity, a gate, an output spread over several
positions, no output projection at all)."""

from __future__ import annotations

import torch
from torch import nn

from structinit.adapters.provenance_blocks import assemble, decode, grads_of
from structinit.adapters.provenance_record import Operand, TraceError, first_tensor, record, restored
from structinit.utils.state import derived_weights


def output_block(module, args, kwargs, ops, v: Operand, params, originals, heads, group, r, dim):
    """The output projection: the module runs again with the context (map · v) replaced by zeros,
    ones and labels 1 + h·r + c; the gradients of its summed output say which entries read which
    head channel (module doc)."""
    context = v.product_index
    shape = ops[context][3].shape
    lead_axes = v.context_lead_axes(len(shape))
    ones = torch.ones(shape, dtype=ops[context][3].dtype, device=ops[context][3].device)
    head = torch.zeros(shape, dtype=torch.long, device=ones.device)
    sizes = [shape[a] for a in lead_axes]
    for lead in _all_leads(sizes):
        index = [slice(None)] * len(shape)
        for a, i in zip(lead_axes, lead):
            index[a] = i
        head[tuple(index)] = group(lead, sizes)
    chan = torch.arange(r, device=ones.device).reshape([-1 if a == v.context_channel_axis % len(shape) else 1
                                                        for a in range(len(shape))])
    labels = (1 + head * r + chan).to(ones.dtype)
    try:
        got = {name: _output_grads(module, args, kwargs, context, value, params)
               for name, value in (("zeros", torch.zeros_like(ones)), ("ones", ones), ("labels", labels))}
    except TraceError:
        _context_passed_on(module, args, kwargs, context, ones, heads)
        raise
    per_head = [[{} for _ in params] for _ in range(heads)]
    bias = None
    for i, (name, _) in enumerate(params):
        g0, g1, gl = got["zeros"][i], got["ones"][i], got["labels"][i]
        read = g0.ne(0)  # entries the output reads without the context: a bias, or columns of other channels
        if bool(read.any()):
            if g0.ndim == 1 and bool(read.all()) and torch.equal(g0, g1):
                if bias is not None:
                    raise TraceError(f"the output has two biases ({name!r} is the second)")
                bias = originals[name]
                continue
            if not (torch.equal(g1[read], g0[read]) and torch.equal(gl[read], g0[read])):
                raise TraceError(f"parameter {name!r} acts on the attention's output beyond its projection")
        # a projection that also reads channels beside the context (SHViT's, of the untouched ones): their columns
        for c, ix in decode(name, g1 - g0, gl - g0, heads * r).items():
            per_head[c // r][i][c % r] = ix
    # the output's width, which may differ from the input's (the projection of a slice of the channels)
    width = max((len(ix) for head in per_head for e in head for ix in e.values()), default=dim)
    if bias is not None and bias.shape != (width,):
        raise TraceError(f"the output's bias has {bias.numel()} entries, its projection {width} rows")
    try:
        (weight, _), weight_name, _ = assemble("the output", per_head, params, originals, heads, r, width, "out")
    except TraceError:
        gates = _token_readers(module, args, kwargs, context, ones, params, got["ones"])
        if gates:
            named = ", ".join(repr(n) for n in gates)
            raise TraceError("its output multiplies the attention's context by a function of its tokens (a gate: "
                             f"{named} read both), so the value path is not linear") from None
        raise
    return (weight, bias), weight_name


def _token_readers(module, args, kwargs, context: int, ones: torch.Tensor, params, grads) -> list[str]:
    """The parameters through which the output reads the module's tokens as well as its context:
    with the context held constant, their gradients (``grads``) move when the tokens do, which
    those of a projection of the context alone do not."""
    x = first_tensor(args, kwargs)
    if not x.is_floating_point():
        return []
    moved = x + torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(x)
    swap = lambda value: moved if value is x else value
    again = _output_grads(module, tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}, context,
                          ones, params)
    return [name for (name, _), before, after in zip(params, grads, again)
            if bool(before.ne(0).any()) and not torch.allclose(before, after, rtol=1e-6, atol=0.0)]


def _context_passed_on(module, args, kwargs, context: int, ones: torch.Tensor, heads: int) -> None:
    """TraceError where the module's output moves with its attention's context though no
    parameter acts on it: the context is the output, with no output projection of the module's
    own (as a module per head is, whose outputs another module joins and projects)."""
    zeros = _first(record(module, args, kwargs, swap={context: torch.zeros_like(ones)}).out)
    if torch.equal(zeros, _first(record(module, args, kwargs, swap={context: ones}).out)):
        return
    alone = ("; if it is one head of several whose outputs another module joins and projects, write the heads as "
             "one module with one projection per role, which structinit reads as one layer" if heads == 1 else "")
    raise TraceError("it has no output projection of its own: its output is its attention's context, which no "
                     f"parameter of the module acts on{alone}")


def _all_leads(shape) -> list[tuple[int, ...]]:
    out = [()]
    for n in shape:
        out = [(*lead, i) for lead in out for i in range(n)]
    return out


def _output_grads(module, args, kwargs, context: int, value: torch.Tensor, params) -> list[torch.Tensor]:
    y = _first(record(module, args, kwargs, swap={context: value}).out)
    if not y.requires_grad:
        raise TraceError("its output does not depend on the attention's context through its parameters")
    return grads_of(y, torch.ones_like(y), params)


def output_unread(module, args, kwargs, context: int, made: torch.Tensor, token_axis: int, reach: int,
                  values: tuple | None = None) -> str | None:
    """Why the module's output is no projection of its attention's context, where that is a
    mechanism no write to projections changes: it does not depend on the context (a scale after
    the output projection that starts at zero: LeViT's BatchNorm), not affinely (an activation
    between them), it reads the value projection (``values``) by another path too
    (:func:`values_beside`), or not token by token (:func:`output_spread`); None where it is
    affine in it token by token (a layout the trace cannot read). Read from the output with the
    context (``made``, the output of op ``context``) replaced by 0, c, d and c + d for fixed random c, d."""
    c, d = _random_like(made), _random_like(made, seed=1)
    y0, y1, y2, y3 = (_first(record(module, args, kwargs, swap={context: value}).out).detach().double()
                      for value in (0 * c, c, d, c + d))
    step = float((y1 - y0).abs().max())
    if step <= 1e-6 * (float(y0.abs().max()) + 1e-30) and float((y3 - y0).abs().max()) <= step + 1e-30:
        return ("its output does not depend on its attention's context (a scale after the output projection that "
                "starts at zero)")
    # c, d and c + d, not c and 2c: a ReLU is linear along each ray from zero
    if float(((y3 - y2) - (y1 - y0)).abs().max()) > 1e-4 * step:
        return "its attention's context passes a nonlinearity before the output projection"
    if values is not None and values_beside(module, args, kwargs, context, made, values):
        return ("its output reads its values besides through its attention map (a term of them joins the context: "
                "a convolution of the values, or each token's own value, which exclusive self-attention subtracts)")
    return output_spread(module, args, kwargs, context, made, token_axis, reach, y0)


def values_beside(module, args, kwargs, context: int, made: torch.Tensor, values: tuple) -> bool:
    """Whether the output reads the value projection's entries (``values``: the parameter
    holding them, as the module computes with it, and the view of them in the module's own)
    while the attention's context (``made``, of op ``context``) stays a fixed random c: the
    values then reach the output by a path besides the map (a token's own value subtracted, a
    convolution of the values added)."""
    weight, view = values
    y = _first(record(module, args, kwargs, swap={context: _random_like(made)}).out)
    if not y.requires_grad:
        return False
    (g,) = torch.autograd.grad(y, weight, _random_like(y, seed=2), allow_unused=True)
    if g is None:
        return False
    mask = torch.zeros(weight.shape, dtype=torch.bool, device=weight.device)
    mask.as_strided(view.shape, view.stride(), view.storage_offset()).fill_(True)  # the layout of the original
    return bool(g[mask].ne(0).any())


def output_bent(module, args, kwargs, context: int, made: torch.Tensor, token_axis: int, reach: int) -> str | None:
    """For an output the labelled run read as a projection of the context: why it is not one
    after all, or None. The labels are positive, which a ReLU passes as they are: the output at
    c and at −c, for a fixed random c, must average to the output at 0 (an activation that
    bends is named as :func:`output_unread` names it); then :func:`output_spread`."""
    c = _random_like(made)
    y0, y1, y2 = (_first(record(module, args, kwargs, swap={context: k * c}).out).detach().double() for k in (0, 1, -1))
    if float(((y1 - y0) + (y2 - y0)).abs().max()) > 1e-4 * float((y1 - y0).abs().max()):
        return "its attention's context passes a nonlinearity before the output projection"
    return output_spread(module, args, kwargs, context, made, token_axis, reach, y0)


def output_spread(module, args, kwargs, context: int, made: torch.Tensor, token_axis: int, reach: int,
                  y0: torch.Tensor) -> str | None:
    """Why the output is not the context projected token by token, or None: the context of one
    token (the middle one, on ``token_axis`` of ``made``, in every slice) moves more than
    ``reach`` output entries (a token's output width times the slices) from ``y0``, the output
    at a context of zeros, as where the output is upsampled to more positions than the map's
    tokens after its projection (LowFormer's, CPUBone's)."""
    c = _random_like(made)
    middle = made.shape[token_axis] // 2
    one = torch.zeros_like(c).movedim(token_axis, 0)
    one[middle] = c.movedim(token_axis, 0)[middle]
    yt = _first(record(module, args, kwargs, swap={context: one.movedim(0, token_axis)}).out).detach().double()
    step = float((yt - y0).abs().max())
    if step > 0 and int(((yt - y0).abs() > 1e-9 * step).sum()) > reach:
        return ("its output carries each token's attention context to several positions (upsampled, or convolved "
                "over the tokens, after the output projection)")
    return None


def values_unread(v: Operand, weight: torch.Tensor, others: list[torch.Tensor] = ()) -> str | None:
    """Why the values are no projection of the tokens, or None: v is not linear in ``weight``,
    its projection's, or in one of the module's ``others`` parameters (the second derivative
    along random directions is not zero), as where an activation or a gate follows the projection
    (iFormer's sigmoid), or a gate made from the tokens mixes them with another layer's values (a
    value residual). A norm before the projection, a rotation or a scale after it leave v linear
    in each parameter, and its second derivative exactly zero."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(v.tensor.shape, generator=gen, dtype=torch.float64).to(v.tensor)
    for param in (weight, *others):
        if not param.requires_grad:
            continue
        u = torch.randn(param.shape, generator=gen, dtype=torch.float64).to(param)
        try:
            (g,) = torch.autograd.grad(v.tensor, param, w, retain_graph=True, create_graph=True, allow_unused=True)
            if g is None or not g.requires_grad:  # no path to v, or a linear one
                continue
            (h,) = torch.autograd.grad(g, param, u, retain_graph=True, allow_unused=True)
        except RuntimeError:  # an op without a second derivative: no word on it
            continue
        if h is not None and bool(h.any()):  # exactly: a sigmoid near zero is nearly linear, but not quite
            return "its values pass a nonlinearity after their projection (an activation or a gate)"
    return None


def _random_like(made: torch.Tensor, seed: int = 0) -> torch.Tensor:
    return torch.randn(made.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(made)


def _first(out) -> torch.Tensor:
    y = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(y, torch.Tensor):
        raise TraceError("its output is not a tensor")
    return y


# -- what keeps a module from being read, whatever else failed -------------------------------------------

# each takes (input, p, training/train, …)
_DROPOUTS = {torch.nn.functional.dropout, torch.dropout, torch.nn.functional.alpha_dropout,
             torch.nn.functional.dropout1d, torch.nn.functional.dropout2d}


def unreadable(module: nn.Module, args: tuple, kwargs: dict) -> str | None:
    """What keeps a module from being read whatever else failed, in words, or None: weights it
    computes from other parameters in its forward, or a dropout left on in eval mode."""
    made = derived_weights(module)
    if made:
        return (f"it computes weights from other parameters in its forward ({made}), which the trace cannot read "
                "as projections: remove that for the init (torch.nn.utils.parametrize.remove_parametrizations, "
                "remove_weight_norm, remove_spectral_norm) and apply it again after")
    return dropped_in_eval(module, args, kwargs)


def dropped_in_eval(module: nn.Module, args: tuple, kwargs: dict) -> str | None:
    """Why a call of ``module`` is random in eval mode, when a dropout in it is called with
    ``training=True`` (``F.dropout``'s default) and p > 0; else None. One more run of the module
    (restored after), so only to name why a layer was refused."""
    with restored(module, []):
        rec = record(module, args, kwargs)
    for func, args, kwargs, _ in rec.ops:
        if func not in _DROPOUTS:
            continue
        p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
        training = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
        if training and float(p) > 0:
            return (f"it drops entries at random even in eval mode: `{func.__name__}(…, p={float(p):g})` is called "
                    "with training=True (F.dropout's default), so its output is not its map applied to v; pass "
                    "training=self.training")
    return None

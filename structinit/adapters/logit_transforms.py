"""What a layer does to its q kᵀ before the softmax, read by comparing the logits the model
really formed with those its projections give (:func:`diagnose`), and the codes a verdict
names it by.

Each transform has a signature in the two sets of logits, tried in this order: q and k of one
length (a norm on q/k); a term added the same for both probe images (a position bias, ALiBi's
too, though it is 0 on the diagonal); the transpose of q kᵀ (q and k read in each other's
roles); the diagonal kept and the rest changed with the content (a rotation by position); each
head's logits a fixed linear mix of all heads' (talking heads), or of its own alone (a per-head
temperature, or one factor for every head: a softmax scale other than the one the module
names); an elementwise monotone function of them (a soft-cap); a term the same for every query
of a key (a per-key bias). A scheme that sets only the projections (mimetic) accepts the
transforms in :data:`TRANSFORMS`, and its check in the model's own forward then says whether the
structure survived them. The two that come from reading a layer by misleading names
(:data:`NAME_MISREADS`) send it to the trace, which reads it by what it computes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from structinit.adapters.attention import adapter_logits
from structinit.adapters.position_mlp import cosine_fits

if TYPE_CHECKING:
    from structinit.adapters.attention import AttentionAdapter
    from structinit.adapters.observe import AttentionMap

# Why a layer is not plain self-attention, as a scheme decides on it (impulse refuses every
# one; mimetic, which sets only the projections, accepts the transforms the model adds on top).
HEAD_MIXING, ROTATION, QK_NORM, POSITION_BIAS = "head-mixing", "rotation", "qk-norm", "position-bias"
HEAD_SCALE, LOGIT_CAP, KEY_BIAS = "head-scale", "logit-cap", "key-bias"
# Read by the wrong names: q and k in each other's roles; a scale other than the one the module names
SWAPPED_ROLES, OTHER_SCALE = "swapped-roles", "other-scale"
SELF_MASK, UNLIKE_CALLS = "self-mask", "unlike-calls"  # the latter: one module called on two token layouts
LAYOUT, NO_MAP, VALUE_PATH, UNCALLED = "layout", "no-map", "value-path", "uncalled"
NO_PROJECTION = "no-output-projection"  # q, k and v read; the output is no projection of the context (a mechanism)
TRANSFORMS = frozenset({ROTATION, QK_NORM, POSITION_BIAS, HEAD_MIXING, HEAD_SCALE, LOGIT_CAP, KEY_BIAS, SELF_MASK,
                        SWAPPED_ROLES, OTHER_SCALE})
# Where an adapter's names mislead it: the trace reads such a layer again by what it computes
NAME_MISREADS = frozenset({SWAPPED_ROLES, OTHER_SCALE})


def as_shape(t: torch.Tensor, shape) -> torch.Tensor | None:
    return t.reshape(shape) if t.numel() == torch.Size(shape).numel() else None


def _open(t: torch.Tensor) -> torch.Tensor:
    """The pairs of logits ``t`` a mask leaves open: finite and above the dtype's lowest float."""
    return torch.isfinite(t) & (t > torch.finfo(t.dtype).min / 2)


def _rows_centred(t: torch.Tensor) -> torch.Tensor:
    """Logits with each row's mean over its open entries removed: a softmax does not see it. A
    pair masked with the dtype's lowest float (Hugging Face's eager masks) is closed, as −∞ is:
    summed, such entries overflow the mean."""
    finite = _open(t)
    mean = torch.where(finite, t, torch.zeros_like(t)).sum(-1, keepdim=True) / finite.sum(-1, keepdim=True).clamp_min(1)
    return torch.where(finite, t - mean, torch.zeros_like(t))


def diagnose(adapter: AttentionAdapter, real: AttentionMap, ours: torch.Tensor, x: torch.Tensor,
             terms: torch.Tensor | None) -> tuple[str, str]:
    """(code, words) for a layer whose real map differs from the adapter's (module doc)."""
    raw_ours = adapter_logits(adapter, x.float(), terms)
    ours_logits = _rows_centred(raw_ours)
    shape = ours_logits.shape
    q_ours = adapter.qk_features(x.float())[0] if real.q is not None and real.k is not None else None
    if q_ours is not None and real.q.shape == q_ours.shape and not torch.allclose(real.q, q_ours, rtol=1e-3, atol=1e-5):
        norms = real.q.norm(dim=-1)  # the same length for every token and head: a norm on q (and k)
        if float(norms.std() / norms.mean().clamp_min(1e-12)) < 1e-3:
            return QK_NORM, "q and k are normalised after their projections (a norm on q/k)"
    raw_real = None if real.logits is None else as_shape(real.logits, shape)
    if raw_real is not None:
        real_logits, ours_logits = _centred_pair(raw_real, raw_ours)
        if _content_free(real_logits - ours_logits):  # before the rotation: an ALiBi bias is 0 on the diagonal too
            return POSITION_BIAS, ("it adds a logit term that does not depend on content (a position bias or mask "
                                   "structinit does not model)")
        if _close(real_logits, _centred_pair(raw_real, raw_ours.transpose(-2, -1))[1]) and not _close(
                real_logits, ours_logits):
            return SWAPPED_ROLES, ("its logits are the transpose of the q kᵀ its projections give as structinit reads "
                                   "them: the projection read as q makes its keys, the one read as k its queries")
        eye = torch.eye(shape[-1], dtype=torch.bool, device=raw_real.device)
        diag_real, diag_ours = raw_real[..., eye], raw_ours[..., eye]
        if real.sinks:  # logits read against the sinks': one constant a head apart (AttentionMap.drop_keys)
            diag_real = diag_real - (diag_real - diag_ours).mean(dim=(0, -1), keepdim=True)
        if torch.isfinite(diag_ours).all() and torch.allclose(diag_real, diag_ours, rtol=1e-3, atol=1e-4):
            # q_i·k_i kept, q_i·k_j changed by content: a rotation by the relative position, 0 on the diagonal
            return ROTATION, ("the q and k it really uses are its projections' rotated by position (rotary "
                              "position embeddings): its logits keep the diagonal and differ off it")
        if mixed := _head_mix(ours_logits, real_logits):
            return mixed
        if _monotone(raw_ours, raw_real):
            return LOGIT_CAP, ("its logits pass an elementwise, order-keeping function after q kᵀ (a soft-cap such "
                               "as c·tanh(x/c)), which changes the gaps between them")
        if _per_key(real_logits - ours_logits):
            return KEY_BIAS, ("it adds a logit term that depends on each key alone, the same for every query (a "
                              "per-key content bias such as u·k_j)")
    if shape[0] > 1 and cosine_fits(adapter, raw_real, x, shape):
        return QK_NORM, ("q and k are normalised after their projections (cosine attention: its logits are a scaled "
                         "cos(q, k) plus a term that does not depend on content)")
    return LAYOUT, ("its q kᵀ is not that of the projections structinit reads (another head layout, such as q, k, v "
                    "packed per head, or a transform of q and k)")


def _centred_pair(raw_real: torch.Tensor, raw_ours: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The real and the adapter's logits, row-centred; pairs the module closes inside (a causal
    mask it builds) are closed in ours too, so that they neither count as a difference nor shift
    the row means the softmax does not see."""
    return _rows_centred(raw_real), _rows_centred(raw_ours.masked_fill(~_open(raw_real), float("-inf")))


def added_term(adapter: AttentionAdapter, real: AttentionMap, x: torch.Tensor, terms) -> torch.Tensor | None:
    """What the layer adds to the q kᵀ its adapter reads on the tokens ``x`` before its softmax,
    row-centred ((slices, H, T, T), real minus ours; its own logits, else the log of its map);
    None when the shapes differ. A term that does not depend on content (a position bias the
    adapter does not model) is the same before and after a write of the projections."""
    raw_ours = adapter_logits(adapter, x.float(), terms)
    own = real.logits if real.logits is not None else real.probs.clamp_min(1e-30).log()
    raw_real = as_shape(own.float(), raw_ours.shape)
    if raw_real is None:
        return None
    real_logits, ours_logits = _centred_pair(raw_real, raw_ours)
    return real_logits - ours_logits


def same_term(before: torch.Tensor, after: torch.Tensor | None) -> bool:
    """Whether ``after`` (:func:`added_term` of one image) is the term ``before`` of the same
    image's slices, to 1e-3 of its largest entry (as :func:`_content_free` judges two images)."""
    if after is None or after.shape[1:] != before.shape[1:] or after.shape[0] > before.shape[0]:
        return False
    spread = float(before.abs().max())
    return math.isfinite(spread) and torch.allclose(after, before[:after.shape[0]], atol=1e-3 * (1 + spread))


def _head_mix(ours: torch.Tensor, real: torch.Tensor) -> tuple[str, str] | None:
    """Each head's real (row-centred) logits as a fixed linear mix of the heads' own: talking heads,
    or, when each head reads only itself, a per-head scale; None when no mix fits."""
    heads = ours.shape[1]
    a = ours.transpose(0, 1).reshape(heads, -1).T.double()  # (pairs, H)
    b = real.transpose(0, 1).reshape(heads, -1).T.double()
    design = torch.cat([a, torch.ones(len(a), 1, dtype=a.dtype, device=a.device)], 1)
    solution = torch.linalg.lstsq(design, b).solution
    residual = float((design @ solution - b).norm() / b.norm().clamp_min(1e-12))
    mix = solution[:heads]
    if residual >= 1e-3 or torch.allclose(mix, torch.eye(heads, dtype=mix.dtype, device=mix.device), atol=1e-3):
        return None
    scale = mix.diagonal()
    if torch.allclose(mix - torch.diag(scale), torch.zeros_like(mix), atol=1e-3 * float(scale.abs().max())):
        if float(scale.max() - scale.min()) <= 1e-3 * float(scale.abs().max()):  # one factor for every head
            return OTHER_SCALE, (f"its logits are the q kᵀ structinit reads times {float(scale.mean()):.4g}, the same "
                                 "for every head: the softmax scale it applies is not the one the module names")
        shown = ", ".join(f"{float(s):.3g}" for s in scale[:8]) + (", …" if heads > 8 else "")
        return HEAD_SCALE, (f"each head's logits are its q kᵀ scaled by a factor of its own ({shown}: a learned "
                            "per-head temperature), not mixed with other heads")
    return HEAD_MIXING, ("its heads are mixed before the softmax (talking-heads attention): a head's map is not its "
                         "own q kᵀ")


def _close(real: torch.Tensor, ours: torch.Tensor) -> bool:
    """Whether two row-centred sets of logits agree, to 1e-3 of the real ones' spread however
    small (logits of a small init are small: no floor of 1e-3 may call them all alike)."""
    spread = float(real.abs().max())
    return math.isfinite(spread) and spread > 0 and torch.allclose(real, ours, rtol=1e-3, atol=1e-3 * spread)


def _open_pairs(ours: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    open_ = torch.isfinite(ours) & _open(real)
    return ours[open_].double(), real[open_].double()


def order_kept(ours: torch.Tensor, real: torch.Tensor) -> bool:
    """Whether the real logits are one non-decreasing function of the adapter's, entry by entry,
    over the pairs open in both (a soft-cap, a temperature, or none)."""
    a, b = _open_pairs(ours, real)
    if a.numel() < 8 or float(a.std()) == 0:
        return False
    steps = b[torch.argsort(a)].diff()
    return float(steps.min()) >= -1e-5 * (1 + float(b.abs().max()))


def _monotone(ours: torch.Tensor, real: torch.Tensor) -> bool:
    """Whether the real logits are one increasing, non-affine function of the adapter's, entry by entry."""
    if not order_kept(ours, real):
        return False
    a, b = _open_pairs(ours, real)
    design = torch.stack([a, torch.ones_like(a)], 1)
    fit = design @ torch.linalg.lstsq(design, b[:, None]).solution
    return float((fit[:, 0] - b).norm() / b.norm().clamp_min(1e-12)) > 1e-3


def _content_free(diff: torch.Tensor) -> bool:
    """Whether a logit term added to q kᵀ (row-centred ``diff`` (B', H, T, T), real minus ours) is
    the same for both probe images, window by window: a position bias or mask."""
    spread, half = float(diff.abs().max()), diff.shape[0] // 2
    return (math.isfinite(spread) and diff.shape[0] > 1 and diff.shape[0] % 2 == 0
            and torch.allclose(diff[:half], diff[half:2 * half], atol=1e-3 * (1 + spread)))


def _per_key(diff: torch.Tensor) -> bool:
    """Whether a logit term added to q kᵀ (as in :func:`_content_free`) is the same for every
    query of a key (a per-key content bias)."""
    spread = float(diff.abs().max())
    return (math.isfinite(spread) and diff.shape[-2] > 1
            and float((diff - diff.mean(-2, keepdim=True)).abs().max()) <= 1e-3 * (1 + spread))

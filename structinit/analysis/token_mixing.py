"""The token-mixing maps of an MLP-Mixer, drawn and scored like attention maps.

A token-mixing MLP y = W₂ φ(W₁ x + b₁) + b₂ mixes each channel's N tokens; its map is the
N×N Jacobian ∂y/∂x = W₂ diag(φ'(W₁ x + b₁)) W₁, which depends on the channel's tokens x only
through φ'. Averaged over channels (and images) it is W₂ diag(mean φ') W₁: one N×N matrix per
layer, the Mixer's analogue of a one-head attention map. For an impulse init it is the shift
matrix S of the layer's tap (exactly when the init took the hidden ≥ 2N route; to within
GELU's tail otherwise). Without images the tokens are zero (content-free): φ'(b₁).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from structinit.adapters import find_token_mixing_layers, select_layers
from structinit.analysis.capture import forward_then_remove
from structinit.functional.targets import target_index
from structinit.schemes.records import get_record

__all__ = ["token_mixing_fidelity", "token_mixing_maps"]


def _slopes(mlp: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean over every leading axis of φ'(W₁ x + b₁), (hidden,), for tokens (..., N)."""
    pre = mlp.fc1(tokens.float()).detach().requires_grad_(True)
    act = getattr(mlp, "act", None) or nn.GELU()
    (slope,) = torch.autograd.grad(act(pre).sum(), pre)  # elementwise φ: the gradient of the sum is φ'
    return slope.reshape(-1, slope.shape[-1]).mean(0)


def _map(mlp: nn.Module, slope: torch.Tensor) -> torch.Tensor:
    return (mlp.fc2.weight.float() * slope) @ mlp.fc1.weight.float()


def token_mixing_maps(model: nn.Module, images: torch.Tensor | None = None,
                      layers: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Per token-mixing MLP of ``model`` (or the ``layers`` chosen), its (N, N) map averaged over
    channels and ``images`` (module doc); with ``images=None``, at zero tokens.

    Examples:
        >>> mixer = structinit.create_model("mixer_cpu_patch4_32")
        >>> _ = structinit.init_(mixer, "impulse", seed=0)
        >>> record = mixer.blocks[0].mlp_tokens.structinit_impulse
        >>> s = structinit.impulse_matrix(record["grid"], record["offset"])
        >>> bool(torch.allclose(token_mixing_maps(mixer, layers=[0])[0], s, atol=1e-5))
        True
    """
    chosen = select_layers(find_token_mixing_layers(model), layers, kind="token-mixing")
    if images is None:
        with torch.enable_grad():
            return [_map(mlp, _slopes(mlp, torch.zeros(1, mlp.fc1.in_features))).detach() for _, mlp in chosen]
    slopes: list[torch.Tensor | None] = [None] * len(chosen)

    def keep(i: int):
        def hook(module, args):
            with torch.enable_grad():
                slopes[i] = _slopes(module, args[0])
        return hook

    handles = [mlp.register_forward_pre_hook(keep(i)) for i, (_, mlp) in enumerate(chosen)]
    was_training = model.training
    model.eval()
    try:
        forward_then_remove(model, images, handles)
    finally:
        model.train(was_training)
    missing = [name for (name, _), s in zip(chosen, slopes) if s is None]
    if missing:
        raise RuntimeError(f"token-mixing MLP(s) {', '.join(missing)} were not called in the forward pass")
    return [_map(mlp, s).detach() for (_, mlp), s in zip(chosen, slopes)]


def token_mixing_fidelity(model: nn.Module, images: torch.Tensor | None = None,
                          layers: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """How close each token-mixing map is to its impulse (the tap recorded by the init):
    ``{'mass': (layers,), 'hit': (layers,)}``, the mean map entry on each row's target and the
    fraction of rows whose largest entry is the target, over rows whose target is on the grid.
    A layer without a record is an error naming it."""
    chosen = select_layers(find_token_mixing_layers(model), layers, kind="token-mixing")
    maps = token_mixing_maps(model, images, layers)
    mass, hit = torch.empty(len(chosen)), torch.empty(len(chosen))
    for i, ((name, mlp), m) in enumerate(zip(chosen, maps)):
        record = get_record(mlp, "impulse")
        if record is None:
            raise ValueError(f"token-mixing MLP {name!r} has no impulse record (it was not initialised by "
                             "structinit's impulse scheme in this process)")
        t = target_index(tuple(record["grid"]), tuple(record["offset"]))
        rows = torch.nonzero(t >= 0).squeeze(1)
        mass[i] = m[rows, t[rows]].mean()
        hit[i] = (m[rows].argmax(-1) == t[rows]).float().mean()
    return {"mass": mass, "hit": hit}

"""``impulse`` for MLP-Mixers: each token-mixing MLP starts as the shift of one k×k tap.

A Mixer carries position in its token-mixing MLPs (N → hidden → N over each channel's tokens,
shared by every channel), not in attention. The impulse init writes into each of them the
shift S of one tap of a k×k filter, exactly through the GELU
(:func:`structinit.functional.token_mixing_impulse`): the block then adds S x to its input,
a depthwise convolution with one one-hot filter shared by all channels. Each layer draws its
own tap (``offsets='random'``) or takes the next of the enumerated ones (centre, up, right,
left, down, diagonals). Unused hidden units start silent. ``init_(mixer, "impulse")`` picks
this scheme for a model whose position lives in token-mixing MLPs.
"""

from __future__ import annotations

import torch
from torch import nn

from structinit.adapters import find_token_mixing_layers, token_grid
from structinit.functional.mixer import token_mixing_impulse
from structinit.functional.targets import check_kernel_size, enumerated_offsets, random_offsets
from structinit.schemes.plan import Plan
from structinit.schemes.registry import register_planner
from structinit.utils import check_choice, check_number, make_generator

__all__ = ["plan_token_mixing_impulse", "token_mixing_impulse_init_"]


def plan_token_mixing_impulse(model: nn.Module, *, kernel_size: int = 3, offsets: str = "random",
                              margin: float = 8.0, generator: torch.Generator | None = None,
                              seed: int | None = None) -> Plan:
    """Every token-mixing MLP of ``model`` written as the shift of one k×k tap (a record
    ``impulse`` with ``offset`` and ``grid`` goes on each MLP). Needs hidden ≥ N tokens and
    biases on fc1 and fc2 when hidden < 2N.

    Examples:
        >>> m = structinit.create_model("mixer_cpu_patch4_32")
        >>> _ = structinit.init_(m, "impulse", seed=0)  # token-mixing MLPs, no attention: this scheme
    """
    check_choice("offsets", offsets, ("random", "enumerated"))
    check_number("margin", margin, low=0, low_open=True)
    layers = find_token_mixing_layers(model)
    grids = [token_grid(model, mlp.fc1.in_features) for _, mlp in layers]
    for grid in dict.fromkeys(grids):
        check_kernel_size(kernel_size, grid)  # before any tap is drawn
    gen = make_generator(generator, seed)
    taps = (random_offsets(len(layers), kernel_size, generator=gen) if offsets == "random"
            else enumerated_offsets(len(layers), kernel_size))
    plan = Plan()
    for (name, mlp), grid, offset in zip(layers, grids, taps):
        w1, b1, w2, b2 = token_mixing_impulse(grid, offset, mlp.fc1.out_features, margin)
        if (b1.any() or b2.any()) and (mlp.fc1.bias is None or mlp.fc2.bias is None):
            raise ValueError(f"{name}: hidden={mlp.fc1.out_features} < 2N = {2 * mlp.fc1.in_features} needs biases on "
                             "fc1 and fc2 to carry the shift through the GELU; this MLP has none")
        plan.add([(mlp.fc1.weight, w1), (mlp.fc2.weight, w2)])
        plan.add([(b, v) for b, v in ((mlp.fc1.bias, b1), (mlp.fc2.bias, b2)) if b is not None])
        plan.records.append((mlp, "impulse", {"offset": offset, "grid": grid, "kernel_size": kernel_size}))
    return plan


token_mixing_impulse_init_ = register_planner("impulse", plan_token_mixing_impulse, target="token_mixing",
                                              function_name="token_mixing_impulse_init_")

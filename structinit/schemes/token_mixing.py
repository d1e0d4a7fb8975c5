"""``impulse`` and ``mimetic`` for MLP-Mixers: each token-mixing MLP starts as a chosen linear
map of its tokens, the shift of one k×k tap or mimetic's αZ + βI.

A Mixer carries position in its token-mixing MLPs (N → hidden → N over each channel's tokens,
shared by every channel), not in attention. The impulse init writes into each of them the
shift S of one tap of a k×k filter, exactly through the GELU
(:func:`structinit.functional.token_mixing_impulse`): the block then adds S x to its input,
a depthwise convolution with one one-hot filter shared by all channels. Each layer draws its
own tap (``offsets='random'``) or takes the next of the enumerated ones (centre, up, right,
left, down, diagonals). Unused hidden units start silent. ``init_(mixer, "impulse")`` picks
this scheme for a model whose position lives in token-mixing MLPs. Both schemes need hidden ≥ N
tokens, and biases on fc1 and fc2 when hidden < 2N.

``mimetic`` on a Mixer writes the formula mimetic initialisation puts on an attention layer's
QKᵀ, A = αZ + βI (Z with entries N(0, 1/N), a fresh draw per layer), as the token map itself,
through the same exact route: each token starts as mostly itself plus a little of every other.
The analogue is structinit's: neither mimetic paper nor the 2025 impulse code covers Mixers.
"""

from __future__ import annotations

import torch
from torch import nn

from structinit.adapters import find_token_mixing_layers, token_grid
from structinit.adapters.survey import ModelSurvey
from structinit.functional.mixer import token_mixing_impulse, token_mixing_linear
from structinit.functional.targets import check_kernel_size, enumerated_offsets, random_offsets
from structinit.schemes import impulse as _attention_impulse  # noqa: F401  registers attention 'impulse' first
from structinit.schemes import mimetic as _attention_mimetic  # noqa: F401  and attention 'mimetic'
from structinit.schemes.plan import Plan
from structinit.schemes.registry import register_planner
from structinit.utils import check_choice, check_number, make_generator

__all__ = ["plan_token_mixing_impulse", "plan_token_mixing_mimetic", "token_mixing_impulse_init_",
           "token_mixing_mimetic_init_"]


def plan_token_mixing_impulse(survey: ModelSurvey, *, kernel_size: int = 3, offsets: str = "random",
                              margin: float = 8.0, generator: torch.Generator | None = None,
                              seed: int | None = None) -> Plan:
    """Every token-mixing MLP of ``model`` written as the shift of one k×k tap (a record
    ``impulse`` with ``offset`` and ``grid`` goes on each MLP).

    Examples:
        >>> m = structinit.create_model("mixer_cpu_patch4_32")
        >>> _ = structinit.init_(m, "impulse", seed=0)  # token-mixing MLPs, no attention: this scheme
    """
    model = survey.model
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
        _plan_weights(plan, name, mlp, token_mixing_impulse(grid, offset, mlp.fc1.out_features, margin))
        plan.records.append((mlp, "impulse", {"offset": offset, "grid": grid, "kernel_size": kernel_size}))
    return plan


def _plan_weights(plan: Plan, name: str, mlp: nn.Module, weights: tuple[torch.Tensor, ...]) -> None:
    w1, b1, w2, b2 = weights
    if (b1.any() or b2.any()) and (mlp.fc1.bias is None or mlp.fc2.bias is None):
        raise ValueError(f"{name}: hidden={mlp.fc1.out_features} < 2N = {2 * mlp.fc1.in_features} needs biases on "
                         "fc1 and fc2 to carry the token map through the GELU; this MLP has none")
    plan.add([(mlp.fc1.weight, w1), (mlp.fc2.weight, w2)])
    plan.add([(b, v) for b, v in ((mlp.fc1.bias, b1), (mlp.fc2.bias, b2)) if b is not None])


def plan_token_mixing_mimetic(survey: ModelSurvey, *, alpha: float = 0.7, beta: float = 0.7, margin: float = 8.0,
                              generator: torch.Generator | None = None, seed: int | None = None) -> Plan:
    """Every token-mixing MLP of ``model`` written as the token map A = αZ + βI (module doc).
    Clears any impulse record the MLPs held.

    Examples:
        >>> m = structinit.create_model("mixer_cpu_patch4_32")
        >>> _ = structinit.init_(m, "mimetic", seed=0)  # token-mixing MLPs, no attention: this scheme
    """
    model = survey.model
    check_number("alpha", alpha)
    check_number("beta", beta)
    check_number("margin", margin, low=0, low_open=True)
    layers = find_token_mixing_layers(model)
    gen = make_generator(generator, seed)
    plan = Plan()
    for name, mlp in layers:
        n = mlp.fc1.in_features
        z = torch.randn(n, n, generator=gen, dtype=torch.float64) / n**0.5
        matrix = alpha * z + beta * torch.eye(n, dtype=torch.float64)
        _plan_weights(plan, name, mlp, token_mixing_linear(matrix, mlp.fc1.out_features, margin))
        plan.records.append((mlp, "impulse", None))
    return plan


token_mixing_mimetic_init_ = register_planner("mimetic", plan_token_mixing_mimetic, target="token_mixing",
                                              function_name="token_mixing_mimetic_init_")


token_mixing_impulse_init_ = register_planner("impulse", plan_token_mixing_impulse, target="token_mixing",
                                              function_name="token_mixing_impulse_init_")

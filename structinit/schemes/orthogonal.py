"""The conv-init scheme 'orthogonal' (target 'conv'): orthogonal kernels for the ordinary
convolutions of a model, every ``nn.Conv2d`` with ``groups == 1`` and a square kernel (a
depthwise or grouped conv, and every other layer, keeps what it had; the biases are left as
they are).

- ``variant='delta'`` (delta-orthogonal, Xiao et al. 2018): ``gain`` times a Haar-random
  orthogonal c_out×c_in matrix at the tap (k − 1)//2, zeros elsewhere
  (:func:`~structinit.functional.orthogonal.delta_orthogonal_kernel`). For stride 1 with
  padding 'same', (k − 1)//2 or circular, the conv is y = M x per pixel: exactly
  norm-preserving (c_out ≥ c_in, gain 1) or co-isometric (c_out < c_in), for odd and even k.
- ``variant='cayley'``: the per-frequency Cayley map of a random skew-Hermitian spectrum,
  truncated back to k×k (:func:`~structinit.functional.orthogonal.cayley_kernel`; ``std``
  sets the spectrum's scale, ``n`` its grid). The truncation costs orthogonality: with
  std 0.1, max_f |Ŵ_fᴴŴ_f − I| ≈ 0.04 for k = 3 and ≈ 0.14 for k = 4 (16 channels), growing
  with ``std`` (see the function's docstring and tests/test_orthogonal_init.py).
"""

from __future__ import annotations

import torch
from torch import nn

from structinit.adapters.survey import ModelSurvey
from structinit.functional import orthogonal as fo
from structinit.schemes.plan import Plan
from structinit.schemes.registry import register_planner
from structinit.utils import check_choice, check_int, check_number, derived_generator, make_generator
from structinit.utils.checks import check_bool

VARIANTS = ("delta", "cayley")


def find_full_convs(model: nn.Module) -> list[tuple[str, nn.Conv2d]]:
    """(name, conv) for every ``nn.Conv2d`` of ``model`` with ``groups == 1`` and a square
    kernel, in module order."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.Conv2d) and m.groups == 1 and m.kernel_size[0] == m.kernel_size[1]]


def plan_orthogonal(survey: ModelSurvey, *, variant: str = "delta", gain: float = 1.0, std: float = 0.1,
                    n: int | None = None, frozen: bool = False, generator: torch.Generator | None = None,
                    seed: int | None = None) -> Plan:
    """Orthogonal kernels for every ``nn.Conv2d`` with ``groups == 1`` (see the module
    docstring): ``variant`` 'delta' (exact) or 'cayley' (truncated, near-orthogonal; ``std``
    and ``n`` apply to it only). Conv l draws from its own stream derived from the seed, so
    a layer's kernel does not depend on the layers before it. ``frozen`` as for the other conv
    schemes: True sets ``requires_grad=False`` on each written weight, False sets it back.

    Examples:
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 3, padding=1))
        >>> _ = structinit.init_(model, "orthogonal", variant="delta", seed=0)
        >>> m = model[1].weight[:, :, 1, 1]
        >>> torch.allclose(m.T @ m, torch.eye(8), atol=1e-6)
        True
    """
    model = survey.model
    check_choice("variant", variant, VARIANTS)
    check_bool("frozen", frozen)
    check_number("gain", gain, low=0, low_open=True)
    check_number("std", std, low=0, low_open=True)
    if n is not None:
        check_int("n", n, low=1)
    convs = find_full_convs(model)
    if not convs:
        raise ValueError(f"scheme 'orthogonal': {type(model).__name__} has no nn.Conv2d with groups == 1 and a "
                         "square kernel to initialise; use it on a model with ordinary convolutions")
    if n is not None:
        big = [f"{name} (k={conv.kernel_size[0]})" for name, conv in convs if conv.kernel_size[0] > n]
        if big and variant == "cayley":
            raise ValueError(f"n={n}: smaller than the kernels of {', '.join(big)}; pass n ≥ the largest kernel "
                             "size or n=None")
    base = int(torch.randint(2**62, (1,), generator=make_generator(generator, seed)))
    plan = Plan()
    for i, (_, conv) in enumerate(convs):
        gen = derived_generator(base, i)
        c_out, c_in, k = conv.out_channels, conv.in_channels, conv.kernel_size[0]
        if variant == "delta":
            w = fo.delta_orthogonal_kernel(c_out, c_in, k, gain=gain, dtype=torch.float64, generator=gen)
        else:
            w = gain * fo.cayley_kernel(c_out, c_in, k, n=n, std=std, dtype=torch.float64, generator=gen)
        plan.add([(conv.weight, w.to(conv.weight.dtype))])
        plan.actions.append(lambda conv=conv: conv.weight.requires_grad_(not frozen))
    return plan


orthogonal_init_ = register_planner("orthogonal", plan_orthogonal, target="conv")

"""Certified ℓ₂ robustness of Lipschitz networks (Tsuzuku et al. 2018; Trockman & Kolter 2021).

If f is L-Lipschitz in ℓ₂, a perturbation of norm ε moves each logit difference
f_y − f_j by at most √2·L·ε, so a prediction whose margin f_y − max_{j≠y} f_j exceeds
√2·L·ε cannot change inside the ball: it is certified at radius ε.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from structinit.utils import check_int, check_number, make_generator

__all__ = ["certified_accuracy", "empirical_lipschitz", "input_lipschitz", "logit_margins", "model_lipschitz",
           "multiclass_hinge_loss", "pgd_l2_accuracy", "pixel_cert_threshold"]


def _check_logits(logits: torch.Tensor, y: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[1] < 2:
        raise ValueError(f"logits: expected a (B, C) tensor with C ≥ 2 classes, got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if not isinstance(y, torch.Tensor) or y.shape != logits.shape[:1] or y.is_floating_point():
        raise ValueError(f"y: expected integer labels of shape ({logits.shape[0]},), got "
                         f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}")


def multiclass_hinge_loss(logits: torch.Tensor, y: torch.Tensor, margin: float = 0.5) -> torch.Tensor:
    """The multi-class hinge loss mean_b (1/C) Σ_{j≠y} max(0, margin − f_y + f_j)
    (``F.multi_margin_loss``), the certified-training loss of Trockman & Kolter (margin 0.5;
    for a certificate at ε pick margin ≈ √2·ε·L). Shapes (B, C), (B,) → scalar.

    Examples:
        >>> multiclass_hinge_loss(torch.tensor([[2.0, 0.0, 0.0]]), torch.tensor([0]), margin=0.5)
        tensor(0.)
        >>> multiclass_hinge_loss(torch.tensor([[0.0, 0.0]]), torch.tensor([0]), margin=1.0)
        tensor(0.5000)
    """
    _check_logits(logits, y)
    check_number("margin", margin, low=0)
    return F.multi_margin_loss(logits, y, margin=margin)


def logit_margins(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """f_y − max_{j≠y} f_j per example, shape (B,): positive where the prediction is right.

    Examples:
        >>> logit_margins(torch.tensor([[3.0, 1.0, 2.0], [0.0, 1.0, 0.5]]), torch.tensor([0, 0]))
        tensor([ 1., -1.])
    """
    _check_logits(logits, y)
    true = logits.gather(1, y.view(-1, 1)).squeeze(1)
    others = logits.scatter(1, y.view(-1, 1), float("-inf"))
    return true - others.max(dim=1).values


def certified_accuracy(logits: torch.Tensor, y: torch.Tensor, eps: float, lipschitz: float = 1.0) -> float:
    """The fraction of examples certified at ℓ₂ radius ``eps`` for an ``lipschitz``-Lipschitz
    network: margin f_y − max_{j≠y} f_j > √2·ε·L. ``eps`` = 0 gives the clean accuracy (ties
    count as wrong).

    Examples:
        >>> logits = torch.tensor([[1.0, 0.0], [0.2, 0.0], [0.0, 1.0]])
        >>> certified_accuracy(logits, torch.tensor([0, 0, 0]), eps=0.1)   # margins 1, 0.2, −1 vs 0.141
        0.6666666666666666
        >>> certified_accuracy(logits, torch.tensor([0, 0, 0]), eps=0.5)   # vs 0.707
        0.3333333333333333
    """
    check_number("eps", eps, low=0)
    check_number("lipschitz", lipschitz, low=0)
    margins = logit_margins(logits, y)
    return int((margins > math.sqrt(2) * eps * lipschitz).sum()) / margins.numel()


def _per_example_norm(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(1).norm(dim=1).view(-1, *([1] * (t.dim() - 1)))


def empirical_lipschitz(model: nn.Module, x: torch.Tensor, *, steps: int = 10, eps: float = 36 / 255,
                        step_size: float | None = None, generator: torch.Generator | None = None,
                        seed: int | None = None) -> float:
    """A lower bound on the local ℓ₂ Lipschitz constant of ``model`` around the batch x
    (B, …): PGD ascent of r(δ) = ‖f(x + δ) − f(x)‖ / ‖δ‖ per example over δ in the ℓ₂ ball of
    radius ``eps`` (normalised-gradient steps of ``step_size``, default ε/4, each followed by a
    projection on the ball), started from a random δ (``generator``/``seed``). Returns the
    largest ratio seen. The model runs as it is (call ``model.eval()`` first for a deterministic
    network); no parameter gradient is accumulated.

    Examples:
        >>> empirical_lipschitz(torch.nn.Linear(3, 3, bias=False).requires_grad_(False).eval(),
        ...                     torch.zeros(2, 3), seed=0) > 0
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 2:
        raise ValueError("x: expected a real floating-point batch (B, …)")
    check_int("steps", steps, low=0)
    check_number("eps", eps, low=0, low_open=True)
    step_size = eps / 4 if step_size is None else check_number("step_size", step_size, low=0, low_open=True)
    gen = make_generator(generator, seed)
    x = x.detach()
    delta = torch.randn(x.shape, generator=gen, dtype=x.dtype).to(x.device)
    delta = delta * (eps / 2) / _per_example_norm(delta).clamp_min(1e-12)
    with torch.no_grad():
        fx = model(x)
    best = 0.0
    for step in range(steps + 1):
        delta.requires_grad_(True)
        diff = (model(x + delta) - fx).flatten(1).norm(dim=1)
        ratio = diff / delta.flatten(1).norm(dim=1)
        best = max(best, float(ratio.detach().max()))
        if step == steps:
            break
        (grad,) = torch.autograd.grad(ratio.sum(), delta)
        with torch.no_grad():
            delta = delta + step_size * grad / _per_example_norm(grad).clamp_min(1e-12)
            norm = _per_example_norm(delta)
            delta = delta * torch.clamp(eps / norm.clamp_min(1e-12), max=1.0)
            delta = torch.where(norm < 1e-12, torch.full_like(delta, eps / math.sqrt(delta[0].numel())), delta)
    return best


def pgd_l2_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float, *, steps: int = 10,
                    step_size: float | None = None, preprocess: Callable[[torch.Tensor], torch.Tensor] | None = None,
                    clamp: tuple[float, float] | None = (0.0, 1.0), generator: torch.Generator | None = None,
                    seed: int | None = None) -> float:
    """Empirical robust accuracy under an ℓ₂ PGD attack of radius ``eps`` (Madry et al. 2018;
    the evaluation of Trockman & Kolter: 10 steps of ε/4): the fraction of x (B, …) whose
    prediction stays right at the attack's last point and is right on the clean x.

    The attack works in the space of ``x`` (pixels in [0, 1] for the harness), running the
    model on ``preprocess(x + δ)`` (e.g. the (x − mean)/std normalisation; default: none).
    It starts from a random δ of norm ε/2 (``generator``/``seed``) and takes normalised-gradient
    ascent steps of ``step_size`` (default ε/4) on the margin loss max_{j≠y} f_j − f_y, each
    followed by the projection on the ε-ball and, with ``clamp``, on the image box (which only
    shrinks δ when x lies in the box). Every point it tries lies in the ball, so for an
    L-Lipschitz model the result is ≥ the certified accuracy at ε (:func:`certified_accuracy`)
    and ≤ the clean accuracy. The model runs as it is (call ``model.eval()`` first); no
    parameter gradient is accumulated.

    Examples:
        >>> model = torch.nn.Linear(2, 2, bias=False).requires_grad_(False).eval()
        >>> with torch.no_grad():
        ...     _ = model.weight.copy_(torch.eye(2))
        >>> x, y = torch.tensor([[1.0, 0.0], [0.6, 0.5]]), torch.tensor([0, 0])
        >>> pgd_l2_accuracy(model, x, y, eps=0.2, clamp=None, seed=0)   # margins 1 and 0.1
        0.5
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 2:
        raise ValueError("x: expected a real floating-point batch (B, …)")
    if not isinstance(y, torch.Tensor) or y.shape != x.shape[:1] or y.is_floating_point():
        raise ValueError(f"y: expected integer labels of shape ({x.shape[0]},)")
    check_int("steps", steps, low=0)
    check_number("eps", eps, low=0, low_open=True)
    step_size = eps / 4 if step_size is None else check_number("step_size", step_size, low=0, low_open=True)
    if clamp is not None and not (len(clamp) == 2 and clamp[0] < clamp[1]):
        raise ValueError(f"clamp={clamp!r}: expected (low, high) with low < high, or None")
    prep = preprocess if preprocess is not None else (lambda t: t)
    gen = make_generator(generator, seed)
    x = x.detach()

    def project(delta: torch.Tensor) -> torch.Tensor:
        delta = delta * torch.clamp(eps / _per_example_norm(delta).clamp_min(1e-12), max=1.0)
        return delta if clamp is None else (x + delta).clamp(*clamp) - x

    with torch.no_grad():
        clean_right = model(prep(x)).argmax(-1) == y
    delta = torch.randn(x.shape, generator=gen, dtype=x.dtype).to(x.device)
    delta = project(delta * (eps / 2) / _per_example_norm(delta).clamp_min(1e-12))
    for _ in range(steps):
        delta.requires_grad_(True)
        logits = model(prep(x + delta)).float()
        loss = -logit_margins(logits, y).sum()
        (grad,) = torch.autograd.grad(loss, delta)
        with torch.no_grad():
            delta = project(delta + step_size * grad / _per_example_norm(grad).clamp_min(1e-12))
    with torch.no_grad():
        adv_right = model(prep(x + delta)).argmax(-1) == y
    return int((clean_right & adv_right).sum()) / len(y)


def input_lipschitz(std: torch.Tensor | tuple[float, ...]) -> float:
    """The ℓ₂ Lipschitz constant of an input normalisation x ↦ (x − mean)/std from
    pixels in [0, 1]: a diagonal map with entries 1/std_c, so its operator norm is
    1/min_c std_c. A model that is L-Lipschitz on normalised inputs is L/min(std)-Lipschitz in
    pixel space (exactly the bound of the composition; the paper mean-centres only, std = 1).

    Examples:
        >>> round(input_lipschitz((0.5, 0.25, 1.0)), 6)
        4.0
    """
    values = std.flatten().tolist() if isinstance(std, torch.Tensor) else list(std)
    return 1.0 / min(values)


def pixel_cert_threshold(eps: float, model_lipschitz: float, std) -> float:
    """The logit margin that certifies a prediction at ℓ₂ radius ``eps`` in pixel space [0, 1]
    for a model that is ``model_lipschitz``-Lipschitz on normalised inputs:
    √2·ε·L_model·(1/min std) (:func:`structinit.analysis.certify.certified_accuracy` with
    lipschitz = L_model/min(std))."""
    return math.sqrt(2) * eps * model_lipschitz * input_lipschitz(std)


def model_lipschitz(model: nn.Module) -> float | None:
    """The ℓ₂ Lipschitz bound a model declares (``model.lipschitz_bound``, e.g. 1.0 for the
    Cayley KWLarge), or None: a model without a proven bound gets no certificate, only PGD."""
    bound = getattr(model, "lipschitz_bound", None)
    return None if bound is None else float(bound)

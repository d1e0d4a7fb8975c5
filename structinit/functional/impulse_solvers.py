r"""The impulse solvers behind one interface, selectable by name: ``analytic`` (ours),
``closed_form`` (2025) and ``gd`` (2024).

A solver turns a position embedding and, per attention layer, the heads' offsets into
query/key factors. Its options are keyword-only constructor arguments, checked when it is
built (:func:`make_impulse_solver`), before any model is touched. Solving is three steps:

1. :meth:`ImpulseSolver.position_embedding` — the PE to write into the model first, or
   ``None`` to keep the model's (analytic writes ``pe_scale`` × the 2-D sin-cos table; closed
   form scales a learned PE).
2. :meth:`ImpulseSolver.pseudo_input` — the position-only tokens X̃ (N×D) the factors are
   fitted to.
3. :meth:`ImpulseSolver.solve` — per layer, Wq and Wk of shape (heads, D, head_dim), with
   logits ``X̃ Wq[h] Wk[h]ᵀ X̃ᵀ`` peaking on each head's target.

Register your own with ``@IMPULSE_SOLVERS.register("name")`` on an :class:`ImpulseSolver`
subclass; ``structinit.init_(model, "impulse", solver="name", **options)`` then uses it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from structinit.functional.attention import LN_EPS, layer_norm_tokens
from structinit.functional.impulse_analytic import content_qk, frequency_budget, impulse_qk, position_columns
from structinit.functional.impulse_closed_form import closed_form_qk, pinv_projector
from structinit.functional.impulse_gd import gd_qk
from structinit.functional.posembed import sincos_2d
from structinit.functional.pseudo_input import PSEUDO_INPUTS, pseudo_input
from structinit.functional.targets import Offset
from structinit.utils import OptionError, Registry, check_choice, check_int, check_number, check_options
from structinit.utils.checks import check_bool

Factors = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class LayerSpec:
    """What a solver needs to know about one attention layer."""

    offsets: tuple[Offset, ...]  # one (dy, dx) per head
    head_dim: int
    scale: float                 # the softmax scale the layer applies


@dataclass(frozen=True)
class SolvedLayer:
    """Factors for one layer, and the offsets they realise (a solution shared between layers
    realises the offsets it was fitted to)."""

    wq: torch.Tensor             # (heads, D, head_dim)
    wk: torch.Tensor             # (heads, D, head_dim)
    offsets: tuple[Offset, ...]


@dataclass(frozen=True, kw_only=True)
class ImpulseSolver:
    """Base class. Subclasses are frozen keyword-only dataclasses whose fields are the
    solver's options, validated in ``__post_init__``."""

    name: ClassVar[str]
    default_offsets: ClassVar[str] = "random"   # 'random' or 'enumerated'
    default_value_init: ClassVar[str] = "keep"  # 'keep' or 'mimetic' (v/proj)
    default_reserve: ClassVar[str] = "none"     # position reservation: 'none', 'patch', 'residual', 'auto'
    # Whether its q/k put each head's argmax on its target (held to it after the write); the published
    # solvers fit it approximately, as their papers do (a short gd run puts many heads elsewhere).
    exact: ClassVar[bool] = False

    def argmax_on_images(self) -> bool:
        """Whether, with a residual reservation, its q/k keep each head's argmax on its target for
        any image content (checked after the write on a probe image; the analytic solver's signed
        kernel without a content term does)."""
        return False

    def reads_model_pe(self) -> bool:
        """Whether the model's current position embedding is read (it must then exist and be
        finite; a solver that only overwrites it is not blocked by NaNs there)."""
        return True

    def position_embedding(self, pe: torch.Tensor | None, *, learned: bool, grid: tuple[int, int],
                           dim: int) -> torch.Tensor | None:
        """(N, D) float64 PE to write into the model before solving, or None to keep it."""
        return None

    def pseudo_input(self, pe: torch.Tensor | None, *, grid: tuple[int, int], dim: int,
                     generator: torch.Generator) -> torch.Tensor:
        """X̃ (N×D): LayerNorm of the PE, what a first block sees with position only."""
        return layer_norm_tokens(pe)

    def solve(self, x: torch.Tensor, grid: tuple[int, int], layers: list[LayerSpec],
              generator: torch.Generator) -> list[SolvedLayer]:
        raise NotImplementedError


IMPULSE_SOLVERS: Registry[type[ImpulseSolver]] = Registry("impulse solver")


def make_impulse_solver(name: str, **options) -> ImpulseSolver:
    """The solver ``name`` with ``options``; unknown names, options and bad values raise here.

    Examples:
        >>> make_impulse_solver("analytic", target_mass=0.3)
        AnalyticSolver(target_mass=0.3, pe_scale=1.0, ridge=0.002, signed=True, content=0.0, frequencies=None)
    """
    cls = IMPULSE_SOLVERS.get(name)
    check_options(cls, options, f"impulse solver {name!r}")
    return cls(**options)


# Defaults chosen by accuracy (structinit compare on CIFAR-10 5k images; the numbers are in
# docs/results/vit-accuracy.md): PE ×1 trains best (a larger PE drowns the patch content); sharpness 0.3–0.5 is
# flat, 0.8 trains worse; a mimetic V/O trains worse. The signed kernel with reserve='auto' keeps
# every argmax on target with real images at PE ×1 and trains as well as the unsigned,
# unreserved kernel did, so it is the default.
@IMPULSE_SOLVERS.register("analytic")
@dataclass(frozen=True, kw_only=True)
class AnalyticSolver(ImpulseSolver):
    """Ours: a separable cosine kernel read out of LayerNorm(PE) by ridge regression, its
    sharpness calibrated to ``target_mass`` (see :mod:`structinit.functional.impulse_analytic`).

    ``pe_scale`` writes pe_scale × the 2-D sin-cos table into the PE's grid rows (``None``
    keeps the model's PE and reads the structure out of it).
    """

    name: ClassVar[str] = "analytic"
    default_reserve: ClassVar[str] = "auto"
    exact: ClassVar[bool] = True
    target_mass: float = 0.5
    pe_scale: float | None = 1.0
    ridge: float = 2e-3
    signed: bool = True
    content: float = 0.0
    frequencies: int | None = None

    def __post_init__(self):
        check_number("target_mass", self.target_mass, low=0, high=1, low_open=True, high_open=True)
        check_number("pe_scale", self.pe_scale, low=0, low_open=True, allow_none=True)
        check_number("ridge", self.ridge, low=0, low_open=True)
        check_bool("signed", self.signed)
        check_number("content", self.content, low=0)
        if self.frequencies is not None:
            check_int("frequencies", self.frequencies, low=1)

    def argmax_on_images(self) -> bool:
        return self.signed and self.content == 0  # a content term lets content move the logits

    def position_frequencies(self, head_dim: int) -> int | None:
        """Frequencies per axis: ``frequencies``, else all that fit, or with a content term
        those that fit half the head (the other half carries the content term)."""
        if self.frequencies is not None or not self.content:
            return self.frequencies
        return max(1, frequency_budget(head_dim // 2, self.signed))

    def token_scale(self, grid: tuple[int, int], dim: int) -> torch.Tensor | None:
        """Each grid token's LayerNorm std, in units of the written table, when this solver
        writes the sin-cos table (LN(c·P) = (P − μ)/√(var P + ε/c²)); None for a kept PE.
        Used by the signed kernel only: ``signed=False`` is the earlier kernel, bit for bit."""
        if self.pe_scale is None:
            return None
        pe = sincos_2d(grid, dim, dtype=torch.float64)
        return (pe.var(-1, unbiased=False) + LN_EPS / self.pe_scale**2).sqrt()

    def reads_model_pe(self) -> bool:
        return self.pe_scale is None

    def position_embedding(self, pe, *, learned, grid, dim):
        return None if self.pe_scale is None else self.pe_scale * sincos_2d(grid, dim, dtype=torch.float64)

    def solve(self, x, grid, layers, generator):
        cache: dict[LayerSpec, Factors] = {}  # layers sharing offsets and head shape share the solution
        out = []
        for spec in layers:
            freqs = self.position_frequencies(spec.head_dim)
            if spec not in cache:
                wq, wk = impulse_qk(x, grid, list(spec.offsets), spec.head_dim, target_mass=self.target_mass,
                                    softmax_scale=spec.scale, ridge=self.ridge, signed=self.signed,
                                    token_scale=self.token_scale(grid, x.shape[1]) if self.signed else None,
                                    frequencies=freqs)
                # Keep them in nn.Linear memory order (heads, r, D), viewed as (heads, D, r): every
                # layer's write is then a view, not another transposed copy.
                cache[spec] = tuple(w.transpose(1, 2).contiguous().transpose(1, 2) for w in (wq, wk))
            wq, wk = cache[spec]
            if self.content:  # a fresh content draw per head and layer, as mimetic's
                used = position_columns(spec.head_dim, self.signed, freqs)
                cq, ck = content_qk(x, len(spec.offsets), spec.head_dim, used, self.content, generator=generator)
                wq, wk = wq + cq, wk + ck
            out.append(SolvedLayer(wq, wk, spec.offsets))
        return out


@IMPULSE_SOLVERS.register("closed_form")
@dataclass(frozen=True, kw_only=True)
class ClosedFormSolver(ImpulseSolver):
    """The 2025 method: target logits through a truncated pseudo-inverse of the pseudo input,
    then a rank-r SVD per head (see :mod:`structinit.functional.impulse_closed_form`).
    ``pe_scale`` multiplies a *learned* PE only, as the published code does."""

    name: ClassVar[str] = "closed_form"
    default_offsets: ClassVar[str] = "enumerated"
    default_value_init: ClassVar[str] = "mimetic"
    pe_scale: float | None = 18.0
    qk_norm: float = 7.0
    logit_scale: float = 1000.0
    noise: float = 3.0
    pinv_rank: int | None = None

    def __post_init__(self):
        check_number("pe_scale", self.pe_scale, low=0, low_open=True, allow_none=True)
        check_number("qk_norm", self.qk_norm, low=0, low_open=True)
        check_number("logit_scale", self.logit_scale, low=0, low_open=True)
        check_number("noise", self.noise, low=0)
        if self.pinv_rank is not None:
            check_int("pinv_rank", self.pinv_rank, low=1)

    def position_embedding(self, pe, *, learned, grid, dim):
        return pe * self.pe_scale if self.pe_scale is not None and learned else None

    def solve(self, x, grid, layers, generator):
        projectors: dict[int, torch.Tensor] = {}  # depends on the pseudo input and rank only
        out = []
        for spec in layers:
            rank = self.pinv_rank or spec.head_dim
            if rank not in projectors:
                projectors[rank] = pinv_projector(x, rank)
            wq, wk = closed_form_qk(x, grid, list(spec.offsets), spec.head_dim, generator=generator,
                                    logit_scale=self.logit_scale, noise=self.noise, qk_norm=self.qk_norm,
                                    projector=projectors[rank])
            out.append(SolvedLayer(wq, wk, spec.offsets))
        return out


@IMPULSE_SOLVERS.register("gd")
@dataclass(frozen=True, kw_only=True)
class GradientDescentSolver(ImpulseSolver):
    """The 2024 method: Adam on the MSE between softmax maps and impulse matrices, with the
    published periodic renormalisation (see :mod:`structinit.functional.impulse_gd`).
    ``share_solution`` fits once and copies the fit to every layer."""

    name: ClassVar[str] = "gd"
    steps: int = 10_000
    lr: float = 1e-4
    renorm_every: int = 100
    pseudo: str = "pe"
    share_solution: bool = True
    callback: Callable[[int, float], None] | None = field(default=None, compare=False)

    def __post_init__(self):
        check_int("steps", self.steps, low=0)
        check_number("lr", self.lr, low=0, low_open=True, high=1e30)  # the fit runs in float32
        check_int("renorm_every", self.renorm_every, low=1)
        check_choice("pseudo", self.pseudo, PSEUDO_INPUTS)
        check_bool("share_solution", self.share_solution)
        if self.callback is not None and not callable(self.callback):
            raise OptionError(f"callback={self.callback!r}: expected a function (step, loss) or None")

    def reads_model_pe(self) -> bool:
        return "pe" in self.pseudo

    def pseudo_input(self, pe, *, grid, dim, generator):
        return pseudo_input(self.pseudo, pe, (grid[0] * grid[1], dim), generator=generator)

    def solve(self, x, grid, layers, generator):
        out: list[SolvedLayer] = []
        for spec in layers:
            if out and self.share_solution:
                out.append(out[0])
                continue
            wq, wk = gd_qk(x, grid, list(spec.offsets), spec.head_dim, generator=generator, steps=self.steps,
                           lr=self.lr, renorm_every=self.renorm_every, softmax_scale=spec.scale,
                           callback=self.callback)
            out.append(SolvedLayer(wq, wk, spec.offsets))
        return out

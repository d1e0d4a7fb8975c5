"""1-Lipschitz building blocks (Trockman & Kolter, ICLR 2021): the Cayley orthogonal conv and
linear layers, invertible space-to-depth, GroupSort (MaxMin) and a 1-Lipschitz average pool.

A network made only of these (and biases) is 1-Lipschitz in ℓ₂, so a logit margin above √2·ε
certifies robustness at radius ε (:func:`structinit.analysis.certify.certified_accuracy`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from structinit.functional import cayley_conv as fc
from structinit.utils.checks import check_sizes

__all__ = ["CayleyConv2d", "CayleyLinear", "GroupSort", "LipschitzAvgPool", "SpaceToDepth"]


class SpaceToDepth(nn.Module):
    """(B, C, H, W) → (B, C·b², H/b, W/b) (:func:`~structinit.functional.cayley_conv.space_to_depth`):
    a permutation of the entries, so ‖y‖ = ‖x‖ exactly."""

    def __init__(self, block: int = 2):
        super().__init__()
        check_sizes(block=block)
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fc.space_to_depth(x, self.block)


class GroupSort(nn.Module):
    """MaxMin: the channels (dim 1) split into halves a, b → [max(a, b), min(a, b)]. Each
    output pair is a permutation of an input pair, so the map is 1-Lipschitz and preserves
    norms. The channel count must be even."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[1] % 2:
            raise ValueError(f"GroupSort: expected an even number of channels in dim 1, got shape {tuple(x.shape)}")
        a, b = x.chunk(2, dim=1)
        return torch.cat([torch.maximum(a, b), torch.minimum(a, b)], dim=1)


class LipschitzAvgPool(nn.Module):
    """Average pool over non-overlapping k×k windows times k (the window sum over k, PyTorch's
    ``divisor_override=k``): by Cauchy–Schwarz |Σ_window x|/k ≤ ‖x_window‖₂, so
    ‖pool(x) − pool(x')‖ ≤ ‖x − x'‖ (1-Lipschitz), with equality for inputs constant on each
    window. (A plain average pool has Lipschitz constant 1/k.)"""

    def __init__(self, kernel_size: int = 2):
        super().__init__()
        check_sizes(kernel_size=kernel_size)
        self.kernel_size = kernel_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kernel_size
        return F.avg_pool2d(x, k, stride=k, divisor_override=k)


class _CachedOrthogonal(nn.Module):
    """The orthogonal matrices Q(weight, alpha) recomputed in training mode at every call and
    cached in eval mode, keyed by the tensors' versions (an optimizer step, or any in-place
    write, changes them) and the input size. In eval mode Q is computed without autograd: no
    gradient reaches weight or alpha (input gradients still flow)."""

    weight: nn.Parameter
    alpha: nn.Parameter

    def _init_parameters(self, shape: tuple[int, ...], fan_in: int, bias: bool) -> None:
        self.weight = nn.Parameter(torch.empty(shape))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # what nn.Conv2d / nn.Linear do
        self.alpha = nn.Parameter(self.weight.detach().norm().reshape(()).clone())
        self.bias = nn.Parameter(torch.empty(shape[0]).uniform_(-1, 1) / math.sqrt(fan_in)) if bias else None
        self._cache: tuple[tuple, torch.Tensor] | None = None

    def _matrices(self, extra: object) -> torch.Tensor:
        if self.training:
            self._cache = None
            return self._compute(extra)
        w, a = self.weight, self.alpha
        key = (w._version, a._version, w.data_ptr(), a.data_ptr(), w.dtype, w.device, extra)
        if self._cache is None or self._cache[0] != key:
            with torch.no_grad():
                self._cache = (key, self._compute(extra))
        return self._cache[1]

    def _compute(self, extra: object) -> torch.Tensor:
        raise NotImplementedError

    def train(self, mode: bool = True):
        self._cache = None
        return super().train(mode)


class CayleyConv2d(_CachedOrthogonal):
    """An orthogonal convolution by the Cayley transform, computed in the Fourier domain with
    circular padding (p = (k−1)//2 left/top, k//2 right/bottom; any k, odd or even).

    Input (B, in_channels, n, n) → (B, out_channels, n/stride, n/stride). out ≥ in: the
    convolution (without bias) preserves norms; out < in: co-isometric (1-Lipschitz). The
    parametrisation is α·W/‖W‖_F with α learnable, initialised to ‖W‖_F (so the layer starts
    from W itself, and rescaling W changes nothing).

    ``n``: the input size; None takes it from each input (square, at least k). ``stride=2``:
    an invertible space-to-depth (norm-preserving) then a stride-1 Cayley conv from
    4·in_channels with kernel max(1, k//2), as in the published code. The per-frequency
    matrices are cached in eval mode (see :class:`_CachedOrthogonal`).

    Examples:
        >>> _ = torch.manual_seed(0)
        >>> conv = CayleyConv2d(4, 8, 3, bias=False)
        >>> x = torch.randn(2, 4, 8, 8)
        >>> bool(torch.isclose(conv(x).norm(), x.norm(), rtol=1e-5))
        True
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, n: int | None = None,
                 stride: int = 1, bias: bool = True):
        super().__init__()
        check_sizes(in_channels=in_channels, out_channels=out_channels, kernel_size=kernel_size)
        if stride not in (1, 2) or isinstance(stride, bool):
            raise ValueError(f"stride={stride!r}: expected 1 or 2 (stride 2 is emulated by space-to-depth)")
        if n is not None:
            check_sizes(n=n)
            if stride == 2 and n % 2:
                raise ValueError(f"n={n}: stride 2 needs an even input size")
        self.in_channels, self.out_channels, self.stride, self.n = in_channels, out_channels, stride, n
        self.kernel_size = kernel_size if stride == 1 else max(1, kernel_size // 2)
        self.space_to_depth = SpaceToDepth(2) if stride == 2 else None
        c_in = in_channels * (4 if stride == 2 else 1)
        k = self.kernel_size
        if n is not None and k > n // stride:
            raise ValueError(f"kernel_size={kernel_size}: larger than the {n // stride}×{n // stride} input the conv "
                             f"sees (n={n}, stride={stride}); use a smaller kernel or a larger n")
        self._init_parameters((out_channels, c_in, k, k), c_in * k * k, bias)

    def _compute(self, n: int) -> torch.Tensor:
        return fc.cayley_conv_matrices(self.weight, n, self.alpha)

    def orthogonal_matrices(self, n: int | None = None) -> torch.Tensor:
        """The per-frequency matrices Q_f (n', n'//2 + 1, c_out, c_in) for the size n' the conv
        runs at (n/stride)."""
        n = n if n is not None else self.n
        if n is None:
            raise ValueError("n=None: the layer was built without an input size; pass n")
        return self._matrices(n // self.stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.is_complex() or not x.is_floating_point():
            raise TypeError(f"CayleyConv2d: expected a real floating-point input, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}; pass x.real or x.float()")
        if x.dim() != 4 or x.shape[1] != self.in_channels or x.shape[-1] != x.shape[-2]:
            raise ValueError(f"CayleyConv2d: expected a square input (B, {self.in_channels}, n, n), got shape "
                             f"{tuple(x.shape)}; crop or pad it to n×n (the conv is circular on an n×n grid)")
        if self.n is not None and x.shape[-1] != self.n:
            raise ValueError(f"CayleyConv2d: the layer was built for n={self.n}, got a {x.shape[-2]}×{x.shape[-1]} "
                             f"input; resize the input or build the layer with n={x.shape[-1]} (or n=None)")
        if self.space_to_depth is not None:
            x = self.space_to_depth(x)
        n = x.shape[-1]
        if self.kernel_size > n:
            raise ValueError(f"CayleyConv2d: kernel {self.kernel_size} is larger than the {n}×{n} input; use a "
                             f"larger input or a smaller kernel_size")
        y = fc.fft_circular_conv(x.to(self.weight.dtype), self._matrices(n)).to(x.dtype)
        return y if self.bias is None else y + self.bias.view(1, -1, 1, 1)


class CayleyLinear(_CachedOrthogonal):
    """y = Q x + b with Q the Cayley map of α·W/‖W‖_F (:func:`~structinit.functional.cayley_conv.
    semi_orthogonal_cayley`): out ≥ in, QᵀQ = I (norm-preserving); out < in, QQᵀ = I
    (co-isometric). α is learnable, initialised to ‖W‖_F; Q is cached in eval mode.

    Examples:
        >>> _ = torch.manual_seed(0)
        >>> lin = CayleyLinear(4, 6, bias=False)
        >>> x = torch.randn(3, 4)
        >>> torch.allclose(lin(x).norm(dim=1), x.norm(dim=1), atol=1e-5)
        True
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        check_sizes(in_features=in_features, out_features=out_features)
        self.in_features, self.out_features = in_features, out_features
        self._init_parameters((out_features, in_features), in_features, bias)

    def _compute(self, extra: object) -> torch.Tensor:
        return fc.semi_orthogonal_cayley(self.weight * (self.alpha / self.weight.norm()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_complex():
            raise TypeError(f"CayleyLinear: expected a real input, got {x.dtype}; pass x.real")
        return F.linear(x, self._matrices(None), self.bias)

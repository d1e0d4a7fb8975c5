"""Depthwise-conv filters as tensors, ``torch.nn.init`` style: every function returns a new
float32 tensor of shape (C, 1, k, k) (or a (k², k²) float64 covariance) and draws only from
``generator`` (a CPU ``torch.Generator``; a fresh one seeded from torch's global RNG if None).

Scaling (``norm``) of the hand-made filter families:
    * ``"sum"``: the taps of each filter sum to 1 (an averaging filter; an impulse is a 1).
    * ``"variance"``: each filter's squared norm is 1/3 = k² · 1/(3k²), the total variance of
      PyTorch's default depthwise init U(±1/k), so the signal scale after the conv matches it.

``num_filters`` (impulse, box, gaussian, random): None draws one filter per channel; an int n
draws n filters and channel c uses filter c % n (a fixed cycle, so channels c and c + n share
one). Impulse positions are drawn without replacement while n ≤ k², so the n filters differ.

Covariance filters (Trockman et al. 2023; notes section B): a filter f ∈ ℝ^{k²} (row-major taps)
is drawn from N(0, Σ) (:func:`sample_filters`), e.g. Σ = :func:`gaussian_kronecker_covariance`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from structinit.functional.linalg import psd_sqrt
from structinit.utils import check_choice, check_int, check_number, make_generator

NORMS = ("sum", "variance")


def _check_shape(channels: int, kernel_size: int, num_filters: int | None) -> int:
    check_int("channels", channels, low=1)
    check_int("kernel_size", kernel_size, low=1)
    if num_filters is None:
        return channels
    check_int("num_filters", num_filters, low=1)
    if num_filters > channels:
        raise ValueError(f"num_filters={num_filters}: more filters than the {channels} channels they are shared by "
                         f"(channel c uses filter c % n); pass at most {channels}, or None for one per channel")
    return num_filters


def _spread(filters: torch.Tensor, channels: int) -> torch.Tensor:
    """(n, k, k) distinct filters → (C, 1, k, k), channel c taking filter c % n."""
    idx = torch.arange(channels) % filters.shape[0]
    return filters[idx].unsqueeze(1).contiguous()


def _normalise(filters: torch.Tensor, norm: str) -> torch.Tensor:
    check_choice("norm", norm, NORMS)
    flat = filters.flatten(1)
    if norm == "sum":
        return filters / flat.sum(1).view(-1, 1, 1)
    return filters * torch.sqrt(1 / 3 / flat.pow(2).sum(1)).view(-1, 1, 1)


def impulse_filters(channels: int, kernel_size: int, *, num_filters: int | None = None, norm: str = "sum",
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """Filters with one tap ≠ 0 at a uniformly random position: 1 (``norm='sum'``) or 1/√3
    (``norm='variance'``). Shape (channels, 1, k, k).

    Examples:
        >>> f = impulse_filters(4, 3, generator=torch.Generator().manual_seed(0))
        >>> f.shape, f.flatten(1).sum(1).tolist()
        (torch.Size([4, 1, 3, 3]), [1.0, 1.0, 1.0, 1.0])
    """
    n = _check_shape(channels, kernel_size, num_filters)
    g, taps = make_generator(generator), kernel_size**2
    pos = torch.randperm(taps, generator=g)[:n] if n <= taps else torch.randint(taps, (n,), generator=g)
    out = torch.zeros(n, taps)
    out[torch.arange(n), pos] = 1.0
    return _spread(_normalise(out.view(n, kernel_size, kernel_size), norm), channels)


def box_filters(channels: int, kernel_size: int, *, taps: int = 3, num_filters: int | None = None,
                norm: str = "sum", generator: torch.Generator | None = None) -> torch.Tensor:
    """Filters with ``taps`` = N distinct random taps of equal value, 1/N (``norm='sum'``) or
    1/√(3N) (``norm='variance'``), the others 0. Shape (channels, 1, k, k); needs N ≤ k².

    Examples:
        >>> f = box_filters(2, 3, taps=4, generator=torch.Generator().manual_seed(0))
        >>> (f != 0).flatten(1).sum(1).tolist()
        [4, 4]
    """
    n = _check_shape(channels, kernel_size, num_filters)
    check_int("taps", taps, low=1, high=kernel_size**2)
    g = make_generator(generator)
    keys = torch.rand(n, kernel_size**2, generator=g)
    chosen = keys.argsort(1)[:, :taps]  # N distinct taps per filter
    out = torch.zeros(n, kernel_size**2).scatter_(1, chosen, 1.0)
    return _spread(_normalise(out.view(n, kernel_size, kernel_size), norm), channels)


def gaussian_filters(channels: int, kernel_size: int, *, sigma: float = 1.0, num_filters: int | None = None,
                     norm: str = "sum", generator: torch.Generator | None = None) -> torch.Tensor:
    """Isotropic Gaussian blobs f[i, j] ∝ exp(−((i − a)² + (j − b)²) / (2σ²)) centred on a
    uniformly random tap (a, b), scaled by ``norm``. Shape (channels, 1, k, k).

    Examples:
        >>> f = gaussian_filters(1, 5, sigma=1.0, generator=torch.Generator().manual_seed(0))
        >>> round(float(f.sum()), 6)
        1.0
    """
    n = _check_shape(channels, kernel_size, num_filters)
    check_number("sigma", sigma, low=0, low_open=True)
    g, k = make_generator(generator), kernel_size
    centre = torch.randint(k * k, (n,), generator=g)
    a, b = (centre // k).double().view(-1, 1, 1), (centre % k).double().view(-1, 1, 1)
    i = torch.arange(k, dtype=torch.float64)
    d2 = (i.view(1, -1, 1) - a) ** 2 + (i.view(1, 1, -1) - b) ** 2
    out = torch.exp(-d2 / (2 * float(sigma) ** 2))
    return _spread(_normalise(out, norm).float(), channels)


def random_filters(channels: int, kernel_size: int, *, num_filters: int | None = None,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """PyTorch's default depthwise init: taps U(−1/k, 1/k) (fan_in = k²), variance 1/(3k²).
    Shape (channels, 1, k, k).

    Examples:
        >>> f = random_filters(3, 5, generator=torch.Generator().manual_seed(0))
        >>> bool(f.abs().max() <= 1 / 5)
        True
    """
    n = _check_shape(channels, kernel_size, num_filters)
    g = make_generator(generator)
    out = (torch.rand(n, kernel_size, kernel_size, generator=g) * 2 - 1) / kernel_size
    return _spread(out, channels)


# --------------------------------------------------------------------------- covariances
def gaussian_kronecker_covariance(kernel_size: int, sigma: float, *, trace: float = 1 / 3) -> torch.Tensor:
    """Σ = c · G_σ ⊗ G_σ, (k², k²) float64, with G_σ[a, b] = exp(−(a − b)²/(2σ²)) and c
    chosen so that tr Σ = ``trace`` (default 1/3, PyTorch's default total filter variance).
    Stationary (depends on the tap offset only), separable (Kronecker rank 1) and PSD.

    Examples:
        >>> cov = gaussian_kronecker_covariance(3, 1.0)
        >>> cov.shape, round(float(cov.trace()), 6)
        (torch.Size([9, 9]), 0.333333)
    """
    k = check_int("kernel_size", kernel_size, low=1)
    s = check_number("sigma", sigma, low=0, low_open=True)
    t = check_number("trace", trace, low=0, low_open=True)
    i = torch.arange(k, dtype=torch.float64)
    gram = torch.exp(-((i[:, None] - i[None, :]) ** 2) / (2 * s * s))
    cov = torch.kron(gram, gram)
    return cov * (t / float(cov.trace()))


def depth_sigma(layer: int, depth: int, sigma0: float, v_sigma: float) -> float:
    """σ_l = σ₀ + v_σ · l / (D − 1) for layer l ∈ {0, …, D − 1} (σ₀ when D = 1): a linear,
    monotone schedule across depth. Raises if σ_l ≤ 0.

    Examples:
        >>> [depth_sigma(l, 3, 1.0, 0.5) for l in range(3)]
        [1.0, 1.25, 1.5]
    """
    d = check_int("depth", depth, low=1)
    check_int("layer", layer, low=0, high=d - 1)
    s0, v = check_number("sigma0", sigma0), check_number("v_sigma", v_sigma)
    sigma = s0 + v * (layer / (d - 1) if d > 1 else 0.0)
    if not sigma > 0:
        raise ValueError(f"sigma0={sigma0!r}, v_sigma={v_sigma!r}: layer {layer} of {d} gets σ = {sigma:g} ≤ 0; "
                         "use sigma0 > 0 and sigma0 + v_sigma > 0")
    return sigma


def _check_cov(cov: object) -> int:
    if not isinstance(cov, torch.Tensor) or cov.dim() != 2 or cov.shape[0] != cov.shape[1]:
        raise ValueError(f"cov: expected a square (k², k²) tensor, got {getattr(cov, 'shape', type(cov).__name__)}")
    k = math.isqrt(cov.shape[0])
    if k * k != cov.shape[0] or k == 0:
        raise ValueError(f"cov: size {cov.shape[0]} is not k² for an integer k ≥ 1; pass the covariance of k×k filters")
    if not torch.isfinite(cov).all():
        raise ValueError("cov contains NaN/inf; pass a finite covariance")
    return k


def sample_filters(cov: torch.Tensor, channels: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """``channels`` filters f ~ N(0, Σ) i.i.d.: f = Σ^{½} z, z ~ N(0, I), with Σ^{½} the
    symmetric PSD square root (:func:`~structinit.functional.linalg.psd_sqrt`; negative
    eigenvalues from round-off count as 0, so any symmetric PSD-up-to-round-off Σ works). Unlike a
    factor made of eigenvectors, Σ^{½} is the same on every machine, repeated eigenvalues and all.
    Σ: (k², k²); returns (channels, 1, k, k) float32.

    Examples:
        >>> f = sample_filters(gaussian_kronecker_covariance(3, 1.0), 8, generator=torch.Generator().manual_seed(0))
        >>> f.shape
        torch.Size([8, 1, 3, 3])
    """
    k = _check_cov(cov)
    check_int("channels", channels, low=1)
    g = make_generator(generator)
    z = torch.randn(channels, k * k, generator=g, dtype=torch.float64)
    return (z @ psd_sqrt(cov)).float().view(channels, 1, k, k)


def estimate_covariance(filters: torch.Tensor) -> torch.Tensor:
    """Σ̂ = Fᵀ F / h for h filters F (h, k²) (zero mean assumed, as in the paper); ``filters``
    is (h, 1, k, k) or (h, k, k). Returns (k², k²) float64.

    Examples:
        >>> estimate_covariance(torch.ones(4, 1, 2, 2)).shape
        torch.Size([4, 4])
    """
    if not isinstance(filters, torch.Tensor) or filters.dim() not in (3, 4) or filters.shape[-1] != filters.shape[-2]:
        raise ValueError(f"filters: expected (h, 1, k, k) or (h, k, k), got {getattr(filters, 'shape', filters)}")
    flat = filters.detach().double().reshape(filters.shape[0], -1)
    if filters.dim() == 4 and filters.shape[1] != 1:
        raise ValueError(f"filters: expected depthwise weights (h, 1, k, k), got {tuple(filters.shape)}")
    return flat.T @ flat / flat.shape[0]


def _interp2(t: torch.Tensor, k_new: int) -> torch.Tensor:
    """Bilinear resize (align_corners) of the last two dims of (..., k, k) to (k_new, k_new)."""
    lead = t.shape[:-2]
    out = F.interpolate(t.reshape(-1, 1, *t.shape[-2:]), size=(k_new, k_new), mode="bilinear", align_corners=True)
    return out.reshape(*lead, k_new, k_new)


def resize_covariance(cov: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """Σ of k×k filters → Σ' of k'×k' filters: Σ viewed as a 4-D (k, k, k, k) tensor is resized
    bilinearly (align_corners) over both tap pairs, rescaled to the same trace,
    re-symmetrised and projected onto the PSD cone (negative eigenvalues → 0). k' = k returns
    a copy of Σ unchanged.

    Examples:
        >>> cov = gaussian_kronecker_covariance(3, 1.0)
        >>> torch.equal(resize_covariance(cov, 3), cov), resize_covariance(cov, 5).shape
        (True, torch.Size([25, 25]))
    """
    k = _check_cov(cov)
    k_new = check_int("kernel_size", kernel_size, low=1)
    cov = cov.double()
    if k_new == k:
        return cov.clone()
    if k == 1:
        raise ValueError(f"kernel_size={k_new}: a 1×1 source covariance has no spatial structure to resize; "
                         "transfer from a source with kernel size ≥ 2")
    t = cov.reshape(k, k, k, k)  # [a, b, c, d]: tap (a, b) with tap (c, d)
    t = _interp2(t, k_new)  # over (c, d)
    t = _interp2(t.permute(2, 3, 0, 1), k_new).permute(2, 3, 0, 1)  # over (a, b)
    out = t.reshape(k_new * k_new, k_new * k_new)
    out = (out + out.T) / 2
    evals, evecs = torch.linalg.eigh(out)
    out = (evecs * evals.clamp_min(0)) @ evecs.T
    out = (out + out.T) / 2
    return out * (float(cov.trace()) / float(out.trace())) if float(out.trace()) > 0 else out


def relative_depth_map(source_depth: int, target_depth: int) -> list[int]:
    """Target layer l ↦ source layer round(l · (D_s − 1)/(D_t − 1)) (halves round up), so the
    first and last layers map onto each other; D_t = 1 maps to source layer 0.

    Examples:
        >>> relative_depth_map(4, 7)
        [0, 1, 1, 2, 2, 3, 3]
    """
    ds = check_int("source_depth", source_depth, low=1)
    dt = check_int("target_depth", target_depth, low=1)
    if dt == 1:
        return [0]
    return [math.floor(i * (ds - 1) / (dt - 1) + 0.5) for i in range(dt)]


# --------------------------------------------------------------------------- calibration
def fit_kronecker_sigma(cov: torch.Tensor, *, grid: torch.Tensor | None = None) -> tuple[float, float]:
    """The σ whose trace-normalised G_σ ⊗ G_σ (:func:`gaussian_kronecker_covariance`) is
    closest to the trace-normalised ``cov`` (k², k²) in Frobenius norm, and the relative
    residual ‖Σ̂ − Σ_σ‖_F / ‖Σ̂‖_F of that fit (0 for a covariance of the family; near 1 for
    one the family cannot describe). ``grid`` is the σ values searched (default 0.2 … 8,
    log-spaced, 400 points). Used to calibrate the ``covariance`` scheme's defaults from the
    filters of a trained model.

    Examples:
        >>> sigma, residual = fit_kronecker_sigma(gaussian_kronecker_covariance(5, 1.3))
        >>> abs(sigma - 1.3) < 0.02, residual < 0.01
        (True, True)
    """
    k = _check_cov(cov)
    target = cov.double() / float(cov.double().trace())
    sigmas = torch.logspace(math.log10(0.2), math.log10(8.0), 400, dtype=torch.float64) if grid is None else grid
    errors = torch.stack([torch.linalg.matrix_norm(target - gaussian_kronecker_covariance(k, float(s), trace=1.0))
                          for s in sigmas])
    best = int(errors.argmin())
    return float(sigmas[best]), float(errors[best] / torch.linalg.matrix_norm(target))


def fit_depth_schedule(sigmas: list[float]) -> tuple[float, float]:
    """(σ₀, v_σ) of the least-squares line σ_l ≈ σ₀ + v_σ · l/(D − 1) through per-layer σ's
    (:func:`depth_sigma`'s schedule); one layer gives (σ, 0).

    Examples:
        >>> fit_depth_schedule([1.0, 1.25, 1.5])
        (1.0, 0.5)
    """
    if not sigmas or not all(isinstance(s, (int, float)) and s > 0 for s in sigmas):
        raise ValueError(f"sigmas: expected a non-empty list of positive numbers, got {sigmas!r}")
    d = len(sigmas)
    if d == 1:
        return float(sigmas[0]), 0.0
    t = torch.arange(d, dtype=torch.float64) / (d - 1)
    design = torch.stack([torch.ones(d, dtype=torch.float64), t], 1)
    coef = torch.linalg.lstsq(design, torch.tensor(sigmas, dtype=torch.float64)[:, None]).solution.flatten()
    return round(float(coef[0]), 12), round(float(coef[1]), 12)

"""How similar two layers' representations are: linear centred kernel alignment (CKA,
Kornblith et al. 2019), on one full batch or accumulated over minibatches with the unbiased
estimator of Nguyen, Raghu & Kornblith (2021), and a layer × layer CKA matrix between two
models (or a model and itself) on the same images.

For a model, a layer's representation of an image is the (T, D) tokens its attention layer
receives (in a pre-norm ViT: LayerNorm of the residual stream; prefix tokens included),
flattened to one T·D vector per image as Raghu et al. (2021) do for ViTs. The token mean
(one D vector per image) is the alternative, ``tokens='mean'``. A model without attention but
with token-mixing MLPs (an MLP-Mixer) is read the same way at each token-mixing MLP's input.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from structinit.adapters import find_attention_layers, find_token_mixing_layers, is_token_mixing, select_layers
from structinit.analysis.capture import check_all_called, forward_then_remove, run_with_hooks
from structinit.utils import check_choice, check_int
from structinit.utils.checks import show

MIN_BATCH = 4  # HSIC_1 divides by n(n − 3) and (n − 1)(n − 2): it needs n > 3 examples


def _features(name: str, x) -> torch.Tensor:
    """``x`` as a finite (n, p) float64 matrix, or an error naming ``name``."""
    if not isinstance(x, torch.Tensor) or x.ndim != 2 or x.is_complex() or x.dtype == torch.bool:
        what = f"a tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else show(x)
        raise ValueError(f"{name}: expected a 2-D (examples, features) matrix, got {what}; "
                         "flatten each example's features first, e.g. x.flatten(1)")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} contains NaN/Inf values; CKA needs finite features")
    return x.detach().double()


def _check_same_n(x: torch.Tensor, y: torch.Tensor, names=("x", "y")) -> None:
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"{names[0]} has {x.shape[0]} examples (rows) but {names[1]} has {y.shape[0]}; CKA "
                         "compares two representations of the same examples, row i of both being example i")


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    r"""Linear CKA between two representations of the same n examples (Kornblith et al. 2019).

    With column-centred X̄ = X − 1μ_Xᵀ (n, p), Ȳ (n, q) and K = X̄X̄ᵀ, L = ȲȲᵀ,

        CKA(X, Y) = ⟨K, L⟩_F / (‖K‖_F ‖L‖_F) = ‖ȲᵀX̄‖²_F / (‖X̄ᵀX̄‖_F ‖ȲᵀȲ‖_F) ∈ [0, 1],

    HSIC(K, L) / √(HSIC(K, K) · HSIC(L, L)) with the biased HSIC estimator. It is 1 for
    Y = X·Q·c (Q orthogonal, c ≠ 0) and invariant to such transforms of either argument.
    Computed in float64, in whichever of the n×n and feature-space forms is smaller.

    Args:
        x: (n, p) features, one row per example.
        y: (n, q) features of the same examples.

    Returns:
        A 0-dim float64 tensor.

    Examples:
        >>> x = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
        >>> q, _ = torch.linalg.qr(torch.randn(8, 8, generator=torch.Generator().manual_seed(1)))
        >>> round(linear_cka(x, 3 * x @ q).item(), 6)
        1.0
    """
    x, y = _features("x", x), _features("y", y)
    _check_same_n(x, y)
    raw, (x, y) = (x, y), (x - x.mean(0), y - y.mean(0))
    for name, v, before in (("x", x, raw[0]), ("y", y, raw[1])):
        # Relative test: the mean of equal float rows need not be exact, leaving rounding noise.
        if not v.abs().amax() > 1e-12 * before.abs().amax():
            raise ValueError(f"{name} has the same row for every example (no variance after centring); CKA is "
                             "undefined for a constant representation")
    n, p, q = x.shape[0], x.shape[1], y.shape[1]
    if n * n <= p * q:  # n×n Grams are the smaller objects
        k, lg = x @ x.T, y @ y.T
        return (k * lg).sum() / (k.norm() * lg.norm())
    return (y.T @ x).square().sum() / ((x.T @ x).norm() * (y.T @ y).norm())


def _pairwise_hsic(ks: torch.Tensor, ls: torch.Tensor) -> torch.Tensor:
    """HSIC_1 of every pair of Grams of two stacks (A, n, n) and (B, n, n) → (A, B)."""
    n = ks.shape[-1]
    ks = ks - torch.diag_embed(ks.diagonal(dim1=-2, dim2=-1))  # K̃: the diagonal zeroed
    ls = ls - torch.diag_embed(ls.diagonal(dim1=-2, dim2=-1))
    trace = torch.einsum("aij,bij->ab", ks, ls)  # tr(K̃L̃), both symmetric
    sums = ks.sum((1, 2))[:, None] * ls.sum((1, 2))[None]  # (1ᵀK̃1)(1ᵀL̃1)
    cross = ks.sum(2) @ ls.sum(2).T  # 1ᵀK̃L̃1 = (K̃1)·(L̃1)
    return (trace + sums / ((n - 1) * (n - 2)) - 2 * cross / (n - 2)) / (n * (n - 3))


def unbiased_hsic(gram_k: torch.Tensor, gram_l: torch.Tensor) -> torch.Tensor:
    r"""The unbiased HSIC estimator HSIC_1 of Song et al. (2012) of two n×n Gram matrices.

    With K̃, L̃ the Grams with their diagonals set to zero and 1 the all-ones vector,

        HSIC_1(K, L) = 1/(n(n−3)) · [ tr(K̃L̃) + (1ᵀK̃1)(1ᵀL̃1)/((n−1)(n−2)) − 2/(n−2) · 1ᵀK̃L̃1 ],

    an unbiased estimate of HSIC for n > 3 examples (a U-statistic over distinct 4-tuples);
    for linear kernels it is unchanged by a shift of the features, so they need no centring,
    and its mean over minibatches is unbiased too.

    Args:
        gram_k, gram_l: (n, n) symmetric Gram matrices of the same n examples, e.g. K = XXᵀ.

    Returns:
        A 0-dim float64 tensor (it may be slightly negative for independent features).

    Examples:
        >>> x = torch.randn(6, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        >>> k, k_shifted = x @ x.T, (x + 5) @ (x + 5).T
        >>> bool(torch.isclose(unbiased_hsic(k, k), unbiased_hsic(k_shifted, k)))
        True
    """
    grams = []
    for name, g in (("gram_k", gram_k), ("gram_l", gram_l)):
        if not isinstance(g, torch.Tensor) or g.ndim != 2 or g.shape[0] != g.shape[1] or g.shape[0] < MIN_BATCH:
            what = f"shape {tuple(g.shape)}" if isinstance(g, torch.Tensor) else show(g)
            raise ValueError(f"{name}: expected an (n, n) Gram matrix with n ≥ {MIN_BATCH} examples (HSIC_1 needs "
                             f"n > 3), got {what}")
        grams.append(_features(name, g))
    _check_same_n(*grams, ("gram_k", "gram_l"))
    return _pairwise_hsic(grams[0][None], grams[1][None])[0, 0]


class MinibatchCKA:
    r"""Linear CKA of every pair of layers, accumulated over minibatches (Nguyen, Raghu &
    Kornblith 2021).

    For each minibatch b with features X_i (layer i of A) and Y_j (layer j of B), Grams
    K_i = X_iX_iᵀ, L_j = Y_jY_jᵀ enter the unbiased estimator (:func:`unbiased_hsic`), and

        CKA_ij = mean_b HSIC_1(K_i, L_j) / √(mean_b HSIC_1(K_i, K_i) · mean_b HSIC_1(L_j, L_j)).

    Its memory is the A×B accumulators, not the examples; with many batches it approaches the
    population CKA, which the full-batch :func:`linear_cka` only reaches for n ≫ features.
    A pair whose denominator is not positive (a constant layer) gets NaN.

    Examples:
        >>> cka = MinibatchCKA()
        >>> g = torch.Generator().manual_seed(0)
        >>> for _ in range(5):
        ...     x = torch.randn(16, 8, generator=g)
        ...     cka.update([x, x[:, :4]], [2 * x])
        >>> cka.compute().shape, round(cka.compute()[0, 0].item(), 6)
        (torch.Size([2, 1]), 1.0)
    """

    def __init__(self) -> None:
        self.batches = 0
        self._xy = self._xx = self._yy = None

    def update(self, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> None:
        """Add one minibatch: ``xs`` the (n, p_i) features of each layer of A, ``ys`` the
        (n, q_j) features of each layer of B, all for the same n ≥ 4 examples."""
        xs, ys = self._layers("xs", xs), self._layers("ys", ys)
        for name, f in zip(("xs[0]", "ys[0]"), (xs[0], ys[0])):
            if f.shape[0] < MIN_BATCH:
                raise ValueError(f"{name} has {f.shape[0]} examples, but the unbiased HSIC estimator needs a "
                                 f"minibatch of at least {MIN_BATCH}; use larger batches")
        self._add(torch.stack([x @ x.T for x in xs]), torch.stack([y @ y.T for y in ys]))

    def _layers(self, name: str, fs) -> list[torch.Tensor]:
        if isinstance(fs, torch.Tensor):
            fs = [fs]
        if not isinstance(fs, Sequence) or not fs:
            raise ValueError(f"{name}={show(fs)}: expected a non-empty list of (n, features) tensors, one per layer")
        out = [_features(f"{name}[{i}]", f) for i, f in enumerate(fs)]
        for i, f in enumerate(out):
            _check_same_n(out[0], f, (f"{name}[0]", f"{name}[{i}]"))
        return out

    def _add(self, ks: torch.Tensor, ls: torch.Tensor) -> None:
        """Add one minibatch given as Gram stacks (A, n, n) and (B, n, n) of the same n examples."""
        _check_same_n(ks[0], ls[0], ("xs[0]", "ys[0]"))
        if self._xy is not None and self._xy.shape != (ks.shape[0], ls.shape[0]):
            raise ValueError(f"this minibatch has {ks.shape[0]} × {ls.shape[0]} layers, earlier ones had "
                             f"{self._xy.shape[0]} × {self._xy.shape[1]}; pass the same layers every time")
        xy = _pairwise_hsic(ks, ls)
        xx, yy = _pairwise_hsic(ks, ks).diagonal(), _pairwise_hsic(ls, ls).diagonal()
        if self._xy is None:
            self._xy, self._xx, self._yy = xy, xx, yy
        else:
            self._xy, self._xx, self._yy = self._xy + xy, self._xx + xx, self._yy + yy
        self.batches += 1

    def compute(self) -> torch.Tensor:
        """The (layers of A × layers of B) float64 CKA matrix of the minibatches so far."""
        if self._xy is None:
            raise RuntimeError("MinibatchCKA.compute() before any update(); add at least one minibatch")
        # The 1/batches of the three means cancels.
        denom = self._xx[:, None] * self._yy[None]
        return torch.where(denom > 0, self._xy / denom.clamp_min(1e-300).sqrt(), torch.nan)


def _layers(model: nn.Module, layers: Sequence[int] | None) -> list:
    """The chosen (name, attention adapter) pairs, or for a Mixer its (name, token-mixing MLP)."""
    if not any(is_token_mixing(m) for m in model.modules()):
        return select_layers(find_attention_layers(model), layers)
    return select_layers(find_token_mixing_layers(model), layers, kind="token-mixing")


def _layer_grams(model: nn.Module, chosen, images: torch.Tensor, tokens: str) -> torch.Tensor:
    """(layers, B, B) Grams of the flattened (or token-mean) input of each chosen layer."""
    grams: list[torch.Tensor | None] = [None] * len(chosen)

    def keep(i: int, x: torch.Tensor) -> None:
        # A windowed layer (Swin) gets (B·windows, T, D), image-major: one row per image again.
        x = x.double().reshape(len(images), -1, x.shape[-1])
        f = x.flatten(1) if tokens == "flatten" else x.mean(1)  # (B, T·D) or (B, D)
        grams[i] = f @ f.T

    if chosen and isinstance(chosen[0][1], nn.Module):  # token-mixing MLPs: each is called on (B, D, T)
        forward_then_remove(model, images, [
            mlp.register_forward_pre_hook(lambda m, args, i=i: keep(i, args[0].transpose(1, 2).detach()))
            for i, (_, mlp) in enumerate(chosen)])
    else:
        run_with_hooks(model, images, chosen, keep)
    check_all_called(chosen, [g is not None for g in grams])
    return torch.stack(grams)


@torch.no_grad()
def cka_matrix(
    model_a: nn.Module,
    model_b: nn.Module,
    images: torch.Tensor,
    *,
    batch_size: int = 64,
    layers_a: Sequence[int] | None = None,
    layers_b: Sequence[int] | None = None,
    tokens: str = "flatten",
) -> torch.Tensor:
    """Minibatch linear CKA between every attention layer's input (token-mixing MLP's, for a
    Mixer) in ``model_a`` and in ``model_b`` on the same ``images`` (:class:`MinibatchCKA`).

    Representations as in the module doc, ``tokens`` 'flatten' or 'mean' (a windowed layer's
    windows of each image taken together); the two models may differ in depth, width and token
    count. Both run in eval mode on the same batches of ``batch_size`` ≥ 4 images; a last batch
    of fewer than 4 is merged into the one before. Only the B×B Grams of each batch are kept.

    Returns:
        (len(layers_a), len(layers_b)) float64, entry [i, j] the CKA of layer i of A with layer
        j of B; a model against itself has a diagonal of 1.

    Examples:
        >>> model = structinit.create_model("vit_micro_patch2_16")
        >>> m = cka_matrix(model, model, torch.randn(16, 3, 16, 16), batch_size=8)
        >>> m.shape, [round(v, 6) for v in m.diagonal().tolist()]
        (torch.Size([2, 2]), [1.0, 1.0])
    """
    tokens = check_choice("tokens", tokens, ("flatten", "mean"))
    batch_size = check_int("batch_size", batch_size, low=MIN_BATCH)
    if not isinstance(images, torch.Tensor) or images.ndim < 1 or images.shape[0] < MIN_BATCH:
        raise ValueError(f"images={show(images)}: expected a tensor of at least {MIN_BATCH} images along dim 0 "
                         "(the unbiased HSIC estimator needs n > 3 per batch)")
    chosen_a, chosen_b = _layers(model_a, layers_a), _layers(model_b, layers_b)
    n = images.shape[0]
    starts = list(range(0, n, batch_size))
    if len(starts) > 1 and n - starts[-1] < MIN_BATCH:
        starts.pop()  # the short remainder joins the previous batch
    ends = [*starts[1:], n]
    same = model_b is model_a and [name for name, _ in chosen_b] == [name for name, _ in chosen_a]
    cka = MinibatchCKA()
    modes = [(m, m.training) for m in (model_a, model_b)]
    try:
        for m, _ in modes:
            m.eval()
        for s, e in zip(starts, ends):
            ks = _layer_grams(model_a, chosen_a, images[s:e], tokens)
            cka._add(ks, ks if same else _layer_grams(model_b, chosen_b, images[s:e], tokens))
    finally:
        for m, was_training in reversed(modes):
            m.train(was_training)
    return cka.compute()

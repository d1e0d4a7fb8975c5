r"""Gradient-descent impulse attention (the 2024 method), reproduced faithfully.

All heads jointly: Q_h ∈ ℝ^{D×r}, K_h ∈ ℝ^{r×D}, initialised U(−1, 1)·(r·heads)^{−½}.
Minimise the mean squared error between softmax(X̃ Q_h K_h X̃ᵀ / √r) and the zero-padded
impulse matrices H_h with Adam (lr 1e-4) for 10,000 steps; every 100 steps (step 0
included) rescale each column of Q_h (length D) and of K_h (length r) to the mean column
norm of the initial Q. The periodic rescaling caps the logits, so the fitted maps stay soft.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from structinit.functional.targets import Offset, impulse_matrix

Factors = tuple[torch.Tensor, torch.Tensor]  # Wq, Wk of shape (heads, D, head_dim)


def gd_qk(x: torch.Tensor, grid: tuple[int, int], offsets: list[Offset], head_dim: int, *,
    generator: torch.Generator | None = None, steps: int = 10_000, lr: float = 1e-4, renorm_every: int = 100,
    softmax_scale: float | None = None, callback: Callable[[int, float], None] | None = None) -> Factors:
    """Wq, Wk (heads, D, head_dim) fitted on pseudo input ``x`` (N×D), float32.
    ``callback(step, loss)`` is called every ``renorm_every`` steps (for progress/benchmarks)."""
    if steps < 0:
        raise ValueError(f"steps={steps}: must be ≥ 0")
    heads = len(offsets)
    d = x.shape[1]
    x = x.float()
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    target = torch.stack([impulse_matrix(grid, off) for off in offsets])
    bound = (head_dim * heads) ** -0.5
    q = ((torch.rand(heads, d, head_dim, generator=generator) * 2 - 1) * bound).requires_grad_()
    k = ((torch.rand(heads, head_dim, d, generator=generator) * 2 - 1) * bound).requires_grad_()
    col_norm = q.detach().norm(dim=1).mean()
    opt = torch.optim.Adam([q, k], lr=lr)
    for step in range(steps):
        if step % renorm_every == 0:
            with torch.no_grad():
                q.mul_(col_norm / q.norm(dim=1, keepdim=True).clamp_min(1e-12))
                k.mul_(col_norm / k.norm(dim=1, keepdim=True).clamp_min(1e-12))
        logits = (x @ q) @ (k @ x.T) * scale
        loss = torch.nn.functional.mse_loss(logits.softmax(-1), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if callback is not None and step % renorm_every == 0:
            callback(step, float(loss))
    return q.detach().clone(), k.detach().transpose(1, 2).clone()

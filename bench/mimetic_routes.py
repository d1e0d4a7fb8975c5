"""Routes to the mimetic init's per-head products W_q W_kᵀ = best rank-r approximation of
M = αZ + βI, timed on one layer of a ViT-B/16 (D 768, 12 heads, r 64) on 2 threads.

- ``svd f64, head by head``: the published recipe, one dense float64 SVD per head.
- ``svd f64, batched``: the same SVDs in one batched call.
- ``svd f32, batched``: in float32 (error: the product against the float64 truncation).
- ``svd_lowrank (randomized)``: ``torch.svd_lowrank`` with q = r + 8 and 2 power iterations:
  not exact (error: its product against the exact truncation, relative).
- ``circular (closed form)``: ``noise='circular'``: Z a random normal matrix whose truncation
  is known in closed form (``structinit.functional.mimetic.circular_factors``); exact for its
  own M (error: against the SVD truncation of that M, on one head).

    .venv/bin/python bench/mimetic_routes.py
"""

from __future__ import annotations

import argparse

import torch
from common import median_seconds

from structinit.functional.mimetic import circular_factors, mimetic_noise


def truncation(m: torch.Tensor, r: int) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(m)
    return (u[..., :r] * s[..., None, :r]) @ vh[..., :r, :]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    d, h, r = args.dim, args.heads, args.dim // args.heads
    gen = torch.Generator().manual_seed(0)
    ms = torch.stack([0.7 * mimetic_noise(d, generator=gen) + 0.7 * torch.eye(d, dtype=torch.float64)
                      for _ in range(h)])
    exact = truncation(ms, r)

    def rel(p: torch.Tensor) -> float:
        return ((p.double() - exact).norm() / exact.norm()).item()

    rows = [
        ("svd f64, head by head", lambda: [torch.linalg.svd(m) for m in ms], 0.0),
        ("svd f64, batched", lambda: torch.linalg.svd(ms), 0.0),
        ("svd f32, batched", lambda: torch.linalg.svd(ms.float()), rel(truncation(ms.float(), r))),
    ]
    lowrank = lambda: torch.svd_lowrank(ms, q=r + 8, niter=2)
    u, s, v = lowrank()
    approx = (u[..., :r] * s[..., None, :r]) @ v[..., :r].transpose(-1, -2)
    rows.append(("svd_lowrank (randomized)", lowrank, rel(approx)))
    left, right, m = circular_factors(d, r, 0.7, 0.7, with_target=True, generator=torch.Generator().manual_seed(1))
    err = ((left[0] @ right[0] - truncation(m[0], r)).norm() / truncation(m[0], r).norm()).item()
    rows.append(("circular (closed form)", lambda: circular_factors(d, r, 0.7, 0.7, heads=h, generator=gen), err))
    print(f"| route (one layer: D {d}, {h} heads, r {r}) | seconds per layer | × circular | relative error |")
    print("|---|---:|---:|---:|")
    times = {name: median_seconds(fn, args.repeats) for name, fn, _ in rows}
    base = times["circular (closed form)"]
    for name, _, error in rows:
        print(f"| {name} | {times[name]:.4f} | {times[name] / base:.0f} | {error:.1e} |")


if __name__ == "__main__":
    main()

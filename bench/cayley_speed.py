"""Speed of the Cayley orthogonal convolution against nn.Conv2d at the KWLarge layer sizes
(docs/results/speed.md#cayley-convolutions): per conv of ``kwlarge_cpu`` and ``kwlarge`` on
32×32 inputs, forward+backward of ``CayleyConv2d`` against the plain circular-padded conv of
the same model built with ``conv="plain"``; the eval forward with the per-frequency matrices
recomputed and cached; and the per-frequency Cayley solve written three ways (``inv``, the
library's; ``solve``; ``lu``). Each cell is the median of ``--repeats`` timings.

    .venv/bin/python bench/cayley_speed.py              # batch 128, 2 threads
    .venv/bin/python bench/cayley_speed.py --quick      # batch 32, 1 thread, a few repeats (a smoke run)
"""

from __future__ import annotations

import argparse
from collections import Counter
from functools import partial

import torch
from common import median_seconds

from structinit.functional import cayley_conv as fc
from structinit.models import create_model

MODELS = {"kwlarge_cpu": (16, 32), "kwlarge": (32, 64)}  # each KWLarge's channels (c1, c2)
timed = partial(median_seconds, warmup=2)


def layers(model: str) -> list[tuple[str, int, int, int]]:
    """(label, c_in, input size n, stride) of the four convs of KWLarge ``model`` on 32×32."""
    c1, c2 = MODELS[model]
    return [(f"conv1 3→{c1}", 3, 32, 1), (f"conv2 {c1}→{c1} s2", c1, 32, 2),
            (f"conv3 {c1}→{c2}", c1, 16, 1), (f"conv4 {c2}→{c2} s2", c2, 16, 2)]


def cayley_variant(how: str):
    """semi_orthogonal_cayley for c_out ≥ c_in written with ``how`` (inv | solve | lu)."""
    def q(w: torch.Tensor) -> torch.Tensor:
        c_out, c_in = w.shape[-2:]
        if c_in > c_out:
            return q(w.mT).mT
        u, v = w[..., :c_in, :], w[..., c_in:, :]
        eye = torch.eye(c_in, dtype=w.dtype, device=w.device)
        a = u - u.mH + v.mH @ v
        if how == "inv":
            inv = torch.linalg.inv(eye + a)
            return torch.cat([inv @ (eye - a), -2 * v @ inv], dim=-2)
        if how == "solve":
            return torch.cat([torch.linalg.solve(eye + a, eye - a),
                              -2 * torch.linalg.solve(eye + a, v, left=False)], dim=-2)
        lu, piv = torch.linalg.lu_factor(eye + a)
        return torch.cat([torch.linalg.lu_solve(lu, piv, eye - a),
                          -2 * torch.linalg.lu_solve(lu, piv, v, left=False)], dim=-2)
    return q


def measure(model: str, batch: int, repeats: int) -> list[dict]:
    rows = []
    torch.manual_seed(0)
    # the model's own convs: KWLarge puts one at every other index (a GroupSort between)
    cayley_model, plain_model = create_model(model), create_model(model, conv="plain")
    for i, (name, c_in, n, stride) in enumerate(layers(model)):
        cayley, plain = cayley_model[2 * i], plain_model[2 * i]
        x = torch.randn(batch, c_in, n, n, requires_grad=True)
        step = lambda layer: lambda: layer(x).square().mean().backward()
        row = {"layer": name, "train_cayley": timed(step(cayley), repeats), "train_plain": timed(step(plain), repeats)}
        xe = x.detach()
        cayley.train()
        with torch.no_grad():
            row["eval_nocache"] = timed(lambda: cayley(xe), repeats)  # train mode: Q recomputed each call
            cayley.eval()
            row["eval_cached"] = timed(lambda: cayley(xe), repeats)
            row["eval_plain"] = timed(lambda: plain(xe), repeats)
        w_hat = fc.fft_conv_weight(cayley.weight.detach(), n // stride)
        ref = fc.semi_orthogonal_cayley(w_hat)
        for how in ("inv", "solve", "lu"):
            f = cayley_variant(how)
            assert torch.allclose(f(w_hat), ref, atol=1e-4), how
            w = w_hat.clone().requires_grad_(True)
            row[f"solve_{how}"] = timed(lambda: f(w).abs().sum().backward(), repeats)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="kwlarge_cpu,kwlarge")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="batch 32, 1 thread, 3 repeats: a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.threads, args.repeats = 32, 1, 3
    torch.set_num_threads(args.threads)
    print(f"batch {args.batch}, {args.threads} thread(s), median of {args.repeats}; times in ms\n")
    print("| model | layer | fwd+bwd Cayley | fwd+bwd Conv2d | ratio | eval fwd recomputed | eval fwd cached "
          "| eval fwd Conv2d | cached ratio | Cayley solve fwd+bwd: inv | solve | lu |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    totals = {}
    for model in args.models.split(","):
        for r in measure(model, args.batch, args.repeats):
            ms = {k: 1e3 * v for k, v in r.items() if k != "layer"}
            totals.setdefault(model, Counter()).update(ms)  # Counter.update adds: the four convs' sums
            print(f"| {model} | {r['layer']} | {ms['train_cayley']:.2f} | {ms['train_plain']:.2f} | "
                  f"{ms['train_cayley'] / ms['train_plain']:.1f}× | {ms['eval_nocache']:.2f} | {ms['eval_cached']:.2f}"
                  f" | {ms['eval_plain']:.2f} | {ms['eval_cached'] / ms['eval_plain']:.1f}× | {ms['solve_inv']:.2f} | "
                  f"{ms['solve_solve']:.2f} | {ms['solve_lu']:.2f} |")
    for model, t in totals.items():
        print(f"\n{model}, all four convs: fwd+bwd {t['train_cayley'] / t['train_plain']:.1f}× Conv2d; eval forward "
              f"{t['eval_nocache'] / t['eval_cached']:.1f}× faster cached ({t['eval_cached'] / t['eval_plain']:.1f}× "
              f"Conv2d); Cayley solve inv {t['solve_inv']:.1f} ms, solve {t['solve_solve']:.1f} ms, "
              f"lu {t['solve_lu']:.1f} ms")


if __name__ == "__main__":
    main()

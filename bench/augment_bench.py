"""Throughput of the batch augmentations (structinit.augment) on a CIFAR-sized uint8 batch.

Prints images/s (median of ``--repeats`` timed calls after one warm-up call) for each config,
on the CPU by default; ``--device cuda`` times it on a GPU (synchronised).

    .venv/bin/python bench/augment_bench.py
    .venv/bin/python bench/augment_bench.py --batch 512 --device cuda
"""

from __future__ import annotations

import argparse

import torch
from common import median_seconds

from structinit.augment import Augment

CONFIGS = ("crop4", "flip", "crop4,flip", "ra2-9-0.5", "ra2-9-0.5,crop4,flip")


def images_per_second(aug: Augment, x: torch.Tensor, repeats: int) -> float:
    generator = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if x.is_cuda else None
    return x.shape[0] / median_seconds(lambda: aug(x, generator), repeats, sync=sync)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--size", type=int, default=32, help="image height and width")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    x = torch.randint(0, 256, (args.batch, 3, args.size, args.size), dtype=torch.uint8,
                      generator=torch.Generator().manual_seed(0)).to(args.device)  # fmt: skip
    threads = torch.get_num_threads()
    print(f"batch {tuple(x.shape)} uint8 on {args.device}, {threads} CPU threads, torch {torch.__version__}")
    print(f"{'augment':<24}{'images/s':>12}{'ms/batch':>10}")
    for spec in CONFIGS:
        rate = images_per_second(Augment.parse(spec), x, args.repeats)
        print(f"{spec:<24}{rate:>12,.0f}{1000 * args.batch / rate:>10.2f}")


if __name__ == "__main__":
    main()

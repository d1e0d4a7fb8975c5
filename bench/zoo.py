"""The zoo (docs/results/zoo.md): structinit's attention inits, with no hints, on the ViTs of
``bench/zoo_catalogue.py``, each built from code by its own package. Per model × scheme: ✓ and
the seconds of ``structinit.init_`` (for impulse also the argmax hit on real images, layer 1 /
mean over layers), or ✗ and the error's first sentence; and the modules left alone.

    .venv-zoo/bin/python bench/zoo.py                      # needs bash scripts/setup_zoo.sh
    .venv-zoo/bin/python bench/zoo.py --models tv_vit_b_16 --schemes impulse
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from common import DATA_DIR
from torch import nn
from zoo_catalogue import BY_NAME, CATALOGUE, ZooModel  # noqa: F401  (CATALOGUE: re-exported for tests/zoo)

import structinit

SCHEMES = ("impulse", "mimetic", "timm", "pytorch", "jax", "xavier")
CIFAR = Path(DATA_DIR) / "cifar-10-batches-py"


def build(entry: ZooModel, seed: int = 0) -> nn.Module:
    """``entry``'s model with its package's default init, seeded, in eval mode."""
    torch.manual_seed(seed)
    return entry.build().eval()


# -- real images ---------------------------------------------------------------------------

def real_images(n: int, size: int, cifar_dir: Path = CIFAR) -> tuple[torch.Tensor, str]:
    """(n, 3, size, size) float32 real images, standardised, and where they came from: the first
    ``n`` CIFAR-10 test images or, without CIFAR-10, sklearn's 8×8 digits; bilinear resize to ``size``."""
    if (cifar_dir / "test_batch").is_file():
        from structinit.data import load_dataset  # the library's safe loader: never unpickles code

        x, source = load_dataset("cifar10", cifar_dir, "test").images[:n].float() / 255, "CIFAR-10 test"
    else:
        from sklearn.datasets import load_digits

        x = torch.tensor(load_digits().images[:n], dtype=torch.float32)[:, None].repeat(1, 3, 1, 1) / 16
        source = "sklearn digits"
    x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
    return (x - x.mean()) / x.std(), source


# -- one model × scheme ----------------------------------------------------------------------

@dataclass
class Cell:
    ok: bool
    seconds: float = float("nan")
    error: str = ""
    hit_first: float = float("nan")
    hit_mean: float = float("nan")
    skipped: tuple[str, ...] = ()  # modules the scheme left alone (attention-pooling heads)


def run_cell(model: nn.Module, scheme: str, images: torch.Tensor | None, seed: int = 0,
             options: dict | None = None) -> Cell:
    """``init_(model, scheme, seed=seed, **options)`` timed; for impulse with ``images`` its
    real-image hit."""
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # what was left alone is read from the init record below
            structinit.init_(model, scheme, seed=seed, **(options or {}))
    except Exception as err:  # the table reports every failure, it does not stop at one
        return Cell(False, error=f"{type(err).__name__}: {str(err).splitlines()[0]}")
    cell = Cell(True, time.perf_counter() - start)
    record = structinit.get_record(model, "init") or {}
    cell.skipped = tuple(name for name, _ in record.get("skipped", ()))
    if scheme == "impulse" and images is not None:
        summary = structinit.fidelity_summary(structinit.impulse_fidelity(model, images, batch_size=8))
        cell.hit_first, cell.hit_mean = summary.hit_first, summary.hit_mean
    return cell


def run_model(entry: ZooModel, schemes, n_images: int, seed: int = 0) -> dict[str, Cell]:
    """Every scheme on a fresh copy of ``entry``'s model (one build, copied per scheme)."""
    base = build(entry, seed)
    images, _ = real_images(n_images, entry.image_size) if n_images else (None, "")
    return {s: run_cell(copy.deepcopy(base), s, images, seed, entry.options.get(s)) for s in schemes}


# -- the table -------------------------------------------------------------------------------

def format_cell(scheme: str, cell: Cell) -> str:
    if not cell.ok:  # the error's first sentence: enough to say why in a table cell
        error = cell.error.replace("|", "/")
        return f"✗ {error.split(': ', 1)[0]}: {error.split(': ', 1)[-1].split(', as ')[0].split('; ')[0]}"
    text = f"✓ {cell.seconds:.2f} s"
    if scheme == "impulse" and cell.hit_first == cell.hit_first:
        text += f" · hit {cell.hit_first:.3f} / {cell.hit_mean:.3f}"
    return text


def table(rows: dict[str, dict[str, Cell]], schemes) -> str:
    head = "| model | package | " + " | ".join(f"`{s}`" for s in schemes) + " | left alone |"
    lines = [head, "|---|---|" + "---|" * len(schemes) + "---|"]
    for name, cells in rows.items():
        entry = BY_NAME[name]
        skipped = sorted({n for c in cells.values() for n in c.skipped})
        lines.append(f"| `{name}` ({entry.what}) | {entry.package} | "
                     + " | ".join(format_cell(s, cells[s]) for s in schemes)
                     + f" | {', '.join(f'`{n}`' for n in skipped) or '–'} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(BY_NAME), help="comma-separated catalogue names")
    ap.add_argument("--schemes", default="impulse,mimetic", help=f"comma-separated, of {', '.join(SCHEMES)}")
    ap.add_argument("--images", type=int, default=16, help="real images for impulse's hit (0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    names, schemes = args.models.split(","), args.schemes.split(",")
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; the catalogue has {', '.join(BY_NAME)}")
    rows = {}
    for name in names:
        rows[name] = run_model(BY_NAME[name], schemes, args.images, args.seed)
        print(f"{name}: " + ", ".join(f"{s} {format_cell(s, c)}" for s, c in rows[name].items()), flush=True)
    _, source = real_images(1, 32)
    print(f"\nimpulse hit: argmax on target, layer 1 / mean over layers, {args.images} {source} images\n")
    print(table(rows, schemes))


if __name__ == "__main__":
    main()

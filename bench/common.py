"""What the benchmarks share: where the data is, the one timing rule, the exact CIFAR-10 test
images, the fidelity columns, markdown tables and the figures' pyplot. Each script imports it by
name (``bench/`` is on a script's import path, and the tests' conftest adds it); structinit is
imported where it is used: ``bench/init_speed.py --against`` times another checkout's.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

# Where every benchmark reads its datasets unless --data-dir says otherwise: the library's own
# setting, $STRUCTINIT_DATA (as structinit.data.default_root reads it), if set; else the shared
# datasets folder beside this checkout (the commands in docs/ run from the repository root).
DATA_DIR = os.environ.get("STRUCTINIT_DATA") or "../shared/datasets"


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1,
                   sync: Callable[[], object] | None = None) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` calls after ``warmup`` calls, so
    that first-call costs (the allocator, lazy imports, kernel loading) are not counted.
    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before and after each timed call, so that a
    call's queued device work is inside its own time."""
    sync = sync or (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timed_init(build: Callable[[], torch.nn.Module], scheme: str, seed: int, repeats: int,
               options: Callable[[torch.nn.Module], dict] = lambda model: {}) -> tuple[torch.nn.Module, float]:
    """(the last model, the median seconds of ``structinit.init_(model, scheme, seed=seed,
    **options(model))``) over ``repeats`` fresh models from ``build()``; building the model and
    its options is not timed."""
    import structinit

    times = []
    for _ in range(repeats):
        model = build()
        opts = options(model)
        start = time.perf_counter()
        structinit.init_(model, scheme, seed=seed, **opts)
        times.append(time.perf_counter() - start)
    return model, statistics.median(times)


def cifar_test_images(root: str | Path, n: int) -> torch.Tensor:
    """First ``n`` images of CIFAR-10's ``test_batch``, normalised with the training-set
    statistics, (n, 3, 32, 32) float32. ``root``: the folder that holds
    ``cifar-10-batches-py``, that folder itself, or the ``.tar.gz`` archive (read by the
    library's safe loader, which never unpickles code)."""
    from structinit.data import DatasetFormatError, DatasetNotFoundError, load_dataset

    try:
        test = load_dataset("cifar10", root, "test")
    except (DatasetNotFoundError, DatasetFormatError, FileNotFoundError) as err:
        sys.exit(f"error: {err}\n(--data-dir: the folder that holds cifar-10-batches-py, that folder, or the archive)")
    return test.normalised(n)


def fidelity_row(fid: dict) -> tuple[float, float, float, float]:
    """(mass L1, hit L1, mass mean, hit mean) of :func:`structinit.impulse_fidelity`'s result,
    as :func:`structinit.fidelity_summary` gives them."""
    import structinit

    return dataclasses.astuple(structinit.fidelity_summary(fid))


def core_hours(result: dict) -> float:
    """CPU time of one finished run (its ``result.json``): its training wall time times the
    threads it ran on."""
    return result["wall_s"] * result["device"]["threads"] / 3600


def markdown(head: Sequence[str], align: str, rows: Sequence[Sequence[object]] = ()) -> str:
    """A markdown table: the header, its rule (``align``: one letter a column, ``l`` left, ``r``
    right) and a line per row of cells; no newline at the end."""
    rule = "|" + "".join("---:|" if a == "r" else "---|" for a in align)
    return "\n".join(["| " + " | ".join(head) + " |", rule, *("| " + " | ".join(map(str, r)) + " |" for r in rows)])


def pyplot():
    """matplotlib's pyplot on the Agg backend: the figures are files, never a window."""
    from structinit.utils.optional_imports import require

    require("matplotlib", "the figures").use("Agg")
    return require("matplotlib.pyplot", "the figures")

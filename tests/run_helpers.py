"""Shared by the kill-and-resume tests of image and sequence runs."""

from __future__ import annotations

import json
import time
from pathlib import Path


def wait_for_rows(metrics: Path, rows: int, timeout: float = 120.0) -> list[dict]:
    """Poll a run's ``metrics.jsonl`` until it holds ``rows`` rows (or ``timeout`` passes);
    return the rows it has."""
    deadline = time.time() + timeout
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < rows):
        time.sleep(0.01)
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []

"""Run a producer ahead of its consumer, in a background thread.

The training loop can take augmented batches from the CPU while the accelerator runs the step
before: torch's CPU ops release the GIL, so a producer thread keeps the host's cores busy while
the loop's thread only queues device work.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import TypeVar

__all__ = ["ahead"]

T = TypeVar("T")
_DONE = object()


def ahead(items: Iterator[T], depth: int) -> Iterator[T]:
    """Yield what ``items`` yields, in order, computed by a background thread that runs up to
    ``depth`` items ahead (``depth`` ≥ 1). An exception in the producer is raised here, at the
    item where it happened; a consumer that stops early (or fails) stops the producer.

    Examples:
        >>> list(ahead(iter(range(5)), depth=2))
        [0, 1, 2, 3, 4]
    """
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
        raise ValueError(f"ahead: depth={depth!r}: expected an int ≥ 1 (the items produced ahead)")
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                slots.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
            put((_DONE, None))
        except BaseException as error:  # handed to the consumer, raised there
            put((_DONE, error))

    worker = threading.Thread(target=produce, name="structinit-ahead", daemon=True)
    worker.start()
    try:
        while True:
            item, error = slots.get()
            if error is not None:
                raise error
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
        worker.join()

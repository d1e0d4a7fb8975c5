"""Unpickling that cannot run code: only the globals that numpy-array pickles need.

``pickle.load`` calls whatever callable a file names (``os.system`` included), so a corrupted or
malicious "CIFAR batch" could execute code. The CIFAR python batches are dicts of bytes, lists
of ints and uint8 ndarrays; rebuilding those needs exactly the globals allowed below. Anything
else is refused before it is looked up, and the error names the file.
"""

from __future__ import annotations

import codecs
import functools
import importlib
import io
import pickle
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from structinit.data.datasets import DatasetFormatError

__all__ = ["ForbiddenGlobalError", "load_pickle"]


class ForbiddenGlobalError(pickle.UnpicklingError):
    """The pickle names a global outside the allow-list (it would run arbitrary code)."""


def _numpy_module(name: str) -> Any:
    # numpy 2 moved numpy.core to numpy._core (numpy.core remains a deprecated alias); files
    # written by either numpy name either module, and both must map to the same function.
    for module in (f"numpy._core.{name}", f"numpy.core.{name}"):
        try:
            return importlib.import_module(module)
        except ImportError:
            continue
    raise ImportError(f"numpy has neither numpy._core.{name} nor numpy.core.{name}")


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    # Python 3 writes ``bytes`` into protocol-2 pickles as _codecs.encode(str, "latin1"). Only
    # that use is allowed: other codecs (zlib, base64, …) have no business in a dataset file.
    if encoding not in ("latin1", "latin-1", "iso-8859-1"):
        raise ForbiddenGlobalError(f"_codecs.encode with encoding {encoding!r}; only 'latin1' is allowed")
    return codecs.encode(text, "latin1")


@functools.cache
def _allowed() -> dict[tuple[str, str], Any]:
    multiarray, numeric = _numpy_module("multiarray"), _numpy_module("numeric")
    table: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): _latin1_encode,
    }
    for core in ("numpy._core", "numpy.core"):
        table[(f"{core}.multiarray", "_reconstruct")] = multiarray._reconstruct  # ndarray, protocol ≤ 4
        table[(f"{core}.numeric", "_frombuffer")] = numeric._frombuffer  # ndarray, protocol 5
        # numpy scalars (e.g. labels stored as np.int64) pickle through multiarray.scalar
        table[(f"{core}.multiarray", "scalar")] = multiarray.scalar
    return table


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` only resolves the allow-listed globals."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _allowed()[(module, name)]
        except KeyError:
            raise ForbiddenGlobalError(
                f"refusing to load global {module}.{name}: only numpy arrays, bytes, lists and dicts are allowed"
            ) from None


def load_pickle(source: bytes | BinaryIO, path: str | Path) -> Any:
    """Unpickle ``source`` (bytes or a binary file) with :class:`RestrictedUnpickler`.

    ``encoding="bytes"`` keeps Python-2 ``str`` objects (the official CIFAR files) as bytes.
    ``path`` is only used in error messages. Raises :class:`DatasetFormatError` for anything
    that is not a clean pickle of allowed objects.
    """
    stream = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source
    try:
        return RestrictedUnpickler(stream, encoding="bytes").load()
    except ForbiddenGlobalError as exc:
        raise DatasetFormatError(
            f"{path}: {exc} — the file is corrupted or not a dataset file; it was not executed. "
            "Delete it and re-download (download=True)"
        ) from exc
    except Exception as exc:  # a garbled pickle can fail in any of a dozen ways
        raise DatasetFormatError(
            f"{path}: not a valid pickle ({type(exc).__name__}: {exc}); the file is corrupted or truncated — "
            "delete it and re-download (download=True)"
        ) from exc

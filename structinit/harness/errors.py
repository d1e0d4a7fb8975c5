"""Which errors come from the user's input, and what input each one concerns.

The class of an error cannot tell a typo from a bug: a ``ValueError`` raised while checking a
config is the user's, one raised deep inside the training loop is a bug. So the place decides:
checks run inside :func:`user_input`, which marks what they raise with the parameter it
concerns (``"out_dir"``, ``"init"`` …), and :func:`input_parameter` reads the mark back; the
exception itself is unchanged, so library callers see exactly what they saw before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from structinit.data import DatasetFormatError, DatasetNotFoundError, DownloadError
from structinit.utils import OptionError

__all__ = ["NonFiniteLossError", "RunIOError", "RunLockedError", "input_parameter", "user_input"]

# What a check raises about its input; anything else (RuntimeError, KeyError …) stays a bug.
_INPUT_ERRORS = (ValueError, TypeError, OSError, ImportError)
_MARK = "structinit_input"


class RunLockedError(RuntimeError):
    """Another process holds the lock of a run folder: it is training that run right now."""


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/Inf loss; the last good checkpoint is left in place."""


class RunIOError(OSError):
    """The storage refused a run file (a full disk, a folder that is not writable); the file
    that was there before is unchanged, so the run resumes from its last good checkpoint."""


@contextmanager
def user_input(parameter: str) -> Iterator[None]:
    """Mark a ``ValueError``, ``TypeError``, ``OSError`` or ``ImportError`` raised in the block
    as an error in the input ``parameter`` (a ImageConfig field or a function argument) and
    re-raise it. The innermost mark wins: it names the most specific parameter."""
    try:
        yield
    except _INPUT_ERRORS as err:
        if getattr(err, _MARK, None) is None:
            setattr(err, _MARK, parameter)
        raise


def input_parameter(err: BaseException) -> str | None:
    """The parameter an input error concerns (``""`` when it is not known), or None when
    ``err`` is not an input error: a bug, or a failure of the run itself."""
    mark = getattr(err, _MARK, None)
    # these only ever describe input, wherever they are raised
    if mark is None and isinstance(err, (OptionError, DatasetFormatError, DatasetNotFoundError, DownloadError,
                                         RunLockedError)):
        return ""
    return mark

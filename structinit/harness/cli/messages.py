"""How the command line reports errors: one line in the words of its flags.

The library's messages name Python parameters (``download=True``, ``out_dir``, ``root=``)
because that is what a library caller types. A command-line user typed flags, so
:func:`to_flags` rewrites those phrases into the flags that set them (``--download``,
``--out``, ``--data-dir``), and :func:`format_error` prefixes the flag an error concerns when
the message names none. Which errors are the user's is decided by
:func:`structinit.harness.errors.input_parameter`; the rest are bugs and keep their traceback.
"""

from __future__ import annotations

import errno
import functools
import re

from structinit.harness.cli.flags import UsageError, field_flags
from structinit.harness.errors import NonFiniteLossError, RunIOError, input_parameter
from structinit.harness.tasks import config_fields
from structinit.utils.optional_imports import HARNESS_INSTALL

__all__ = ["exit_code", "format_error", "to_flags"]

# Other parameters an error can concern (errors.user_input marks), as the command line spells them.
_PARAMETER_FLAGS = {"init": "--init", "resume": "--resume", "seeds": "--seeds", "seed": "--seed", "set": "--set",
                    "run": "--run", "layers": "--layers", "queries": "--queries"}
_COMPARE_FLAGS = {"init": "--inits/--init", "seed": "--seeds"}  # compare reads specs from both, seeds from one
# Parameters that are never spelt as flags inside a message (scheme options share their names).
_NOT_TRANSLATED = {"seed", "init", "init_seed", "init_options", "model_kwargs"}


# Phrases the library uses for a parameter that has a flag.
_PHRASES = [(re.compile(pattern), repl) for pattern, repl in [
    # "download=True (--download)", "out_dir (--out)": the library already gave the flag
    (r"(?<![\w-])[a-z_]+(?:=\w+)? \((--[a-z][a-z-]*)\)", r"\1"),
    (r"\b(download|compile|resume|wait)=True\b", r"--\1"),
    (r"\broot=(?= )", "--data-dir"),  # "or root= the folder that contains them"
    (r"\broot=(?=\S)", "--data-dir "),  # "root=/a/file is a file"
    (r"\broot is required\b", "--data-dir is required"),
    (r"load split='train' and carve a test set with holdout_split\(ds, n\)",
     "carve a test set out of the training images with --set holdout=N"),
]]


@functools.cache
def _field_phrases() -> list[tuple[re.Pattern, str]]:
    """``lr=0.1`` → ``--lr 0.1``, ``holdout=5`` → ``--set holdout=5``, and the bare names that
    hints use (``choose another out_dir``): generated from the config fields' flags."""
    flags = field_flags()
    rules = [(rf"\b{field}=", f"{flags[field]} " if field in flags else f"--set {field}=")
             for field in config_fields() if field not in _NOT_TRANSLATED]
    rules += [(rf"\b{field}\b", flags[field]) for field in ("out_dir", "data_dir", "batch_size")]
    return [(re.compile(pattern), repl) for pattern, repl in rules]


def to_flags(text: str, parameter: str | None = None) -> str:
    """``text`` with the library's parameter phrases replaced by the flags that set them. The
    messages about an init or a model (``parameter``) keep their option names: a scheme's
    ``lr=`` is its own option, not ``--lr``."""
    rules = _PHRASES if parameter in ("init", "model") else _PHRASES + _field_phrases()
    for pattern, repl in rules:
        text = pattern.sub(repl, text)
    return text


def exit_code(err: BaseException) -> int | None:
    """2 for an error in the user's input, 1 for a run that failed on its own (a diverged
    loss, a full disk), None for a bug (shown with its traceback)."""
    if isinstance(err, (NonFiniteLossError, RunIOError)) or storage_refused(err):
        return 1
    if isinstance(err, ImportError) and HARNESS_INSTALL in str(err):  # a missing package, named
        return 1
    if isinstance(err, UsageError) or input_parameter(err) is not None:
        return 2
    return None


# What the storage answers when it refuses a write (a full disk, a read-only or forbidden place).
_STORAGE = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


def storage_refused(err: BaseException) -> bool:
    """Whether ``err`` is the storage refusing a file a command writes (a figure, a table):
    a failure of the run, said in one line, not a bug (its traceback helps nobody)."""
    return (isinstance(err, OSError) and not isinstance(err, RunIOError) and err.errno in _STORAGE
            and input_parameter(err) is None)  # a file of the user's that cannot be read is their input


def format_error(err: BaseException, command: str) -> str:
    """``structinit <command>: error: <message>``, one line, in flags; the flag the error
    concerns leads when the message names none."""
    if storage_refused(err):
        where = err.filename or "a file"
        return (f"structinit {command}: error: {where}: could not be written ({err.strerror}); free space, or "
                "choose another --out")
    lines = str(err).strip().splitlines()
    message = lines[0] if lines else type(err).__name__
    parameter = input_parameter(err) or ""
    if not isinstance(err, UsageError):  # those are already written in flags
        message = to_flags(message, parameter)
    flag = ((_COMPARE_FLAGS if command == "compare" else {}).get(parameter) or field_flags().get(parameter)
            or _PARAMETER_FLAGS.get(parameter) or (f"--set {parameter}" if parameter in config_fields() else ""))
    if flag and "--" not in message:
        message = f"{flag}: {message}"
    return f"structinit {command}: error: {message}"


"""How the command line reports errors: one line in the words of its flags.

The library's messages name Python parameters (``download=True``, ``out_dir``, ``root=``)
because that is what a library caller types. A command-line user typed flags, so
:func:`to_flags` rewrites those phrases into the flags that set them (``--download``,
``--out``, ``--data-dir``), and :func:`format_error` prefixes the flag an error concerns when
the message names none. Which errors are the user's is decided by
:func:`structinit.harness.errors.input_parameter`; the rest are bugs and keep their traceback.
"""

from __future__ import annotations

import difflib
import functools
import re
import types
import typing
from typing import Any

from structinit.harness.errors import input_parameter

__all__ = ["FIELD_FLAGS", "UsageError", "check_set_item", "exit_code", "format_error", "to_flags"]

# TrainConfig fields with a flag of their own; every other field is set with --set.
FIELD_FLAGS = {"dataset": "--dataset", "data_dir": "--data-dir", "model": "--model", "epochs": "--epochs",
               "batch_size": "--batch-size", "lr": "--lr", "train_size": "--train-size", "precision": "--precision",
               "ema_decay": "--ema-decay", "augment": "--augment", "eval_every": "--eval-every",
               "download": "--download", "compile": "--compile", "out_dir": "--out", "loss": "--loss",
               "certify_eps": "--certify"}
# Other parameters an error can concern (errors.user_input marks), as the command line spells them.
_PARAMETER_FLAGS = {"init": "--init", "resume": "--resume", "seeds": "--seeds", "set": "--set", "run": "--run",
                    "layers": "--layers", "queries": "--queries"}
_COMPARE_FLAGS = {"init": "--inits/--init"}  # compare reads specs from both
# Parameters that are never spelt as flags inside a message (scheme options share their names).
_NOT_TRANSLATED = {"seed", "init", "init_seed", "init_options", "model_kwargs"}


class UsageError(ValueError):
    """A flag's value the command line itself rejects; the message names the flag."""


# Phrases the library uses for a parameter that has a flag.
_PHRASES = [(re.compile(pattern), repl) for pattern, repl in [
    # "download=True (--download)", "out_dir (--out)": the library already gave the flag
    (r"(?<![\w-])[a-z_]+(?:=\w+)? \((--[a-z][a-z-]*)\)", r"\1"),
    (r"\b(download|compile|resume|wait)=True\b", r"--\1"),
    (r"\broot=(?= )", "--data-dir"),  # "or root= the folder that contains them"
    (r"\broot is required\b", "--data-dir is required"),
    (r"load split='train' and carve a test set with holdout_split\(ds, n\)",
     "carve a test set out of the training images with --set holdout=N"),
]]


@functools.cache
def _field_phrases() -> list[tuple[re.Pattern, str]]:
    """``lr=0.1`` → ``--lr 0.1``, ``holdout=5`` → ``--set holdout=5``, and the bare names that
    hints use (``choose another out_dir``)."""
    rules = [(rf"\b{field}=", f"{FIELD_FLAGS[field]} " if field in FIELD_FLAGS else f"--set {field}=")
             for field in _config_fields() if field not in _NOT_TRANSLATED]
    rules += [(rf"\b{field}\b", FIELD_FLAGS[field]) for field in ("out_dir", "data_dir", "batch_size")]
    return [(re.compile(pattern), repl) for pattern, repl in rules]


@functools.cache
def _config_fields() -> dict[str, Any]:
    from structinit.harness.train import TrainConfig

    return typing.get_type_hints(TrainConfig)


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
    loss), None for a bug (shown with its traceback)."""
    from structinit.harness.train import NonFiniteLossError

    if isinstance(err, UsageError) or input_parameter(err) is not None:
        return 2
    return 1 if isinstance(err, NonFiniteLossError) else None


def format_error(err: BaseException, command: str) -> str:
    """``structinit <command>: error: <message>``, one line, in flags; the flag the error
    concerns leads when the message names none."""
    lines = str(err).strip().splitlines()
    message = lines[0] if lines else type(err).__name__
    parameter = input_parameter(err) or ""
    if not isinstance(err, UsageError):  # those are already written in flags
        message = to_flags(message, parameter)
    flag = (_COMPARE_FLAGS if command == "compare" else {}).get(parameter) or _flag(parameter)
    if flag and "--" not in message:
        message = f"{flag}: {message}"
    return f"structinit {command}: error: {message}"


def _flag(parameter: str) -> str:
    if parameter in FIELD_FLAGS or parameter in _PARAMETER_FLAGS:
        return FIELD_FLAGS.get(parameter) or _PARAMETER_FLAGS[parameter]
    return f"--set {parameter}" if parameter in _config_fields() else ""


def check_set_item(item: str, owned: dict[str, str], config: type | None = None) -> tuple[str, Any]:
    """``--set KEY=VALUE`` as (field, value), the value read as a literal and checked against
    the type of that field of ``config`` (default TrainConfig; SequenceConfig for ``--task``
    runs); ``owned`` maps the fields the command sets itself to their flags. Fields with a flag
    of their own are allowed: ``--set train_size=None`` says what ``--train-size`` cannot."""
    from structinit.harness.specs import parse_literal

    key, eq, text = item.partition("=")
    key = key.strip().replace("-", "_")
    if not eq or not key:
        raise UsageError(f"--set {item!r}: expected KEY=VALUE, e.g. --set warmup_epochs=5")
    hints = _config_fields() if config is None else typing.get_type_hints(config)
    if key not in hints:
        close = difflib.get_close_matches(key, hints, n=1)
        maybe = f" (did you mean {close[0]}?)" if close else ""
        raise UsageError(f"--set {item!r}: no training option {key!r}{maybe}; valid: {', '.join(sorted(hints))}")
    if key in owned:  # the command sets it from that flag, which would silently replace this value
        raise UsageError(f"--set {item!r}: {key} is set by {owned[key]} here; use that flag")
    value = parse_literal(text.strip())
    if not _fits(value, hints[key]) and _fits(text.strip(), hints[key]):
        value = text.strip()  # a text field given digits: --set data_dir=2024 is the folder "2024"
    if not _fits(value, hints[key]):
        raise UsageError(f"--set {item!r}: {key} takes {_describe(hints[key])}, got {value!r}")
    return key, value


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` (a parsed literal) has the type ``hint`` of a TrainConfig field."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint in (int, float):  # an int is a fine float; a bool is neither (True would read as 1)
        return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    if origin is tuple:
        fixed = len(args) == len(value) if isinstance(value, (tuple, list)) and Ellipsis not in args else True
        return isinstance(value, (tuple, list)) and fixed and all(_fits(v, a) for v, a in zip(value, args))
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, origin or hint)


def _describe(hint: Any) -> str:
    return re.sub(r"\btyping\.", "", str(hint).replace("<class '", "").replace("'>", ""))


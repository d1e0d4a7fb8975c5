"""The training commands' flags, generated from the config fields' facts
(:mod:`structinit.harness.config`), and the config the flags describe.

``train`` and ``compare`` share these flags: one per config field that declares a flag, over
every task kind (``--dataset`` for images, ``--task`` and ``--steps`` for sequence tasks),
``--recipe``, and ``--set KEY=VALUE`` for any other field. The kind of a run is chosen by its
selector flag (``--task`` picks a sequence task; images otherwise); a flag of another kind is
refused, since it would silently do nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import typing
from typing import Any

from structinit.harness.config import ImageConfig, check_field, facts
from structinit.harness.errors import user_input
from structinit.harness.recipes import preset
from structinit.harness.specs import parse_init_spec, parse_literal, spec_label
from structinit.harness.tasks import KINDS, Kind, config_fields
from structinit.utils.checks import matches_annotation

__all__ = ["UsageError", "add_training_flags", "check_set_item", "config_from_args", "field_flags", "out_path",
           "run_name"]


class UsageError(ValueError):
    """A flag's value the command line itself rejects; the message names the flag."""


def out_path(text: str) -> str:
    """``--out``'s type: a path, never empty (an empty one would fall back to the default folder
    without a word)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is empty: name a folder, or leave --out out for the default")
    return text


def field_flags() -> dict[str, str]:
    """{field: its flag} over every kind: ``lr`` → ``--lr``, ``out_dir`` → ``--out``."""
    return {name: f for name, (kind, _) in config_fields().items() if (f := facts(kind.config, name).flag)}


def _flag_type(hint: Any):
    """The argparse type of a field's annotation: ``int | None`` → int."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return _flag_type(args[0]) if args else hint


def add_training_flags(p: argparse.ArgumentParser, owned: dict[str, str]) -> None:
    """The flags of ``train`` and ``compare``; ``owned``: fields the command sets with its own flags."""
    recipes = sorted({name for kind in KINDS.values() for name in kind.recipes})
    defaults = ", ".join(f"{k.default_recipe} for {k.name} runs" for k in KINDS.values())
    p.add_argument("--recipe", default=None, choices=recipes, help=f"base settings (default: {defaults})")
    for name, (kind, _) in config_fields().items():
        fact = facts(kind.config, name)
        if fact.flag is None or name in owned:
            continue
        hint = typing.get_type_hints(kind.config)[name]
        if hint is bool:
            p.add_argument(fact.flag, dest=name, action="store_true", default=None, help=fact.help)
        else:
            p.add_argument(fact.flag, dest=name, type=fact.parse or _flag_type(hint), default=None, help=fact.help,
                           metavar=fact.metavar)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other config field, e.g. --set warmup_epochs=5 (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--wait", action="store_true",
                   help="if another process is training a run folder, wait for it instead of stopping")


def _kind_flag(kind: Kind) -> str:
    return f"{facts(kind.config, kind.selector).flag} runs" if kind.selector else f"{kind.name} runs"


def recipe_of(args: argparse.Namespace) -> tuple[Kind, str]:
    """(the kind, the recipe): the kind is the one whose selector flag was given (``--task``), else the
    default kind; the recipe is ``--recipe`` if given (it must be of that kind), else the kind's default."""
    chosen = [k for k in KINDS.values() if k.selector and getattr(args, k.selector, None) is not None]
    kind = chosen[0] if chosen else next(k for k in KINDS.values() if k.selector is None)
    if args.recipe is None:
        return kind, kind.default_recipe
    if args.recipe not in kind.recipes:
        owner = next(k for k in KINDS.values() if args.recipe in k.recipes)
        how = f"add {facts(owner.config, owner.selector).flag}, or " if owner.selector else "remove the selector, or "
        raise UsageError(f"--recipe {args.recipe}: a recipe for {_kind_flag(owner)}, not for {_kind_flag(kind)}; "
                         f"{how}choose one of {', '.join(sorted(kind.recipes))}")
    return kind, args.recipe


def run_name(args: argparse.Namespace) -> str:
    """The default folder name of a command's runs: the recipe, and the selector's spec if any."""
    kind, recipe = recipe_of(args)
    return f"{recipe}-{spec_label(getattr(args, kind.selector))}" if kind.selector else recipe


def config_from_args(args: argparse.Namespace, owned: dict[str, str], **extra: Any):
    """The config the flags describe: the recipe, then the flags, then ``--set``, then ``extra``."""
    kind, recipe = recipe_of(args)
    names = {f.name for f in dataclasses.fields(kind.config)}
    overrides: dict[str, Any] = {}
    for name, (owner, _) in config_fields().items():
        fact = facts(owner.config, name)
        value = getattr(args, name, None) if fact.flag and name not in owned else None
        if value is None:
            continue
        if name not in names:
            raise UsageError(f"{fact.flag} applies to {_kind_flag(owner)}, not to {_kind_flag(kind)}; remove it")
        if fact.spec_of:  # "name:key=value,…" sets the field and its options
            with user_input(name):
                overrides[name], overrides[fact.spec_of] = parse_init_spec(value)
            owned = {**owned, name: fact.flag, fact.spec_of: fact.flag}
        else:
            overrides[name] = value
    overrides |= dict(check_set_item(item, owned, kind.config) for item in args.set)
    return preset(kind.recipes, kind.config, recipe, {**overrides, **extra})


def check_set_item(item: str, owned: dict[str, str], config: type = ImageConfig) -> tuple[str, Any]:
    """``--set KEY=VALUE`` as (field, value), the value read as a literal and checked against
    the type of that field of ``config``; ``owned`` maps the fields the command sets itself to
    their flags. Fields with a flag of their own are allowed: ``--set train_size=None`` says
    what ``--train-size`` cannot."""
    key, eq, text = item.partition("=")
    key = key.strip().replace("-", "_")
    if not eq or not key:
        raise UsageError(f"--set {item!r}: expected KEY=VALUE, e.g. --set warmup_epochs=5")
    hints = typing.get_type_hints(config)
    if key not in hints:
        close = difflib.get_close_matches(key, hints, n=1)
        maybe = f" (did you mean {close[0]}?)" if close else ""
        raise UsageError(f"--set {item!r}: no training option {key!r}{maybe}; valid: {', '.join(sorted(hints))}")
    if key in owned:  # the command sets it from that flag, which would silently replace this value
        raise UsageError(f"--set {item!r}: {key} is set by {owned[key]} here; use that flag")
    value = parse_literal(text.strip())
    if not matches_annotation(value, hints[key]) and matches_annotation(text.strip(), hints[key]):
        value = text.strip()  # a text field given digits: --set data_dir=2024 is the folder "2024"
    try:  # the field's type and rule, said about --set: the field may have a flag the user did not type
        check_field(config, key, value)
    except ValueError as err:
        raise UsageError(f"--set {item!r}: {str(err).partition(': ')[2]}") from None
    return key, value

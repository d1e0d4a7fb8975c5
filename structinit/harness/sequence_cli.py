"""``structinit train --task …`` and ``structinit compare --task …``: the sequence-task runs
(:mod:`structinit.harness.train_sequence`) under the image commands' conventions. The task
and its options are one spec, written like an init spec: ``--task copy:length=64,vocab=16``
or ``--task mqar:pairs=16,length=128``; ``--steps`` sets the step budget; every other
:class:`~structinit.harness.train_sequence.SequenceConfig` field is ``--set KEY=VALUE``."""

from __future__ import annotations

import argparse

from structinit.harness.cli_errors import UsageError, check_set_item
from structinit.harness.errors import user_input
from structinit.harness.specs import parse_init_spec

# The flags shared with image runs that mean the same thing here (field → flag).
SHARED_FLAGS = {"model": "--model", "batch_size": "--batch-size", "lr": "--lr", "eval_every": "--eval-every"}
# Image-only flags (field → flag): given with --task they would silently do nothing.
IMAGE_FLAGS = {"dataset": "--dataset", "data_dir": "--data-dir", "epochs": "--epochs", "train_size": "--train-size",
               "precision": "--precision", "ema_decay": "--ema-decay", "augment": "--augment",
               "download": "--download", "compile": "--compile"}
DEFAULT_RECIPE = "seq-cpu"


def check_recipe_kind(args: argparse.Namespace) -> str:
    """The recipe of the command: ``--recipe`` if given (it must be of the right kind), else
    the default of the kind (``digits`` for images, ``seq-cpu`` with ``--task``)."""
    from structinit.harness.recipes import RECIPES, SEQUENCE_RECIPES

    sequence = args.task is not None
    if args.recipe is None:
        return DEFAULT_RECIPE if sequence else "digits"
    if sequence and args.recipe not in SEQUENCE_RECIPES:
        raise UsageError(f"--recipe {args.recipe}: an image recipe, but --task {args.task} trains a sequence task; "
                         f"choose one of {', '.join(sorted(SEQUENCE_RECIPES))}")
    if not sequence and args.recipe not in RECIPES:
        raise UsageError(f"--recipe {args.recipe}: a sequence-task recipe; add --task copy or --task mqar, or "
                         f"choose an image recipe: {', '.join(sorted(RECIPES))}")
    return args.recipe


def sequence_config(args: argparse.Namespace, owned: dict[str, str], **extra):
    """The :class:`SequenceConfig` the flags describe (recipe, then flags, then ``--set``)."""
    from structinit.harness.recipes import sequence_recipe
    from structinit.harness.train_sequence import SequenceConfig

    for field, flag in IMAGE_FLAGS.items():
        if getattr(args, field, None) is not None:
            raise UsageError(f"{flag} does not apply to --task runs (they generate their data); remove it")
    with user_input("task"):
        task, task_options = parse_init_spec(args.task)
    overrides = {field: getattr(args, field) for field in SHARED_FLAGS if getattr(args, field) is not None}
    if args.steps is not None:
        overrides["steps"] = args.steps
    for item in args.set:
        key, value = check_set_item(item, {**owned, "task": "--task", "task_options": "--task"}, SequenceConfig)
        overrides[key] = value
    return sequence_recipe(check_recipe_kind(args), **{**overrides, "task": task, "task_options": task_options,
                                                       **extra})

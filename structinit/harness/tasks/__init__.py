"""What a run trains on. A task kind bundles its config class, its :class:`Task
<structinit.harness.run.lifecycle.Task>`, its recipes and the words a report uses for it;
:func:`train` runs any config through the one lifecycle of :mod:`structinit.harness.run.lifecycle`.

A new task (say, segmentation) is a module here with a config class, a task class and a
recipe registry, and one :class:`Kind` in :data:`KINDS`: the command line, ``compare``,
the report and run folders then handle it with no other change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from structinit.harness.config import RunConfig, SequenceConfig, ImageConfig
from structinit.harness.recipes import RECIPES, SEQUENCE_RECIPES
from structinit.harness.run.lifecycle import run_task
from structinit.harness.tasks.image import ImageTask
from structinit.harness.tasks.sequence import SequenceTask
from structinit.utils import Registry

__all__ = ["KINDS", "Kind", "kind_of", "make_task", "train"]


@dataclass(frozen=True)
class Kind:
    """A kind of task, and all that the command line and the report need to know of it."""

    name: str
    config: type[RunConfig]
    task: Callable[[Any], Any]
    recipes: Registry
    default_recipe: str
    selector: str | None  # the config field whose flag picks this kind (None: the default kind)
    data: str  # the field that names the data ("dataset", "task")
    budget: str  # the field that sets how long a run trains ("epochs", "steps")
    subject: str  # what the init acts on, in a report's words
    title: str  # a report's title
    attention_figures: bool  # whether a report can draw its attention maps


KINDS: dict[str, Kind] = {
    "image": Kind("image", ImageConfig, ImageTask, RECIPES, "digits", None, "dataset", "epochs",
                  "attention layers of a Vision Transformer", "Attention initialisation", True),
    "sequence": Kind("sequence", SequenceConfig, SequenceTask, SEQUENCE_RECIPES, "seq-cpu", "task", "task", "steps",
                     "layers of a sequence model", "Sequence-model initialisation", False),
}


def kind_of(config_or_result: RunConfig | dict) -> Kind:
    """The kind of a config, or of a result.json's dict (``kind``; image when absent)."""
    if isinstance(config_or_result, dict):
        return KINDS[config_or_result.get("kind", "image")]
    for kind in KINDS.values():
        if type(config_or_result) is kind.config:
            return kind
    raise TypeError(f"{type(config_or_result).__name__}: not a run config; expected one of "
                    f"{', '.join(k.config.__name__ for k in KINDS.values())}")


def make_task(cfg: RunConfig):
    """The task that trains ``cfg``."""
    return kind_of(cfg).task(cfg)


def train(cfg: RunConfig, resume: bool = False, progress: bool = True, wait: bool = False) -> dict[str, Any]:
    """Train ``cfg`` (a :class:`~structinit.harness.config.ImageConfig` for images, a
    :class:`~structinit.harness.config.SequenceConfig` for sequence tasks), evaluating and
    checkpointing as it goes; return the result, also written to ``out_dir/result.json``.

    ``resume=True`` returns a finished run's result and continues a half-finished one from its
    last checkpoint. The settings, ``out_dir`` and the data are checked before anything is
    loaded or written; errors in them are marked as input errors
    (:mod:`structinit.harness.errors`). While the run trains its folder is locked: another
    process on the same ``out_dir`` raises
    :class:`~structinit.harness.errors.RunLockedError`, or with ``wait=True`` waits."""
    return run_task(make_task(cfg), resume=resume, progress=progress, wait=wait)

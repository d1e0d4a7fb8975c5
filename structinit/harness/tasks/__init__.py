"""What a run trains on. A task kind bundles its config class, its :class:`Task
<structinit.harness.run.lifecycle.Task>`, its recipes and the words a report uses for it;
:func:`train` runs any config through the one lifecycle of :mod:`structinit.harness.run.lifecycle`.

A new task (say, segmentation) is a module here with a config class, a task class and a
recipe registry, and one :class:`Kind` in :data:`KINDS`: the command line, ``compare``,
the report and run folders then handle it with no other change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from structinit.harness.config import ImageConfig, RunConfig, SequenceConfig
from structinit.harness.recipes import RECIPES, SEQUENCE_RECIPES
from structinit.harness.run.lifecycle import Task, run_task
from structinit.harness.tasks.image import ImageTask
from structinit.harness.tasks.sequence import SequenceTask
from structinit.utils import Registry

__all__ = ["KINDS", "Kind", "config_fields", "kind_of", "make_task", "train"]


@dataclass(frozen=True, kw_only=True)
class Kind:
    """A kind of run (image, sequence), and all that the command line and the report need to
    know of it; built with keyword arguments. The config fields it names (``selector``,
    ``data``, ``budget``) and its default recipe are checked on construction, so that a
    misspelt one fails when the module is imported, not in a report."""

    name: str  # its key in KINDS, and a result.json's "kind"
    config: type[RunConfig]
    task: Callable[[Any], Task]  # the config → the task that trains it
    recipes: Registry
    default_recipe: str
    # Fields of ``config`` that the command line and the report read:
    selector: str | None  # the one whose flag picks this kind (None: the default kind)
    data: str  # the one that names the data
    budget: str  # the one that sets how long a run trains
    # The report's words:
    subject: str  # what the init acts on
    title: str  # the page's title
    attention_figures: bool  # whether a report can draw its attention maps

    def __post_init__(self) -> None:
        fields = {f.name for f in dataclasses.fields(self.config)}
        named = [self.data, self.budget, *([self.selector] if self.selector is not None else [])]
        unknown = [name for name in named if name not in fields]
        if unknown:
            raise ValueError(f"kind {self.name!r}: {', '.join(unknown)} not fields of {self.config.__name__}")
        if self.default_recipe not in self.recipes:
            raise ValueError(f"kind {self.name!r}: default_recipe={self.default_recipe!r} is not one of its recipes")


KINDS: dict[str, Kind] = {kind.name: kind for kind in (
    Kind(name="image", config=ImageConfig, task=ImageTask, recipes=RECIPES, default_recipe="digits",
         selector=None, data="dataset", budget="epochs",
         subject="attention layers of a Vision Transformer", title="Attention initialisation",
         attention_figures=True),
    Kind(name="sequence", config=SequenceConfig, task=SequenceTask, recipes=SEQUENCE_RECIPES,
         default_recipe="seq-cpu", selector="task", data="task", budget="steps",
         subject="layers of a sequence model", title="Sequence-model initialisation",
         attention_figures=False),
)}


def config_fields() -> dict[str, tuple[Kind, dataclasses.Field]]:
    """Every config field of every kind, with the first kind that has it, in declaration order."""
    found: dict[str, tuple[Kind, dataclasses.Field]] = {}
    for kind in KINDS.values():
        for field in dataclasses.fields(kind.config):
            found.setdefault(field.name, (kind, field))
    return found


def kind_of(config_or_result: RunConfig | dict) -> Kind:
    """The kind of a config, or of a result.json's dict (``kind``; image when absent)."""
    if isinstance(config_or_result, dict):
        return KINDS[config_or_result.get("kind", "image")]
    for kind in KINDS.values():
        if type(config_or_result) is kind.config:
            return kind
    raise TypeError(f"{type(config_or_result).__name__}: not a run config; expected one of "
                    f"{', '.join(k.config.__name__ for k in KINDS.values())}")


def check_run_config(name: str, cfg: object) -> None:
    """A TypeError in one line naming ``name``, the value's type and how to build a config,
    unless ``cfg`` is one of the kinds' configs."""
    if not any(type(cfg) is kind.config for kind in KINDS.values()):
        kinds = ", ".join(k.config.__name__ for k in KINDS.values())
        raise TypeError(f"{name}: expected a run config ({kinds}), got {type(cfg).__name__}; build one with "
                        "structinit.recipe('digits', epochs=2) (a recipe, any field overridden) or "
                        "structinit.ImageConfig(dataset=..., model=...)")


def make_task(cfg: RunConfig):
    """The task that trains ``cfg``: its kind's (:class:`Kind`) task built on it."""
    return kind_of(cfg).task(cfg)


def train(cfg: RunConfig, resume: bool = False, progress: bool = True, wait: bool = False) -> dict[str, Any]:
    """Train ``cfg`` (a :class:`~structinit.harness.config.ImageConfig` for images, a
    :class:`~structinit.harness.config.SequenceConfig` for sequence prediction), evaluating and
    checkpointing as it goes; return the result, also written to ``out_dir/result.json``.

    ``resume=True`` returns a finished run's result and continues a half-finished one from its
    last checkpoint. The settings, ``out_dir`` and the data are checked before anything is
    loaded or written; errors in them are marked as input errors
    (:mod:`structinit.harness.errors`). While the run trains its folder is locked: another
    process on the same ``out_dir`` raises
    :class:`~structinit.harness.errors.RunLockedError`, or with ``wait=True`` waits."""
    check_run_config("cfg", cfg)
    return run_task(make_task(cfg), resume=resume, progress=progress, wait=wait)

"""A run's configuration, where every field says once what it is.

Each field is declared with :func:`option`, which keeps beside its default the field's
:class:`Facts`: one line of help (the command line's ``--help`` text and the report's
"meaning" column), its flag (``--lr``; a field without one is set with ``--set KEY=VALUE``)
and its check. The command line's flags, ``--set``'s type checks, error messages written in
flags and the report's configuration table are all generated from these facts.

:class:`RunConfig` holds what every run has (model, init, optimiser, seeds, folder);
:class:`ImageConfig` (images) and :class:`SequenceConfig` (synthetic sequence tasks) add their
task's fields. A subclass may redeclare a field to change its default; it keeps the base's
facts unless it declares its own.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from typing import Any

from structinit.harness.errors import user_input
from structinit.schemes.registry import lookup
from structinit.utils.checks import check_annotated

__all__ = ["Facts", "RunConfig", "SequenceConfig", "ImageConfig", "check_config", "config_from_dict", "facts",
           "option"]

# torch.compile's modes (torch.compile(mode=…)); "default" is torch's own default.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")


@dataclass(frozen=True)
class Facts:
    """What the command line and the report know of a field."""

    help: str
    flag: str | None = None                 # its own flag, e.g. "--lr"; None: --set only
    parse: Callable[[str], Any] | None = None  # the flag's argparse type (default: from the annotation)
    metavar: str | None = None
    check: str | tuple | Callable[[Any], Any] | None = None  # a rule of RULES ("count": int ≥ 1, …), the
    #                                         tuple of the values allowed, or a function raising ValueError
    expected: str | None = None             # what a failed check says is expected (default: from the check)
    spec_of: str | None = None              # the flag reads "name:key=value,…": the options go to this field


def option(default: Any = MISSING, *, help: str, flag: str | bool = False, factory: Callable[[], Any] | None = None,
           **facts: Any) -> Any:
    """A dataclass field with its :class:`Facts`; ``flag=True`` spells the flag from the name
    (``batch_size`` → ``--batch-size``)."""
    return dataclasses.field(default=default, default_factory=factory if factory else MISSING,
                             metadata={"facts": Facts(help, flag if isinstance(flag, str) else None, **facts),
                                       "own_flag": flag is True})


def facts(config: type | object, name: str) -> Facts:
    """The facts of field ``name``: the nearest declaration in the class hierarchy that has them."""
    kind = config if isinstance(config, type) else type(config)
    for cls in kind.__mro__:
        field = getattr(cls, "__dataclass_fields__", {}).get(name)
        if field is not None and "facts" in field.metadata:
            found = field.metadata["facts"]  # flag=True spells the flag from the name
            own = "--" + name.replace("_", "-") if field.metadata["own_flag"] else found.flag
            return dataclasses.replace(found, flag=own)
    raise KeyError(f"{kind.__name__} has no field {name!r}")


FLOAT32_MAX = 3.4028234663852886e38  # a rate or a decay becomes a float32 tensor: beyond this it is inf


def _number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and abs(value) <= FLOAT32_MAX)


def _whole(value: Any) -> bool:
    return _number(value) and isinstance(value, int)


# A field's value rule: what it accepts, and what its error says is expected.
RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "count": (lambda v: _whole(v) and v >= 1, "a positive whole number"),
    "natural": (lambda v: _whole(v) and v >= 0, "a whole number ≥ 0"),
    "positive": (lambda v: _number(v) and v > 0, "a positive finite number (float32: at most 3.4e38)"),
    "nonnegative": (lambda v: _number(v) and v >= 0, "a finite number ≥ 0 (float32: at most 3.4e38)"),
    "fraction": (lambda v: _number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "decay": (lambda v: _number(v) and 0 < v < 1, "a number in (0, 1), such as 0.999"),
    "seed": (lambda v: _whole(v) and 0 <= v < 2**63, "a whole number in [0, 2**63)"),
    "flag": (lambda v: isinstance(v, bool), "True or False"),
    "text": (lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string"),
    "options": (lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v), "a dict of named options"),
    "betas": (lambda v: isinstance(v, (tuple, list)) and len(v) == 2 and all(_number(b) and 0 <= b < 1 for b in v),
              "two numbers in [0, 1), such as (0.9, 0.999)"),
}


def check_field(config: type | object, name: str, value: Any) -> None:
    """ValueError ``name=value: expected …`` when ``value`` is not of the type field ``name`` of
    ``config`` is annotated with, or breaks the check it declares (None passes where the field
    may be None: its default is, or its type allows it)."""
    kind = config if isinstance(config, type) else type(config)
    hint = typing.get_type_hints(kind)[name]
    if value is None and (kind.__dataclass_fields__[name].default is None or type(None) in typing.get_args(hint)):
        return
    check_annotated(name, value, hint)  # the type, as an init option's is checked; then the field's range
    fact = facts(kind, name)
    if callable(fact.check):  # a check owned elsewhere, whose error names the value: the scheme table's lookup
        fact.check(value)
    elif isinstance(fact.check, tuple) and value not in fact.check:
        raise ValueError(f"{name}={value!r}: expected {fact.expected or ' or '.join(map(repr, fact.check))}")
    elif isinstance(fact.check, str) and not RULES[fact.check][0](value):
        raise ValueError(f"{name}={value!r}: expected {fact.expected or RULES[fact.check][1]}")


def check_config(cfg: RunConfig) -> None:
    """Check every field that declares a check; errors are input errors naming the field."""
    for field in dataclasses.fields(cfg):
        with user_input(field.name):
            check_field(cfg, field.name, getattr(cfg, field.name))


def config_from_dict(kind: type, values: dict[str, Any]) -> RunConfig:
    """A ``kind`` config from a result's or checkpoint's dict (JSON gives betas back as a list;
    fields a newer version dropped are ignored)."""
    names = {f.name for f in dataclasses.fields(kind)}
    config = {k: v for k, v in values.items() if k in names}
    if isinstance(config.get("betas"), list):
        config["betas"] = tuple(config["betas"])
    return kind(**config)


@dataclass
class RunConfig:
    """What every run depends on, whatever it trains on (saved in its checkpoint and result)."""

    model: str = option("vit_cpu_patch4_32", flag=True, check="text",
                        help="the model trained (structinit.list_models(), or timm/<name>)")
    model_kwargs: dict[str, Any] = option(  # noqa: RUF009
        factory=dict, check="options", help="extra arguments of the model")
    init: str = option("pytorch", check=lookup, help="the initialisation scheme")
    init_options: dict[str, Any] = option(  # noqa: RUF009
        factory=dict, check="options", help="the scheme's options ({} = its defaults)")
    batch_size: int = option(128, flag=True, check="count", help="examples per optimisation step")
    lr: float = option(1e-3, flag=True, check="positive", help="peak learning rate (AdamW; warm-up, then cosine decay)")
    min_lr: float = option(1e-5, check="nonnegative", help="learning rate at the end of the cosine decay")
    warmup_lr: float = option(1e-5, check="nonnegative", help="learning rate at the start of warm-up")
    weight_decay: float = option(0.05, check="nonnegative", help="AdamW weight decay, on weight matrices only (not "
                                 "on the model's no_weight_decay() parameters, biases or norms)")
    eps: float = option(1e-8, check="positive", help="AdamW epsilon")
    betas: tuple[float, float] = option((0.9, 0.999), check="betas", help="AdamW betas")
    grad_clip: float | None = option(1.0, check="positive", help="gradient norm clipped to this (None = off)",
                                     expected="a gradient norm > 0, or None for no clipping")
    precision: str = option("auto", flag=True, check=("auto", "fp32", "bf16", "fp16"),
                            expected="auto, fp32, bf16 or fp16",
                            help="arithmetic: fp32, bf16, fp16, or auto (bf16 where the hardware has it natively, "
                            "else fp32)")
    compile: bool = option(False, flag=True, check="flag", help="torch.compile the model")
    compile_mode: str = option("default", check=COMPILE_MODES, expected=", ".join(COMPILE_MODES),
                               help="torch.compile's mode, with compile: reduce-overhead replays the step's kernels "
                               "as CUDA graphs, the max-autotune modes search kernels first (minutes)")
    ema_decay: float | None = option(None, flag=True, check="decay", help="decay of an exponential moving average "
                                     "of the weights, also evaluated and exported (None = off)")
    eval_every: int = option(1, flag=True, check="count",
                             help="evaluate every N epochs (sequence tasks: every N steps, and checkpoint then)")
    seed: int = option(0, check="seed", help="seed of the data order and augmentation")
    init_seed: int | None = option(None, check="seed", help="seed of the model and init (None = the run's seed)")
    out_dir: str = option("runs/run", flag="--out", check="text", help="the run folder")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _radius(text: str) -> float:
    """A radius from the command line: a number (``0.1412``) or a fraction (``36/255``), read without eval."""
    import argparse

    num, slash, den = text.partition("/")
    try:
        return float(num) / float(den) if slash else float(num)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number or a fraction such as 36/255") from None


@dataclass
class ImageConfig(RunConfig):
    """An image-classification run (:mod:`structinit.harness.tasks.image`)."""

    dataset: str = option("digits", flag=True, check="text",
                          help="the images and labels: digits, cifar10, mnist, … (structinit.data.DATASETS)")
    data_dir: str | None = option(None, flag=True, check="text", help="where the dataset's files are read from")
    download: bool = option(False, flag=True, check="flag", help="fetch the dataset if missing")
    train_size: int | None = option(None, flag=True, check="count",
                                    help="training images used, class-stratified (None = all)")
    holdout: int = option(0, check="natural", help="training images set aside to measure accuracy "
                          "(0 = use the test split)")
    holdout_mode: str = option("last", check=("last", "stratified"),
                               help="which images are set aside: 'last' in order, or 'stratified'")
    test_prefix: int | None = option(None, check="count", help="also score the first N test images")
    test_every: int = option(1, check="count", help="score the whole test split every N epochs and at the last "
                             "(needs test_prefix, the split scored at every evaluation in between)")
    epochs: int = option(30, flag=True, check="count", help="passes over the training images")
    warmup_epochs: float = option(2.0, check="nonnegative", help="epochs of learning-rate warm-up")
    label_smoothing: float = option(0.1, check="fraction", help="label smoothing of the cross-entropy loss")
    loss: str = option("ce", flag=True, check=("ce", "hinge"), help="ce (cross-entropy) or hinge (the multi-class "
                       "hinge loss of certified training)", expected="'ce' (cross-entropy) or 'hinge' (the "
                       "multi-class hinge loss of certified training)")
    hinge_margin: float | None = option(None, check="positive", help="margin of the hinge loss, with loss='hinge' "
                                        "only (None = √2·certify_eps/min(std), else 0.5)",
                                        expected="a margin > 0, or None for the default (√2·certify_eps/min(std), "
                                        "else 0.5)")
    certify_eps: float | None = option(None, flag="--certify", parse=_radius, metavar="EPS", check="positive",
                                       help="ℓ₂ radius in pixel space, e.g. 36/255: adds certified (and final PGD) "
                                       "accuracy", expected="an ℓ₂ radius > 0 in pixel space [0, 1], e.g. 36/255 ≈ "
                                       "0.1412, or None for no certification")
    augment: str = option("crop4,flip", flag=True, check="text", help="data augmentation, applied to whole batches")
    cpu_prefetch: int = option(0, check="natural", help="augment on the CPU in a background thread, this many "
                               "batches ahead of the step (0: on the training device, in the step); the same "
                               "batches either way (on a GPU a blend may round a tie the other way), so a run may "
                               "change it when it resumes")
    aug_workers: int = option(0, check="natural", help="augment on the CPU in this many worker processes, kept for "
                              "the whole run (0: none; cpu_prefetch or the device does it); the same batches for any "
                              "number, so a run may change it when it resumes")


@dataclass
class SequenceConfig(RunConfig):
    """A synthetic sequence-task run (:mod:`structinit.harness.tasks.sequence`): copying or
    multi-query associative recall, a fresh batch every step."""

    model: str = "mamba_seq_2x64"
    init: str = "default"
    task: str = option("copy", flag="--task", spec_of="task_options", metavar="SPEC", check="text",
                       help="a sequence task instead of images: copy:length=64,vocab=16 or mqar:pairs=8,length=64")
    task_options: dict[str, Any] = option(  # noqa: RUF009
        factory=dict, check="options", help="the task's options ({} = its defaults)")
    steps: int = option(2000, flag=True, check="count", help="optimiser steps of a --task run (a fresh batch each)")
    batch_size: int = option(64, flag=True, check="count", help="sequences per optimisation step")
    warmup_steps: int = option(100, check="natural", help="steps of learning-rate warm-up")
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.98)
    precision: str = "fp32"
    eval_every: int = option(250, flag=True, check="count", help="evaluate (and checkpoint) every N steps")
    heldout_size: int = option(1000, check="count", help="held-out sequences, the same for every seed and init")
    seed: int = option(0, check="seed", help="seed of the training stream")
    out_dir: str = "runs/seq"

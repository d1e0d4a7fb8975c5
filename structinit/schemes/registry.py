"""The scheme table: every initialisation is selectable by a string name.

A scheme is a *planner*, ``plan_x(survey, *, …) -> Plan``, that checks what depends on the model
and computes every value without writing. It reads the model through its
:class:`~structinit.adapters.survey.ModelSurvey`, built once per init: every fact a probe
of the model's forward finds is found once, and a scheme that asks for none runs no forward.
:data:`SCHEMES` maps ``(target, name)`` to it, the target saying which layers it initialises
(:data:`TARGETS`): ``impulse`` is one scheme for attention, one for depthwise convs and one for
MLP-Mixer token mixing.

:func:`plan_init` is the one way in: it finds the name (:func:`lookup`), picks the target whose
layers the model has, checks the options against the planner's signature and annotations (a
``float`` must be a finite number, …), runs the planner and checks what it would write. ``init_``
and ``structinit.impulse_init_`` and its siblings commit that plan.
"""

from __future__ import annotations

import functools
import inspect
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from structinit.adapters import is_depthwise, is_ssm, is_token_mixing
from structinit.adapters.survey import ModelSurvey, forms_no_attention
from structinit.schemes.model_checks import check_model
from structinit.schemes.plan import Plan, check_no_overwrite
from structinit.schemes.spec import parse_init_spec
from structinit.utils import OptionError, check_choice, check_int, check_options
from structinit.utils.checks import check_annotated, check_layers, is_number, show
from structinit.utils.state import ModuleState, own_precision

# 'model': every layer of the model (framework defaults); the others: the layers of one kind.
TARGETS = ("model", "attention", "conv", "ssm", "token_mixing")


@dataclass(frozen=True)
class Scheme:
    """One row of :data:`SCHEMES`."""

    name: str
    target: str
    plan: Callable[..., Plan]           # plan(survey, **options) -> Plan; writes nothing
    init: Callable[..., nn.Module]      # the in-place function: init(model, **options) -> model
    typed: bool = True                  # options checked against plan's annotations (False: by name only)


# (target, name) → scheme, in the order they were registered.
SCHEMES: dict[tuple[str, str], Scheme] = {}


def _register(scheme: Scheme) -> Scheme:
    key = (scheme.target, scheme.name)
    old = SCHEMES.get(key)
    if old is not None and old.init is not scheme.init and old.plan is not scheme.plan:
        raise ValueError(f"scheme {scheme.name!r} is already registered for target {scheme.target!r}; rename it")
    return SCHEMES.setdefault(key, scheme)


def register_planner(name: str, planner: Callable[..., Plan], *, target: str = "model",
                     function_name: str | None = None) -> Callable[..., nn.Module]:
    """Put a built-in planner in the table; returns its in-place function ``function_name``
    (default ``<name>_init_``), which is ``plan_init`` with the scheme fixed."""
    check_choice("target", target, TARGETS)
    what = function_name or f"{name}_init_"

    @functools.wraps(planner)
    def init(model: nn.Module, *args, **options) -> nn.Module:
        check_model(model)
        commit_and_report(_plan(SCHEMES[(target, name)], model, args, options, what), what)
        return model

    init.__name__ = init.__qualname__ = what
    sig = inspect.signature(planner)
    model = inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=nn.Module)
    example = inspect.Parameter("example_inputs", inspect.Parameter.KEYWORD_ONLY, default=None)
    params = [model, *list(sig.parameters.values())[1:]]
    at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
    init.__signature__ = sig.replace(parameters=[*params[:at], example, *params[at:]], return_annotation=nn.Module)
    return _register(Scheme(name, target, planner, init)).init


def register_scheme(name: str, fn: Callable[..., nn.Module] | None = None, *, target: str = "model"):
    """Make the in-place ``fn(model, **options) -> model`` selectable as ``init_(model, name)``
    (usable as a decorator). ``target`` says which modules it initialises (one of
    :data:`TARGETS`). Its options are checked by name against its signature; it runs when the
    plan commits, and if it raises, every parameter and buffer of the model is restored."""
    check_choice("target", target, TARGETS)

    def deco(f):
        @functools.wraps(f)
        def plan(survey: ModelSurvey, *args, **options) -> Plan:
            model = survey.model
            return Plan(actions=[lambda: f(model, *args, **options)], touched=[*model.parameters(), *model.buffers()])

        _register(Scheme(name, target, plan, f, typed=False))
        return f

    return deco(fn) if fn is not None else deco


def lookup(name: str) -> list[Scheme]:
    """Every registration of scheme ``name``, the first registered first; the one place an
    unknown name is refused (a ``ValueError`` listing the valid ones)."""
    found = [s for s in SCHEMES.values() if s.name == name] if isinstance(name, str) else []
    if not found:
        raise ValueError(f"unknown scheme {name!r}; valid names: {', '.join(schemes())}")
    return found


def option_defaults(name: str, options: dict | None = None) -> dict[str, object]:
    """The options scheme ``name`` takes that have a default, with it (every registration's; the
    first registered wins a name two share), and those of the part ``options`` choose, for a
    planner that passes ``**options`` on to one (``plan.option_defaults(options)``: impulse's
    solver)."""
    out: dict[str, object] = {}
    for scheme in reversed(lookup(name)):
        params = list(inspect.signature(scheme.plan).parameters.values())[1:]
        out |= {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        more = getattr(scheme.plan, "option_defaults", None)
        out |= more(options or {}) if more is not None else {}
    return out


def schemes(target: str | None = None) -> list[str]:
    """Names accepted by :func:`init_` (those initialising ``target`` modules, if given)."""
    if target is not None:
        check_choice("target", target, TARGETS)
    return sorted({s.name for s in SCHEMES.values() if target is None or s.target == target})


def get_scheme(name: str, target: str | None = None) -> Callable[..., nn.Module]:
    """The in-place function of scheme ``name`` (for a name registered for several targets, the
    one for ``target``; default the first registered)."""
    found = lookup(name)
    if target is None:
        return found[0].init
    check_choice("target", target, [s.target for s in found])
    return SCHEMES[(target, name)].init


def _check_seed(name: str, value: object) -> None:
    if value is not None:  # the range torch.Generator.manual_seed takes
        check_int(name, value, low=-(2**63), high=2**64 - 1)


# Options every scheme reads the same way, checked so whatever their annotation says: ``layers``
# is an index or several (as select_layers takes it), ``seed`` what a torch.Generator takes.
SHARED_OPTIONS: dict[str, Callable[[str, object], None]] = {"layers": check_layers, "seed": _check_seed}


@functools.cache
def _hints(fn: Callable) -> dict[str, object]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve: nothing is checked against it
        return {}


def _check_options(scheme: Scheme, args: tuple, options: dict, what: str) -> None:
    """The call ``scheme.plan(model, *args, **options)`` checked before it runs: an unknown
    option is an :class:`OptionError` listing the valid ones (unless the planner takes
    ``**options``), and each option given is checked against its annotation
    (:func:`~structinit.utils.checks.check_annotated`) or its :data:`SHARED_OPTIONS` rule."""
    sig = inspect.signature(scheme.plan)
    params = list(sig.parameters.values())[1:]  # after the model
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        check_options(scheme.plan, options, what, valid=named)
    try:
        bound = sig.bind(None, *args, **options)
    except TypeError as err:
        raise OptionError(f"{what}: {err}; pass the model, then options by name: {', '.join(named)}") from None
    if not scheme.typed:
        return
    hints = _hints(scheme.plan)
    for name in named:
        if name in bound.arguments:
            value = bound.arguments[name]
            if name in SHARED_OPTIONS:
                SHARED_OPTIONS[name](name, value)
            elif name in hints:
                check_annotated(name, value, hints[name])


# What an option far outside float range makes the maths raise (an SVD of inf, a float overflow).
_NUMERIC_FAILURES = (torch.linalg.LinAlgError, ZeroDivisionError, OverflowError, FloatingPointError)


def _numbers(options: dict, tensors: bool = False) -> str:
    """The numeric options given (with ``tensors``, the tensor ones), as ``k=v, …``."""
    return ", ".join(f"{k}={show(v)}" for k, v in options.items()
                     if (isinstance(v, torch.Tensor) if tensors else is_number(v) and k != "seed"))


@own_precision()
def _plan(scheme: Scheme, model: nn.Module, args: tuple, options: dict, what: str,
          survey: ModelSurvey | None = None, state: ModuleState | None = None) -> Plan:
    """``scheme.plan(survey, *args, **options)`` on a checked model, surveyed once (``survey``, or a new one)
    (:func:`~structinit.schemes.model_checks.check_model`) in its own precision (whatever the caller's autocast),
    its options checked first and its plan after: every planned value must be finite in the dtype of the tensor
    it goes to. A finite but huge (or tiny) option can still overflow: a ``ValueError`` naming the numeric options."""
    options = dict(options)
    example = options.pop("example_inputs", None)  # the survey's, whatever the scheme
    _check_options(scheme, args, options, what)
    state = state or ModuleState(model)  # the probes run the model: what their forwards cache is put back
    try:
        survey = survey or ModelSurvey(model, example_inputs=example, grid=options.get("grid"))
        plan = scheme.plan(survey, *args, **options)
    except _NUMERIC_FAILURES as err:
        given = _numbers(options) or _numbers(options, tensors=True)
        if not given:
            raise
        raise ValueError(f"{what} failed on the values given ({type(err).__name__}: {err}); one may be far too large, "
                         f"too small or degenerate (a tensor of zeros): {given}") from err
    except ValueError as err:  # a value the maths turned into NaN/inf: blame the numbers given, unless it names one
        given = _numbers(options)
        if "NaN/inf" not in str(err) or not given or any(f"{k}=" in str(err) for k in options):
            raise
        raise ValueError(f"{what}: {err}; the numeric options given: {given} (one may be far too large or too "
                         "small)") from err
    finally:
        state.restore()
    if isinstance(plan, Plan):
        plan.check_held(model, what, state.storages())
        _check_writes(plan, model, what, options)
        plan.state = state
    return plan


def _check_writes(plan: Plan, model: nn.Module, what: str, options: dict) -> None:
    for dst, value in plan.writes:
        if not (value.is_floating_point() and dst.is_floating_point()) or value.numel() == 0:
            continue
        lo, hi = torch.aminmax(value)  # NaN if any entry is NaN; then no comparison holds
        top = torch.finfo(dst.dtype).max
        if -top <= lo and hi <= top:
            continue
        names = {t.untyped_storage().data_ptr(): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
        where = names.get(dst.untyped_storage().data_ptr(), f"a {tuple(dst.shape)} tensor")
        given = f"the numeric options given: {n}" if (n := _numbers(options)) else "no numeric option was given"
        raise ValueError(f"{what} would write NaN/inf into {where} ({dst.dtype}); nothing was written. Either an "
                         f"option is too large or too small for the model ({given}), or a tensor it reads already "
                         "holds NaN/inf")
    check_no_overwrite(plan, model, what)


def commit_and_report(plan: Plan, what: str) -> None:
    """``plan.commit()``, then a warning that lists the layers the scheme left alone on purpose
    (attention-pooling heads, layers the forward never calls), if any, each with why: the caller
    must not believe they were initialised."""
    plan.commit()
    for note in plan.notes:
        warnings.warn(f"{what}: {note}", UserWarning, stacklevel=3)
    if plan.skipped:
        warnings.warn(f"{what} left alone: " + "; ".join(f"{n} ({why})" for n, why in plan.skipped)
                      + " (structinit.get_record(model, 'init') lists them)", UserWarning, stacklevel=3)


_LAYERS_OF: dict[str, Callable[[nn.Module], bool]] = {"conv": is_depthwise, "ssm": is_ssm,
                                                       "token_mixing": is_token_mixing}
_PRESENT: dict[str, Callable[[ModelSurvey], bool]] = {
    "attention": lambda survey: bool(survey.candidates),
    **{target: (lambda survey, of=of: any(of(m) for m in survey.model.modules())) for target, of in _LAYERS_OF.items()},
}


def _dispatch_record(model: nn.Module, name: str, entry: Scheme) -> dict | None:
    """What ``init_(model, name)`` says when a name that also initialises attention initialises
    another kind of layer (the model has none): the target and its layers, as the model's 'init'
    record (``structinit.get_record(model, 'init')``); None otherwise."""
    if entry.target == "attention" or all(e.target != "attention" for e in lookup(name)):
        return None
    layers = [n for n, m in model.named_modules() if _LAYERS_OF[entry.target](m)]
    return {"scheme": name, "target": entry.target, "layers": layers,
            "why": f"{type(model).__name__} has no attention; its {entry.target} layers are initialised"}


def resolve_scheme(model: nn.Module, name: str, options: dict,
                   survey: ModelSurvey | None = None) -> tuple[Scheme, dict]:
    """The registration of ``name`` that fits ``model``, and the options without ``target``.

    A name registered once is that entry (``target`` is then an unknown option, as before).
    For a name registered for several targets, ``target=`` picks one; otherwise the entry whose
    layers the model has (attention layers → 'attention', depthwise convs → 'conv', SSM layers →
    'ssm', MLP-Mixer token mixing → 'token_mixing'); a model with both needs ``target=``; a
    model with neither gets the first entry (and its error).
    """
    entries = lookup(name)
    if len(entries) == 1:
        return entries[0], options
    targets = [e.target for e in entries]
    options = dict(options)
    target = options.pop("target", None)
    if target is not None:
        check_choice("target", target, targets)
        return next(e for e in entries if e.target == target), options
    survey = ModelSurvey(model) if survey is None else survey
    present = [e for e in entries if _PRESENT.get(e.target, lambda s: False)(survey)]
    kinds = [e.target for e in present]
    if "attention" in targets and "attention" not in kinds and kinds:
        # Attention no adapter claims, beside layers of another kind: the plain call must not quietly
        # initialise the other kind instead. find_attention_layers names the attention it cannot read; a
        # model whose graph provably has none (ConvMixer) is not run to see.
        found = survey.attention if not forms_no_attention(model) else None
        unknown = [] if found is None else [*found.unknown, *found.unread]
        if found is not None and found.verdicts:  # attention only the trace read is attention all the same
            present, kinds = [next(e for e in entries if e.target == "attention"), *present], ["attention", *kinds]
        elif unknown:
            raise ValueError(
                f"scheme {name!r} initialises attention, and {type(model).__name__} has attention that no adapter "
                f"understands: {', '.join(f'{n} ({what})' for n, what in unknown)}; nothing was written. Register "
                f"an adapter for it (structinit.register_adapter), or pass target={kinds[0]!r} to initialise only "
                f"its {kinds[0]} layers")
        pooled = [] if found is None or found.verdicts else found.skipped()
        if pooled:  # attention it does not shape (fewer queries than keys) is attention all the same
            raise ValueError(
                f"scheme {name!r} initialises self-attention, and {type(model).__name__} has attention that is not "
                f"self-attention over its tokens: {', '.join(f'{n} ({what})' for n, what in pooled[:3])}"
                f"{'…' if len(pooled) > 3 else ''}; nothing was written. Pass target={kinds[0]!r} to initialise "
                f"its {kinds[0]} layers instead")
    if len(present) > 1 and "attention" in kinds:
        chosen = next(e for e in present if e.target == "attention")
        others = [t for t in kinds if t != "attention"]
        warnings.warn(f"scheme {name!r}: {type(model).__name__} has attention and {', '.join(others)} layers; the "
                      f"attention is initialised and the {', '.join(others)} layers are left as they are (pass "
                      f"target={others[0]!r} to initialise those)", UserWarning, stacklevel=4)
        return chosen, options
    if len(present) > 1:
        raise OptionError(f"target=None: scheme {name!r} exists for targets {', '.join(targets)} and "
                          f"{type(model).__name__} has layers of each ({', '.join(kinds)}); "
                          f"pass target= one of {', '.join(repr(t) for t in targets)}")
    return (present or entries)[0], options


def plan_init(model: nn.Module, scheme: str, **options) -> Plan:
    """Everything ``init_(model, scheme, **options)`` would do, checked and computed but not
    written: ``plan_init(...).commit()`` is ``init_(...)``. A bad name, option or value raises
    here with the model untouched.

    A scheme registered with :func:`register_scheme` is checked against its signature only
    (names, not types), and its plan runs it at commit.
    """
    check_model(model)
    scheme, options = _with_spec_options(scheme, options)
    example = options.pop("example_inputs", None)
    survey = ModelSurvey(model, example_inputs=example, grid=options.get("grid"))  # one per init, read by the planner
    given = "target" in options
    state = ModuleState(model)  # what an error leaves: a read may change a model (a spectral norm in train mode)
    try:
        entry, options = resolve_scheme(model, scheme, options, survey)
    finally:
        state.restore()
    plan = _plan(entry, model, (), options, f"scheme {scheme!r}", survey, state)
    said = None if given else _dispatch_record(model, scheme, entry)
    if said is not None:  # another kind of layer than the name's attention: said, never silent
        plan.records.append((model, "init", said))
    return plan


def _with_spec_options(scheme, options: dict) -> tuple[str, dict]:
    """``'impulse:kernel_size=3'`` (the command line's spec) → ('impulse', {'kernel_size': 3, …});
    an option given both in the spec and as a keyword is refused, naming it."""
    if not isinstance(scheme, str) or ":" not in scheme:
        return scheme, options
    name, given = parse_init_spec(scheme)
    both = sorted(set(given) & set(options))
    if both:
        raise ValueError(f"scheme {scheme!r}: option {both[0]!r} is given both in the spec and as a keyword "
                         f"({both[0]}={options[both[0]]!r}); give it once")
    return name, {**given, **options}


def init_(model: nn.Module, scheme: str, **options) -> nn.Module:
    """Initialise ``model`` in place with the scheme called ``scheme`` and return it.

    ``options`` go to the scheme's function (e.g. :func:`structinit.impulse_init_`); every
    scheme takes ``generator=`` or ``seed=`` for bit-reproducible weights. A name registered
    for several targets ('impulse': attention and conv) picks the one whose layers the model
    has, or the one named by ``target=`` (:func:`resolve_scheme`).

    An attention scheme checks its write in the model's own forward, on a probe it builds:
    images of the size the model states (or common sizes, or of the ``grid=`` given), else token
    ids. A model whose forward takes something else (several arguments, packed patches and
    their grid sizes) needs ``example_inputs=``: a tensor, a tuple of positional arguments or a
    dict of keyword arguments of its forward, used whole; without an input to check on, the
    write is refused.

    Examples:
        >>> model = structinit.create_model("vit_tiny_patch2_32")
        >>> _ = structinit.init_(model, "impulse", kernel_size=3, seed=0)
        >>> _ = structinit.init_(model, "mimetic", example_inputs=torch.randn(1, 3, 32, 32), seed=0)
    """
    commit_and_report(plan_init(model, scheme, **options), f"scheme {scheme!r}")
    return model

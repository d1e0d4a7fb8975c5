"""Text the user types: values (``--set lr=3e-3``) and init specs
(``impulse:target_mass=0.3,layers=(0,1)``). The command line and :func:`~structinit.harness.compare.compare`
read them with the same functions, so a value means the same thing wherever it is written."""

from __future__ import annotations

from structinit.harness.errors import user_input
from structinit.schemes.spec import _split_top_level, parse_init_spec, parse_literal
from structinit.utils import is_int

__all__ = ["check_init_specs", "parse_init_spec", "parse_literal", "parse_seeds", "spec_label", "split_init_specs"]


def split_init_specs(text: str) -> list[str]:
    """``'pytorch,impulse:pe_scale=1.0,layers=(0,1),mimetic'`` → ``['pytorch',
    'impulse:pe_scale=1.0,layers=(0,1)', 'mimetic']``; ``';'`` also separates specs.

    A comma-separated piece that holds ``key=value`` and no ``name:`` belongs to the spec
    before it (scheme names never contain ``=``); commas inside brackets belong to values.
    """
    specs: list[str] = []
    for chunk in text.split(";"):
        for piece in _split_top_level(chunk):
            piece = piece.strip()
            if not piece:
                continue
            if "=" in piece and ":" not in piece.split("=", 1)[0]:  # key=value with no name: an option
                if not specs or ":" not in specs[-1]:
                    raise ValueError(f"init list {text!r}: option {piece!r} follows no 'scheme:' to belong to")
                specs[-1] += "," + piece
            else:
                specs.append(piece)
    return specs


def spec_label(spec: str) -> str:
    """The folder an init spec's runs go in: ``impulse:pe_scale=2`` → ``impulse_pe_scale-2``;
    a path in an option (``covariance_transfer:source=runs/a/model.safetensors``) stays one
    folder name (``/`` → ``+``)."""
    return spec.replace(":", "_").replace(",", "_").replace("=", "-").replace("/", "+").replace("\\", "+")


MAX_SEED_COUNT = 10_000  # a count past this is a typo, not a study (each seed is a run)


def parse_seeds(seeds: str | int | list[int]) -> list[int]:
    """Seeds from a count (``3`` or ``"3"`` → 0, 1, 2) or a list (``"0,4,7"`` or ``[0, 4, 7]``) of
    distinct seeds in [0, 2⁶³); a ValueError marked as the input ``seeds`` otherwise (a seed given
    twice would be one run counted twice).

    Examples:
        >>> parse_seeds("3"), parse_seeds("0,4,7"), parse_seeds([5])
        ([0, 1, 2], [0, 4, 7], [5])
    """
    value = parse_literal(seeds) if isinstance(seeds, str) else seeds  # "3" → 3, "0,4,7" → (0, 4, 7)
    given = f"--seeds {seeds!r}" if isinstance(seeds, str) else f"seeds={seeds!r}"  # the command line's words
    with user_input("seeds"):
        if is_int(value) and 1 <= value <= MAX_SEED_COUNT:
            return list(range(int(value)))
        if is_int(value) and value > MAX_SEED_COUNT:
            one = (f"to run seed {value} alone, give a list of one: --seeds {value}, (seeds=[{value}])"
                   if value < 2**63 else "a seed is a whole number in [0, 2**63)")
            raise ValueError(f"{given}: a count of {value} seeds is {value} runs; a count is at most "
                             f"{MAX_SEED_COUNT:,}; {one}")
        if isinstance(value, (list, tuple)) and value and all(is_int(s) for s in value):
            out = [int(s) for s in value]
            bad = next((s for s in out if not 0 <= s < 2**63), None)
            if bad is not None:
                raise ValueError(f"{given}: seed {bad} is not a whole number in [0, 2**63); use seeds such as 0,4,7")
            twice = next((s for k, s in enumerate(out) if s in out[:k]), None)
            if twice is not None:
                raise ValueError(f"{given}: seed {twice} is given twice; each seed is one run, so list each once")
            return out
        hint = ""
        if is_int(value) and value <= 0:  # "--seeds 0" usually means "seed 0 alone"
            hint = "; a count is at least 1: seed 0 alone is a count of 1 (--seeds 1), or a list such as 0,5"
        raise ValueError(f"{given}: expected a count (3 means seeds 0, 1, 2) or a list (0,4,7){hint}")


def _same(default: object, value: object) -> bool:
    """Whether an option's ``value`` is its ``default`` (1 and 1.0 alike)."""
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (default, value))
    return float(default) == float(value) if numbers else repr(default) == repr(value)


def _defaults(name: str, options: dict) -> dict[str, object]:
    """Scheme ``name``'s option defaults; none for a name no scheme has (refused where it runs)."""
    from structinit.schemes.registry import option_defaults

    try:
        return option_defaults(name, options)
    except ValueError:
        return {}


def check_init_specs(inits) -> list[str]:
    """The init specs of a comparison as a list: a string is split as ``--inits`` splits it
    (``"pytorch,impulse:kernel_size=5"``); a ValueError marked as the input ``init`` when there is
    none, one is not a string, or two name the same init with the same options.

    Examples:
        >>> check_init_specs("pytorch,impulse:kernel_size=5")
        ['pytorch', 'impulse:kernel_size=5']
    """
    with user_input("init"):
        specs = split_init_specs(inits) if isinstance(inits, str) else inits
        if not isinstance(specs, (list, tuple)) or not specs or not all(isinstance(s, str) for s in specs):
            raise ValueError(f"inits={inits!r}: expected init specs, a list such as ['pytorch', 'impulse'] or a "
                             "string such as 'pytorch,impulse'")
        seen: dict[tuple, str] = {}
        for spec in specs:
            name, options = parse_init_spec(spec)
            defaults = _defaults(name, options)  # an option set to its default names the init without it
            given = {k: v for k, v in options.items() if not (k in defaults and _same(defaults[k], v))}
            key = (name, tuple(sorted((k, repr(v)) for k, v in given.items())))
            if key in seen:
                said = [f"{k}={v!r}" for k, v in options.items() if k not in given]
                why = f" ({', '.join(said)}: {'its default' if len(said) == 1 else 'its defaults'})" if said else ""
                raise ValueError(f"init spec {spec!r} names the same init as {seen[key]!r}{why}; each init is one "
                                 "set of runs, so list each once")
            seen[key] = spec
        return list(specs)

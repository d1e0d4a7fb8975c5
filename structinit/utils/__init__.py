"""Pieces every layer of structinit shares: the one registry class, argument checks, and
seeding. Nothing here imports from the rest of the package."""

from structinit.utils.checks import (
    OptionError,
    check_choice,
    check_finite,
    check_int,
    check_number,
    check_options,
    is_int,
    is_number,
    warn_caller,
)
from structinit.utils.registry import Registry
from structinit.utils.seeding import check_generator, derive_seed, derived_generator, make_generator
from structinit.utils.transfer import to_device

__all__ = [
    "OptionError", "Registry", "check_choice", "check_finite", "check_generator", "check_int",
    "check_number", "check_options", "derive_seed", "derived_generator", "is_int", "is_number",
    "make_generator", "to_device", "warn_caller",
]  # fmt: skip

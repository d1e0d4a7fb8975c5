"""Imports of the optional packages that only the harness extra installs (scikit-learn,
matplotlib, pillow, tqdm, safetensors). ``import structinit`` needs none of them; the code
that does imports them through :func:`require`, at first use, so that a missing one says how
to install it.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

__all__ = ["HARNESS_INSTALL", "HARNESS_MODULES", "require", "require_harness"]

HARNESS_INSTALL = 'pip install -e ".[harness]" in a clone of structinit (the package torch-structinit)'
# import name → the name pip knows it by
_PACKAGES = {"PIL": "pillow", "sklearn": "scikit-learn"}
# What the harness extra installs that every harness command may use (mambapy, for the Mamba
# models alone, is asked for where it is used).
HARNESS_MODULES = ("sklearn", "matplotlib", "PIL", "tqdm", "safetensors")


def require(module: str, purpose: str) -> ModuleType:
    """``module`` imported, or an ``ImportError`` that names the package, what needs it
    (``purpose``) and the install command of the harness extra."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        top = module.partition(".")[0]
        package = _PACKAGES.get(top, top)
        raise ImportError(
            f"{purpose} needs the {package} package, which is not installed or does not import ({err}); "
            f"install the harness extra: {HARNESS_INSTALL}",
            name=err.name,
        ) from err


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module entry set to None
        return False


def require_harness(purpose: str) -> None:
    """Raise one ``ImportError`` that lists every package of :data:`HARNESS_MODULES` that is
    not installed, names ``purpose`` and the install command; nothing when all are. A command
    checks this before it starts, so that a base install is told at once, not hours into a run.
    It looks the packages up without importing them (sklearn alone takes half a second); one
    that is installed but broken is reported by :func:`require` where it is used."""
    missing = [_PACKAGES.get(m, m) for m in HARNESS_MODULES if not _installed(m)]
    if missing:
        raise ImportError(f"{purpose} needs the harness extra, and {', '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not installed; install it: {HARNESS_INSTALL}")

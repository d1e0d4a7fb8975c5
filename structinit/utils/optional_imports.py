"""Imports of the optional packages that only the harness extra installs (scikit-learn,
matplotlib, pillow, tqdm, safetensors). ``import structinit`` needs none of them; the code
that does imports them through :func:`require`, at first use, so that a missing one says how
to install it.
"""

from __future__ import annotations

import importlib
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


def require_harness(purpose: str) -> None:
    """Raise one ``ImportError`` that lists every package of :data:`HARNESS_MODULES` that does
    not import, names ``purpose`` and the install command; nothing when all import. A command
    checks this before it starts, so that a base install is told at once, not hours into a run."""
    missing = []
    for module in HARNESS_MODULES:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(_PACKAGES.get(module, module))
    if missing:
        raise ImportError(f"{purpose} needs the harness extra, and {', '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not installed; install it: {HARNESS_INSTALL}")

"""Imports of the optional packages that only the harness extra installs (scikit-learn,
matplotlib, pillow, tqdm, safetensors). ``import structinit`` needs none of them; the code
that does imports them through :func:`require`, at first use, so that a missing one says how
to install it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["HARNESS_INSTALL", "require"]

HARNESS_INSTALL = 'pip install -e ".[harness]" in a clone of structinit (the package torch-structinit)'
# import name → the name pip knows it by
_PACKAGES = {"PIL": "pillow", "sklearn": "scikit-learn"}


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

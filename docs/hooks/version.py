"""mkdocs hook: the footer names the version, read from ``structinit.__version__`` (the one
place it is written) without importing the package."""

import ast
from pathlib import Path


def package_version() -> str:
    tree = ast.parse((Path(__file__).resolve().parents[2] / "structinit" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise RuntimeError("structinit/__init__.py sets no __version__")


def on_config(config):
    config["copyright"] = f"structinit {package_version()} · MIT licence"
    return config

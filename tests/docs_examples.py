"""The ```python blocks of the documentation (docs/**/*.md and README.md), found and run.

A block is skipped when the line before its fence is an HTML comment
``<!-- no-test: WHY -->`` (it needs a dataset on disk, a GPU, …), and when it imports a
package of the zoo venv that is not importable here (``ZOO_PACKAGES``):
``tests/zoo/test_docs_examples.py`` runs those in ``.venv-zoo`` (``bash scripts/test_zoo.sh``).
Each block runs on its own, in a fresh namespace, in a temporary working directory, on one
thread, with warnings as errors; every registry of structinit is restored afterwards, so an example that
registers an adapter, a scheme or a recipe leaves nothing behind.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Packages a block may import that only the zoo venv has (the main venv has transformers).
ZOO_PACKAGES = ("timm", "torchvision", "vit_pytorch", "open_clip")

FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
NO_TEST = re.compile(r"<!--\s*no-test:\s*(?P<why>.+?)\s*-->\s*$")


@dataclass(frozen=True)
class Example:
    path: str  # relative to the repository root
    line: int  # of the opening fence
    code: str
    skip: str | None  # the no-test reason, if any

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"

    def packages(self) -> list[str]:
        """The zoo packages this block imports."""
        return [m for m in ZOO_PACKAGES if re.search(rf"^\s*(import|from) {m}\b", self.code, flags=re.M)]


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def examples() -> list[Example]:
    """Every ```python block, in file order."""
    found = []
    for path in markdown_files():
        text = path.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = NO_TEST.search(before)
            found.append(Example(str(path.relative_to(ROOT)), text.count("\n", 0, match.start()) + 1,
                                 match.group(1), marker["why"] if marker else None))
    return found


def missing_packages(example: Example) -> list[str]:
    return [m for m in example.packages() if importlib.util.find_spec(m) is None]


def _registries() -> list:
    from structinit.utils import Registry

    seen: dict[int, Registry] = {}
    for name, module in list(sys.modules.items()):
        if name == "structinit" or name.startswith("structinit."):
            for value in list(vars(module).values()):
                if isinstance(value, Registry):
                    seen[id(value)] = value
    return list(seen.values())


def run_example(example: Example, workdir: Path) -> dict:
    """Run the block in ``workdir``; return its namespace. Registries are restored after."""
    import torch

    import structinit.harness.recipes  # noqa: F401  (loads every registry, to snapshot them)
    from structinit.schemes import SCHEMES  # the scheme table is a plain dict, not a Registry

    saved = [(r, dict(r._entries)) for r in _registries()]
    schemes = dict(SCHEMES)
    cwd, threads = os.getcwd(), torch.get_num_threads()
    scope: dict = {"__name__": "__docs_example__"}
    torch.manual_seed(0)
    try:
        os.chdir(workdir)
        torch.set_num_threads(1)  # tiny models: one thread is as fast, and immune to a busy machine
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            exec(compile(example.code, example.name, "exec"), scope)
    finally:
        os.chdir(cwd)
        torch.set_num_threads(threads)
        for registry, entries in saved:
            registry._entries = entries
        SCHEMES.clear()
        SCHEMES.update(schemes)
    return scope


# The tables of docs/harness/configs.md, generated from the config classes' fields and facts.
CONFIGS_PAGE = ROOT / "docs" / "harness" / "configs.md"
TABLE = re.compile(r"(<!-- fields: (?P<name>\w+) -->\n)(.*?)(<!-- /fields -->)", re.S)


def _default(field) -> str:
    import dataclasses

    if field.default_factory is not dataclasses.MISSING:
        return f"`{field.default_factory()!r}`"
    return f"`{field.default!r}`"


def _flag(cls, name: str) -> str:
    """How the command line sets field ``name``: its flag, the flag of the spec that carries it,
    the command's own flag (train's, and compare's where it differs), or ``--set``."""
    import dataclasses

    from structinit.harness import config
    from structinit.harness.cli.main import OWNED

    fact = config.facts(cls, name)
    if name in OWNED["train"]:
        train, compare = OWNED["train"][name], OWNED["compare"].get(name)
        return f"`{train}`" + (f" (compare: `{compare}`)" if compare and compare != train else "")
    if fact.flag:
        return f"`{fact.flag}`"
    for other in dataclasses.fields(cls):
        carrier = config.facts(cls, other.name)
        if carrier.spec_of == name and carrier.flag:
            return f"`{carrier.flag}` (its spec's options)"
    return f"`--set {name}=…`"


def config_table(name: str) -> str:
    """The Markdown table of config class ``name``: for RunConfig every field; for a subclass
    the fields it adds and those whose default it changes."""
    import dataclasses

    from structinit.harness import config

    cls = getattr(config, name)
    base = {f.name: f for f in dataclasses.fields(config.RunConfig)}
    rows = ["| field | default | flag | meaning |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        inherited = cls is not config.RunConfig and field.name in base
        if inherited and _default(field) == _default(base[field.name]):
            continue
        fact = config.facts(cls, field.name)
        flag = _flag(cls, field.name)
        meaning = fact.help.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
        meaning += " (its default here)" if inherited else ""
        rows.append(f"| `{field.name}` | {_default(field)} | {flag} | {meaning} |")
    return "\n".join(rows) + "\n"


def configs_page(text: str) -> str:
    """``text`` (the configs page) with every generated table brought up to date."""
    return TABLE.sub(lambda m: m.group(1) + config_table(m["name"]) + m.group(4), text)

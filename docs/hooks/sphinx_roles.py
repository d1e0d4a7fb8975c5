"""A Griffe extension for the API reference: the docstrings' Sphinx roles as links.

The docstrings are Google style and cross-reference with Sphinx roles (:func:`x`,
:class:`~a.b.C`, :class:`Title <a.b.C>`, :mod:`x`, …), which Markdown would show as raw
text. Once the ``structinit`` package is loaded, this rewrites each role into an *optional*
autorefs link: a link where the target is rendered somewhere in the site, the name in code
otherwise, so ``mkdocs build --strict`` never fails on a reference to an object the reference
pages leave out.

Names are resolved as Sphinx would: relative to the object, its class and its module; through
imports (aliases) to where the object is defined; an in-place scheme function
(``impulse_init_ = register_planner("impulse", plan_impulse, …)``) to its planner, which holds
its docstring; and the harness names ``structinit`` imports on first use (``_LAZY``) to their
modules.
"""

from __future__ import annotations

import ast
import html
import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|obj|exc|const):`(?P<body>[^`]+)`")
TITLED = re.compile(r"^(?P<title>.+?)\s*<(?P<target>[^<>]+)>$")
PLANNER = re.compile(r"^register_planner\([^,]+,\s*(?P<planner>\w+)")


def _walk(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)


def _redirects(pkg: griffe.Module) -> dict[str, str]:
    """identifier → the identifier that holds its documentation."""
    found: dict[str, str] = {}
    for obj in _walk(pkg):
        if obj.is_attribute and obj.value is not None:
            match = PLANNER.match(str(obj.value))
            if match and match["planner"] in obj.parent.members:
                found[obj.path] = f"{obj.parent.path}.{match['planner']}"
                found[f"{pkg.path}.{obj.name}"] = found[obj.path]
    lazy = pkg.members.get("_LAZY")
    if lazy is not None and lazy.is_attribute and lazy.value is not None:
        try:
            for name, module in ast.literal_eval(str(lazy.value)).items():
                found[f"{pkg.path}.{name}"] = f"{module}.{name}"
        except (ValueError, SyntaxError):
            pass
    return found


def _resolve(name: str, obj: griffe.Object) -> str:
    """The full identifier of ``name`` as written in ``obj``'s docstring."""
    name = name.lstrip(".")
    head, _, rest = name.partition(".")
    if head == "structinit":
        return name
    for scope in (obj, obj.parent, obj.module):
        if scope is None or head not in scope.members:
            continue
        member = scope.members[head]
        base = member.target_path if member.is_alias else member.path
        return f"{base}.{rest}" if rest else base
    return name


def rewrite(text: str, obj: griffe.Object, redirects: dict[str, str]) -> str:
    """``text`` with every Sphinx role replaced by an optional autorefs link."""

    def link(match: re.Match) -> str:
        body = match["body"].strip()
        titled = TITLED.match(body)
        if titled:
            title, name = titled["title"], titled["target"]
        else:
            name = body.lstrip("~")
            title = name.rsplit(".", 1)[-1] if body.startswith("~") else name
        identifier = _resolve(name, obj)
        identifier = redirects.get(identifier, identifier)
        return f'<autoref identifier="{html.escape(identifier)}" optional><code>{html.escape(title)}</code></autoref>'

    return ROLE.sub(link, text)


class SphinxRoles(griffe.Extension):
    """Rewrite the Sphinx roles of every docstring of a package once it is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        redirects = _redirects(pkg)
        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = rewrite(obj.docstring.value, obj, redirects)

"""The built documentation shows no raw Markdown: what ``mkdocs build --strict`` lets through,
such as a table or a list swallowed by a list item and printed as text. The site is built once
into a temporary folder and every paragraph, list item and table cell of every page is read."""

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What Markdown looks like when it was not rendered: a table row or rule, bold or a link left in
# its markup, a list marker or a heading at the start of a line of running text, a code fence.
RAW = [
    (re.compile(r"(^|\n)\s*\|[^\n]*\|\s*(\n|$)"), "a table row"),
    (re.compile(r"\|\s*:?-{3,}:?\s*\|"), "a table rule"),
    (re.compile(r"\*\*[^*\s][^*]*\*\*"), "bold markup"),
    (re.compile(r"\]\([^)\s]+\)"), "a link's markup"),
    (re.compile(r"\n\s*(?:[-*+]|\d+\.) \S"), "a list marker"),
    (re.compile(r"(^|\n)#{1,6} \S"), "a heading's markup"),
    (re.compile(r"```"), "a code fence"),
]


class _Text(HTMLParser):
    """The text of every <p>, <li>, <td> and <th> outside code, one string per element."""

    BLOCKS = frozenset({"p", "li", "td", "th"})

    def __init__(self):
        super().__init__()
        self.stack, self.code, self.out = [], 0, []

    def handle_starttag(self, tag, attrs):
        if tag in ("code", "pre", "script", "style"):
            self.code += 1
        if tag in self.BLOCKS:
            self.stack.append([])

    def handle_endtag(self, tag):
        if tag in ("code", "pre", "script", "style"):
            self.code -= 1
        if tag in self.BLOCKS and self.stack:
            self.out.append("".join(self.stack.pop()))

    def handle_data(self, data):
        if self.stack and not self.code:
            self.stack[-1].append(data)


def raw_markdown(html: str) -> list[tuple[str, str]]:
    """(what, the text around it) for each piece of raw Markdown in ``html``'s running text."""
    parser = _Text()
    parser.feed(html)
    found = []
    for text in parser.out:
        for pattern, what in RAW:
            m = pattern.search(text)
            if m:
                found.append((what, text[max(0, m.start() - 60):m.end() + 60].strip()))
    return found


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    built = os.environ.get("STRUCTINIT_DOCS_SITE")  # scripts/test.sh builds the site (--strict) just before
    if built and (Path(built) / "index.html").is_file():
        return Path(built)
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--quiet", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, env={"NO_MKDOCS_2_WARNING": "1", "PATH": ""})
    assert done.returncode == 0, done.stderr
    return out


def test_no_page_shows_raw_markdown(site):
    pages = sorted(p for p in site.rglob("*.html") if "assets" not in p.parts)
    assert len(pages) > 20
    bad = [(str(p.relative_to(site)), what, text) for p in pages for what, text in raw_markdown(p.read_text())]
    assert not bad, "raw Markdown in the built docs:\n" + "\n".join(f"{p}: {w}: …{t}…" for p, w, t in bad[:20])


def test_the_check_sees_a_table_swallowed_by_a_list_item():
    # What Python-Markdown makes of a list item holding an indented table and more items.
    html = ("<ul><li><p><strong>Mimetic pays.</strong> Gain:</p><p>| | CIFAR-10 |\n|---|---|\n| mimetic | +1.8 |\n"
            "- <strong>The gain does not shrink.</strong></p></li></ul>")
    assert {what for what, _ in raw_markdown(html)} >= {"a table row", "a table rule", "a list marker"}
    assert raw_markdown("<p>A <strong>rendered</strong> page with <code>| a | b |</code> in code.</p>") == []


def test_the_api_reference_documents_each_object_once(site):
    """An object mkdocstrings renders has a heading whose id is its dotted path; the API pages
    must not render one object under several paths (``structinit.init_`` and
    ``structinit.schemes.registry.init_``), which reads as three functions."""
    ids = [i for p in sorted((site / "api").rglob("*.html")) for i in re.findall(r'id="(structinit\.[\w.]+)"',
                                                                                    p.read_text())]
    by_name: dict[str, list[str]] = {}
    for dotted in dict.fromkeys(ids):
        by_name.setdefault(dotted.rsplit(".", 1)[-1], []).append(dotted)
    for name in ("init_", "plan_init", "Plan", "register_scheme", "get_record", "set_record"):
        assert len(by_name.get(name, [])) == 1, f"{name} is rendered as {by_name.get(name)}"

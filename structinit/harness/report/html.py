"""The building blocks of ``structinit report``'s page: escaped text, tables, figures embedded
as PNG data URIs, a small Markdown reader (headings, tables, lists, paragraphs) and the page
itself with its inline style and script. The page loads nothing: no external CSS, script,
font or image, so it reads the same offline, in a mail attachment or years later.

Every piece of text that comes from data (init specs, config values, file contents) goes
through :func:`esc`; the functions here return HTML strings that are safe to concatenate.
"""

from __future__ import annotations

import base64
import html
import io
import json
import re
from collections.abc import Iterable, Sequence
from importlib import resources

from structinit.harness.config import facts
from structinit.harness.tasks import config_fields
from structinit.utils.optional_imports import require

__all__ = ["config_html", "esc", "figure", "figure_png", "json_html", "markdown", "note", "page",
           "split_config", "table", "versions_html"]

# The page's style and script, kept beside this module as the files they are; inlined in every page.
CSS = (resources.files(__package__) / "page.css").read_text(encoding="utf-8")
SCRIPT = (resources.files(__package__) / "page.js").read_text(encoding="utf-8")


def esc(value: object) -> str:
    """``value`` as text, HTML-escaped (quotes too: safe inside attributes)."""
    return html.escape(str(value), quote=True)


def figure_png(fig) -> bytes:
    """A matplotlib Figure rendered to PNG bytes in memory (and closed)."""
    plt = require("matplotlib.pyplot", "the report's figures")
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", bbox_inches="tight")
    finally:
        plt.close(fig)
    return buffer.getvalue()


def figure(png: bytes, alt: str, caption_html: str) -> str:
    """An embedded PNG with its caption (``caption_html`` is HTML: escape its text first)."""
    uri = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
    return (f'<figure><img src="{uri}" alt="{esc(alt)}">'
            f"<figcaption>{caption_html}</figcaption></figure>")


def note(text: str) -> str:
    """A visible remark in the page (something skipped, and why)."""
    return f'<p class="note">{esc(text)}</p>'


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], numeric: Iterable[int] = (),
          row_classes: Sequence[str] | None = None, raw: bool = False) -> str:
    """An HTML table. Headers and cells are escaped unless ``raw`` (they are already HTML); the
    columns in ``numeric`` are right-aligned."""
    numeric = set(numeric)
    cell = (lambda v: str(v)) if raw else esc

    def attrs(i: int) -> str:
        return ' class="num"' if i in numeric else ""

    head = "".join(f"<th{attrs(i)}>{cell(h)}</th>" for i, h in enumerate(headers))
    body = []
    for r, row in enumerate(rows):
        cls = row_classes[r] if row_classes and row_classes[r] else ""
        tr = f'<tr class="{esc(cls)}">' if cls else "<tr>"
        body.append(tr + "".join(f"<td{attrs(i)}>{cell(v)}</td>" for i, v in enumerate(row)) + "</tr>")
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'


_BULLET = re.compile(r"^\s*[-*] ")


def _inline(text: str) -> str:
    """Escaped text with Markdown's `code` and **bold** turned into tags."""
    out = esc(text)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _md_table(lines: list[str]) -> str:
    header, rows = _cells(lines[0]), [_cells(ln) for ln in lines[1:]]
    numeric: set[int] = set()
    if rows and all(re.fullmatch(r":?-+:?", c) for c in rows[0]):
        numeric = {i for i, c in enumerate(rows[0]) if c.endswith(":") and not c.startswith(":")}
        rows = rows[1:]
    width = len(header)
    rows = [(r + [""] * width)[:width] for r in rows]
    return table([_inline(h) for h in header], [[_inline(c) for c in r] for r in rows], numeric, raw=True)


def markdown(text: str) -> str:
    """A small, safe subset of Markdown as HTML: ``#`` headings (shown one level below the
    page's sections), ``|`` tables, ``-``/``*`` lists, fenced code blocks and paragraphs; `code`
    and **bold** inline. Everything else is escaped text: nothing in ``text`` becomes markup."""
    blocks, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].rstrip()
        kind = _kind(line)
        if not line.strip():
            i += 1
        elif kind == "fence":
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```")), len(lines))
            blocks.append(f"<pre><code>{esc(chr(10).join(lines[i + 1:end]))}</code></pre>")
            i = end + 1
        elif kind == "heading":
            level = min(len(line) - len(line.lstrip("#")) + 2, 6)
            blocks.append(f"<h{level}>{_inline(line.lstrip('#').strip())}</h{level}>")
            i += 1
        else:
            group = []
            while i < len(lines) and lines[i].strip() and _kind(lines[i]) == kind:
                group.append(lines[i])
                i += 1
            if kind == "table":
                blocks.append(_md_table(group))
            elif kind == "list":
                blocks.append("<ul>" + "".join(f"<li>{_inline(_BULLET.sub('', g))}</li>" for g in group) + "</ul>")
            else:
                blocks.append(f"<p>{_inline(' '.join(g.strip() for g in group))}</p>")
    return "\n".join(blocks)


def _kind(line: str) -> str:
    if line.lstrip().startswith("```"):
        return "fence"
    if line.lstrip().startswith("|"):
        return "table"
    if _BULLET.match(line):
        return "list"
    return "heading" if line.startswith("#") else "para"


def page(title: str, subtitle: str, intro_html: str, sections: Sequence[tuple[str, str, str]],
         footer_html: str) -> str:
    """The whole self-contained page: a title, an introduction, a table of contents and the
    ``sections`` (anchor, heading, body HTML); ``<body data-images-total>`` counts its images."""
    toc = "".join(f'<a href="#{esc(a)}">{esc(h)}</a>' for a, h, _ in sections)
    body = "".join(f'<section id="{esc(a)}"><h2>{esc(h)}</h2>{b}</section>' for a, h, b in sections)
    main = (f"<main><header><h1>{esc(title)}</h1><p class=\"subtitle\">{esc(subtitle)}</p>"
            f'<p class="intro">{intro_html}</p><nav class="toc">On this page: {toc}</nav></header>'
            f"{body}<footer>{footer_html}</footer></main>")
    total = main.count("<img ")
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{esc(title)}</title>\n<style>{CSS}</style>\n</head>\n"
            f'<body data-images-total="{total}">\n{main}\n<script>{SCRIPT}</script>\n</body>\n</html>\n')


# ----------------------------------------------------------------------------- sections from runs
# Settings each run has for itself: shown with the seeds, not in the configuration.
PER_RUN = ("out_dir", "seed")


def split_config(groups) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """(settings every run shares: field → value, the others: init → field → value) of the
    runs' TrainConfigs; the init and its options are always per init when there are several,
    and ``out_dir`` and ``seed`` are per run (left out)."""
    per_group = {}
    for name, group in groups.items():
        values: dict[str, list[str]] = {}
        for r in group:
            for key, value in r.result["config"].items():
                if key not in PER_RUN:
                    values.setdefault(key, []).append(value if isinstance(value, str) else repr(value))
        per_group[name] = {k: " / ".join(dict.fromkeys(v)) for k, v in values.items()}
    keys = sorted(dict.fromkeys(k for g in per_group.values() for k in g), key=_field_order)
    shared = {}
    for key in keys:
        found = {g.get(key, "–") for g in per_group.values()}
        if len(found) == 1 and not (key in ("init", "init_options") and len(groups) > 1):
            shared[key] = found.pop()
    differing = {name: {k: g.get(k, "–") for k in keys if k not in shared} for name, g in per_group.items()}
    return shared, differing


def _field_order(key: str) -> tuple[int, str]:
    """The config classes' own order (model and init first, output last); unknown keys after."""
    order = list(config_fields())
    return (order.index(key), "") if key in order else (len(order), key)


def _meaning(config: type, key: str) -> str:
    try:
        return facts(config, key).help
    except KeyError:  # a field of an older version
        return ""


def config_html(groups) -> str:
    shared, differing = split_config(groups)
    config = next(iter(groups.values()))[0].kind.config
    html = (f'<p class="caption">The training settings (structinit {config.__name__} fields, as each run\'s '
            "result.json records them). Settings shared by every run:</p>")
    html += table(["setting", "value", "meaning"], [[k, v, _meaning(config, k)] for k, v in shared.items()])
    columns = list(next(iter(differing.values()))) if differing else []
    if columns:
        html += '<h3>Settings that differ between inits</h3>'
        html += table(["compared as", *columns], [[name, *row.values()] for name, row in differing.items()])
    return html


def versions_html(groups) -> str:
    rows = [[name, ", ".join(str(r.result["seed"]) for r in g), str(len(g))] for name, g in groups.items()]
    html = table(["init", "seeds", "runs"], rows, numeric=(2,))
    html += ('<p class="caption">A seed fixes the model\'s construction, the init\'s random draws, the order of '
             "the training images and the augmentation: the same seed gives the same run again.</p>")
    versions = {}
    for name, group in groups.items():
        for r in group:
            v = r.result.get("versions", {})
            key = tuple(str(v.get(k, "–")) for k in ("python", "torch", "structinit", "platform"))
            versions.setdefault(key, []).append(f"{name} seed {r.result['seed']}")
    rows = [[*key, "all runs" if len(versions) == 1 else ", ".join(who)] for key, who in versions.items()]
    return html + "<h3>Software</h3>" + table(["python", "torch", "structinit", "platform", "runs"], rows)


def json_html(data: dict, name: str, folded: Sequence[str] = (), limit: int = 80) -> str:
    """The entries of a JSON object (nested objects flattened to dotted keys, lists of objects
    counted, objects named in ``folded`` only in the full text) as a table of at most ``limit``
    rows, and all of it folded away below."""
    rows: list[list[str]] = []

    def walk(prefix: str, value) -> None:
        if prefix.rpartition(".")[2] in folded and isinstance(value, dict):
            rows.append([prefix, f"{len(value)} entries (see all of {name} below)"])
        elif isinstance(value, dict) and value:
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
            rows.append([prefix, f"{len(value)} entries (see all of {name} below)"])
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            rows.append([prefix, text if len(text) <= 300 else text[:300] + " …"])

    walk("", data)
    dump = json.dumps(data, indent=2, default=str)
    html = table(["entry", "value"], rows[:limit])
    if len(rows) > limit:
        html += note(f"{len(rows) - limit} more entries are only in the full {name} below.")
    return html + (f"<details><summary>All of {esc(name)} ({len(dump):,} characters)</summary>"
                   f"<pre>{esc(dump[:50_000])}</pre></details>")

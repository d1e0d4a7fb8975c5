"""``structinit report``: one self-contained HTML page for a compare or ablate folder. The page
parses, holds the results table and figures that decode as PNG, refers to nothing outside
itself, escapes what it shows; bad folders and unwritable places fail clearly; ``compare``
writes the page and survives a failure to draw it."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest

from structinit.harness.cli.main import main
from structinit.harness.compare import compare
from structinit.harness.recipes import recipe
from structinit.harness.report import page as report

plt = pytest.importorskip("matplotlib.pyplot")

INITS = ["pytorch", "impulse"]
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


def tiny_compare(out: Path) -> Path:
    """2 inits × 1 seed, 1 epoch on 64 digits images: seconds."""
    compare(recipe("digits", epochs=1, train_size=64), INITS, [0], out, progress=False)
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_compare(tmp_path_factory.mktemp("report") / "cmp")


class Page(HTMLParser):
    """The page's elements, checked to nest properly, with the text of its title and table rows."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.elements: list[tuple[str, dict]] = []
        self.rows: list[list[str]] = []
        self.title = ""
        self.feed(text)
        self.close()
        assert not self.stack, f"unclosed elements: {self.stack}"

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))
        if tag == "tr":
            self.rows.append([])
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()

    def handle_data(self, data):
        if "title" in self.stack:
            self.title += data
        if "td" in self.stack or "th" in self.stack:
            self.rows[-1].append(data.strip())

    def attrs(self, tag: str) -> list[dict]:
        return [a for t, a in self.elements if t == tag]


def decoded_images(page: Page) -> list[tuple[int, int]]:
    """(height, width) of every <img>, each a PNG data URI decoded with matplotlib."""
    sizes = []
    for img in page.attrs("img"):
        prefix, _, data = img["src"].partition(",")
        assert prefix == "data:image/png;base64", img["src"][:60]
        image = plt.imread(io.BytesIO(base64.b64decode(data)), format="png")
        sizes.append(image.shape[:2])
    return sizes


def test_compare_writes_a_self_contained_report(folder):
    text = (folder / "report.html").read_text()
    page = Page(text)
    assert page.title.startswith("Attention initialisations compared: pytorch, impulse")
    rows = {r[0]: r for r in page.rows if r and r[0] in INITS and len(r) == 6}
    assert set(rows) == set(INITS)  # the results table: one row per init
    for row in rows.values():
        assert row[1] == "test_acc" and re.fullmatch(r"\d+\.\d\d ± \d+\.\d\d", row[2])
    sizes = decoded_images(page)
    assert len(sizes) == 3 and all(h > 0 and w > 0 for h, w in sizes)  # curves, attention at init and trained
    body = page.attrs("body")[0]
    assert body["data-images-total"] == "3"
    assert "imagesDecoded" in text  # the script the browser test reads
    for tag, attrs in page.elements:
        for key in ("src", "href"):
            assert not re.match(r"\s*(https?:)?//", attrs.get(key) or ""), (tag, attrs)
        assert tag not in ("link", "iframe", "object") and not (tag == "script" and "src" in attrs)
    assert "http://" not in text and "https://" not in text
    for words in ("Training curves", "At initialisation.", "After training.", "Settings shared by every run",
                  "Software", "2.13", "the first 8 test images of digits"):
        assert words in text, words


def test_report_command_writes_elsewhere_with_out(folder, tmp_path, capsys):
    out = tmp_path / "pages" / "page.html"
    assert main(["report", str(folder), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"→ {out}"
    assert Page(out.read_text()).title.startswith("Attention initialisations compared")
    assert report.report_path(folder, tmp_path) == tmp_path / "report.html"  # a folder: report.html in it


def test_a_dataset_that_cannot_be_loaded_leaves_a_note(folder, tmp_path, monkeypatch):
    from structinit.data import DatasetNotFoundError

    def missing(cfg, n):
        raise DatasetNotFoundError("data_dir=/nowhere does not exist")

    monkeypatch.setattr(report, "eval_images", missing)
    page = Page(report.write_report(folder, tmp_path / "r.html").read_text())
    notes = [a for a in page.attrs("p") if a.get("class") == "note"]
    assert notes and len(decoded_images(page)) == 1  # the curves only
    text = (tmp_path / "r.html").read_text()
    assert "pytorch: no attention maps, the dataset &#x27;digits&#x27; could not be loaded here" in text


def test_runs_the_summary_does_not_list_are_left_out_with_a_note(folder, tmp_path, monkeypatch):
    copy = tmp_path / "cmp"
    shutil.copytree(folder, copy)
    summary = json.loads((copy / "summary.json").read_text())
    del summary["impulse"]  # as if a later comparison in this folder had trained pytorch alone
    (copy / "summary.json").write_text(json.dumps(summary))
    monkeypatch.setattr(report, "_attention_html", lambda groups: "")  # not what this test is about
    text = report.write_report(copy).read_text()
    assert [r[0] for r in Page(text).rows if r and r[0] in INITS] == ["pytorch", "pytorch"]  # results, versions
    assert "Left out: 1 other finished run(s) in this folder that summary.json does not list (impulse seed 0)." \
        in text


def test_ablation_folder_is_read_generically_and_escaped(tmp_path):
    folder = tmp_path / "abl"
    folder.mkdir()
    (folder / "ablation.md").write_text(
        "# Ablation `sharpness`: how sharp\n\n```\nstructinit ablate sharpness --recipe digits\n```\n\n"
        "How sharp should the maps be? <img src=x onerror=alert(1)>\n\n"
        "| variant | init spec | real hit L1 |\n|---|---|---:|\n"
        "| target_mass=0.3 | `impulse:target_mass=0.3` | 0.900 |\n"
        "| target_mass=0.9 | `impulse:target_mass=0.9` | 1.000 |\n")
    (folder / "ablation.json").write_text(json.dumps({
        "rows": [{"label": "target_mass=0.3"}, {"label": "target_mass=0.9"}],
        "settings": {"ablation": "sharpness", "seeds": [0], "question": "How sharp?"},
        "versions": {"torch": "2.13.0+cpu", "python": "3.11.7"}}))
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.bar([0, 1], [0.9, 1.0])
    fig.savefig(folder / "ablation.png")
    plt.close(fig)

    text = report.write_report(folder).read_text()
    page = Page(text)
    assert page.title == "Ablation sharpness: how sharp"
    assert ["target_mass=0.9", "impulse:target_mass=0.9", "1.000"] in page.rows
    assert ["versions.torch", "2.13.0+cpu"] in page.rows and ["rows", "2 entries (see all of ablation.json below)"] \
        in page.rows
    assert len(decoded_images(page)) == 1
    assert "&lt;img src=x onerror=alert(1)&gt;" in text and len(page.attrs("img")) == 1
    assert "<pre><code>structinit ablate sharpness --recipe digits</code></pre>" in text
    assert "Configuration" not in text  # no runs in this folder


def test_folders_without_results_are_named(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"holds no finished run"):
        report.write_report(empty)
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"structinit report: error: {tmp_path / 'nowhere'} does not exist (or is not a folder); pass a " \
                  "run or comparison folder"
    assert not (empty / "report.html").exists()


def command_fails(capsys, *argv) -> str:
    assert main(["report", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("structinit report: error: "), lines
    return lines[0]


def test_a_place_that_cannot_be_written_fails_before_drawing(folder, tmp_path, capsys, monkeypatch):
    def draw(*args):
        raise AssertionError("the page was drawn before --out was checked")

    monkeypatch.setattr(report, "_compare_page", draw)
    (tmp_path / "file").write_text("")
    line = command_fails(capsys, str(folder), "--out", str(tmp_path / "file" / "r.html"))
    assert line.endswith(f"cannot write the report to {tmp_path / 'file' / 'r.html'}: {tmp_path / 'file'} is a "
                         "file, not a folder; choose another place for it (--out FILE)")
    monkeypatch.setattr(report, "_can_write", lambda f: False)  # what a read-only folder is, under any user
    line = command_fails(capsys, str(folder))
    assert line.endswith(f"cannot write the report to {folder / 'report.html'}: no permission to write in {folder}; "
                         "choose another place for it (--out FILE)")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permissions")
def test_a_read_only_folder(folder, tmp_path, capsys):
    locked = tmp_path / "ro"
    locked.mkdir(mode=0o555)
    try:
        assert "no permission to write in" in command_fails(capsys, str(folder), "--out", str(locked / "r.html"))
    finally:
        locked.chmod(0o755)


def test_compare_survives_a_report_that_cannot_be_made(folder, capsys, monkeypatch):
    def broken(out):
        raise ValueError("result.json of impulse is odd\nsecond line")

    monkeypatch.setattr(report, "write_report", broken)
    summary = compare(recipe("digits", epochs=1, train_size=64), INITS, [0], folder, progress=False)  # runs reused
    assert set(summary) == set(INITS)
    warning = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]
    assert warning == [f"warning: {folder / 'report.html'} not written (ValueError: result.json of impulse is odd)"]


def test_markdown_and_text_are_escaped():
    from structinit.harness.report.html import esc, markdown, table

    assert esc('<a href="x">') == "&lt;a href=&quot;x&quot;&gt;"
    html = markdown("# T <b>\n\n- **bold** `<i>`\n- two\n\nplain & <script>\n")
    assert html == ("<h3>T &lt;b&gt;</h3>\n<ul><li><strong>bold</strong> <code>&lt;i&gt;</code></li><li>two</li></ul>\n"
                    "<p>plain &amp; &lt;script&gt;</p>")
    assert "<td>&lt;x&gt;</td>" in table(["h"], [["<x>"]])

"""The report in a real browser: headless Chromium opens ``report.html`` from a file:// URL,
with no network, and every figure decodes, the table is there, and the page renders to a
screenshot that is not blank. Skipped, saying why, where no Chromium is installed (CI
installs Debian's ``chromium`` in ``.ci/run``)."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from structinit.harness.compare import compare
from structinit.harness.recipes import recipe

plt = pytest.importorskip("matplotlib.pyplot")

INITS = ["pytorch", "impulse"]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def browser() -> str:
    found = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    if found is None:
        pytest.skip(f"no headless Chromium on PATH (looked for {', '.join(BROWSERS)}); install Debian's chromium "
                    "package (apt-get install chromium) to check report.html in a browser")
    return found


def chromium(exe: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    """Headless Chromium with its own profile folder, no sandbox (CI runs as root), no GPU."""
    command = [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
               "--disable-extensions", "--disable-background-networking", f"--user-data-dir={profile}", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{command}\n{done.stderr[-2000:]}"
    return done


class DumpedDom(HTMLParser):
    """The <body> attributes, <title> text and table rows of the DOM Chromium serialised."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.body: dict = {}
        self.title, self.rows, self.images, self._open = "", [], 0, []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        if tag == "body":
            self.body = dict(attrs)
        elif tag == "tr":
            self.rows.append([])
        elif tag == "img":
            self.images += 1
        self._open.append(tag)

    def handle_endtag(self, tag):
        if tag in self._open:
            del self._open[len(self._open) - 1 - self._open[::-1].index(tag):]

    def handle_data(self, data):
        if self._open and self._open[-1] == "title":
            self.title += data
        elif self._open and self._open[-1] in ("td", "th") and self.rows:
            self.rows[-1].append(data.strip())


def test_report_renders_in_a_headless_browser(tmp_path):
    exe = browser()
    out = tmp_path / "cmp"
    compare(recipe("digits", epochs=1, train_size=64), INITS, [0], out, progress=False)  # writes report.html
    url = (out / "report.html").resolve().as_uri()
    assert url.startswith("file://")

    dom = DumpedDom(chromium(exe, tmp_path / "profile", "--virtual-time-budget=5000", "--dump-dom", url).stdout)
    assert dom.title == "Attention initialisations compared: pytorch, impulse"
    results = [r for r in dom.rows if r and r[0] in INITS and re.fullmatch(r"\d+\.\d\d ± \d+\.\d\d", r[2])]
    assert sorted(r[0] for r in results) == sorted(INITS)  # one results row per init
    total = int(dom.body["data-images-total"])
    assert total == dom.images == 3  # training curves, attention at init, attention after training
    assert dom.body.get("data-images-decoded") == str(total), dom.body  # every image decoded, non-zero size

    shot = tmp_path / "report.png"
    chromium(exe, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1280,2000", url)
    image = plt.imread(shot)
    assert image.shape[0] > 0 and image.shape[1] > 0
    assert float(image[..., :3].var()) > 0  # not blank

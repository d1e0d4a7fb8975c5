"""Every ```python block of the documentation and the README runs as written (see
``tests/docs_examples.py`` for what is skipped and why)."""

import pytest

from docs_examples import ROOT, examples, missing_packages, run_example

EXAMPLES = examples()


def test_the_docs_have_examples_and_every_skip_says_why():
    assert len(EXAMPLES) >= 20
    names = {e.path for e in EXAMPLES}
    assert "README.md" in names and "docs/your-model.md" in names
    for e in EXAMPLES:
        assert e.skip is None or len(e.skip) > 10, f"{e.name}: say why the block is not tested"


def test_the_readme_links_into_the_docs_exist():
    import re

    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#\s]+)", text)
    assert links
    for link in links:
        assert (ROOT / link).is_file(), link


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_example_runs(example, tmp_path):
    if example.skip:
        pytest.skip(example.skip)
    missing = missing_packages(example)
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (the zoo venv runs it: bash scripts/test_zoo.sh)")
    run_example(example, tmp_path)


def test_the_config_tables_match_the_config_fields():
    """docs/harness/configs.md's tables are generated: regenerate them with
    ``STRUCTINIT_WRITE_DOCS=1 .venv/bin/python -m pytest tests/test_docs_examples.py -k config_tables``."""
    import os

    from docs_examples import CONFIGS_PAGE, configs_page

    text = CONFIGS_PAGE.read_text(encoding="utf-8")
    want = configs_page(text)
    if want != text and os.environ.get("STRUCTINIT_WRITE_DOCS") == "1":
        CONFIGS_PAGE.write_text(want, encoding="utf-8")
        text = want
    assert "<!-- fields: ImageConfig -->" in text and "<!-- fields: SequenceConfig -->" in text
    assert want == text, "stale: " + (test_the_config_tables_match_the_config_fields.__doc__ or "")


def test_which_init_states_the_seed_spread_that_the_data_show():
    # The page's words on how far seeds spread are the numbers bench/seed_spread.py computes from
    # the per-seed data in docs/results/data/.
    import re
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from seed_spread import cells
    finally:
        sys.path.remove(str(ROOT / "bench"))
    found = cells()
    text = (ROOT / "docs" / "which-init.md").read_text()
    wider, total = map(int, re.search(r"in (\d+) of the (\d+) measured cells by more than 2 points", text).groups())
    assert (wider, total) == (sum(1 for c in found if c[2] > 2.0), len(found))
    spread = {(name, cell): round(points, 1) for name, cell, points, _ in found}
    assert spread[("cpu-cifar-vit.json", "impulse")] == 3.3 and "up to 3.3 points\nfor impulse on `cpu-cifar`" in text
    assert spread[("data-size.json", "accuracy/cifar10/1000/timm")] == 3.8 and "3.8 for `timm`" in text
    assert round(found[0][2]) == 15 and "by up to 15 points" in text

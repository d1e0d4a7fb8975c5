"""The self-contained HTML report of a comparison or an ablation: the page and its building blocks."""

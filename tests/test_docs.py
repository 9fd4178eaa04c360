"""The guides: README.md quotes no measured figure (a figure lives in a results row and on the page rendered from
it), and every relative link of the guides and of the results' and experiments' READMEs points at a file that
exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# a measured figure as the pages print them: seconds, ratios, rates, decimal sizes and shares
FIGURE = re.compile(r"\b\d+(?:,\d{3})*(?:\.\d+)? ?(?:s/step|s a step|tokens/s|GB/s|TB/s)\b"
                    r"|\b\d+\.\d+ ?(?:s\b|×|GB\b|GiB\b|%)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
GUIDES = sorted([ROOT / "README.md", ROOT / "reports" / "README.md", ROOT / "results" / "README.md",
                 ROOT / "experiments" / "README.md", *ROOT.glob("results/*/README.md"),
                 *ROOT.glob("experiments/*/README.md")])


def measured_figures(text: str) -> list[str]:
    return [m.group(0) for m in FIGURE.finditer(text)]


def broken_links(path: Path) -> list[str]:
    """The relative link targets of a Markdown file that do not exist beside it."""
    return [t for t in LINK.findall(path.read_text())
            if "://" not in t and not (path.parent / t).exists()]


def test_the_readme_quotes_no_measured_figure():
    assert measured_figures((ROOT / "README.md").read_text()) == []


def test_a_quoted_figure_is_found():
    """Negative control: a sentence quoting measured figures; its neighbours, settings and budgets, are not figures."""
    text = ("Poros took 15.32 s a step (1,070 tokens/s, 23.76 GB as nvidia-smi counts it) against 17.20 s: 1.12× its "
            "tokens/s, copies at 55.2 GB/s, 97.2% hidden. Settings: --vram-budget 24GB, 40 GB, seq 512, "
            "--benchmark-compare-fail mean:25%, 200 steps × 3 passes.")
    assert measured_figures(text) == ["15.32 s a step", "1,070 tokens/s", "23.76 GB", "17.20 s", "1.12×",
                                      "55.2 GB/s", "97.2%"]


@pytest.mark.parametrize("path", GUIDES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_of_a_guide_exists(path):
    assert broken_links(path) == []


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "there.md").write_text("x")
    doc = tmp_path / "README.md"
    doc.write_text("[a](there.md) [b](gone/README.md) [c](https://example.org/x) [d](there.md#part)")
    assert broken_links(doc) == ["gone/README.md"]

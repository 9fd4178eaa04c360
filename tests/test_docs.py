"""The guides: README.md is a guide that fits on a few screens and quotes a measured figure only in its headline
table, which `poros docs` renders from the official page's rows; docs/settings.md is rendered from the settings table;
the Quick start's test line is the one CI runs; every relative link of a guide, and every path a guide, page or
matrix file names, exists; README's training example runs as written."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from poros.harness.report.layout import HEADLINE, headline_markdown, load_manifest, with_headline
from poros.settings_doc import settings_markdown

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# a measured figure as the pages print them: seconds, ratios, rates, decimal sizes and shares
FIGURE = re.compile(r"\b\d+(?:,\d{3})*(?:\.\d+)? ?(?:s/step|s a step|tokens/s|GB/s|TB/s)\b"
                    r"|\b\d+\.\d+ ?(?:s\b|×|GB\b|GiB\b|%)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
GUIDES = sorted({README, *ROOT.glob("docs/*.md"), ROOT / "reports" / "README.md", ROOT / "results" / "README.md",
                 ROOT / "experiments" / "README.md", *ROOT.glob("results/**/README.md"),
                 *ROOT.glob("experiments/*/README.md"), ROOT / "reports" / "reference" / "README.md"})
PAGES = sorted(ROOT.glob("reports/*.md"))
MATRIX_FILES = sorted(ROOT.glob("poros/matrices/*.yaml"))
# the checkout's top-level folders: a path starting with one of them names a file or folder of the repository
TOP = ("poros", "results", "reports", "experiments", "scripts", "matrices", "tests", "suites", "docs", ".ci")
PATH = re.compile(r"(?<![\w/.~-])((?:\.\./)*(?:%s)/[\w./+-]*)" % "|".join(re.escape(t) for t in TOP))
PLACEHOLDER = re.compile(r"[A-Z]{3,}|<|\*|\{")  # results/NAME/, OUT/results.jsonl, results/*/README.md


def measured_figures(text: str) -> list[str]:
    return [m.group(0) for m in FIGURE.finditer(text)]


def outside_headline(text: str) -> str:
    """README without its headline block (the table `poros docs` renders from rows)."""
    begin, end = HEADLINE
    return text.split(begin)[0] + text.split(end)[-1] if begin in text and end in text else text


def broken_links(path: Path) -> list[str]:
    """The relative link targets of a Markdown file that do not exist beside it."""
    return [t for t in LINK.findall(path.read_text())
            if "://" not in t and not (path.parent / t).exists()]


def named_paths(text: str) -> list[str]:
    """The repository paths a text names (`results/h200/README.md`, `../../reports/h200.md`), placeholders left
    out, trailing punctuation stripped."""
    found = (m.group(1).rstrip(".,:;") for m in PATH.finditer(text))
    return [p for p in found if not PLACEHOLDER.search(p)]


def missing_paths(path: Path, root: Path = ROOT) -> list[str]:
    """The paths `path` names that do not exist: relative to the checkout, or to `path`'s folder when they climb."""
    return [p for p in named_paths(path.read_text()) if not ((path.parent if p.startswith("..") else root) / p).exists()]


def test_the_readme_is_a_guide_of_a_few_screens():
    lines = README.read_text().splitlines()
    assert len(lines) <= 140, f"README.md has {len(lines)} lines; the guide keeps to 140, details go to docs/"
    for heading in ("## Quick start", "## What Poros is", "## Measured results", "## Entry points", "## Layout"):
        assert heading in lines, heading
    for entry in ("poros bench matrix", "pytest suites/ --matrix=", "tox -e torch210,torch212", ".ci/run",
                  "poros train", "poros export --merge", "poros generate", "poros plan"):
        assert entry in README.read_text(), entry


def test_the_readme_quotes_no_measured_figure_outside_its_headline_table():
    assert measured_figures(outside_headline(README.read_text())) == []


def test_the_readme_headline_table_is_rendered_from_the_official_rows():
    text = README.read_text()
    assert with_headline(text, headline_markdown(ROOT, load_manifest(ROOT))) == text, "run `poros docs`"


def test_a_headline_edited_by_hand_is_found():
    """Negative control: one figure of the table changed by hand no longer re-renders; a README without the block
    is refused."""
    text = README.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| ") and "PASS" in line)
    edited = text.replace(row, row.replace("PASS", "PASS ", 1))
    assert with_headline(edited, headline_markdown(ROOT, load_manifest(ROOT))) != edited
    with pytest.raises(ValueError, match="no headline block"):
        with_headline(outside_headline(text), "table")


def test_a_quoted_figure_is_found():
    """Negative control: a sentence quoting measured figures; its neighbours, settings and budgets, are not figures."""
    text = ("Poros took 15.32 s a step (1,070 tokens/s, 23.76 GB as nvidia-smi counts it) against 17.20 s: 1.12× its "
            "tokens/s, copies at 55.2 GB/s, 97.2% hidden. Settings: --vram-budget 24GB, 40 GB, seq 512, "
            "--benchmark-compare-fail mean:25%, 200 steps × 3 passes.")
    assert measured_figures(text) == ["15.32 s a step", "1,070 tokens/s", "23.76 GB", "17.20 s", "1.12×",
                                      "55.2 GB/s", "97.2%"]


def test_the_settings_page_is_rendered_from_the_settings_table():
    assert (ROOT / "docs" / "settings.md").read_text() == settings_markdown(), "run `poros docs`"


def test_a_setting_left_out_of_the_settings_page_is_found(monkeypatch):
    """Negative control: a setting added to the table changes the page, so a stale one fails the test above."""
    import dataclasses

    import poros.settings_doc as doc

    extra = dataclasses.replace(doc.SETTINGS[0], name="new_setting", help="a setting added later")
    monkeypatch.setattr(doc, "SETTINGS", (*doc.SETTINGS, extra))
    assert "`new_setting`" in doc.settings_markdown() != (ROOT / "docs" / "settings.md").read_text()


def test_the_quick_start_test_line_is_the_one_ci_runs():
    """README's Quick start, line 2 of its first code block, is the command .ci/run runs first (one place to read
    what CI does); line 1 runs the default job from an install of its own."""
    block = README.read_text().split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert block[1] in ci, f"{block[1]!r} is not a line of .ci/run"
    assert "README Quick start, line 2" in ci[ci.index(block[1]) - 1]
    assert block[0].startswith("python3 -m venv") and "poros bench matrix" in block[0]


@pytest.mark.parametrize("path", GUIDES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_of_a_guide_exists(path):
    assert broken_links(path) == []


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "there.md").write_text("x")
    doc = tmp_path / "README.md"
    doc.write_text("[a](there.md) [b](gone/README.md) [c](https://example.org/x) [d](there.md#part)")
    assert broken_links(doc) == ["gone/README.md"]


@pytest.mark.parametrize("path", [*GUIDES, *PAGES, *MATRIX_FILES], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_guide_page_or_matrix_names_exists(path):
    assert missing_paths(path) == []


def test_a_path_that_does_not_exist_is_found(tmp_path):
    """Negative control: a script that is gone, a folder renamed, a climbing link past its target; placeholders and
    the names of things a run writes are not paths of the repository."""
    doc = tmp_path / "results" / "x" / "README.md"
    doc.parent.mkdir(parents=True)
    doc.write_text("Rows of `scripts/sweep.py MODEL`; see results/h200x2-fast-attention/ and "
                   "[p](../../reports/h200.md), [q](../../../reports/h200.md), reports/h200.md. Not paths: "
                   "results/NAME/, OUT/x, `results/*/README.md`, `~/poros/results/x`.")
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "h200.md").write_text("page")
    assert missing_paths(doc, root=tmp_path) == ["scripts/sweep.py", "results/h200x2-fast-attention/",
                                                 "../../../reports/h200.md"]


def training_example() -> list[str]:
    """README's training example: the code block after `poros train`'s entry, one command a line."""
    text = README.read_text()
    block = text[text.index("**`poros train`**"):].split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.extended  # scripts/tiny_checkpoint.py, then poros train, export and generate, each a process (1-2 min)
def test_the_readme_training_example_runs_as_written(tmp_path):
    commands = training_example()
    assert [c[:2] for c in commands] == [["python3", "scripts/tiny_checkpoint.py"], ["poros", "train"],
                                                 ["poros", "export"], ["poros", "generate"]], commands
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "tiny_checkpoint.py").write_text((ROOT / "scripts" / "tiny_checkpoint.py").read_text())
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    for command in commands:
        argv = [sys.executable, *command[1:]] if command[0] == "python3" else [sys.executable, "-m", *command]
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, env=env)
        assert done.returncode == 0, f"{shlex.join(command)}: exit {done.returncode}\n{done.stderr[-3000:]}"
    assert (tmp_path / "out" / "tiny-run" / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "out" / "tiny-merged" / "model.safetensors").is_file()

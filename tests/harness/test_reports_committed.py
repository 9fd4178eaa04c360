"""Pages in reports/ are pure functions of results/: each re-renders byte for byte (Markdown) from the results
files and reference that reports/manifest.yaml names for it. One page per matrix in matrices/ (a matrix without rows
of its own reproduces the reference figures, reports/reference/), and reports/README.md, the index, links each."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from poros.cli import main
from poros.harness.matrix import MATRICES
from poros.harness.report import load_results
from tests.harness.test_report import assert_tables_well_formed

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = yaml.safe_load((ROOT / "reports" / "manifest.yaml").read_text())
INDEX = ROOT / "reports" / "README.md"
REFERENCE_README = ROOT / "reports" / "reference" / "README.md"
KEYS = {"results", "reference", "sweep", "title", "fails", "matrices"}


def matrices_of(page: str, entry: dict) -> list[str]:
    """The matrices a page shows: `matrices:`, else the one its file is named after."""
    return list(entry.get("matrices") or [Path(page).stem])


def layout_problems(manifest: dict, matrices: set[str], reference_text: str, index_text: str) -> list[str]:
    """What breaks one page per matrix: a page naming no such matrix, a matrix on two pages or on none (unless the
    reference figures' README names it as reproducing them, or the index lists it among the matrices not measured
    yet, on a line of its own), a page the index does not link."""
    unmeasured = {m for line in index_text.splitlines() if line.startswith("- not measured yet: ")
                  for m in re.findall(r"`matrices/([^`]+)\.yaml`", line)}
    problems, pages_of = [], {}
    for page, entry in manifest.items():
        for m in matrices_of(page, entry):
            pages_of.setdefault(m, []).append(page)
            if m not in matrices:
                problems.append(f"{page}: no matrices/{m}.yaml")
        if f"]({Path(page).name})" not in index_text:
            problems.append(f"{page}: reports/README.md does not link it")
    for m in sorted(matrices):
        pages = pages_of.get(m, [])
        if len(pages) > 1:
            problems.append(f"matrices/{m}.yaml: on {len(pages)} pages ({', '.join(pages)})")
        elif not pages and f"matrices/{m}.yaml" not in reference_text and m not in unmeasured:
            problems.append(f"matrices/{m}.yaml: no page shows it")
        elif pages and m in unmeasured:
            problems.append(f"matrices/{m}.yaml: the index says it is not measured yet, and {pages[0]} shows it")
    return problems


def render(tmp_path: Path, report: str, entry: dict) -> str:
    """Run `poros report` as the manifest says, writing under tmp_path with the report's own file name
    (the Markdown links the PNG by that name)."""
    out = tmp_path / Path(report).name
    argv = ["report", *(str(ROOT / r) for r in entry["results"]), "-o", str(out)]
    if entry.get("reference"):
        argv += ["--reference", str(ROOT / entry["reference"])]
    if entry.get("sweep"):
        argv += ["--sweep"]
    if entry.get("title"):
        argv += ["--title", entry["title"]]
    # `fails: true`: the page shows a cell that failed (its row says why), so `poros report` exits 1
    assert main(argv) == (1 if entry.get("fails") else 0)
    return out.read_text()


def test_manifest_lists_every_committed_report():
    committed = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "reports").glob("*.md") if p != INDEX)
    assert sorted(MANIFEST) == committed
    for report, entry in MANIFEST.items():
        assert set(entry) <= KEYS, f"{report}: unknown key(s) {set(entry) - KEYS}"
        for path in [*entry["results"], *([entry["reference"]] if entry.get("reference") else [])]:
            assert (ROOT / path).is_file(), f"{report}: {path} does not exist"
        linked = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", (ROOT / report).read_text())
        assert linked or entry.get("sweep"), f"{report}: links no plot"  # a sweep page plots only the axes its rows vary
        for png in linked:
            assert (ROOT / report).with_name(png).is_file(), f"{report}: its {png} is not committed"


@pytest.mark.parametrize("report", sorted(MANIFEST), ids=lambda r: f"report={Path(r).stem}")
def test_committed_report_rerenders_identically(tmp_path, report, capsys):
    got = render(tmp_path, report, MANIFEST[report])
    want = (ROOT / report).read_text()
    assert got == want, (f"{report} differs from what its results render; re-render it with "
                         f"`poros report` as reports/manifest.yaml says")


def test_comparison_sees_a_missing_results_file(tmp_path, capsys):
    """Negative control: leaving out one results file of a multi-file report changes the Markdown."""
    report, entry = next((r, e) for r, e in MANIFEST.items() if len(e["results"]) > 1)
    got = render(tmp_path, report, {**entry, "results": entry["results"][1:]})
    assert got != (ROOT / report).read_text()


@pytest.mark.parametrize("report", sorted(MANIFEST), ids=lambda r: f"report={Path(r).stem}")
def test_committed_report_tables_are_well_formed(report):
    assert_tables_well_formed((ROOT / report).read_text())


def test_one_page_per_matrix_and_the_index_links_each():
    matrices = {p.stem for p in MATRICES.glob("*.yaml")}
    assert layout_problems(MANIFEST, matrices, REFERENCE_README.read_text(), INDEX.read_text()) == []


def test_the_index_names_the_official_page():
    official = [line for line in INDEX.read_text().splitlines() if "](h200.md)" in line]
    assert official and "official" in official[0] and "matrices/h200.yaml" in official[0], official


def test_layout_problems_are_found():
    """Negative control: a matrix no page shows, one on two pages, a page of no matrix, a page the index leaves out;
    the accepted neighbours: a matrix the reference figures' README names, a page naming its matrices."""
    manifest = {"reports/a.md": {}, "reports/ab.md": {"matrices": ["a", "b"]}, "reports/ghost.md": {}}
    index = "[a](a.md) [ab](ab.md)\n- not measured yet: `matrices/new.yaml`, `matrices/b.yaml`\n`matrices/c.yaml`"
    got = layout_problems(manifest, {"a", "b", "c", "new", "ref"}, "`matrices/ref.yaml` reproduces these", index)
    assert got == ["reports/ghost.md: no matrices/ghost.yaml", "reports/ghost.md: reports/README.md does not link it",
                   "matrices/a.yaml: on 2 pages (reports/a.md, reports/ab.md)",
                   "matrices/b.yaml: the index says it is not measured yet, and reports/ab.md shows it",
                   "matrices/c.yaml: no page shows it"]


@pytest.mark.parametrize("report", sorted(MANIFEST), ids=lambda r: f"report={Path(r).stem}")
def test_each_page_shows_rows_of_its_matrices(report):
    rows = load_results([ROOT / r for r in MANIFEST[report]["results"]])
    assert set(rows["matrix"]) & set(matrices_of(report, MANIFEST[report])), set(rows["matrix"])

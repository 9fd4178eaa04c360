"""Reports in reports/ are pure functions of results/: each re-renders byte for byte (Markdown) from the
results files and reference that reports/manifest.yaml names for it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from poros.cli import main
from tests.harness.test_report import assert_tables_well_formed

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = yaml.safe_load((ROOT / "reports" / "manifest.yaml").read_text())


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
    committed = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "reports").glob("*.md"))
    assert sorted(MANIFEST) == committed
    for report, entry in MANIFEST.items():
        keys = {"results", "reference", "sweep", "title", "fails"}
        assert set(entry) <= keys, f"{report}: unknown key(s) {set(entry) - keys}"
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

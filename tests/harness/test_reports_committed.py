"""Pages in reports/ are pure functions of results/: each re-renders byte for byte (Markdown) from the rows of its own
folder, as reports/manifest.yaml says (poros/harness/report/layout.py). One page per matrix, `matrices/NAME.yaml` ->
`results/NAME/` -> `reports/NAME.md`, every folder with its page and every page with its folder, and the index,
reports/README.md, is what `poros docs` renders from that layout."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from poros.cli import main
from poros.harness.matrix import MATRICES
from poros.harness.report import load_results, write_report
from poros.harness.report.layout import (INDEX, Page, layout_problems, load_manifest, official_page, render_index,
                                         unmeasured_matrices)
from tests.harness.test_report import assert_tables_well_formed, cpu_row, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
PAGES = load_manifest(ROOT)
BY_NAME = {p.name: p for p in PAGES}
MATRIX_NAMES = {p.stem for p in MATRICES.glob("*.yaml")}
PNG = re.compile(r"!\[[^\]]*\]\(([^)]+)\)")


def render(tmp_path: Path, page: Page, **change) -> str:
    """The page as `poros docs` renders it (`write_report` with the manifest's options), under its own file name
    (the Markdown links its PNGs by that name)."""
    out = tmp_path / page.markdown.name
    args = {**page.report_args(ROOT), **change}
    write_report(out_md=out, **args)
    return out.read_text()


@pytest.mark.parametrize("name", sorted(BY_NAME), ids=lambda n: f"report={n}")
def test_committed_report_rerenders_identically(tmp_path, name):
    got = render(tmp_path, BY_NAME[name])
    want = (ROOT / BY_NAME[name].markdown).read_text()
    assert got == want, f"reports/{name}.md differs from what its rows render; run `poros docs`"


def test_comparison_sees_a_missing_results_file(tmp_path):
    """Negative control: leaving out one results file of a multi-file page changes the Markdown."""
    page = next(p for p in PAGES if len(p.results) > 1)
    got = render(tmp_path, page, results_paths=page.rows_files(ROOT)[1:])
    assert got != (ROOT / page.markdown).read_text()


@pytest.mark.parametrize("name", sorted(BY_NAME), ids=lambda n: f"report={n}")
def test_committed_report_tables_are_well_formed(name):
    assert_tables_well_formed((ROOT / BY_NAME[name].markdown).read_text())


def test_every_plot_a_page_links_is_committed_and_every_committed_plot_linked():
    linked = set()
    for page in PAGES:
        pngs = PNG.findall((ROOT / page.markdown).read_text())
        assert pngs or page.sweep, f"{page.markdown}: links no plot"  # a sweep page plots only the axes its rows vary
        linked |= set(pngs)
    assert sorted(p.name for p in (ROOT / "reports").glob("*.png")) == sorted(linked)


def test_a_failing_page_says_so():
    """`fails: true` marks exactly the pages that show a failed cell, so `poros report` exits 1 for them."""
    from poros.harness.report import failures

    for page in PAGES:
        shows_failure = bool(failures(load_results(page.rows_files(ROOT)), sweep=page.sweep))
        assert shows_failure == page.fails, page.name


def test_one_page_per_matrix_each_with_its_folder():
    assert layout_problems(ROOT, PAGES, MATRIX_NAMES) == []


def test_the_index_is_rendered_from_the_layout():
    assert (ROOT / INDEX).read_text() == render_index(ROOT, PAGES, MATRIX_NAMES), "run `poros docs`"


def test_the_index_names_the_official_page():
    official = [line for line in (ROOT / INDEX).read_text().splitlines() if "](h200.md)**" in line]
    assert official_page(PAGES).name == "h200"
    assert official and "official" in official[0] and "matrices/h200.yaml" in official[0], official


def test_a_new_matrix_without_rows_is_listed_as_not_measured_yet():
    before = unmeasured_matrices(ROOT, PAGES, MATRIX_NAMES)
    assert unmeasured_matrices(ROOT, PAGES, MATRIX_NAMES | {"h200-new"}) == sorted([*before, "h200-new"])
    assert "h200" not in before and "cpu" not in before  # matrices with rows are not listed
    index = render_index(ROOT, PAGES, MATRIX_NAMES | {"h200-new"})
    assert "Not measured yet (no rows, so no page): " in index and "`matrices/h200-new.yaml`." in index


def _checkout(tmp_path: Path) -> Path:
    """A checkout of one page `a` (matrix a, rows in results/a/) and one page `ab` of two runs of matrices ab and
    its twin ab-2, each in a folder of its own."""
    root = tmp_path / "checkout"
    for name, matrix in (("a/results.jsonl", "a"), ("ab/one/results.jsonl", "ab"), ("ab/two/results.jsonl", "ab-2")):
        path = root / "results" / name
        path.parent.mkdir(parents=True)
        write_jsonl(path, [cpu_row(model="tiny-qwen2", matrix=matrix)])
    (root / "reports").mkdir()
    for name in ("a", "ab"):
        (root / "reports" / f"{name}.md").write_text("page\n")
    (root / "reports" / "manifest.yaml").write_text(
        "a:\n  shows: one\n  official: true\n  results: [results.jsonl]\n"
        "ab:\n  shows: two\n  matrices: [ab, ab-2]\n  results: [one/results.jsonl, two/results.jsonl]\n")
    return root


def test_layout_problems_are_found(tmp_path):
    """Negative control: each way to break the layout, in a checkout that is whole before it is broken."""
    root = _checkout(tmp_path)
    matrices = {"a", "ab", "ab-2"}
    assert layout_problems(root, load_manifest(root), matrices) == []
    shutil.copytree(root / "results" / "a", root / "results" / "orphan")  # a folder no page renders
    (root / "reports" / "ghost.md").write_text("page\n")  # a page the manifest leaves out
    write_jsonl(root / "results" / "ab" / "one" / "extra.jsonl", [cpu_row(matrix="ab")])  # rows no page reads
    two = root / "results" / "ab" / "two" / "results.jsonl"
    two.write_text(two.read_text().replace('"ab-2"', '"a"'))  # rows of another page's matrix
    got = layout_problems(root, load_manifest(root), matrices - {"ab-2"} | {"unshown"})
    assert got == ["reports/ab.md: no matrices/ab-2.yaml",
                   "results/ab/two/results.jsonl: rows of a, not of reports/ab.md's ab, ab-2: they belong in results/a/",
                   "results/orphan/: no page reports/orphan.md renders it (reports/manifest.yaml)",
                   "reports/ghost.md: reports/manifest.yaml does not name it",
                   "results/ab/one/extra.jsonl: rows that reports/ab.md does not read"], got


def test_a_matrix_on_two_pages_and_a_missing_folder_are_found(tmp_path):
    root = _checkout(tmp_path)
    manifest = root / "reports" / "manifest.yaml"
    manifest.write_text(manifest.read_text() + "b:\n  shows: three\n  matrices: [b, a]\n  results: [r.jsonl]\n")
    (root / "reports" / "b.md").write_text("page\n")
    got = layout_problems(root, load_manifest(root), {"a", "ab", "ab-2", "b"})
    assert got == ["reports/b.md: no results/b/ holds its rows", "reports/b.md: results/b/r.jsonl does not exist",
                   "matrices/a.yaml: on 2 pages (a, b)"], got


@pytest.mark.parametrize("entry, named", [
    ("a:\n  shows: one\n  results: [results.jsonl]\n", "one page marked `official: true`"),
    ("a:\n  shows: one\n  official: true\n  results: [../b/results.jsonl]\n", "outside results/a/"),
    ("a:\n  shows: one\n  official: true\n  matrices: [b, a]\n  results: [r.jsonl]\n", "starting with 'a'"),
    ("a:\n  official: true\n  results: [r.jsonl]\n  colour: red\n", "unknown key(s) colour"),
], ids=["no-official-page", "rows-outside-the-folder", "named-after-another-matrix", "unknown-key"])
def test_a_malformed_manifest_is_refused_naming_the_entry(tmp_path, entry, named):
    from poros.errors import ConfigError

    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "manifest.yaml").write_text(entry)
    with pytest.raises(ConfigError) as e:
        load_manifest(tmp_path)
    assert named in str(e.value), str(e.value)


@pytest.mark.parametrize("name", sorted(BY_NAME), ids=lambda n: f"report={n}")
def test_each_page_shows_rows_of_its_matrices(name):
    rows = load_results(BY_NAME[name].rows_files(ROOT))
    assert set(rows["matrix"]) <= set(BY_NAME[name].matrices), set(rows["matrix"])


def test_docs_renders_a_checkout_whole_then_finds_a_page_edited_by_hand(tmp_path, capsys):
    """`poros docs` renders every page, the index, README's table and docs/settings.md, and removes a plot no page
    links; `--check` then passes, and fails naming a page edited by hand."""
    root = _docs_checkout(tmp_path)
    (root / "reports" / "gone.png").write_bytes(b"")
    assert main(["docs", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "wrote reports/a.md" in out and "removed reports/gone.png" in out and "wrote docs/settings.md" in out, out
    assert "| tiny-qwen2 | PASS |" in (root / "README.md").read_text()
    assert main(["docs", "--root", str(root), "--check"]) == 0
    (root / "reports" / "a.md").write_text((root / "reports" / "a.md").read_text().replace("PASS", "pass"))
    assert main(["docs", "--root", str(root), "--check"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "stale: reports/a.md (run `poros docs`)"
    (root / "results" / "new").mkdir()  # a matrix's rows before its page is in the manifest: nothing is written
    assert main(["docs", "--root", str(root)]) == 1
    assert capsys.readouterr().out == "layout: results/new/: no page reports/new.md renders it (reports/manifest.yaml)\n"
    assert "pass" in (root / "reports" / "a.md").read_text()


def _docs_checkout(tmp_path: Path) -> Path:
    """`_checkout` with the checkout's own matrices and a README whose headline block is empty: every file stale."""
    root = _checkout(tmp_path)
    (root / "matrices").mkdir()
    for name in ("a", "ab", "ab-2"):  # the checkout's own matrices (only their names matter here)
        (root / "matrices" / f"{name}.yaml").write_text("name: x\n")
    (root / "README.md").write_text("# x\n\n<!-- headline: `poros docs` renders this table from the official page's "
                                    "rows; edit nothing here -->\n<!-- /headline -->\n")
    return root


@pytest.mark.parametrize("victim, what", [("reports/a.md", "the page"), ("README.md", "README's headline table into"),
                                          ("docs/settings.md", "the settings page")],
                         ids=["page", "readme", "settings"])
def test_docs_out_of_space_leaves_each_file_whole_and_says_so_in_one_line(tmp_path, capsys, monkeypatch, victim, what):
    """The disk fills while `poros docs` writes a file: half of it reaches the disk, then ENOSPC. The file keeps
    its old bytes, no temporary is left beside it, and the command ends in one line naming the file (exit 2, as
    every command but `poros bench` ends at a failed write); run again with room, it writes the file."""
    import builtins
    import errno

    import poros.common.atomic as atomic
    from tests.fixtures import one_line_refusal

    root = _docs_checkout(tmp_path)
    target = root / victim
    if victim == "docs/settings.md":
        target.parent.mkdir()
        target.write_text("the old settings page\n")
    before = target.read_bytes()

    class Filling:  # a file the disk fills under: half of each write lands, then ENOSPC
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def filling_open(path, *args, **kwargs):
        f = builtins.open(path, *args, **kwargs)
        beside = Path(path).parent == target.parent and Path(path).name.startswith(f".{target.stem}.")
        return Filling(f) if beside else f

    monkeypatch.setattr(atomic, "open", filling_open, raising=False)
    code = main(["docs", "--root", str(root)])
    line = one_line_refusal(capsys, code, f"poros docs: error: cannot write {what} {target} (No space left on device); "
                                          "free space; every file is whole")
    assert "run `poros docs` again once there is room" in line, line
    assert target.read_bytes() == before, f"{victim} was changed by a write that failed"
    left = [str(p.relative_to(root)) for p in root.rglob("*") if "partial" in p.name]
    assert left == [], f"temporaries left behind: {left}"
    monkeypatch.undo()  # control: with room, the same command writes it
    assert main(["docs", "--root", str(root)]) == 0
    assert target.read_bytes() != before and f"wrote {victim}" in capsys.readouterr().out


def test_docs_outside_a_checkout_is_refused_in_one_line(tmp_path, capsys):
    from tests.fixtures import one_line_refusal

    code = main(["docs", "--root", str(tmp_path)])
    one_line_refusal(capsys, code, str(tmp_path), "not a Poros checkout", "reports/manifest.yaml")


def test_rows_name_their_matrix():
    """Every committed row names the matrix it measures: the layout's rule reads it."""
    for page in PAGES:
        for path in page.rows_files(ROOT):
            for line in path.read_text().splitlines():
                assert json.loads(line).get("matrix") in page.matrices, path

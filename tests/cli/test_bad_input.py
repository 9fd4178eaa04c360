"""Inputs a user can give that end, each, in one line and a non-zero status (or do the right thing): paths that
loop or name nothing, values a row or a setting cannot hold. Each beside a control that runs."""

from __future__ import annotations

import pytest

from poros.cli import main
from tests.fixtures import one_line_refusal
from tests.harness.test_report import fixture_row, write_jsonl


def _usage_error(capsys, argv, named: str) -> None:
    """argparse's refusal: exit 2, its usage and one error line naming `named`, no traceback."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    assert named in err.strip().splitlines()[-1], err


@pytest.mark.parametrize("argv", [
    ["report", "r.jsonl", "-o", ""], ["report", "", "-o", "r.md"], ["bench", "matrix", "cpu", "-o", ""],
    ["bench", "status", "cpu", "-o", ""], ["train", "--data", "d.jsonl", "-o", ""],
    ["export", "--merge", "--model", "m", "--adapter", "a", "-o", ""], ["validate", ""],
], ids=["report-o", "report-input", "bench-o", "status-o", "train-o", "export-o", "validate-file"])
def test_an_empty_path_is_refused_not_read_as_the_current_folder(capsys, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    _usage_error(capsys, argv, "expected a path, got ''")
    assert list(tmp_path.iterdir()) == [], "nothing written into the current folder"


def test_a_loop_of_symbolic_links_as_a_path_is_one_line(capsys, tmp_path):
    loop = tmp_path / "a"
    loop.symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(loop)
    results = tmp_path / "results.jsonl"
    write_jsonl(results, [fixture_row(), fixture_row(method="resident")])
    one_line_refusal(capsys, main(["report", str(loop), "-o", str(tmp_path / "r.md")]),
                     f"results file {loop} is a loop of symbolic links")
    one_line_refusal(capsys, main(["report", str(results), "-o", str(loop)]), f"-o {loop} is a loop")
    one_line_refusal(capsys, main(["bench", "matrix", "cpu", "-o", str(loop)]),
                     f"output folder {loop} is a loop of symbolic links")
    # control: a link to the results file, and a page written through a link to a folder
    (tmp_path / "link.jsonl").symlink_to(results)
    (tmp_path / "pages").mkdir()
    (tmp_path / "to-pages").symlink_to(tmp_path / "pages")
    assert main(["report", str(tmp_path / "link.jsonl"), "-o", str(tmp_path / "to-pages" / "r.md")]) == 0
    assert (tmp_path / "pages" / "r.md").is_file()

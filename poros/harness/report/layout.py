"""The layout of a checkout's measured results: one page per matrix, `matrices/NAME.yaml` measures `results/NAME/`,
rendered as `reports/NAME.md` as `reports/manifest.yaml` says (`Page`). `layout_problems` names what breaks that
correspondence; `render_index` writes reports/README.md, the index, from it.

A page of several runs keeps one folder per run under its own (`results/NAME/RUN/`); a page of several matrices (a
matrix and its twins, the same settings but one) is named after the first and holds the others' rows too. Pages read
no row from anywhere else: a rows file lies under its page's folder, and every row names one of its page's matrices.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from poros.common.yamlfile import load_yaml
from poros.errors import ConfigError
from poros.harness.report.format import md_table

MANIFEST = Path("reports/manifest.yaml")
README = Path("README.md")
HEADLINE = ("<!-- headline: `poros docs` renders this table from the official page's rows; edit nothing here -->",
            "<!-- /headline -->")
INDEX = Path("reports/README.md")
REFERENCE_README = Path("reports/reference/README.md")
RUN_FILES_NOT_ROWS = {"passes.jsonl"}  # a run's pass log: JSON Lines, but no results rows
KEYS = {"shows", "results", "official", "reference", "sweep", "title", "matrices", "fails"}


@dataclass(frozen=True)
class Page:
    """One page of reports/, as reports/manifest.yaml describes it."""

    name: str
    shows: str  # one line for the index
    results: tuple[str, ...]  # rows files relative to results/NAME/, in the order `poros report` takes them
    matrices: tuple[str, ...]  # the matrices whose rows it shows, its own name first
    official: bool = False
    reference: str | None = None  # a reference CSV, relative to the checkout
    sweep: bool = False
    title: str | None = None
    fails: bool = False  # shows a failed cell: `poros report` exits 1 for it

    @property
    def markdown(self) -> Path:
        return Path("reports") / f"{self.name}.md"

    @property
    def folder(self) -> Path:
        return Path("results") / self.name

    def rows_files(self, root: Path) -> list[Path]:
        return [root / self.folder / r for r in self.results]

    def report_args(self, root: Path) -> dict:
        """`write_report`'s arguments for this page (its output path aside)."""
        return {"results_paths": self.rows_files(root), "title": self.title, "sweep": self.sweep,
                "reference_csv": root / self.reference if self.reference else None}


def _page(name: str, entry, problems: list[str]) -> Page | None:
    where = f"{MANIFEST}: {name}"
    if not isinstance(entry, dict):
        problems.append(f"{where}: expected a mapping of {', '.join(sorted(KEYS))}, got {entry!r}")
        return None
    unknown = set(entry) - KEYS
    if unknown:
        problems.append(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; expected some of {', '.join(sorted(KEYS))}")
    shows, results = entry.get("shows"), entry.get("results")
    if not isinstance(shows, str) or not shows.strip():
        problems.append(f"{where}: shows: expected one line for the index, got {shows!r}")
    if not (isinstance(results, list) and results and all(isinstance(r, str) for r in results)):
        problems.append(f"{where}: results: expected a list of rows files under results/{name}/, got {results!r}")
        results = []
    for r in results:
        if Path(r).is_absolute() or ".." in Path(r).parts:
            problems.append(f"{where}: results: {r!r} is outside results/{name}/; a page reads its own folder only")
    matrices = entry.get("matrices") or [name]
    if not (isinstance(matrices, list) and all(isinstance(m, str) for m in matrices)) or matrices[0] != name:
        problems.append(f"{where}: matrices: expected a list of matrix names starting with {name!r}, got {matrices!r}")
        matrices = [name]
    for flag in ("official", "sweep", "fails"):
        if not isinstance(entry.get(flag, False), bool):
            problems.append(f"{where}: {flag}: expected true or false, got {entry[flag]!r}")
    for text in ("reference", "title"):
        if entry.get(text) is not None and not isinstance(entry[text], str):
            problems.append(f"{where}: {text}: expected text, got {entry[text]!r}")
    return Page(name, str(shows), tuple(results), tuple(matrices), bool(entry.get("official")),
                entry.get("reference"), bool(entry.get("sweep")), entry.get("title"), bool(entry.get("fails")))


def load_manifest(root: Path) -> list[Page]:
    """The pages reports/manifest.yaml describes, in its order.

    Raises:
        ConfigError: naming every malformed entry at once.
    """
    data = load_yaml((root / MANIFEST).read_text())
    if not isinstance(data, dict):
        raise ConfigError([f"expected a mapping of page names, got {type(data).__name__}"], str(MANIFEST))
    problems: list[str] = []
    pages = [p for name, entry in data.items() if (p := _page(str(name), entry, problems)) is not None]
    if sum(p.official for p in pages) != 1:
        problems.append(f"{MANIFEST}: expected one page marked `official: true`, got "
                        f"{[p.name for p in pages if p.official] or 'none'}")
    if problems:
        raise ConfigError(problems, str(MANIFEST))
    return pages


def official_page(pages: list[Page]) -> Page:
    return next(p for p in pages if p.official)


def _row_matrices(path: Path) -> set:
    return {json.loads(line).get("matrix") for line in path.read_text().splitlines() if line.strip()}


def unmeasured_matrices(root: Path, pages: list[Page], matrices: set[str]) -> list[str]:
    """Matrices no page shows, leaving out those the reference figures' README names as reproducing them."""
    shown = {m for p in pages for m in p.matrices}
    reference = (root / REFERENCE_README).read_text() if (root / REFERENCE_README).is_file() else ""
    return sorted(m for m in matrices - shown if f"matrices/{m}.yaml" not in reference)


def layout_problems(root: Path, pages: list[Page], matrices: set[str]) -> list[str]:
    """What breaks one page per matrix: a page of no such matrix, a matrix on two pages, a page without its folder or
    a folder without its page, a rows file a page does not read or one outside its page's folder, a row of another
    matrix than its page's, a committed page the manifest does not name, a rows file or reference that is missing."""
    problems, pages_of = [], {}
    for p in pages:
        for m in p.matrices:
            pages_of.setdefault(m, []).append(p.name)
            if m not in matrices:
                problems.append(f"{p.markdown}: no matrices/{m}.yaml")
        if not (root / p.folder).is_dir():
            problems.append(f"{p.markdown}: no {p.folder}/ holds its rows")
        if p.reference and not (root / p.reference).is_file():
            problems.append(f"{p.markdown}: its reference {p.reference} does not exist")
        for r, path in zip(p.results, p.rows_files(root)):
            if not path.is_file():
                problems.append(f"{p.markdown}: {p.folder / r} does not exist")
            else:
                other = sorted(str(m) for m in _row_matrices(path) - set(p.matrices))
                if other:
                    problems.append(f"{p.folder / r}: rows of {', '.join(other)}, not of {p.markdown}'s "
                                    f"{', '.join(p.matrices)}: they belong in results/{other[0]}/")
    for m, names in pages_of.items():
        if len(names) > 1:
            problems.append(f"matrices/{m}.yaml: on {len(names)} pages ({', '.join(names)})")
    names = {p.name for p in pages}
    for folder in sorted(d for d in (root / "results").iterdir() if d.is_dir()):
        if folder.name not in names:
            problems.append(f"results/{folder.name}/: no page reports/{folder.name}.md renders it (reports/manifest.yaml)")
    for md in sorted((root / "reports").glob("*.md")):
        if md.name != INDEX.name and md.stem not in names:
            problems.append(f"reports/{md.name}: reports/manifest.yaml does not name it")
    for p in pages:
        read = {root / p.folder / r for r in p.results}
        for path in sorted((root / p.folder).rglob("*.jsonl")) if (root / p.folder).is_dir() else []:
            if path.name not in RUN_FILES_NOT_ROWS and path not in read:
                problems.append(f"{path.relative_to(root)}: rows that {p.markdown} does not read")
    return problems


def render_index(root: Path, pages: list[Page], matrices: set[str]) -> str:
    """reports/README.md: the official page, then one line per page, from the manifest and the layout."""
    official = official_page(pages)
    lines = [
        "# Reports",
        "",
        "<!-- Written by `poros docs` from reports/manifest.yaml and the folders of results/: edit those, not this. -->",
        "",
        "One page per matrix: `poros bench matrix matrices/NAME.yaml -o results/NAME` writes its rows, and `poros docs`",
        "renders them as `reports/NAME.md` (`poros report` with the options `manifest.yaml` gives the page). A page of",
        "several runs keeps one folder per run under its own (`results/NAME/RUN/`); a matrix measured again beside",
        "another on one page (its twin: the same settings but one) is listed under the page's `matrices:` and writes into",
        "its folder. Nobody edits a page by hand, and a page reads no row from outside its folder",
        "(`tests/harness/test_reports_committed.py` renders each page again and compares it byte for byte).",
        "",
        f"**The official result is [{official.name}.md]({official.name}.md)**, the page of "
        f"`matrices/{official.name}.yaml`: {official.shows}.",
        "Every other page measures one question, often in a reduced run (fewer steps or passes than its matrix asks for;",
        "the page says so): compare ratios within a page, not seconds across pages.",
        "",
    ]
    table = []
    for p in pages:
        readme = root / p.folder / "README.md"
        rows = f"[{p.folder}/](../{p.folder}/README.md)" if readme.is_file() else f"`{p.folder}/`"
        table.append((f"[{p.name}.md]({p.name}.md)", ", ".join(f"`{m}`" for m in p.matrices), p.shows, rows))
    lines.append(md_table(("page", "matrices", "what it shows", "rows"), table))
    unmeasured = unmeasured_matrices(root, pages, matrices)
    if unmeasured:
        lines += ["", "Not measured yet (no rows, so no page): " + ", ".join(f"`matrices/{m}.yaml`" for m in unmeasured)
                  + "."]
    shown = {m for p in pages for m in p.matrices}
    reproducing = sorted(matrices - shown - set(unmeasured))
    if reproducing:
        lines += ["", f"{' and '.join(f'`matrices/{m}.yaml`' for m in reproducing)} reproduce the official figures in "
                  f"`reference/official.csv` ([reference/](reference/README.md)); no rows of theirs are committed, and "
                  f"`{official.name}.md` sets those figures beside its own."]
    lines += ["", "Probes, profiles and earlier runs that a page no longer shows are in",
              "[../experiments/](../experiments/README.md), each with its question, command and answer.", ""]
    return "\n".join(lines)


def headline_markdown(root: Path, pages: list[Page]) -> str:
    """README's headline: the official page's results as one table per model (`headline_table`), with a line saying
    what ran and where the page is."""
    from poros.harness.report.rows import latest, load_reference, load_results, named_as_reference
    from poros.harness.report.tables import headline_table, runs_text
    from poros.harness.report.format import uniq

    page = official_page(pages)
    df = load_results(page.rows_files(root))
    reference = load_reference(root / page.reference) if page.reference else None
    df = latest(named_as_reference(df, reference))
    timed = df[df["status"] == "ok"]
    what = (f"`matrices/{page.name}.yaml` on {uniq(df['hardware'])}, {runs_text(timed)} a cell, "
            f"{uniq(df['stack'])}")
    return (f"From [{page.markdown}]({page.markdown}) ({what}; rows in [{page.folder}/]({page.folder}/README.md)), "
            f"every poros cell first gated bitwise against resident QLoRA:\n\n{headline_table(df)}")


def with_headline(readme: str, headline: str) -> str:
    """README's text with the headline block's content replaced by `headline`.

    Raises:
        ValueError: when README holds no headline block (its two marker lines, in order).
    """
    begin, end = HEADLINE
    if readme.count(begin) != 1 or readme.count(end) != 1 or readme.index(begin) > readme.index(end):
        raise ValueError(f"{README} has no headline block: a line {begin!r}, then the table, then {end!r}")
    head, rest = readme.split(begin, 1)
    return f"{head}{begin}\n{headline}\n{end}{rest.split(end, 1)[1]}"

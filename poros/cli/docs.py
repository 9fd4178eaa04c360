"""`poros docs`: render what a checkout's guides and pages derive from its rows and its code, or check them."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from poros.common.atomic import write_atomic
from poros.errors import PorosError

PNG = re.compile(r"!\[[^\]]*\]\(([^)]+\.png)\)")  # the plots a page links
# said after a write that failed: each file is written whole or left as it was, so a second run finishes the rest
AGAIN = "every file is whole (written or as it was); run `poros docs` again once there is room"

EPILOG = """examples:
  poros docs                  # in a checkout: render every page, the index, README's table, docs/settings.md
  poros docs --check          # write nothing; exit 1 naming each file that is stale
  poros docs --root ~/poros   # the checkout at that path

Renders, each from its source and only where it changed:
  reports/NAME.md (+ its PNGs)  from results/NAME/, as reports/manifest.yaml says (poros report); a PNG
                                no page links any more is removed
  reports/README.md             the index, from reports/manifest.yaml and the folders of results/
  README.md's headline table    from the rows of the official page (manifest: official: true)
  docs/settings.md              from the settings table, poros/settings.py
First it checks the layout (one page per matrix, matrices/NAME.yaml -> results/NAME/ -> reports/NAME.md) and
stops, naming each problem, where it is broken. --check compares the Markdown only: a page's PNGs depend on
the matplotlib version. Each file is written under a temporary name and renamed over the old one, so a run
stopped or out of space leaves every file whole. Exit 0 when everything is (or now is) up to date, 1 when
--check found a stale file or the layout is broken, 2 naming the file that could not be written.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("docs", help="render the pages, the index, README's table and docs/settings.md", epilog=EPILOG)
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file is stale")
    p.add_argument("--root", default=".", help="the checkout (default: the current folder)")
    p.set_defaults(run=run)


def _matrices(root: Path) -> set[str]:
    """The names of the checkout's matrices (its matrices/ folder, else those shipped with Poros)."""
    from poros.harness.matrix import MATRICES

    folder = root / "matrices" if (root / "matrices").is_dir() else MATRICES
    return {p.stem for p in folder.glob("*.yaml")}


def _texts(root: Path, pages, matrices: set[str]) -> dict[Path, str]:
    """Every text file `poros docs` writes besides the pages, as it should read."""
    from poros.harness.report.layout import INDEX, README, headline_markdown, render_index, with_headline
    from poros.settings_doc import settings_markdown

    try:
        readme = with_headline((root / README).read_text(), headline_markdown(root, pages))
    except ValueError as e:
        raise PorosError(str(e)) from None
    return {INDEX: render_index(root, pages, matrices), README: readme,
            Path("docs/settings.md"): settings_markdown()}


def _what(target: Path) -> str:
    """A file `poros docs` writes, in the words of a line that says it could not write it."""
    from poros.harness.report.layout import INDEX, README

    return {INDEX: "the index", README: "README's headline table into", Path("docs/settings.md"): "the settings page"
            }.get(target, "the plot" if target.suffix == ".png" else "the page")


def _pages(root: Path, pages, tmp: Path) -> dict[Path, Path]:
    """Each page rendered into a folder of its own under `tmp`, with its PNGs: {page path in the checkout: rendered
    Markdown}."""
    from poros.harness.report import write_report

    out = {}
    for page in pages:
        md = tmp / page.name / f"{page.name}.md"
        write_report(out_md=md, **page.report_args(root))
        out[page.markdown] = md
    return out


def run(args) -> int:
    from poros.harness.report.layout import MANIFEST, layout_problems, load_manifest

    root = Path(args.root).resolve()
    if not (root / MANIFEST).is_file():
        raise PorosError(f"{root} is not a Poros checkout: no {MANIFEST} (give the checkout with --root)")
    pages = load_manifest(root)
    matrices = _matrices(root)
    problems = layout_problems(root, pages, matrices)
    if problems:
        for line in problems:
            print(f"layout: {line}")
        return 1
    stale, linked = [], set()
    with tempfile.TemporaryDirectory() as tmp:
        for target, md in _pages(root, pages, Path(tmp)).items():
            linked |= set(PNG.findall(md.read_text()))
            if not (root / target).is_file() or (root / target).read_text() != md.read_text():
                stale.append(target)
                if not args.check:
                    for f in sorted(md.parent.iterdir()):  # the Markdown and its PNG(s): STEM.png, STEM-axis.png
                        write_atomic(root / target.parent / f.name, f.read_bytes(), _what(Path(f.name)), AGAIN)
    for png in sorted((root / "reports").glob("*.png")):  # a plot no page links any more
        if png.name not in linked:
            stale.append(png.relative_to(root))
            if not args.check:
                png.unlink()
    for target, text in _texts(root, pages, matrices).items():
        path = root / target
        if not path.is_file() or path.read_text() != text:
            stale.append(target)
            if not args.check:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(path, text, _what(target), AGAIN)
    if args.check:
        for target in stale:
            print(f"stale: {target} (run `poros docs`)")
        if not stale:
            print(f"{len(pages)} pages, the index, README's table and docs/settings.md: up to date")
        return 1 if stale else 0
    print("".join(f"{'removed' if t.suffix == '.png' else 'wrote'} {t}\n" for t in stale) + f"{len(pages)} pages, "
          f"the index, README's table and docs/settings.md: {'the rest ' if stale else ''}up to date")
    return 0

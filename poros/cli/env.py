"""`poros env`: a copy-and-paste environment block; `--find-source TREE`: the commits whose package is a row's source
tree (what ran, measured from its files, where the machine had no git)."""

from __future__ import annotations

import re

from poros.errors import PorosError
from poros.provenance import commits_of_tree, env_block, provenance

EPILOG = """examples:
  poros env
  poros env --json > env.json
  poros env --find-source b4f4a133be1c10c71681ae9e1bb3879acf595fbe   # a row's provenance.git.source_tree
"""


def add_parser(sub) -> None:
    p = sub.add_parser("env", help="print the environment (versions, git commit, GPUs)", epilog=EPILOG)
    p.add_argument("--json", action="store_true", help="print the full provenance record as JSON")
    p.add_argument("--find-source", metavar="TREE",
                   help="list the commits on --branch whose poros/ folder is TREE (a row's provenance.git.source_tree)")
    p.add_argument("--branch", default="main", help="the branch --find-source searches (default: main)")
    p.set_defaults(run=run)


def run(args) -> int:
    if args.find_source is not None:
        tree = args.find_source.strip().lower()
        if not re.fullmatch(r"[0-9a-f]{40}", tree):
            raise PorosError(f"--find-source: expected a source tree (40 hex digits, a row's "
                             f"provenance.git.source_tree), got {args.find_source!r}")
        commits = commits_of_tree(tree, args.branch)
        if not commits:
            print(f"no commit on {args.branch} has poros/ as tree {tree}: the files that ran held changes no commit "
                  f"of {args.branch} has")
            return 1
        print(f"poros/ is tree {tree} at {len(commits)} commit(s) on {args.branch} (newest first; they differ outside "
              f"poros/ only):")
        print("\n".join(commits))
        return 0
    if args.json:
        import json

        print(json.dumps(provenance(), indent=2))
    else:
        print(env_block())
    return 0

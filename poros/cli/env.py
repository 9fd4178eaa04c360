"""`poros env`: a copy-and-paste environment block."""

from __future__ import annotations

from poros.provenance import env_block, provenance

EPILOG = """examples:
  poros env
  poros env --json > env.json
"""


def add_parser(sub) -> None:
    p = sub.add_parser("env", help="print the environment (versions, git commit, GPUs)", epilog=EPILOG)
    p.add_argument("--json", action="store_true", help="print the full provenance record as JSON")
    p.set_defaults(run=run)


def run(args) -> int:
    if args.json:
        import json

        print(json.dumps(provenance(), indent=2))
    else:
        print(env_block())
    return 0

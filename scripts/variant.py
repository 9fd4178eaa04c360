"""Schedule settings given on a probe's command line (`--variant KEY=VALUE,...`), shared by the probes in scripts/."""

from __future__ import annotations

from poros.settings import SCHEDULE_NAMES, check_values


def parse_variant(text: str) -> dict:
    """`cuda_graphs=true,vram_budget=24GB` as checked schedule settings (poros/settings.py).

    Raises:
        SystemExit: naming the item that is not KEY=VALUE of a schedule setting, or the value that is wrong.
    """
    raw = {}
    for item in filter(None, text.split(",")):
        k, eq, v = item.partition("=")
        if not eq or k not in SCHEDULE_NAMES:
            raise SystemExit(f"variant {text!r}: expected KEY=VALUE with KEY one of {', '.join(SCHEDULE_NAMES)}")
        raw[k] = {"true": True, "false": False}.get(v.lower(), int(v) if v.isdigit() else v)
    values, problems = check_values(raw)
    if problems:
        raise SystemExit(f"variant {text!r}: {'; '.join(problems)}")
    return values


def echo(variant: dict) -> dict:
    """A variant's settings as rows and logs write them (enums by their value)."""
    return {k: getattr(x, "value", x) for k, x in variant.items()}

"""Byte sizes as settings and flags give them (`parse_size`: `24GB`, `40GiB`, `300MB`, `1.5e9`, an integer, or
`auto`) and as plans, messages and reports show them (`format_size`)."""

from __future__ import annotations

import math
import re

AUTO = "auto"  # a size left to be measured where the run is (a budget: what the device or host has free)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value) -> int | str:
    """A byte count from `24GB`, `40GiB`, `300MB`, `1.5e9` or an integer; `auto` stays `auto`.

    Raises:
        ValueError: naming the accepted forms.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 24GB, 40GiB, 300MB or auto, got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or int(value) <= 0:  # YAML's .inf and .nan; 0.5 would be 0 bytes
            raise ValueError(f"expected a finite size of at least 1 byte, got {value!r}")
        return int(value)
    text = str(value).strip().lower().replace(" ", "")
    if text == AUTO:
        return AUTO
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)([a-z]*)", text)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"expected a size such as 24GB, 40GiB, 300MB or auto, got {value!r}")
    n = float(m.group(1)) * _UNITS[m.group(2)]
    if not math.isfinite(n) or int(n) <= 0:  # 1e400 overflows to infinity
        raise ValueError(f"expected a finite size of at least 1 byte, got {value!r}")
    n = int(n)
    return n


def is_auto(value) -> bool:
    """Whether a size setting's value is `auto` (to be measured), not a byte count or none."""
    return isinstance(value, str) and value == AUTO


def format_size(n: int | str | None) -> str:
    if n is None:
        return "none"
    if isinstance(n, str):
        return n
    return f"{n / 1e9:.3g} GB" if n >= 10**8 else f"{n / 1e6:.3g} MB"

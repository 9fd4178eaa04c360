"""The value checkers of the training settings (poros/settings.py). Each takes a value as a matrix file, a run
file or a flag gives it and returns it coerced, or raises ValueError saying what was expected and what came in (a
huge integer by its number of digits). Each declares the type of what it returns (`returns`): the type of its
setting's TrainConfig field (poros/config.py)."""

from __future__ import annotations

import enum
import math
from typing import Callable, Literal

from poros.sizes import AUTO, is_auto, parse_size


def returns(type_) -> Callable[[Callable], Callable]:
    """Marks a checker with the type of the values it returns (its `type`)."""

    def mark(check: Callable) -> Callable:
        check.type = type_
        return check

    return mark


MAX_COUNT = 2**31 - 1  # counts and lengths: torch sizes them in int32 in places (and none is near it)
MAX_SEED = 2**32 - 1  # seeds are combined with strides of about 2**20 into torch's 64-bit seeds


@returns(int)
def positive_int(v):
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"expected an integer > 0, got {_short(v)}")
    if v > MAX_COUNT:
        raise ValueError(f"expected an integer > 0 and at most {MAX_COUNT}, got {_short(v)}")
    return v


MAX_STREAM_BUFFERS = 8  # rotating buffers a plan may stream through: past a few, each adds a block's memory for no copy


@returns(int)
def stream_buffer_count(v):
    """Rotating buffers of streamed blocks: at least two (one filling while the compute reads the other)."""
    if not isinstance(v, int) or isinstance(v, bool) or not 2 <= v <= MAX_STREAM_BUFFERS:
        raise ValueError(f"expected an integer from 2 to {MAX_STREAM_BUFFERS}, got {_short(v)}")
    return v


@returns(int)
def sequence_length(v):
    """Tokens per sequence: at least two, since the loss of a sequence predicts each token from those before it."""
    v = positive_int(v)
    if v < 2:
        raise ValueError(f"expected an integer >= 2 (a sequence of one token has no next token to learn), got {v}")
    return v


@returns(int)
def seed_int(v):
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_SEED:
        raise ValueError(f"expected an integer from 0 to {MAX_SEED} (2**32 - 1), got {_short(v)}")
    return v


@returns(float)
def positive_number(v):
    """A finite number > 0 (inf and nan are refused: a step with them writes NaN everywhere)."""
    return _number(v, "a number > 0", lambda f: f > 0, out_of_range="a finite number > 0")


@returns(int)
def non_negative_int(v):
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_COUNT:
        raise ValueError(f"expected an integer >= 0 and at most {MAX_COUNT}, got {_short(v)}")
    return v


def _number(v, what: str, ok: Callable[[float], bool], out_of_range: str | None = None) -> float:
    """`v` as a float that is finite and `ok`; errors say `what` was expected (`out_of_range` for a number
    that is not finite or not `ok`, where given)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"expected {what}, got {_short(v)}")
    try:
        f = float(v)
    except OverflowError:  # an integer beyond a float's range
        raise ValueError(f"expected a finite {what.removeprefix('a ')}, got {_short(v)}") from None
    if not math.isfinite(f) or not ok(f):
        raise ValueError(f"expected {out_of_range or what}, got {_short(v)}")
    return f


@returns(float)
def non_negative_number(v):
    return _number(v, "a finite number >= 0", lambda f: f >= 0)


@returns(float)
def dropout_share(v):
    """A share of the inputs zeroed: 0 (off) up to, not including, 1."""
    return _number(v, "a number from 0 up to (not including) 1", lambda f: 0 <= f < 1)


@returns(float | None)
def optional_positive_number(v):
    if v is None or v == "none":
        return None
    if isinstance(v, str):  # as a flag gives it
        try:
            v = float(v)
        except ValueError:
            raise ValueError(f"expected a number > 0 or none, got {v!r:.80}") from None
    return _number(v, "a finite number > 0 or none", lambda f: f > 0)


def _short(v) -> str:
    """A value as an error shows it: a huge integer by its size, not its 400 digits."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**20:
        return f"an integer of {len(str(abs(v)))} digits"
    return f"{v!r:.80}"


@returns(bool)
def flag(v):
    if not isinstance(v, bool):
        raise ValueError(f"expected true or false, got {v!r}")
    return v


@returns(bool | Literal["auto"])
def flag_or_auto(v):
    """true, false, or auto (left to the planner)."""
    if isinstance(v, bool):
        return v
    if is_auto(v):
        return AUTO
    raise ValueError(f"expected true, false or auto, got {_short(v)}")


def one_of(enum_cls: type[enum.Enum]) -> Callable:
    @returns(enum_cls)
    def check(v):
        if isinstance(v, enum_cls):
            return v
        try:
            return enum_cls(v)
        except ValueError:
            raise ValueError(f"expected one of {', '.join(m.value for m in enum_cls)}, got {v!r}") from None

    return check


@returns(tuple[str, ...])
def module_names(v):
    if isinstance(v, str):  # q_proj,v_proj as a flag gives it
        v = [t.strip() for t in v.split(",")]
    if not isinstance(v, (list, tuple)) or not v or not all(isinstance(t, str) and t for t in v):
        raise ValueError(f"expected a non-empty list of module names, got {v!r}")
    return tuple(v)


@returns(int | Literal["auto"] | None)
def optional_size(v):
    return None if v is None or v == "none" else parse_size(v)


def _optional_int(v, least: int, wanted: str, auto: bool = False):
    """`v` as an integer from `least` to MAX_COUNT (a string of digits too), None for none, and with `auto` the word
    auto as itself."""
    if v is None or v == "none":
        return None
    if auto and is_auto(v):
        return v
    if isinstance(v, str) and v.isdigit():
        v = int(v)
    others = "auto or none" if auto else "or none"
    if not isinstance(v, int) or isinstance(v, bool) or v < least:
        raise ValueError(f"expected an integer {wanted}{',' if auto else ''} {others}, got {_short(v)}")
    if v > MAX_COUNT:
        raise ValueError(f"expected an integer {wanted} and at most {MAX_COUNT}, {others}, got {_short(v)}")
    return v


@returns(int | None)
def optional_count(v):
    """An integer >= 0, or none."""
    return _optional_int(v, 0, ">= 0")


@returns(int | Literal["auto"] | None)
def optional_count_or_auto(v):
    """An integer >= 0, auto, or none."""
    return _optional_int(v, 0, ">= 0", auto=True)


@returns(int | None)
def optional_positive_int(v):
    """An integer > 0, or none."""
    return _optional_int(v, 1, "> 0")
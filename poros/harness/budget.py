"""A run's time budget (`--max-minutes`), in one place: whether a pass or gate may start (`TimeBudget.check`, judged
by what earlier passes and gates took), and, while one runs, whether it can still end within the budget
(`TimeBudget.watch`: after every optimizer step of every trainer in the process, at the fastest pace its steps have
shown; `expired`, while the harness waits on a child process). A pass or gate that cannot end within the budget is
not started, or is stopped (`OutOfTime`), its finished passes kept for `--resume`; one that could not end within a
whole budget (`OutOfTime.never`) is said so in one line, since running the part again would not get it further."""

from __future__ import annotations

import contextlib
import time


class OutOfTime(Exception):
    """The next pass or gate would end past the run's time budget (or the budget ran out while it ran): the cell
    stops, its finished passes kept, and `--resume` continues it. `never`: it could not end within a whole
    budget of this length: the budget (or the steps) must change."""

    def __init__(self, message: str, never: bool = False):
        super().__init__(message)
        self.never = never


def _seconds(s: float) -> str:
    return f"{s:.3g} s" if s < 1e6 else f"{s:.2e} s"


class TimeBudget:
    """`minutes` from `start` (time.monotonic(); default now)."""

    def __init__(self, minutes: float, start: float | None = None):
        self.minutes = minutes
        self.seconds = 60.0 * minutes
        self.start = time.monotonic() if start is None else start
        self.deadline = self.start + self.seconds

    @classmethod
    def seconds_from_now(cls, seconds: float) -> "TimeBudget":
        return cls(seconds / 60.0)

    @property
    def flag(self) -> str:
        return f"--max-minutes {self.minutes:g}"

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def expired(self) -> bool:
        return self.left() <= 0

    def never(self, what: str, seconds: float, lower: str) -> OutOfTime:
        return OutOfTime(f"{what} cannot end within {self.flag} ({_seconds(self.seconds)}): it takes at least "
                         f"{_seconds(seconds)}; lower {lower} or raise --max-minutes", never=True)

    def check(self, what: str, seconds: float | None, *, margin: float = 1.0, lower: str = "--steps") -> None:
        """Before `what` starts, expected to take `seconds` (None: not known yet).

        Raises:
            OutOfTime: the budget is spent, or `what` would end past it (with `margin` on the estimate); `never`
                where `seconds` alone exceed the whole budget (`lower` names the setting to lower).
        """
        if self.expired():
            raise OutOfTime(f"the budget is spent before {what}")
        if seconds is None:
            return
        if seconds > self.seconds:
            raise self.never(what, seconds, lower)
        if time.monotonic() + margin * seconds > self.deadline:
            raise OutOfTime(f"{what} would take about {_seconds(seconds)}, {_seconds(max(self.left(), 0.0))} are left")

    @contextlib.contextmanager
    def watch(self, what: str, steps: int, lower: str = "--steps"):
        """While `what` runs its `steps` optimizer steps: after each one (`poros.engine.methods.trainer.after_each_step`),
        OutOfTime where the budget is spent, or where the steps left, at the fastest pace seen after the first step
        (which compiles and warms caches), would end past it; `never` where all `steps` at that pace exceed the
        whole budget."""
        from poros.engine.methods.trainer import after_each_step

        seen = {"done": 0, "last": time.monotonic(), "fastest": None}

        def after_step() -> None:
            now = time.monotonic()
            seen["done"] += 1
            took, seen["last"] = now - seen["last"], now
            if seen["done"] > 1:
                seen["fastest"] = took if seen["fastest"] is None else min(seen["fastest"], took)
            left = steps - seen["done"]
            if left <= 0:
                return
            if now >= self.deadline:
                raise OutOfTime(f"{what} was stopped at the budget after {seen['done']} of {steps} steps")
            pace = seen["fastest"]
            if pace is None:
                return
            if steps * pace > self.seconds:
                raise self.never(f"{what} ({steps} steps at {_seconds(pace)} a step)", steps * pace, lower)
            if now + left * pace > self.deadline:
                raise OutOfTime(f"{what} was stopped after {seen['done']} of {steps} steps: the other {left} would "
                                f"take at least {_seconds(left * pace)}, {_seconds(self.deadline - now)} are left")

        with after_each_step(after_step):
            yield

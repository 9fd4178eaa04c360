"""What a `poros train` run shows and keeps as it goes: the progress line, log.csv, loss.png, and
the Ctrl-C request that stops it at a step boundary."""

from __future__ import annotations

import csv
import io
import signal
import sys
import threading
import time
from pathlib import Path

from poros.common.atomic import append_line, atomic_path, write_atomic

LOG_COLUMNS = ("step", "loss", "lr", "tokens_per_s", "peak_memory_gb", "eval_loss")


class RunLog:
    """log.csv, one row per step; on resume rows after the checkpoint's step are dropped."""

    def __init__(self, path: Path, keep_through: int):
        self.path = path
        rows = []
        if keep_through and path.is_file():
            with path.open(newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= keep_through]
        text = io.StringIO(newline="")
        w = csv.DictWriter(text, LOG_COLUMNS)
        w.writeheader()
        w.writerows(rows)
        write_atomic(path, text.getvalue(), "the run's log")

    def append(self, row: dict) -> None:
        """One step's row, appended whole or not at all (a full disk: `WriteError`)."""
        text = io.StringIO(newline="")
        csv.DictWriter(text, LOG_COLUMNS).writerow({k: "" if row.get(k) is None else row[k] for k in LOG_COLUMNS})
        append_line(self.path, text.getvalue().encode(), "a step's row to")

    def rows(self) -> list[dict]:
        with self.path.open(newline="") as f:
            return list(csv.DictReader(f))


def plot_loss(log: RunLog, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = log.rows()
    fig = Figure(figsize=(7, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([int(r["step"]) for r in rows], [float(r["loss"]) for r in rows], label="train loss", lw=1)
    ev = [(int(r["step"]), float(r["eval_loss"])) for r in rows if r["eval_loss"]]
    if ev:
        ax.plot(*zip(*ev), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(path, "the loss plot") as tmp:
        fig.savefig(str(tmp), dpi=100)


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


class Progress:
    """A one-line bar on a terminal (step, loss, tokens/s, time left, memory); plain lines otherwise."""

    def __init__(self, total: int, start: int, stream=None, tty: bool | None = None):
        self.total, self.start, self.stream = total, start, stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.every = max(1, (total - start) // 50)
        self.t0 = None
        self._bar_drawn = False  # the terminal's line holds the bar: a message starts a new line

    def update(self, step: int, loss: float, tokens_per_s: float, memory: str = "") -> None:
        """`memory`: the peak memory so far as the line shows it (`peak 61.2 GB on cuda`)."""
        now = time.perf_counter()
        if self.t0 is None:  # time left from the steps after the first (which carries the warm-up)
            self.t0, self.first = now, step
        rate = (now - self.t0) / (step - self.first) if step > self.first else None
        left = "--:--" if rate is None else _duration(rate * (self.total - step))
        text = f"step {step}/{self.total} loss {loss:.4f} {tokens_per_s:,.0f} tok/s {left} left" + \
            (f" {memory}" if memory else "")
        if self.tty:
            done = int(20 * step / self.total)
            print(f"\r[{'#' * done}{'.' * (20 - done)}] {text}  ", end="", file=self.stream, flush=True)
            self._bar_drawn = True
        elif step == self.total or (step - self.start) % self.every == 0 or step == self.start + 1:
            print(text, file=self.stream, flush=True)

    def message(self, text: str) -> None:
        print(("\n" if self._bar_drawn else "") + text, file=self.stream, flush=True)
        self._bar_drawn = False


class StopRequest:
    """The first Ctrl-C (SIGINT) or SIGTERM (what schedulers and preemption send) asks the loop to save a
    checkpoint and stop after the current step; a second aborts at once. Once that checkpoint is saved
    (`settle`), nothing is left that a second could abort without loss: further signals are ignored until
    `restore_signals`, so none lands as a traceback in whatever runs then (a finalizer that garbage
    collection runs prints "Exception ignored ..."). Only the main thread receives signals; elsewhere
    nothing is installed."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, say):
        self.requested, self.say, self.previous = False, say, {}
        self.signum: int | None = None
        self.settled = False

    def _handler(self, signum, frame):
        if self.settled:
            return
        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.signum = True, signum
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        self.say(f"{name}: saving a checkpoint after this step (Ctrl-C again aborts without saving)")

    def settle(self) -> None:
        """The stop's checkpoint is saved: signals from now on are ignored (their handler stays installed past
        the block, until `restore_signals`)."""
        self.settled = True

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handler) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        if self.settled and self.previous:
            _lingering.append(self.previous)
        else:
            for s, handler in self.previous.items():
                signal.signal(s, handler)
        self.previous = {}


_lingering: list[dict] = []  # the handlers settled StopRequests replaced, for `restore_signals`


def signals_held() -> bool:
    """Whether a settled StopRequest still ignores signals."""
    return bool(_lingering)


def restore_signals() -> None:
    """Put back the handlers a settled StopRequest left ignoring signals."""
    while _lingering:
        for s, handler in _lingering.pop().items():
            signal.signal(s, handler)

"""A process-wide change that several holders may want at once (trainers alive together, closed in any order).

`Counted.held()` makes the change when the first holder enters and undoes it when the last one leaves, so no
holder's exit undoes it under another that still needs it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable


class Counted:
    """`make()` on the first entry (its result is the state `undo` gets), `undo(state)` after the last exit."""

    def __init__(self, make: Callable[[], Any], undo: Callable[[Any], None]):
        self._make, self._undo = make, undo
        self._lock = threading.Lock()
        self._state = None
        self.holders = 0

    @contextlib.contextmanager
    def held(self):
        with self._lock:
            if self.holders == 0:
                self._state = self._make()
            self.holders += 1
        try:
            yield
        finally:
            with self._lock:
                self.holders -= 1
                if self.holders == 0:
                    self._undo(self._state)
                    self._state = None

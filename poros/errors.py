"""User-facing errors: each is one line that names the bad value and what to do."""

from __future__ import annotations


class PorosError(Exception):
    """Base class; the CLI prints these as one line instead of a traceback."""


PROBLEM_CHARS = 400  # a problem quotes what came in: a megabyte-long value is shown by its start and its length


def shorten(text: str, limit: int = PROBLEM_CHARS) -> str:
    """`text`, or its first `limit` characters and how many more there were."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text) - limit:,} more characters)"


class ConfigError(PorosError, ValueError):
    """A configuration (CLI flags, TrainConfig or matrix file) is invalid.

    Collects every problem so the user can fix them all at once.
    """

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = [shorten(str(p)) for p in problems]
        self.source = source
        super().__init__(f"{source}: " + "; ".join(self.problems))


class UnknownModelError(PorosError, ValueError):
    """A model name is neither registered nor a checkpoint folder."""


class CheckpointError(PorosError):
    """A local checkpoint folder is incomplete or not a supported decoder-only model."""


class PinningError(PorosError):
    """Host memory for the NF4 store could not be page-locked."""


class CapabilityError(PorosError):
    """The requested method or backend cannot run in this environment."""


class BudgetError(PorosError):
    """No plan fits the device memory the user allows."""


class WriteError(PorosError):
    """A file, or standard output, could not be written (a full disk, a file-size limit, a read-only folder):
    the message names what and where; nothing that looks whole was left half-written."""

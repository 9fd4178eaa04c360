"""What a launcher (torchrun, or `poros train --gpus N` starting its ranks) tells a process through its
environment. Read without torch, so a command can ask before it loads anything."""

from __future__ import annotations

import os

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched() -> bool:
    """Whether a launcher started this process as one of several ranks."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1

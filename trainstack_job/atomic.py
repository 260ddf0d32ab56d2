"""Files that readers see whole or not at all: the one atomic write every part of trainstack uses for the
files it shares with another process (a checkpoint's `latest.json`, a node's exit record, the progress file).
Standard library only, and importing no other trainstack_job module: trainstack_job.contract and
trainstack_job.layout both write through it.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable: the directory's own entry, not only the file's data."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write via a temp file, fsync, rename and fsync the directory: readers see old or new, never half."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)

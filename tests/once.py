"""What a test session builds once for all its xdist workers: an expensive fixture's result (a dataset, a
reference run, a benchmark's quick report) that each worker would otherwise build again for itself, since
a module- or session-scoped fixture is per worker under pytest-xdist."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """A folder built once per test session by whichever xdist worker asks first; the others wait for it
    and read it. Nothing may write into it afterwards. A failed build is not marked built: the next worker
    to ask builds it again (and fails the same way, in its own tests)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's own folder, above every worker's (pytest-xdist's documented way)
    folder = base / name
    with FileLock(f"{folder}.lock"):
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            build(folder)
            (folder / ".built").touch()
    return folder

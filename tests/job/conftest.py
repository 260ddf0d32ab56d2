"""Job.from_env() takes over SIGTERM/SIGINT; every test here gives pytest its own handlers back."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from tests.tools import missing_modules


def installed(*modules: str) -> pytest.MarkDecorator:
    """Skip unless every module is installed, without importing it: the jobs run in their own processes,
    and importing lightning into the test process costs 3 s of CPU in every pytest worker that collects it.
    In CI (TRAINSTACK_CI=1) the skip is a failure that names them (tests/tools.py)."""
    missing = missing_modules(*modules)
    return pytest.mark.skipif(
        bool(missing), reason=f"not installed: {', '.join(missing)} (pip install -e '.[dev]')"
    )


@pytest.fixture(autouse=True)
def _restore_signal_handlers() -> Iterator[None]:
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)

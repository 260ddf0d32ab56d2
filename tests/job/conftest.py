"""Job.from_env() takes over SIGTERM/SIGINT; every test here gives pytest its own handlers back."""

from __future__ import annotations

import importlib.util
import signal
from collections.abc import Iterator

import pytest


def installed(*modules: str) -> pytest.MarkDecorator:
    """Skip unless every module is installed, without importing it: the jobs run in their own processes,
    and importing lightning into the test process costs 3 s of CPU in every pytest worker that collects it."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    return pytest.mark.skipif(bool(missing), reason=f"not installed: {', '.join(missing)}")


@pytest.fixture(autouse=True)
def _restore_signal_handlers() -> Iterator[None]:
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)

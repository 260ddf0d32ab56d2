"""Shared fixtures: an isolated AWS environment that can only ever reach 127.0.0.1."""

from __future__ import annotations

import json
import os
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from demo.collector import ImportsFrozen
from demo.moto_server import MOTO_SETTINGS
from demo.moto_server import moto_server as embedded_moto_server
from tests.iam import plugin as iam_check
from tests.tools import pytest_runtest_makereport as pytest_runtest_makereport  # in CI no test skips

if TYPE_CHECKING:
    from tests.forkserver import ForkServer

# Set before any test makes a boto3 client (importing boto3 reads nothing): no test may find real
# credentials or reach a real endpoint.
_ISOLATED_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    # No instance-metadata credential lookups unless a test points IMDS at its own simulator.
    "AWS_EC2_METADATA_DISABLED": "true",
    # No AMI catalogue in moto: tests use demo.stack.STAND_IN_AMI.
    **MOTO_SETTINGS,
}
for _key, _value in _ISOLATED_ENV.items():
    os.environ[_key] = _value
os.environ.pop("AWS_PROFILE", None)
os.environ.pop("AWS_ENDPOINT_URL", None)
# `make test` runs one xdist worker per core, and the trainers the tests start are tiny: one intra-op
# thread per process is faster than two fighting over the cores (a test life: 7 s vs 8 s alone, 19 s loaded).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(wrapper=True, optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> Generator[None, int, int]:
    """`pytest -n auto` (make test): three workers more than xdist's count of cores. Much of a worker's time
    is spent waiting (for trainer and agent processes it started, on sockets, on timeouts under test), and
    the more workers, the more of those waits another one's work fills: on 2 cores, four workers left the
    cores idle a fifth of the time in places, five filled most of it at the same CPU-seconds
    (bench/RESULTS.md, thirteenth session; with the suite's CPU then, a fifth cost more than it filled).
    PYTEST_XDIST_AUTO_NUM_WORKERS still sets the number."""
    cores = yield
    return cores if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") else cores + 3


# Each module's wall seconds as last measured (`python -m bench.suitecost --record-modules`); a module not
# listed is estimated from its tests: `@pytest.mark.slow(seconds=N)` where marked, UNMARKED_SECONDS each else.
MODULE_SECONDS = Path(__file__).with_name("module_seconds.json")
UNMARKED_SECONDS = 0.1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Costliest module first. `make test` (`--dist loadscope --no-loadscope-reorder`) gives each worker a
    whole module at a time, in the order of the modules' first tests here: a module's fixtures are built on
    one worker, not on each, and one module's waits (a deadline under test, an agent's poll) overlap other
    modules' work rather than stalling every worker at once. The costliest first, so that a 70 s module never
    starts last and leaves the other workers idle at the end (longest-processing-time-first scheduling).
    Within a module pytest's order is kept."""
    measured = recorded_module_seconds()
    estimated: dict[str, float] = {}
    for item in items:
        module = _module_scope(item)
        estimated[module] = estimated.get(module, 0.0) + _expected_seconds(item)
    expected = {module: measured.get(module, seconds) for module, seconds in estimated.items()}
    items.sort(key=lambda item: -expected[_module_scope(item)])  # stable: a module's tests keep their order


def recorded_module_seconds(path: Path | None = None) -> dict[str, float]:
    """tests/module_seconds.json ({} where there is none); a damaged one stops the run in one line."""
    path = path or MODULE_SECONDS
    if not path.exists():
        return {}
    try:
        recorded = json.loads(path.read_text())
        if not isinstance(recorded, dict):
            raise ValueError("not an object of module: seconds")
        return {str(module): float(seconds) for module, seconds in recorded.items()}
    except (ValueError, TypeError) as exc:
        raise pytest.UsageError(
            f"{path}: unreadable ({exc}); write it again with `python -m bench.suitecost --record-modules`, "
            "or delete it (modules are then ordered by their slow markers)"
        ) from None


def _module_scope(item: pytest.Item) -> str:
    """`item`'s module, as its node id names it (xdist's loadscope sends a module's tests together)."""
    return item.nodeid.split("::", 1)[0]


def _expected_seconds(item: pytest.Item) -> float:
    marker = item.get_closest_marker("slow")
    if marker is None:
        return UNMARKED_SECONDS
    return float(marker.kwargs.get("seconds", 10))


def pytest_configure(config: pytest.Config) -> None:
    """The IAM check (tests/iam): every AWS call of the agent, capacity fallback and CLI is recorded. And the
    worker's imports are kept out of full garbage collections (demo/collector.py)."""
    iam_check.configure(config)
    ImportsFrozen().watch()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Checks every recorded call against its principal's declared policy; a refusal fails the session."""
    iam_check.sessionfinish(session)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    iam_check.terminal_summary(terminalreporter, config)


@dataclass(frozen=True)
class MotoServer:
    """A moto server on 127.0.0.1 with a port the OS picked."""

    endpoint_url: str

    def env(self) -> dict[str, str]:
        """Environment for a subprocess that must talk to this server only."""
        # The IAM recording folder travels too: an agent started with this environment is recorded.
        return {**_ISOLATED_ENV, **iam_check.recording_env(), "AWS_ENDPOINT_URL": self.endpoint_url}


# What a test may never leave behind for the next one on its worker: an endpoint or identity another test
# then reaches instead of its own (a demo's endpoint once sent the next test's moto calls to a closed port).
_ENVIRONMENT_GUARDED = ("AWS_ENDPOINT_URL", "AWS_PROFILE", *_ISOLATED_ENV)


@pytest.fixture()
def collector_alone() -> Iterator[None]:
    """The garbage collector as a process without the worker's own freezing (demo/collector.py) has it, and
    with no automatic collection: a test that checks what is frozen sees only what its code froze."""
    import gc

    watchers = gc.callbacks[:]
    gc.callbacks.clear()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.callbacks[:] = watchers + [c for c in gc.callbacks if c not in watchers]
        if was_enabled:
            gc.enable()


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    before = {key: os.environ.get(key) for key in _ENVIRONMENT_GUARDED}
    yield
    left = {key: os.environ.get(key) for key in _ENVIRONMENT_GUARDED if os.environ.get(key) != before[key]}
    for key, value in before.items():  # put back, so that one leak fails one test only
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    assert not left, f"the test left {left} in os.environ: set them with monkeypatch, which restores them"


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    """One moto server per test session, started on port 0 and stopped at the end."""
    with embedded_moto_server() as endpoint_url:
        yield MotoServer(endpoint_url=endpoint_url)


@pytest.fixture()
def aws(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoServer]:
    """Point boto3 in this process at the moto server, and reset moto's state afterwards."""
    import requests

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint_url)
    yield moto_server
    requests.post(f"{moto_server.endpoint_url}/moto-api/reset", timeout=10)


@pytest.fixture(scope="session")
def fork_server() -> Iterator[ForkServer]:
    """This worker's trainer fork server (tests/forkserver.py), started by the first test that asks: its
    imports cost what one trainer life's do, and every later life forked from it skips them."""
    from tests.forkserver import TRAINER_MODULES, serving

    with serving(*TRAINER_MODULES) as server:
        yield server

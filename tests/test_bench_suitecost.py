"""bench/suitecost.py: each test's CPU lands on that test, whether its worker, a process it reaped or a life
its fork server forked spent it; the run's whole CPU, wall time and busy share come with the report."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from bench.suitecost import REPO, SpentByTest, SuiteCost, record_module_seconds, report, run

SUITE = """
import os, subprocess, sys, time
from pathlib import Path

import pytest

from tests.forkserver import serving

BURN = "import time\\nend = time.process_time() + 0.6\\nwhile time.process_time() < end: pass\\n"


def burn() -> None:
    exec(BURN)


def test_burns_in_its_worker() -> None:
    burn()


def test_burns_in_a_process_it_reaps() -> None:
    subprocess.run([sys.executable, "-c", BURN], check=True)


@pytest.fixture(scope="module")
def server():
    with serving("json") as started:
        yield started


def test_starts_the_fork_server(server) -> None:
    pass


def test_burns_in_a_forked_life(server, tmp_path: Path) -> None:
    life = server.start(["-c", BURN], dict(os.environ), tmp_path, tmp_path / "log")
    assert life.wait(timeout=60) == 0


def test_burns_in_a_fork_server_it_closes(tmp_path: Path) -> None:
    with serving("json") as own:
        life = own.start(["-c", BURN], dict(os.environ), tmp_path, tmp_path / "log")
        assert life.wait(timeout=60) == 0


def test_waits() -> None:
    time.sleep(0.6)
"""


def test_each_tests_cpu_lands_on_it_wherever_it_ran(tmp_path: Path) -> None:
    (tmp_path / "test_costs.py").write_text(SUITE)
    cost = run(["-n0", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", str(tmp_path)], cwd=tmp_path)
    assert cost.exit_code == 0
    by_name = {t.test.rsplit("::", 1)[1]: t for t in cost.tests}
    assert set(by_name) == {
        "test_burns_in_its_worker",
        "test_burns_in_a_process_it_reaps",
        "test_starts_the_fork_server",
        "test_burns_in_a_forked_life",
        "test_burns_in_a_fork_server_it_closes",
        "test_waits",
    }
    assert by_name["test_burns_in_its_worker"].worker >= 0.5
    assert by_name["test_burns_in_a_process_it_reaps"].reaped >= 0.5
    # The module's server runs on past the test: its life's CPU is read from it, not reaped yet.
    forked = by_name["test_burns_in_a_forked_life"]
    assert forked.forked >= 0.5 and forked.reaped < 0.3
    # A server started and closed within the test is reaped with its life: counted once, as reaped.
    closes = by_name["test_burns_in_a_fork_server_it_closes"]
    # (The module's server, idle meanwhile, may still be charged a clock tick of its own: 10 ms.)
    assert closes.reaped >= 0.5 and closes.forked < 0.1
    # The module's server is closed in the last test's teardown: what earlier tests were given of it is not
    # given again (the life's 0.6 s would otherwise land on a test that only sleeps).
    waits = by_name["test_waits"]
    assert waits.wall >= 0.6 and waits.cpu < 0.3, "a wait is wall time, not CPU"
    assert sum(t.cpu for t in cost.tests) < cost.cpu, "no CPU-second given twice"
    # The whole run: every process pytest reaped, so at least the three burns, and more wall than they took.
    assert cost.cpu >= 2.4 and cost.wall >= 3.0
    assert cost.busy is not None and 0 < cost.busy <= 1


def test_the_report_names_the_costliest_tests_and_modules_first() -> None:
    tests = [
        SpentByTest("tests/a.py::cheap", 0.1, 0.0, 0.0, 5.0),
        SpentByTest("tests/b.py::dear", 1.0, 2.0, 3.0, 7.0),
        SpentByTest("tests/a.py::middling", 0.5, 0.5, 0.0, 1.0),
    ]
    out = io.StringIO()
    report(SuiteCost(0, 20.0, 9.0, 0.9, tests), 2, Console(file=out, width=200))
    text = out.getvalue()
    assert "3 tests, pytest exit 0: 20.0 s wall, 9.0 CPU-seconds (7.1 on the tests" in text
    assert "cores 90% busy" in text
    assert text.index("tests/b.py::dear") < text.index("tests/a.py::middling")
    assert "tests/a.py::cheap" not in text, "--top 2 lists two tests"
    # By module: b (6.0) before a (1.1).
    modules = text[text.index("modules that cost the most CPU") :]
    assert modules.index("tests/b.py") < modules.index("tests/a.py") and "1.1" in modules


def test_recorded_module_seconds_order_make_tests_modules_costliest_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tests.conftest as suite

    recorded = tmp_path / "module_seconds.json"
    tests = [
        SpentByTest("tests/a.py::one", 0.1, 0.0, 0.0, 0.4),
        SpentByTest("tests/a.py::two", 0.1, 0.0, 0.0, 0.8),
        SpentByTest("tests/b.py::story", 1.0, 2.0, 3.0, 30.0),
        SpentByTest("tests/c.py::quick", 0.0, 0.0, 0.0, 0.2),
    ]
    record_module_seconds(SuiteCost(0, 40.0, 9.0, 0.9, tests), recorded)
    assert json.loads(recorded.read_text()) == {"tests/a.py": 1.2, "tests/b.py": 30.0}, "under 1 s: left out"

    def item(nodeid: str, slow: float | None = None) -> Any:
        marker = None if slow is None else SimpleNamespace(kwargs={"seconds": slow})
        return SimpleNamespace(nodeid=nodeid, get_closest_marker=lambda name: marker)

    monkeypatch.setattr(suite, "MODULE_SECONDS", recorded)
    items = [
        item("tests/a.py::one"),
        item("tests/a.py::two"),
        item("tests/b.py::story"),
        item("tests/c.py::quick"),
        item("tests/d.py::new_story", slow=20.0),  # not recorded yet: its marker estimates it
        item("tests/e.py::new"),
    ]
    suite.pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == [
        "tests/b.py::story",
        "tests/d.py::new_story",
        "tests/a.py::one",
        "tests/a.py::two",
        "tests/c.py::quick",
        "tests/e.py::new",
    ]


def test_every_recorded_module_still_exists_and_a_damaged_record_is_one_line(tmp_path: Path) -> None:
    from tests.conftest import MODULE_SECONDS, recorded_module_seconds

    recorded = recorded_module_seconds()
    assert recorded, f"{MODULE_SECONDS} is missing: python -m bench.suitecost --record-modules writes it"
    gone = [module for module in recorded if not (REPO / module).is_file()]
    assert not gone, f"{MODULE_SECONDS} names modules that no longer exist: {gone}; record it again"

    damaged = tmp_path / "module_seconds.json"
    for text in ("{not json", '["tests/a.py"]', '{"tests/a.py": "slow"}'):
        damaged.write_text(text)
        with pytest.raises(pytest.UsageError) as refused:
            recorded_module_seconds(damaged)
        assert str(damaged) in str(refused.value) and "--record-modules" in str(refused.value)
        assert "\n" not in str(refused.value)

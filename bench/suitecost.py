"""`python -m bench.suitecost [--top N] [PYTEST ARGS...]`: what `make test` costs in CPU, test by test.

`make test` on 2 cores is bound by CPU-seconds and by how busy its waits leave the cores, and wall time says
neither: a story that waits out a lease for 40 s costs a few CPU-seconds, one that trains costs most of its
wall time on each core it uses. This runs pytest (by default as `make test` does) with a plugin that records,
for each test, the CPU of its worker (every thread: the embedded AWS server, in-process agents), of the
processes the worker reaped during the test (a demo story's subprocess and all under it), and of the lives
the worker's fork server forked and reaped meanwhile (tests/forkserver.py). It then prints the run's wall
time, its whole CPU (every process pytest reaped, the fork servers' lives included), how busy the machine's
cores were, and the tests and modules that cost the most CPU.

A test's figure is what ran while it ran: a fork server's first start is paid by the test that asked for it.
The rest of the run's CPU (workers starting, collecting) lands on no test.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
RECORD_ENV = "TRAINSTACK_SUITECOST_DIR"
MAKE_TEST_ARGS = ["-n", "auto", "--dist", "loadscope", "--no-loadscope-reorder"]
# Each module's measured seconds, which `make test` orders the modules by (tests/conftest.py).
MODULE_SECONDS = REPO / "tests" / "module_seconds.json"
_TICKS = os.sysconf("SC_CLK_TCK")


# -- the plugin, in each pytest process (`-p bench.suitecost`) ---------------------------------------------


def _fork_servers_cpu() -> dict[int, float]:
    """The CPU-seconds of each of this process's running fork servers so far: its own and its reaped
    lives'."""
    forkserver = sys.modules.get("tests.forkserver")
    spent = {}
    for pid in getattr(forkserver, "running_pids", lambda: [])():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # closed meanwhile
        # utime, stime, cutime, cstime: fields 14-17 of proc(5), 12-15 after the command name.
        spent[pid] = sum(int(value) for value in fields[11:15]) / _TICKS
    return spent


def _reaped() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
    folder = os.environ.get(RECORD_ENV)
    if not folder:
        return (yield)
    worker, reaped, servers, began = time.process_time(), _reaped(), _fork_servers_cpu(), time.monotonic()
    result = yield
    servers_now = _fork_servers_cpu()
    # A server closed during this test was reaped by the worker with everything it ever spent: what earlier
    # tests were given of it is not this test's.
    given = sum(spent for pid, spent in servers.items() if pid not in servers_now)
    row = {
        "test": item.nodeid,
        "worker": time.process_time() - worker,
        "reaped": _reaped() - reaped - given,
        "forked": sum(spent - servers.get(pid, 0.0) for pid, spent in servers_now.items()),
        "wall": time.monotonic() - began,
    }
    with (Path(folder) / f"{os.getpid()}.jsonl").open("a") as out:
        out.write(json.dumps(row) + "\n")
    return result


# -- the run and its report --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpentByTest:
    test: str
    worker: float
    reaped: float
    forked: float
    wall: float

    @property
    def cpu(self) -> float:
        return self.worker + self.reaped + self.forked

    @property
    def module(self) -> str:
        return self.test.split("::", 1)[0]


@dataclass(frozen=True)
class SuiteCost:
    exit_code: int
    wall: float
    cpu: float
    busy: float | None  # the machine's cores, 0..1, over the run; None where /proc/stat cannot be read
    tests: list[SpentByTest]


def _busy_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of every core so far (/proc/stat's aggregate line; idle and iowait are idle)."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values) - idle, sum(values)


def read_costs(folder: Path) -> list[SpentByTest]:
    return [
        SpentByTest(**json.loads(line)) for path in sorted(folder.glob("*.jsonl")) for line in path.open()
    ]


def run(pytest_args: list[str], cwd: Path = REPO) -> SuiteCost:
    """pytest with the plugin in `cwd`; CPU, wall time and busy share measured around it."""
    with tempfile.TemporaryDirectory(prefix="trainstack-suitecost-") as folder:
        env = {
            **os.environ,
            RECORD_ENV: folder,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # as `make test` runs it: compiled once, read after
        before_children = resource.getrusage(resource.RUSAGE_CHILDREN)
        before_ticks, began = _busy_ticks(), time.monotonic()
        code = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "bench.suitecost", *pytest_args],
            cwd=cwd,
            env=env,
            check=False,
        ).returncode
        wall = time.monotonic() - began
        after_ticks, after_children = _busy_ticks(), resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after_children.ru_utime + after_children.ru_stime) - (
            before_children.ru_utime + before_children.ru_stime
        )
        busy = None
        if before_ticks and after_ticks and after_ticks[1] > before_ticks[1]:
            busy = (after_ticks[0] - before_ticks[0]) / (after_ticks[1] - before_ticks[1])
        return SuiteCost(code, wall, cpu, busy, read_costs(Path(folder)))


def _table(rows: Iterable[tuple[str, ...]], columns: tuple[str, ...]) -> Table:
    table = Table()
    for index, column in enumerate(columns):
        table.add_column(column, justify="right" if index < len(columns) - 1 else "left")
    for row in rows:
        table.add_row(*row)
    return table


def report(cost: SuiteCost, top: int, console: Console) -> None:
    attributed = sum(t.cpu for t in cost.tests)
    busy = "unknown" if cost.busy is None else f"{cost.busy:.0%}"
    console.print(
        f"{len(cost.tests)} tests, pytest exit {cost.exit_code}: {cost.wall:.1f} s wall, {cost.cpu:.1f} "
        f"CPU-seconds ({attributed:.1f} on the tests, the rest starting and collecting), cores {busy} busy"
    )
    expensive = sorted(cost.tests, key=lambda t: -t.cpu)[:top]
    console.print(f"the {len(expensive)} tests that cost the most CPU")
    console.print(
        _table(
            (
                (
                    f"{t.cpu:.1f}",
                    f"{t.worker:.1f}",
                    f"{t.reaped:.1f}",
                    f"{t.forked:.1f}",
                    f"{t.wall:.1f}",
                    t.test,
                )
                for t in expensive
            ),
            ("CPU-s", "worker", "reaped", "forked", "wall s", "test"),
        )
    )
    cpu: dict[str, float] = defaultdict(float)
    wall: dict[str, float] = defaultdict(float)
    for t in cost.tests:
        cpu[t.module] += t.cpu
        wall[t.module] += t.wall
    modules = sorted(cpu, key=lambda module: -cpu[module])[:top]
    console.print(f"the {len(modules)} modules that cost the most CPU")
    console.print(
        _table(
            ((f"{cpu[module]:.1f}", f"{wall[module]:.1f}", module) for module in modules),
            ("CPU-s", "wall s", "module"),
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.suitecost",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Arguments after the options go to pytest (default: make test's -n auto --dist loadscope "
        "--no-loadscope-reorder).",
    )
    parser.add_argument("--top", type=int, default=25, help="how many tests and modules to list")
    parser.add_argument(
        "--record-modules",
        action="store_true",
        help=f"write each module's wall seconds to {MODULE_SECONDS.relative_to(REPO)} (make test's order)",
    )
    args, pytest_args = parser.parse_known_args(argv)
    cost = run(pytest_args or MAKE_TEST_ARGS)
    report(cost, args.top, Console(width=160))
    if args.record_modules:
        record_module_seconds(cost, MODULE_SECONDS)
    return cost.exit_code


def record_module_seconds(cost: SuiteCost, path: Path) -> None:
    """Each module's tests' wall seconds summed, to a tenth, for the modules of a second or more: what
    tests/conftest.py orders `make test`'s modules by. A module left out (new, or under a second) is
    estimated there from its tests."""
    seconds: dict[str, float] = defaultdict(float)
    for t in cost.tests:
        seconds[t.module] += t.wall
    kept = {module: round(s, 1) for module, s in sorted(seconds.items()) if s >= 1.0}
    path.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    sys.exit(main())

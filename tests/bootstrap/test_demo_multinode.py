"""`python -m demo --nodes 2` end to end: two real agents train one job over gloo, a spot notice on one, the
survivor regroups alone, the replacement joins; zero steps lost, world sizes 2 → 1 → 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.bootstrap.test_demo import demo_env
from tests.forkserver import ForkServer
from tests.iam.plugin import recording_env

REPO = Path(__file__).resolve().parents[2]

CHECKS = (
    "every agent exited 0 (3 nodes)",
    "the stop was confirmed in S3 at the step every rank stopped at",
    "steps lost = 0",
    "steps lost = 0 when the replacement joined",
    "world sizes 2, then 1, then 2",
    "results in S3",
    "group scaled to zero",
    "exactly one 'training completed' notification",
    "ledger: 3 lives (preempted, completed, completed)",
)


@pytest.mark.slow(seconds=79)
def test_two_nodes_lose_no_step_to_a_spot_notice_and_take_the_replacement_back(
    tmp_path: Path, fork_server: ForkServer
) -> None:
    # demo_env: piped, as in CI, one torch thread per rank, each node's launcher and its ranks forked; under
    # pytest's 300 s per test.
    result = subprocess.run(
        [sys.executable, "-m", "demo", "--nodes", "2", "--workdir", str(tmp_path / "demo")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
        # The IAM recording folder (tests/iam): the nodes' agents record their calls for the session's check.
        env={**demo_env(tmp_path, fork_server), **recording_env()},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    for check in CHECKS:
        assert f"PASS {check}" in output, output[-6000:]
    assert "FAIL" not in output
    world = next(line for line in output.splitlines() if line.strip().startswith("world sizes over time"))
    assert world.split()[-5:] == ["2", "→", "1", "→", "2"], world
    assert "s3://trainstack-demo-data/results/metrics.json" in output
    assert (tmp_path / "demo" / "timeline.png").stat().st_size > 10_000
    # Each simulated instance had its own scratch.
    assert all((tmp_path / "demo" / f"node-{n}" / "scratch").is_dir() for n in (1, 2, 3))


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--nodes", "3"], "--nodes 3: the local demo runs 1 or 2 nodes"),
        (["--nodes", "2", "--job", "examples/charlm"], "user jobs on several nodes are not supported yet"),
    ],
)
def test_what_the_multi_node_demo_does_not_run_is_refused_in_one_line(
    tmp_path: Path, argv: list[str], says: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "demo", *argv, "--workdir", str(tmp_path / "demo")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert says in result.stdout and len(result.stdout.strip().splitlines()) == 1, result.stdout
    assert not (tmp_path / "demo").exists()

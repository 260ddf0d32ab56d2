"""The scheduling bench (bench/scheduling/) at its `--quick` size: a few jobs on a few simulated instances
per run, the real `bind_job`/`_bind_lanes`, lease and ledger against a moto server. The pass conditions must
hold; no timing is asserted (this machine's speed is not under test)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.scheduling.checks import check_run, most_at_once, overlaps
from bench.scheduling.journal import Holding, Journal
from bench.scheduling.report import main
from bench.scheduling.runs import limit_run, pools_run
from tests.once import built_once

LIMIT_CHECK = "never more than maxConcurrentJobs at once"
CHECKS = {
    "every job ran exactly once",
    "never two writers at once",
    "no job's lease lost",
    "no busy instance scaled in",
    "no errors",
}


def _check(run: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(c for c in run["checks"] if c["name"] == name)
    return found


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The `--quick` run, once per session: the tests below only read its report (on two workers each
    would run it: about 8 CPU-seconds)."""

    def build(folder: Path) -> None:
        main(["--quick", "--json", str(folder / "quick.json")])

    folder = built_once(tmp_path_factory, "scheduling-quick", build)
    report: dict[str, Any] = json.loads((folder / "quick.json").read_text())
    return report


@pytest.mark.slow(seconds=35)
def test_the_quick_runs_keep_one_writer_never_lose_a_lease_and_never_scale_in_a_busy_instance(
    quick: dict[str, Any],
) -> None:
    assert [run["name"] for run in quick["runs"]] == ["pools", "sweep", "burst", "limit"]
    for run in quick["runs"]:
        limited = {LIMIT_CHECK} if run["name"] == "limit" else set()
        assert {c["name"] for c in run["checks"]} == CHECKS | limited
        for name in (CHECKS | limited) - {"every job ran exactly once"}:
            check = _check(run, name)
            assert check["passed"], f"{run['name']}: {name}: {check['detail']}"
        figures = run["figures"]
        assert figures["decisions"] >= figures["jobs"]
        assert figures["s3_requests"]["LIST"] > 0 and figures["s3_requests"]["GET"] > 0
        assert figures["s3_usd_per_job"] > 0
        assert 0 < figures["utilisation"] <= 1
    burst = quick["runs"][2]["figures"]
    # Capacity comes down as the burst's jobs end: by the scaler, or by an idle instance that leaves with a
    # decrement first (which of the two gets there is a race; CI's clean clone once saw only the second).
    lowered = {"SetDesiredCapacity", "TerminateInstanceInAutoScalingGroup"} & set(burst["autoscaling_calls"])
    assert lowered, f"the burst run's capacity never came down: {burst['autoscaling_calls']}"
    assert "0.005" in quick["prices"] and "2026-12-06" in quick["prices"]
    # The limit run: the scheduler function started every instance, on the events EventBridge would send.
    limit = quick["runs"][3]["figures"]
    invoked = limit["lambda_invocations"]
    assert invoked["queue entry"] == 6 and invoked.get("instance ended", 0) >= 1, invoked
    assert limit["lambda_raised"] >= 1 and limit["autoscaling_calls"]["SetDesiredCapacity"] >= 1
    assert 1 <= limit["most_at_once"] <= 2


@pytest.mark.slow(seconds=35)
def test_every_job_ran_exactly_once(quick: dict[str, Any]) -> None:
    """The race this bench found (a life binds a job that still runs; its holder completes it; the life's
    `begin_life` reopened the completed ledger and took the released lease) is closed: a life bound to a
    running job never restarts an ended one (bootstrap/ledger.py JobEndedError)."""
    for run in quick["runs"]:
        check = _check(run, "every job ran exactly once")
        assert check["passed"], f"{run['name']}: {check['detail']}"


def test_the_checks_catch_two_writers_and_a_job_run_twice_or_never() -> None:
    spec = pools_run(3, 1, 1, 1, 1, seed=1)
    a, b, c = (job.job_id for job in spec.jobs)
    journal = Journal()
    journal.holdings = [
        Holding(a, "i-1", 0.0, 1.0, trained=True, completed=True),
        Holding(a, "i-2", 0.5, 1.5, trained=True, completed=True),  # overlaps i-1 and runs it again
        Holding(b, "i-1", 2.0, 3.0, trained=True, completed=True),
    ]
    assert len(overlaps(journal.holdings)) == 1
    results = {check.name: check for check in check_run(spec, journal)}
    assert not results["never two writers at once"].passed
    once = results["every job ran exactly once"]
    assert not once.passed and f"twice: {a}" in once.detail and f"never: {c}" in once.detail
    assert results["no job's lease lost"].passed


def test_the_limit_check_counts_jobs_running_at_once_until_their_end_was_written() -> None:
    spec = limit_run(3, 2, 2, 2, seed=1)
    a, b, c = (job.job_id for job in spec.jobs)
    journal = Journal()
    journal.holdings = [
        # a's end was written at 1.0; its holder kept the lease until 2.5 while it looked for work.
        Holding(a, "i-1", 0.0, 2.5, trained=True, completed=True, ran_until=1.0),
        Holding(b, "i-2", 0.5, 3.0, trained=True, completed=True, ran_until=2.8),
        Holding(c, "i-3", 1.5, 4.0, trained=True, completed=True, ran_until=3.5),
        Holding(a, "i-4", 0.2, 0.4, trained=False, completed=False),  # a standby that let go: not running
    ]
    assert most_at_once(journal.holdings) == 2
    (limit,) = [check for check in check_run(spec, journal) if check.name == LIMIT_CHECK]
    assert limit.passed and limit.detail == "at most 2 jobs trained at once (maxConcurrentJobs 2)"
    journal.holdings[2] = Holding(c, "i-3", 0.9, 4.0, trained=True, completed=True, ran_until=3.5)
    (limit,) = [check for check in check_run(spec, journal) if check.name == LIMIT_CHECK]
    assert not limit.passed and "at most 3 jobs" in limit.detail
    assert LIMIT_CHECK not in {check.name for check in check_run(pools_run(3, 1, 1, 1, 1, seed=1), journal)}

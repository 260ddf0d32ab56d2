"""The ledger with one writer per job (bootstrap/ledger.py): a holder that still beats is not closed by a
replacement, a standby's wait is billed as such, and the lease's outcomes move the counters as
docs/internals.md says (neither failures nor interruptions; a hand-over is progress)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import boto3
import pytest

from bootstrap.imds import InstanceIdentity
from bootstrap.ledger import JobLedger, LedgerStore
from tests.conftest import MotoServer
from trainstack_job.contract import LifeOutcome

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
HOLDER = InstanceIdentity("i-holder", "g6.xlarge", "us-east-1a", "us-east-1", "spot")
STANDBY = InstanceIdentity("i-standby", "g6.xlarge", "us-east-1b", "us-east-1", "spot")
THIRD = InstanceIdentity("i-third", "g6.xlarge", "us-east-1c", "us-east-1", "spot")
STALE = 60.0


def minutes(n: float) -> datetime:
    return T0 + timedelta(minutes=n)


def life(ledger: JobLedger, instance_id: str) -> dict[str, Any]:
    return next(x for x in ledger.lives if x["instance_id"] == instance_id)


def test_a_replacement_closes_a_silent_life_of_another_instance_but_not_one_that_still_beats() -> None:
    ledger = JobLedger()
    holder_id = ledger.begin_life(HOLDER, 0.36, T0)
    ledger.begin_life(STANDBY, 0.36, minutes(0.5), stale_after_seconds=STALE)  # then vanished, silent
    assert life(ledger, "i-holder")["outcome"] == "running", "the holder beat 30 s ago"
    beating = JobLedger(ledger.data, holder_id)
    beating.update_cost(minutes(10))  # the holder still beats
    replacement = JobLedger(beating.data)
    replacement.begin_life(THIRD, 0.36, minutes(10.5), stale_after_seconds=STALE)
    holder, gone = life(replacement, "i-holder"), life(replacement, "i-standby")
    assert holder["outcome"] == "running" and holder["ended_at"] is None, "a holder that beats is alive"
    assert gone["outcome"] == "interrupted" and gone["closed_by"] == "i-third"
    assert gone["ended_at"] == gone["started_at"], "billed up to its last heartbeat"
    assert replacement.interruptions == 1 and replacement.consecutive_failures == 0
    # Without a stale limit (before leases) every other running life is taken for dead.
    legacy = JobLedger(beating.data)
    legacy.begin_life(THIRD, 0.36, minutes(10.5))
    assert life(legacy, "i-holder")["outcome"] == "interrupted" and legacy.interruptions == 2


def test_the_same_instances_earlier_life_is_a_failure_even_with_a_stale_limit() -> None:
    ledger = JobLedger()
    ledger.begin_life(HOLDER, 0.36, T0)
    restarted = JobLedger(ledger.data)
    restarted.begin_life(HOLDER, 0.36, minutes(0.5), stale_after_seconds=STALE)
    assert restarted.lives[0]["outcome"] == "failed" and restarted.consecutive_failures == 1


def test_a_standby_life_is_billed_its_wait_and_the_ledger_sums_waits_and_handovers() -> None:
    holder = JobLedger()
    holder_id = holder.begin_life(HOLDER, 0.36, T0)
    standby = JobLedger(holder.data)
    standby_id = standby.begin_life(STANDBY, 0.72, minutes(30), stale_after_seconds=STALE)
    standby.mark_standby(minutes(30))
    standby.update_cost(minutes(40))
    assert standby.standby_cost_usd == pytest.approx(0.12), "a wait still open counts what it cost so far"
    standby.end_standby(minutes(50) + timedelta(seconds=1))  # took the lease: trains from here
    waited = life(standby, "i-standby")
    assert waited["standby_seconds"] == 1201.0
    assert waited["standby_cost_usd"] == pytest.approx(0.72 * 1201 / 3600, abs=1e-6), "to the second"
    assert "standby_cost_from_usd" not in waited
    handing = JobLedger(standby.data, holder_id)
    handing.end_life(LifeOutcome.HANDED_OVER, minutes(50))
    trained = JobLedger(handing.data, standby_id)
    trained.update_cost(minutes(90))  # training costs more, but is not standby cost
    assert trained.standby_cost_usd == pytest.approx(0.72 * 1201 / 3600, abs=1e-6)
    assert trained.handovers == 1
    assert trained.total_cost_usd == pytest.approx(0.36 * 50 / 60 + 0.72 * 60 / 60)
    assert "standby_seconds" not in life(trained, "i-holder")
    # Sums are derived from the lives: applying a change again (a retried conditional write) counts once.
    again = JobLedger(trained.data, standby_id)
    again.update_cost(minutes(90))
    assert (again.handovers, again.standby_cost_usd) == (1, trained.standby_cost_usd)


def test_a_wait_that_ends_with_the_life_or_its_instance_is_settled_then() -> None:
    holder = JobLedger()
    holder.begin_life(HOLDER, 0.36, T0)
    standby = JobLedger(holder.data)
    standby.begin_life(STANDBY, 0.36, T0, stale_after_seconds=STALE)
    standby.mark_standby(T0)
    standby.end_life(LifeOutcome.STANDBY_ENDED, minutes(10))  # the job ended while it waited
    waited = life(standby, "i-standby")
    assert waited["standby_seconds"] == 600.0 and waited["standby_cost_usd"] == pytest.approx(0.06)
    third = JobLedger(standby.data)
    third.begin_life(THIRD, 0.36, minutes(10), stale_after_seconds=STALE)
    third.mark_standby(minutes(10))
    third.update_cost(minutes(15))  # its last heartbeat: the instance then vanished
    successor = JobLedger(third.data)
    successor.begin_life(STANDBY, 0.36, minutes(20), stale_after_seconds=STALE)
    vanished = life(successor, "i-third")
    assert vanished["outcome"] == "interrupted"
    assert vanished["standby_seconds"] == 300.0 and vanished["standby_cost_usd"] == pytest.approx(0.03)
    assert successor.standby_cost_usd == pytest.approx(0.09)


@pytest.mark.parametrize(
    "outcome",
    [LifeOutcome.SURPLUS, LifeOutcome.STANDBY_ENDED, LifeOutcome.SUPERSEDED],
    ids=lambda outcome: outcome.value,
)
def test_lease_outcomes_that_say_nothing_about_the_jobs_health_leave_the_crash_counter(
    outcome: LifeOutcome,
) -> None:
    ledger = JobLedger()
    for _ in range(2):
        ledger.begin_life(HOLDER, None, T0)
        ledger.end_life(LifeOutcome.FAILED, T0)
    ledger.begin_life(STANDBY, None, minutes(1))
    ledger.end_life(outcome, minutes(2))
    assert ledger.consecutive_failures == 2, f"{outcome.value} reset or bumped the crash counter"
    assert ledger.interruptions == 0, f"{outcome.value} counted as an interruption"


def test_a_hand_over_is_progress_and_resets_the_crash_counter() -> None:
    ledger = JobLedger()
    ledger.begin_life(HOLDER, None, T0)
    ledger.end_life(LifeOutcome.FAILED, T0)
    ledger.begin_life(HOLDER, None, minutes(1))
    ledger.end_life(LifeOutcome.HANDED_OVER, minutes(2))
    assert (ledger.consecutive_failures, ledger.interruptions, ledger.handovers) == (0, 0, 1)


def test_a_life_that_never_trained_is_not_the_life_before_a_repeated_failure() -> None:
    ledger = JobLedger()
    ledger.begin_life(HOLDER, None, T0)
    ledger.end_life(LifeOutcome.FAILED, T0, failure={"exit_code": 1, "step": 7})
    ledger.begin_life(STANDBY, None, minutes(1))
    ledger.end_life(LifeOutcome.SURPLUS, minutes(1))
    ledger.begin_life(THIRD, None, minutes(2))
    previous = ledger.previous_life()
    assert previous is not None and previous["instance_id"] == "i-holder"


def test_standby_accounting_survives_the_conditional_store(aws: MotoServer) -> None:
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket="trainstack-ledger")
    holder = LedgerStore(s3, "trainstack-ledger", "jobs/demo-1a2b3c4d/state/ledger.json")
    standby = LedgerStore(s3, "trainstack-ledger", "jobs/demo-1a2b3c4d/state/ledger.json")
    holder.begin_life(HOLDER, 0.36, T0, stale_after_seconds=STALE)
    standby.begin_life(STANDBY, 0.36, minutes(0.5), stale_after_seconds=STALE)
    assert life(standby.last, "i-holder")["outcome"] == "running", "the holder beat 30 s ago"
    standby.update(lambda ledger: ledger.mark_standby(minutes(0.5)))
    holder.update(lambda ledger: ledger.update_cost(minutes(10)))
    standby.update(lambda ledger: ledger.end_standby(minutes(10.5)))
    holder.update(lambda ledger: ledger.end_life(LifeOutcome.HANDED_OVER, minutes(10.5)))
    final = holder.load()
    assert final.handovers == 1 and final.consecutive_failures == 0
    assert life(final, "i-standby")["standby_seconds"] == 600.0
    assert final.standby_cost_usd == pytest.approx(0.06)

"""One ledger per job across nodes: lives beside each other, one crash counted once, the cost of all."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from bootstrap.imds import InstanceIdentity
from bootstrap.ledger import JobLedger
from bootstrap.multinode import NodeExit, wait_until_confirmed
from trainstack_job.contract import LifeOutcome

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
NODE_A = InstanceIdentity("i-a", "g6.xlarge", "us-east-1a", "us-east-1", "spot")
NODE_B = InstanceIdentity("i-b", "g6.xlarge", "us-east-1a", "us-east-1", "spot")
STALE = 60.0


def _two_nodes() -> tuple[JobLedger, str, str]:
    ledger = JobLedger()
    a = ledger.begin_life(NODE_A, 1.0, T0, stale_after_seconds=STALE)
    ledger = JobLedger(ledger.data)
    b = ledger.begin_life(NODE_B, 1.0, T0 + timedelta(seconds=20), stale_after_seconds=STALE)
    return ledger, a, b


def test_a_node_joining_leaves_the_other_nodes_live_life_running() -> None:
    ledger, _, _ = _two_nodes()
    assert [life["outcome"] for life in ledger.lives] == ["running", "running"]
    assert ledger.interruptions == 0


def test_a_silent_node_is_closed_as_interrupted_once_its_heartbeat_is_stale() -> None:
    ledger, _, _ = _two_nodes()
    late = JobLedger(ledger.data)
    late.begin_life(
        InstanceIdentity("i-c", "g6.xlarge", "us-east-1a", "us-east-1", "spot"),
        1.0,
        T0 + timedelta(seconds=20 + STALE + 1),
        stale_after_seconds=STALE,
    )
    # i-a's last heartbeat was at T0, i-b's at T0+20 s: both older than STALE by then.
    assert [life["outcome"] for life in late.lives] == ["interrupted", "interrupted", "running"]
    assert late.interruptions == 2


def test_one_crash_seen_by_every_node_of_a_generation_counts_once() -> None:
    ledger, a, b = _two_nodes()
    for life_id in (a, b):
        node = JobLedger(ledger.data, life_id)
        node.set_generation(3)
        ledger = JobLedger(node.data)
    for life_id in (a, b):
        node = JobLedger(ledger.data, life_id)
        node.end_life(LifeOutcome.FAILED, T0 + timedelta(minutes=5), failure={"exit_code": 1, "step": 7})
        ledger = JobLedger(node.data)
    assert ledger.consecutive_failures == 1


def test_a_failure_beside_this_one_is_not_the_previous_life_but_one_from_an_earlier_generation_is() -> None:
    ledger, a, b = _two_nodes()
    for life_id, generation in ((a, 1), (b, 2)):
        node = JobLedger(ledger.data, life_id)
        node.set_generation(generation)
        ledger = JobLedger(node.data)
    before_b = JobLedger(ledger.data, b).previous_life()
    assert before_b is not None and before_b["instance_id"] == "i-a"
    node_a = JobLedger(ledger.data, a)
    node_a.set_generation(2)
    ledger = JobLedger(node_a.data)
    assert JobLedger(ledger.data, b).previous_life() is None, "same generation: beside, not before"


def test_the_job_cost_sums_every_nodes_life() -> None:
    ledger, a, _ = _two_nodes()
    node_a = JobLedger(ledger.data, a)
    total = node_a.update_cost(T0 + timedelta(hours=1))
    # i-a: 1 h at $1; i-b: 20 s before its own heartbeat was last written (at its start).
    assert total == pytest.approx(1.0, abs=0.01)


def test_silent_lives_are_closed_by_the_survivor_once_at_their_last_heartbeat() -> None:
    ledger = JobLedger()
    for index, instance_id in enumerate(("i-a", "i-b", "i-c")):
        ledger = JobLedger(ledger.data)
        identity = InstanceIdentity(instance_id, "g6.xlarge", "us-east-1a", "us-east-1", "spot")
        ledger.begin_life(identity, 1.0, T0 + timedelta(seconds=index), stale_after_seconds=60)
    # i-b beat at +30 s, then went silent; i-c beats on (+119 s); i-a is the survivor.
    ledger.data["lives"][1]["heartbeat_at"] = (T0 + timedelta(seconds=30)).isoformat()
    ledger.data["lives"][2]["heartbeat_at"] = (T0 + timedelta(seconds=119)).isoformat()
    assert ledger.close_silent_node("i-b", "i-a") is True
    assert ledger.close_silent_node("i-b", "i-a") is False, "closed once"
    life = ledger.lives[1]
    assert life["outcome"] == "interrupted" and life["closed_by"] == "i-a"
    assert life["ended_at"] == (T0 + timedelta(seconds=30)).isoformat()
    assert life["cost_usd"] == pytest.approx(29 / 3600, abs=1e-6), "billed to its last heartbeat"
    # At completion: only lives whose heartbeat stopped are closed; a live follower ends its own.
    assert ledger.close_silent_lives(T0 + timedelta(seconds=120), 10.0, "i-a") == []
    assert ledger.close_silent_lives(T0 + timedelta(seconds=130), 10.0, "i-a") == ["i-c"]
    assert [x["outcome"] for x in ledger.lives] == ["running", "interrupted", "interrupted"]
    assert ledger.interruptions == 2


def test_at_completion_a_life_silent_just_the_limit_or_never_beating_is_closed_by_the_survivor() -> None:
    """The edges of the completion sweep: silent for exactly the limit is silent (as the lease judges it); a
    life that never wrote a heartbeat (a record from before heartbeats) is judged from its start; the
    survivor that closes it is named."""
    ledger, _, _ = _two_nodes()  # i-a started at T0, i-b at T0 + 20 s
    ledger.data["lives"][1]["heartbeat_at"] = None

    assert ledger.close_silent_lives(T0 + timedelta(seconds=29), 10.0, "i-a") == []
    assert ledger.close_silent_lives(T0 + timedelta(seconds=30), 10.0, "i-a") == ["i-b"]

    silent = ledger.lives[1]
    assert silent["outcome"] == "interrupted" and silent["closed_by"] == "i-a"
    assert silent["ended_at"] == silent["started_at"]
    assert ledger.lives[0]["outcome"] == "running", "the survivor ends its own life"


def test_the_node_exit_record_is_read_truthfully_or_not_at_all(tmp_path: Path) -> None:
    path = tmp_path / "node-exit.json"
    assert NodeExit.read(path) is None
    path.write_text("{not json")
    assert NodeExit.read(path) is None
    path.write_text(
        '{"exit_code": 75, "stopped_step": 12, "rank0_here": false, "rendezvous_failed": false,'
        ' "world_size": 2, "ranks": {"1": 75}}'
    )
    assert NodeExit.read(path) == NodeExit(75, 12, False, False, 2)
    path.write_text('{"exit_code": 1, "trained": true, "ended_by": "DistNetworkError: store gone"}')
    assert NodeExit.read(path) == NodeExit(1, trained=True, ended_by="DistNetworkError: store gone")
    path.write_text('{"exit_code": true, "stopped_step": "12", "rank0_here": 1, "trained": 1, "ended_by": 3}')
    assert NodeExit.read(path) == NodeExit(None, None, False, False, None)


def test_an_interrupted_node_waits_for_the_jobs_checkpoint_and_reports_what_it_saw() -> None:
    import time

    seen = iter([(None, None), (10, "e1"), (12, "e2")])
    assert wait_until_confirmed(lambda _d: next(seen), 12, time.monotonic() + 5, poll_seconds=0.01) == 12

    def unreachable(_deadline: float | None) -> tuple[int | None, str | None]:
        raise ConnectionError("S3 down")

    started = time.monotonic()
    assert wait_until_confirmed(unreachable, 12, time.monotonic() + 0.3, poll_seconds=0.05) is None
    # Bounded by the 0.3 s deadline, not by S3 coming back (it never does): generous for a loaded machine.
    assert time.monotonic() - started < 30, "bounded by the notice's deadline"

"""The job-wide stops a life reads from S3 (bootstrap/jobstate.py) against the moto server: `trainstack stop`
first, then the cost cap, crossed by the ledger's job total (what every earlier life cost) even before this
life's trainer has started; the state poller reports each S3 outage once and keeps polling. No agent, no
trainer: the poller runs on a thread with an injected heartbeat."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import boto3
import pytest

from bootstrap.agent_config import AgentConfig
from bootstrap.eventlog import EventLog
from bootstrap.imds import InstanceIdentity
from bootstrap.jobstate import JobState, JobWideStop
from bootstrap.pricing import LifeQuote
from tests.conftest import MotoServer
from trainstack_job.jobs import LEGACY_JOB_ID

BUCKET = "trainstack-jobstate"


@pytest.fixture()
def s3(aws: MotoServer) -> Any:
    client = boto3.client("s3", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    return client


class Lines:
    """The agent's event log, kept as parsed lines."""

    def __init__(self) -> None:
        self.log = EventLog(io.StringIO())
        self.events: list[dict[str, Any]] = []
        self.log.add_sink(lambda line: self.events.append(json.loads(line)))

    def messages(self, containing: str) -> list[str]:
        return [e["message"] for e in self.events if containing in e["message"]]


def job_state(s3: Any, lines: Lines, cap: float | None) -> JobState:
    config = AgentConfig(
        region="us-east-1",
        bucket=BUCKET,
        group_name="g",
        topic_arn="arn:aws:sns:us-east-1:123456789012:t",
        log_group="l",
        max_cost_usd=cap,
    )
    return JobState(s3, config, lines.log)


def request_stop(s3: Any, state: JobState) -> None:
    state.state.write("control.json", {"action": "stop"})


class Costs:
    """The job's total as the heartbeat returns it; counts how often it was asked."""

    def __init__(self, total: float) -> None:
        self.total = total
        self.asked = 0

    def __call__(self) -> float:
        self.asked += 1
        return self.total


def test_without_a_cap_the_cost_is_never_a_stop_nor_asked(s3: Any) -> None:
    costs = Costs(1e9)
    assert job_state(s3, Lines(), cap=None).job_wide_stop(costs) is None
    assert costs.asked == 0


@pytest.mark.parametrize(
    ("total", "stops"), [(0.0, False), (9.99, False), (10.0, True), (10.01, True), (250.0, True)]
)
def test_the_cost_cap_stops_the_job_once_its_total_reaches_the_cap(
    s3: Any, total: float, stops: bool
) -> None:
    wide = job_state(s3, Lines(), cap=10.0).job_wide_stop(Costs(total))
    if stops:
        assert wide == JobWideStop("cost_cap", {"cost_usd": total, "cap_usd": 10.0})
    else:
        assert wide is None


def test_trainstack_stop_comes_first_and_waits_on_no_cost(s3: Any) -> None:
    state = job_state(s3, Lines(), cap=10.0)
    state.state.write("control.json", {"action": "resume"})  # anything else is no stop
    assert state.job_wide_stop(Costs(0.0)) is None
    request_stop(s3, state)
    costs = Costs(99.0)
    assert state.job_wide_stop(costs) == JobWideStop("control")
    assert costs.asked == 0


def run_poller(
    state: JobState, beat: Callable[[], float], until: Callable[[list[tuple[str, dict[str, Any]]]], bool]
) -> list[tuple[str, dict[str, Any]]]:
    """The state poller on its thread, every 20 ms, until `until(stops)` (at most 20 s)."""
    stops: list[tuple[str, dict[str, Any]]] = []
    done = threading.Event()
    poller = threading.Thread(
        target=state.poll, args=(done, 0.02, beat, lambda reason, **fields: stops.append((reason, fields)))
    )
    poller.start()
    deadline = time.monotonic() + 20
    try:
        while not until(stops):
            assert time.monotonic() < deadline, "the poller never got there"
            time.sleep(0.02)
    finally:
        done.set()
        poller.join(10)
    assert not poller.is_alive(), "the poller did not end within 10 s of being told to"
    return stops


def test_a_ledger_total_over_the_cap_stops_the_job_at_the_first_poll_with_one_heartbeat_a_poll(
    s3: Any,
) -> None:
    """Earlier lives already spent the cap: the first poll stops the job (before any trainer starts)."""
    state = job_state(s3, Lines(), cap=5.0)
    beats = Costs(7.5)
    stops = run_poller(state, beats, until=lambda stops: bool(stops))
    assert stops[0] == ("cost_cap", {"cost_usd": 7.5, "cap_usd": 5.0})
    assert beats.asked <= len(stops) + 1, "one heartbeat per poll, shared by the cap check"


def test_the_poller_says_once_that_s3_is_unreachable_and_once_that_it_is_back(s3: Any) -> None:
    lines = Lines()
    state = job_state(s3, lines, cap=5.0)
    failing = {"left": 3}

    def beat() -> float:
        if failing["left"]:
            failing["left"] -= 1
            raise ConnectionError("S3 unreachable")
        return 1.0

    run_poller(state, beat, until=lambda _: bool(lines.messages("reachable again")))
    assert len(lines.messages("cannot read or write job state; will retry")) == 1
    back = [e for e in lines.events if "reachable again" in e["message"]]
    assert len(back) == 1 and back[0]["failed_polls"] == 3


def test_a_ledger_change_s3_refuses_is_reported_not_raised(s3: Any) -> None:
    lines = Lines()
    state = job_state(s3, lines, cap=None)
    s3.delete_bucket(Bucket=BUCKET)
    assert state.record(lambda ledger: None) is False
    said = [e for e in lines.events if e["message"].startswith("ledger not updated")]
    assert len(said) == 1 and said[0]["stage"] == "state"
    assert said[0]["ledger"] == f"s3://{BUCKET}/state/ledger.json" and "NoSuchBucket" in said[0]["error"]


def identity(instance_id: str = "i-0abc") -> InstanceIdentity:
    return InstanceIdentity(instance_id, "g5.xlarge", "us-east-1a", "us-east-1", "spot")


def quote(cost: float) -> LifeQuote:
    return LifeQuote("spot", "test", 0.5, cost, 0.0)


def ledger_in_s3(s3: Any) -> dict[str, Any]:
    return dict(json.loads(s3.get_object(Bucket=BUCKET, Key="state/ledger.json")["Body"].read()))


def test_a_heartbeat_bills_this_life_and_returns_the_jobs_total_what_the_cap_reads(s3: Any) -> None:
    earlier = job_state(s3, Lines(), cap=10.0)
    earlier.ledger_store.begin_life(identity("i-old"), 0.5, datetime(2030, 1, 1, tzinfo=timezone.utc))
    assert earlier.heartbeat(quote(3.0)) == pytest.approx(3.0)
    state = job_state(s3, Lines(), cap=10.0)
    state.ledger_store.begin_life(identity(), 0.5, datetime(2030, 1, 1, 1, tzinfo=timezone.utc))
    total = state.heartbeat(quote(2.5))
    assert total == pytest.approx(5.5), "this life's cost plus every earlier life's"
    saved = ledger_in_s3(s3)
    assert saved["total_cost_usd"] == pytest.approx(5.5)
    assert {life["instance_id"]: life["cost_usd"] for life in saved["lives"]} == pytest.approx(
        {"i-old": 3.0, "i-0abc": 2.5}
    )
    assert state.ledger.total_cost_usd == pytest.approx(5.5)


def test_a_recorded_change_lands_in_the_ledger(s3: Any) -> None:
    state = job_state(s3, Lines(), cap=None)

    def interrupted(ledger: Any) -> None:
        ledger.data["interruptions"] = 2

    assert state.record(interrupted) is True
    assert ledger_in_s3(s3)["interruptions"] == 2


def test_progress_goes_to_s3_with_the_instance_that_made_it(s3: Any, tmp_path: Path) -> None:
    lines = Lines()
    state = job_state(s3, lines, cap=None)
    state.upload_progress()  # before training: nothing to say, nothing written
    state.progress_file = tmp_path / "progress.json"
    state.identity = identity()
    state.upload_progress()  # the trainer has not written it yet
    assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET, Prefix="state/progress.json")
    state.progress_file.write_text(json.dumps({"step": 40, "epoch": 1}))
    state.upload_progress()
    saved = json.loads(s3.get_object(Bucket=BUCKET, Key="state/progress.json")["Body"].read())
    assert saved == {
        "step": 40,
        "epoch": 1,
        "instance_id": "i-0abc",
        "instance_type": "g5.xlarge",
        "az": "us-east-1a",
    }
    s3.delete_object(Bucket=BUCKET, Key="state/progress.json")
    s3.delete_bucket(Bucket=BUCKET)
    state.upload_progress_quietly()  # S3 refuses: said, not raised
    failed = [e for e in lines.events if e["message"] == "progress upload failed"]
    assert len(failed) == 1 and failed[0]["stage"] == "state" and "NoSuchBucket" in failed[0]["error"]


def test_a_life_measures_its_samples_per_second_and_its_end_folds_them_into_the_stacks_table(
    s3: Any, tmp_path: Path
) -> None:
    """The trainer's progress.json reports reach this life's ledger entry at each heartbeat (each once),
    and the update that ends the life merges it into state/throughput.json, from which the pools weigh their
    types and `trainstack estimate` ranks them."""
    from bootstrap.ledger import LifeOutcome
    from trainstack_job.throughput import ThroughputStore, expected_throughput

    state = job_state(s3, Lines(), cap=None)
    start = datetime(2030, 1, 1, tzinfo=timezone.utc)
    state.ledger_store.begin_life(identity(), 0.5, start)
    state.progress_file = tmp_path / "progress.json"
    for step, speed in ((100, 90.0), (100, 500.0), (200, 110.0)):  # the repeated step-100 report counts once
        report = {"step": step, "samples_per_s": speed, "precision": "bf16", "model": "resnet18"}
        state.progress_file.write_text(json.dumps(report))
        state.heartbeat(quote(1.0))
    life = ledger_in_s3(s3)["lives"][0]
    assert (life["samples_per_second"], life["precision"], life["model_family"]) == (
        100.0,
        "bf16",
        "resnet18",
    )
    assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET, Prefix="state/throughput.json"), (
        "only at the end"
    )
    ended = start.replace(hour=2)
    assert state.record(lambda ledger: ledger.end_life(LifeOutcome.COMPLETED, ended))
    table = ThroughputStore(s3, BUCKET, "state/throughput.json").load()
    for scope in ({"job_id": LEGACY_JOB_ID}, {"family": "resnet18"}):
        measured = expected_throughput("g5.xlarge", table=table, **scope)
        assert measured is not None and measured.samples_per_second == pytest.approx(100.0), scope
        assert measured.source.startswith("measured: 1 life"), measured.source


def test_a_throughput_table_s3_refuses_is_said_once_and_the_ledger_still_ends_the_life(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from botocore.exceptions import ClientError

    from bootstrap.ledger import LifeOutcome
    from trainstack_job.throughput import ThroughputStore

    def refused(*args: Any, **kwargs: Any) -> int:
        raise ClientError({"Error": {"Code": "AccessDenied", "Message": "denied"}}, "PutObject")

    lines = Lines()
    state = job_state(s3, lines, cap=None)
    start = datetime(2030, 1, 1, tzinfo=timezone.utc)
    state.ledger_store.begin_life(identity(), 0.5, start)
    state.progress_file = tmp_path / "progress.json"
    state.progress_file.write_text(json.dumps({"step": 10, "samples_per_s": 50.0}))
    monkeypatch.setattr(ThroughputStore, "merge", refused)
    assert state.record(lambda ledger: ledger.end_life(LifeOutcome.COMPLETED, start.replace(hour=1)))
    assert ledger_in_s3(s3)["lives"][0]["outcome"] == LifeOutcome.COMPLETED
    said = [e for e in lines.events if e["message"] == "throughput table not updated"]
    assert (
        len(said) == 1 and "state/throughput.json" in said[0]["error"] and "AccessDenied" in said[0]["error"]
    )
    assert said[0]["stage"] == "state", "said under the job state's stage, where an operator filters for it"
    assert state.record(lambda ledger: None) and len(lines.messages("throughput table")) == 1, "said once"

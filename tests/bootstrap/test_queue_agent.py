"""The agent side of the job queue, against moto with in-process agents and the fake trainer: queued jobs run
in FIFO order on one instance without a new boot, each with its own ledger and results; a job the agent
config defines is queued exactly once; a cancelled job is skipped (queued) or checkpoints and ends (running)
and the next job runs; a job interrupted by a spot notice resumes before the next queued one; a `--now` job
makes the running job yield and that job resumes from its checkpoint afterwards; an empty queue scales the
group to zero at once; a corrupt entry or record, or a job asking for too many instances, is one line and
never blocks the others; two lives racing for the head agree on one job."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import EndpointConnectionError

from bootstrap.agent import Lives
from bootstrap.agent_config import AgentConfig
from bootstrap.eventlog import EventLog
from bootstrap.jobbinding import JobBinding, bind_job
from bootstrap.lifecycle import InstanceLife, LifeResult
from bootstrap.pinned import PINNED_ENV, PinnedCodeError, run_pinned
from demo.imds import ImdsSimulator
from demo.stack import LocalStack
from tests.waiting import join_all
from trainstack_job.queue import SOURCE_RUN, cancel_key, job_record, queue_entry, queue_key

MakeLife = Callable[..., InstanceLife]
A, B, C = "alpha-aaaaaaaa", "bravo-bbbbbbbb", "charlie-cccccccc"
NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
# Short jobs: a few fake steps each (the agent's own work per life dominates).
SHORT = {"steps": 6, "step_seconds": 0.02, "checkpoint_every": 3}
# Long enough that a test acts on it while it trains; it only ends when the test ends it.
LONG = {"steps": 100_000, "step_seconds": 0.02, "checkpoint_every": 1000}


def submit(
    stack: LocalStack, job_id: str, fake: dict[str, Any], at: str, *, now: bool = False, **agent: Any
) -> None:
    """What `trainstack run` writes: the record, then the queue entry."""
    fields = {
        "job_id": job_id,
        "job_name": job_id.rsplit("-", 1)[0],
        "resume_from": None,
        "job": {"fake": fake},
        "user_job": None,
        "bundle_key": "",
        "bundle_sha256": "",
        **agent,
    }
    record = job_record(
        job_id=job_id, name=fields["job_name"], agent=fields, submitted_at=at, source=SOURCE_RUN
    )
    s3 = stack.client("s3")
    s3.put_object(Bucket=stack.bucket, Key=f"jobs/{job_id}/job.json", Body=json.dumps(record).encode())
    s3.put_object(
        Bucket=stack.bucket, Key=queue_key(job_id), Body=json.dumps(queue_entry(job_id, at, now=now))
    )


def cancel(stack: LocalStack, job_id: str) -> None:
    """What `trainstack cancel ID` writes."""
    body = json.dumps({"requested_at": "2026-12-01T12:00:00Z", "by": "test"}).encode()
    stack.client("s3").put_object(Bucket=stack.bucket, Key=cancel_key(job_id), Body=body)


def ledger(stack: LocalStack, job_id: str) -> dict[str, Any]:
    value = stack.read_json(f"jobs/{job_id}/state/ledger.json")
    assert value is not None, f"job {job_id} has no ledger"
    return value


def outcomes(stack: LocalStack, job_id: str) -> list[str]:
    return [life["outcome"] for life in ledger(stack, job_id)["lives"]]


def steps_of(stack: LocalStack, job_id: str) -> int:
    metrics = stack.read_json(f"jobs/{job_id}/results/metrics.json")
    assert metrics is not None, f"job {job_id} has no results"
    return int(metrics["steps"])


class Events:
    """The agent's events as parsed lines (every life of the instance shares the log)."""

    def __init__(self, log: EventLog) -> None:
        self.lines: list[dict[str, Any]] = []
        log.add_sink(lambda line: self.lines.append(json.loads(line)))

    def said(self, message: str) -> list[dict[str, Any]]:
        return [e for e in self.lines if message in e["message"]]

    def one(self, message: str, **fields: Any) -> dict[str, Any]:
        """The one event saying `message` with these fields; else fails showing the stop and end events."""
        found = [e for e in self.said(message) if all(e.get(k) == v for k, v in fields.items())]
        context = [e for e in self.lines if e["stage"] in ("stop", "end", "queue", "job")]
        assert len(found) == 1, f"{len(found)} events {message!r} {fields}; stops and ends: {context}"
        return found[0]


@pytest.fixture()
def instance(make_life: MakeLife) -> Callable[..., tuple[Lives, Events]]:
    """One instance whose agent config defines no job (`job_id: ""`): it runs what the queue holds."""

    def build(**config: Any) -> tuple[Lives, Events]:
        life = make_life(**({"job_id": ""} | config))
        return Lives(life), Events(life.log)

    return build


def start(lives: Lives) -> Future[LifeResult]:
    return ThreadPoolExecutor(max_workers=1).submit(lives.run)


def wait_until(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def reached(lives: Lives, job_id: str, step: int) -> bool:
    """The instance trains `job_id` and its trainer passed `step`."""
    if lives.current.config.job_id != job_id:
        return False
    progress = Path(str(lives.current.config.scratch_dir)) / "output" / "progress.json"
    try:
        return bool(json.loads(progress.read_text())["step"] >= step)
    except (OSError, ValueError, KeyError):
        return False


def test_queued_jobs_run_in_fifo_order_on_one_instance_and_a_cancelled_one_is_skipped(
    stack: LocalStack, instance: Callable[..., tuple[Lives, Events]]
) -> None:
    # Submitted out of key order: FIFO is the order of submission (S3's clock, then `submitted_at` within
    # one of its seconds), not the key.
    submit(stack, B, {**SHORT, "steps": 9}, "2026-12-01T12:00:01.000Z")
    submit(stack, A, SHORT, "2026-12-01T12:00:02.000Z")
    submit(stack, C, SHORT, "2026-12-01T12:00:03.000Z")
    cancel(stack, C)
    lives, events = instance()
    result = lives.run()
    assert (result.outcome, result.exit_code, result.next_job) == ("completed", 0, None)
    # One boot (one Lives run), two jobs: each its own ledger and results, on the same instance, in order.
    assert outcomes(stack, B) == ["completed"] and outcomes(stack, A) == ["completed"]
    assert (steps_of(stack, B), steps_of(stack, A)) == (9, 6)
    first, second = ledger(stack, B)["lives"][0], ledger(stack, A)["lives"][0]
    assert first["instance_id"] == second["instance_id"]
    assert first["ended_at"] <= second["started_at"]
    assert [e["job_id"] for e in events.said("job bound")] == [B, A]
    assert not events.said("using the checkpoint already on this instance"), "A never restores B's steps"
    # The cancelled job never ran: its status says so, with no life and nothing trained.
    cancelled = ledger(stack, C)
    assert (cancelled["status"], cancelled["lives"]) == ("cancelled", [])
    assert stack.read_json(f"jobs/{C}/checkpoints/latest.json") is None
    assert events.said(f"job {C} was cancelled before it ran")
    # Only the last job's end scaled the group to zero; each notification names its job.
    assert stack.group()["DesiredCapacity"] == 0
    subjects = [alert["Subject"] for alert in stack.alerts()]
    assert any(f"job {B}: training completed; next: {A}" in s for s in subjects), subjects
    assert any(s.endswith(f"job {A}: training completed") for s in subjects), subjects
    assert stack.read_json("state/current-job.json") | {"since": None} == {  # type: ignore[operator]
        "job_id": A,
        "since": None,
        "previous": B,
    }
    assert stack.read_json("state/ledger.json") is None, "a config without a job writes no legacy ledger"


def test_a_spot_interrupted_job_resumes_before_the_next_queued_job_and_a_defined_job_is_queued_once(
    stack: LocalStack, make_life: MakeLife, imds: ImdsSimulator, capsys: pytest.CaptureFixture[str]
) -> None:
    """The agent config still defines job A (the stack's default job): every life submits it, once."""
    # A fresh A holds at step 20 until the stop: 60 steps of 20 ms could end before the notice landed.
    defined = {"job_id": A, "job_name": "alpha", "fake": {**LONG, "steps": 60, "hold_at_step": 20}}
    first = Lives(make_life(**defined))
    running = start(first)
    wait_until(lambda: reached(first, A, 8), "job A training")
    submit(stack, B, SHORT, "2999-01-01T00:00:00.000Z")  # queued behind A while A runs
    imds.inject_spot_notice()
    interrupted = running.result(timeout=60)
    assert (interrupted.outcome, interrupted.next_job) == ("preempted", None)
    assert stack.read_json(f"jobs/{B}/state/ledger.json") is None, "B must wait for A"
    confirmed = stack.read_json(f"jobs/{A}/checkpoints/latest.json")
    assert confirmed is not None and confirmed["step"] >= 8
    entry = stack.read_json(queue_key(A))

    imds.clear_events()
    capsys.readouterr()
    second = Lives(make_life(**defined))
    assert second.run().outcome == "completed"
    # The queue never skips an unfinished job: A resumed at its confirmed step, then B ran.
    assert json.dumps({"event": "resumed", "step": confirmed["step"]}) in capsys.readouterr().out
    assert outcomes(stack, A) == ["preempted", "completed"] and outcomes(stack, B) == ["completed"]
    assert ledger(stack, A)["lives"][1]["ended_at"] <= ledger(stack, B)["lives"][0]["started_at"]
    # Two lives booted with the config's job: one queue entry, the first one's, and one record.
    keys = [
        o["Key"] for o in stack.client("s3").list_objects_v2(Bucket=stack.bucket, Prefix="queue/")["Contents"]
    ]
    assert sorted(keys) == [queue_key(A), queue_key(B)]
    assert stack.read_json(queue_key(A)) == entry
    record = stack.read_json(f"jobs/{A}/job.json")
    assert (
        record is not None and record["source"] == "pulumi" and record["agent"]["job"]["fake"]["steps"] == 60
    )


def test_cancel_of_a_running_job_leaves_a_confirmed_checkpoint_then_the_next_job_runs(
    stack: LocalStack, instance: Callable[..., tuple[Lives, Events]]
) -> None:
    submit(stack, A, LONG, "2026-12-01T12:00:01.000Z")
    submit(stack, B, SHORT, "2026-12-01T12:00:02.000Z")
    lives, events = instance()
    running = start(lives)
    wait_until(lambda: reached(lives, A, 10), "job A training")
    cancel(stack, A)
    result = running.result(timeout=60)
    assert (result.outcome, result.next_job) == ("completed", None)
    # A: stopped with its checkpoint confirmed in S3 at the step it reached, and over (cancelled).
    stopped = events.one("trainer stopped; checkpoint confirmed in S3", reason="cancel")
    assert stopped["checkpoint_confirmed"] is True
    cancelled = ledger(stack, A)
    assert (cancelled["status"], outcomes(stack, A)) == ("cancelled", ["cancelled"])
    latest = stack.read_json(f"jobs/{A}/checkpoints/latest.json")
    assert latest is not None and latest["step"] == stopped["checkpoint_step"] == stopped["reached_step"]
    manifest = stack.read_json(f"jobs/{A}/checkpoints/step-{latest['step']}/manifest.json")
    assert manifest is not None, "the confirmed checkpoint is complete in S3"
    # Then B ran on the same instance, from step 0, and the queue being empty the group went to zero.
    assert outcomes(stack, B) == ["completed"] and steps_of(stack, B) == 6
    assert ledger(stack, A)["lives"][0]["instance_id"] == ledger(stack, B)["lives"][0]["instance_id"]
    assert stack.group()["DesiredCapacity"] == 0
    assert any(f"job {A}: cancelled; next: {B}" in alert["Subject"] for alert in stack.alerts())


def test_a_now_job_makes_the_running_job_yield_and_that_job_resumes_from_its_checkpoint_after_it(
    stack: LocalStack, instance: Callable[..., tuple[Lives, Events]], capsys: pytest.CaptureFixture[str]
) -> None:
    # A fresh A holds at step 20 until it is told to yield (a fixed run could end before the agent saw B);
    # resumed, it trains on to 60.
    submit(stack, A, {**LONG, "steps": 60, "hold_at_step": 20}, "2026-12-01T12:00:01.000Z")
    lives, events = instance()
    running = start(lives)
    wait_until(lambda: reached(lives, A, 10), "job A training")
    # `trainstack run --now`: newer than A, yet first in the queue.
    submit(stack, B, SHORT, "2026-12-01T12:00:09.000Z", now=True)
    assert running.result(timeout=90).outcome == "completed"
    # A yielded (not cancelled, not failed: no crash counted), B ran, then A resumed where it had stopped.
    assert outcomes(stack, A) == ["yielded", "completed"] and outcomes(stack, B) == ["completed"]
    yielded, resumed = ledger(stack, A)["lives"]
    (b_life,) = ledger(stack, B)["lives"]
    assert yielded["ended_at"] <= b_life["started_at"] and b_life["ended_at"] <= resumed["started_at"]
    assert ledger(stack, A)["consecutive_failures"] == 0 and ledger(stack, A)["status"] == "completed"
    # (Once the group is at zero the last life may also see its own scale-in: only the yield counts here.)
    assert events.one("stop requested", reason="yield")["to"] == B
    stopped = events.one("trainer stopped; checkpoint confirmed in S3", reason="yield")
    assert stopped["checkpoint_confirmed"] is True
    # B started from step 0 on the same scratch disk; A resumed from its own confirmed step.
    out = capsys.readouterr().out
    assert json.dumps({"event": "resumed", "step": stopped["checkpoint_step"]}) in out
    assert out.count('"event": "resumed"') == 1
    assert steps_of(stack, A) == 60 and steps_of(stack, B) == 6
    assert [e["job_id"] for e in events.said("job bound")] == [A, B, A]
    assert stack.group()["DesiredCapacity"] == 0


def test_an_empty_queue_ends_the_life_at_once_and_scales_the_group_to_zero(
    stack: LocalStack, instance: Callable[..., tuple[Lives, Events]]
) -> None:
    # The user-data of a stack without a default job: no job in the agent config is valid.
    config = AgentConfig.from_mapping(
        {**{k: v for k, v in stack.agent_config().__dict__.items() if k != "prefixes"}, "job_id": ""}
    )
    assert config.job_id == ""
    lives, events = instance()
    result = lives.run()
    assert (result.outcome, result.exit_code) == ("no_job", 0)
    assert stack.group()["DesiredCapacity"] == 0
    assert events.said("the queue holds none") and not events.said("trainer starting")
    listed = stack.client("s3").list_objects_v2(Bucket=stack.bucket, Prefix="state/").get("Contents", [])
    assert [o["Key"] for o in listed if "ledger" in o["Key"] or "current-job" in o["Key"]] == []


def test_a_queue_unreadable_when_a_job_ends_scales_to_zero_and_the_next_job_waits_for_the_next_boot(
    stack: LocalStack, instance: Callable[..., tuple[Lives, Events]]
) -> None:
    """S3 refusing the queue listing at the end of a job must never keep a GPU billing."""
    submit(stack, A, SHORT, "2026-12-01T12:00:01.000Z")
    submit(stack, B, SHORT, "2026-12-01T12:00:02.000Z")
    lives, events = instance()

    def unreachable() -> str | None:
        raise EndpointConnectionError(endpoint_url="https://s3.us-east-1.amazonaws.com")

    lives.current._queued_next = unreachable  # type: ignore[method-assign]
    result = lives.run()
    assert (result.outcome, result.next_job) == ("completed", None)
    assert stack.group()["DesiredCapacity"] == 0
    assert events.one("cannot read the job queue; scaling to zero")["error"].startswith("Could not connect")
    assert stack.read_json(f"jobs/{B}/state/ledger.json") is None, "B stays queued for the next boot"


# -- binding, without trainers ------------------------------------------------------------------------


@pytest.fixture()
def stack_config(stack: LocalStack) -> AgentConfig:
    return stack.agent_config(job_id="")


@pytest.fixture()
def captured() -> tuple[EventLog, list[dict[str, Any]]]:
    lines: list[dict[str, Any]] = []
    log = EventLog(io.StringIO())
    log.add_sink(lambda line: lines.append(json.loads(line)))
    return log, lines


def test_a_corrupt_entry_or_record_and_a_job_too_big_for_the_group_are_one_line_and_block_nothing(
    stack: LocalStack, stack_config: AgentConfig, captured: tuple[EventLog, list[dict[str, Any]]]
) -> None:
    log, lines = captured
    s3 = stack.client("s3")
    s3.put_object(Bucket=stack.bucket, Key="queue/garbage.json", Body=b"{not json")
    submit(stack, A, SHORT, "2026-12-01T12:00:01.000Z", instance_count=4)  # the group holds 1
    submit(stack, B, SHORT, "2026-12-01T12:00:02.000Z")
    s3.put_object(Bucket=stack.bucket, Key=f"jobs/{B}/job.json", Body=b"[]")  # record replaced by junk
    submit(stack, C, SHORT, "2026-12-01T12:00:03.000Z")
    binding = bind_job(s3, stack_config, NOW, log=log)
    assert binding is not None and binding.job_id == C and binding.pinned is None
    assert binding.config is not None and binding.config.job == {"fake": SHORT}
    errors = [e["message"] for e in lines if e.get("level") == "error"]
    assert len(errors) == 3 and all("\n" not in m for m in errors), errors
    assert any("queue/garbage.json is not a queue entry" in m and "delete it" in m for m in errors)
    assert any(
        f"job {A} refused: it asks for 4 instances and the group allows at most 1" in m for m in errors
    )
    assert any(f"jobs/{B}/job.json is missing or not a job record" in m for m in errors)
    # The refused jobs failed with their reason (`trainstack jobs` shows it); nothing retries them.
    assert ledger(stack, A)["status"] == "failed" and "4 instances" in ledger(stack, A)["reason"]
    assert ledger(stack, B)["status"] == "failed"
    assert bind_job(s3, stack_config, NOW, log=log).job_id == C  # type: ignore[union-attr]


def test_a_job_with_other_code_is_pinned_and_the_hop_guard_only_stops_the_same_job(
    stack: LocalStack, stack_config: AgentConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = "f" * 64
    submit(
        stack,
        A,
        SHORT,
        "2026-12-01T12:00:01.000Z",
        bundle_key=f"code/{other}/bundle.tar.gz",
        bundle_sha256=other,
    )
    binding = bind_job(stack.client("s3"), stack_config, NOW)
    assert binding is not None and binding.pinned is not None and binding.pinned["bundle_sha256"] == other
    record = {"job_id": A}  # names no bundle: run_pinned refuses before it could exec anything
    monkeypatch.setenv(PINNED_ENV, A)
    with pytest.raises(PinnedCodeError, match="asked to hop again"):
        run_pinned(stack.client("s3"), stack_config, record)
    # Going on to another job from a pinned agent is allowed (it then fails here only on the missing bundle).
    monkeypatch.setenv(PINNED_ENV, B)
    with pytest.raises(PinnedCodeError, match="names no code bundle"):
        run_pinned(stack.client("s3"), stack_config, record)


def test_a_record_sets_its_own_cost_cap_and_never_inherits_the_previous_jobs_fields(
    stack: LocalStack, stack_config: AgentConfig
) -> None:
    submit(stack, A, SHORT, "2026-12-01T12:00:01.000Z", max_cost_usd=5)
    # The stack's config as a pinned agent has it: another job's fields over it (a user's job, a parent).
    after_other = replace(
        stack_config, max_cost_usd=50.0, user_job={"command": ["python", "x.py"]}, resume_from=B, job_name="x"
    )
    binding = bind_job(stack.client("s3"), after_other, NOW)
    assert binding is not None and binding.config is not None
    job = binding.config
    assert (job.job_id, job.max_cost_usd, job.user_job, job.resume_from, job.job_name) == (
        A,
        5,
        None,
        None,
        "alpha",
    )
    assert job.instance_count == stack_config.instance_count  # not in the record: the stack's


def test_two_lives_racing_for_the_queue_head_agree_on_one_job(
    stack: LocalStack, stack_config: AgentConfig
) -> None:
    submit(stack, A, SHORT, "2026-12-01T12:00:01.000Z")
    submit(stack, B, SHORT, "2026-12-01T12:00:02.000Z")
    results: list[JobBinding | None] = []
    barrier = threading.Barrier(4, timeout=30)  # a boot that dies first breaks it: the others raise

    def boot() -> None:
        s3 = stack.client("s3")
        barrier.wait()
        results.append(bind_job(s3, stack_config, NOW))

    threads = [threading.Thread(target=boot) for _ in range(4)]
    for thread in threads:
        thread.start()
    join_all(threads, 60, "the four racing boots")
    assert {r.job_id for r in results if r is not None} == {A} and len(results) == 4
    assert stack.read_json("state/current-job.json")["job_id"] == A  # type: ignore[index]

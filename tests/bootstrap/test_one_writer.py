"""One job, one writer: two agents on one single-node job, as AWS really runs them.

AWS launches a second instance for a running single-node job in three ordinary ways: capacity rebalancing
(the replacement boots BEFORE the at-risk instance is terminated), a manual scale-up, and a replacement
launched while the old instance still drains its spot notice. In every case the promise is the same and is
checked from what both trainers printed, what S3 holds and what the ledger says: never two trainers at once,
one linear history (the standby's first step is the holder's confirmed stop step + 1; no step trained or
written twice; latest.json never moves back), one completion, a truthful ledger. A writer whose token was
superseded is refused and stops; a second job starts at step 0 and leaves the first one's results alone;
a replacement after a mid-job `pulumi up` runs the running job's own code.

Capacity rebalancing itself (the replacement launched before the at-risk instance goes, a warm standby, the
recommendation turned into a hand-over) is told with the real agents and the real trainer by
`python -m demo --rebalance`, whose checks tests/bootstrap/test_demo_rebalance.py runs: the same promises
(one trainer at a time, no step trained or written twice, latest.json only forward, one completion, the
ledger), asserted once there rather than twice.
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config

from bootstrap.boot import AwsClients
from bootstrap.eventlog import EventLog
from bootstrap.imds import ImdsClient
from bootstrap.lease import DRIFT_SECONDS
from bootstrap.lifecycle import InstanceLife, LifeResult
from demo.fault_proxy import Cut, Pass, S3FaultProxy
from demo.imds import ImdsSimulator, SimulatedInstance
from demo.stack import LocalStack
from tests.bootstrap.conftest import FAKE_TRAINER, upload_dataset
from tests.conftest import MotoServer

# Slow enough steps that the second agent boots, syncs and warms while the first one trains.
STEPS = {"steps": 60, "step_seconds": 0.08, "checkpoint_every": 10, "log_steps": True}
JOB = "resnet-11111111"


@dataclass
class Agent:
    """One simulated instance: its IMDS, its in-process agent, what it and its trainer said, its result."""

    name: str
    instance_id: str
    imds: ImdsSimulator
    life: InstanceLife
    events: io.StringIO
    steps: list[tuple[float, int]] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    result: LifeResult | None = None
    thread: threading.Thread | None = None

    def start(self) -> Agent:
        def run() -> None:
            self.result = self.life.run()

        self.thread = threading.Thread(target=run, name=self.name, daemon=True)
        self.thread.start()
        return self

    def join(self, timeout: float) -> LifeResult:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{self.name} did not end within {timeout} s"
        assert self.result is not None
        return self.result

    def said(self, part: str) -> list[dict[str, Any]]:
        found = []
        for line in self.events.getvalue().splitlines():
            event = json.loads(line)
            if part in event["message"]:
                found.append(event)
        return found

    def wait_for(self, part: str, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.said(part)
            if found:
                return found[0]
            time.sleep(0.05)
        raise AssertionError(f"{self.name} never said {part!r}; it said: {self.events.getvalue()[-3000:]}")


@pytest.fixture()
def agents(stack: LocalStack, tmp_path: Path) -> Iterator[Callable[..., Agent]]:
    upload_dataset(stack)
    simulators: list[ImdsSimulator] = []

    def build(
        name: str,
        instance_id: str,
        *,
        fake: dict[str, Any] | None = None,
        in_group: bool = True,
        clients: AwsClients | None = None,
        lease_seconds: float | None = None,
        drift_seconds: float = DRIFT_SECONDS,
        **config: Any,
    ) -> Agent:
        # A replacement launched by capacity rebalancing is InService beside the instance it replaces.
        state = stack.lifecycle_state if in_group else (lambda _: "InService")
        simulator = ImdsSimulator(SimulatedInstance(instance_id=instance_id), lifecycle_state=state).start()
        simulators.append(simulator)
        events = io.StringIO()
        values: dict[str, Any] = {
            "poll_seconds": 0.2,
            "scratch_dir": str(tmp_path / name),
            "job": {"fake": {**STEPS, **(fake or {})}},
            "job_id": JOB,
            "job_name": "resnet",
        }
        values.update(config)
        life = InstanceLife(
            stack.agent_config(**values),
            log=EventLog(stream=events),
            clients=clients,
            imds=ImdsClient(simulator.endpoint),
            trainer_command=FAKE_TRAINER,
            identity_wait_seconds=2,
            release_wait_seconds=0,
            state_poll_seconds=0.5,
            tick_seconds=0.1,
            lease_seconds=lease_seconds,
            drift_seconds=drift_seconds,
        )
        agent = Agent(name, instance_id, simulator, life, events)

        def sink(line: str) -> None:
            agent.lines.append(line)
            try:
                value = json.loads(line)
            except ValueError:
                return
            if isinstance(value, dict) and value.get("event") == "step":
                agent.steps.append((time.monotonic(), int(value["step"])))

        life.trainer_log_sink = lambda: sink  # type: ignore[method-assign]
        return agent

    yield build
    for simulator in simulators:
        simulator.stop()


def _wait_until(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Wait for an event rather than sleep for a time (60 s: a generous bound on a loaded 2-core machine)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _ledger(stack: LocalStack, job: str = JOB) -> dict[str, Any]:
    body = stack.client("s3").get_object(Bucket=stack.bucket, Key=f"jobs/{job}/state/ledger.json")["Body"]
    value: dict[str, Any] = json.loads(body.read())
    return value


def _versions(stack: LocalStack, prefix: str) -> dict[str, list[dict[str, Any]]]:
    """Every version of every object under `prefix`, oldest first: what was written, and how often."""
    s3 = stack.client("s3")
    found: dict[str, list[dict[str, Any]]] = {}
    for page in s3.get_paginator("list_object_versions").paginate(Bucket=stack.bucket, Prefix=prefix):
        for version in page.get("Versions", []):
            found.setdefault(version["Key"], []).append(version)
    # S3 lists a key's versions newest first (LastModified has one-second resolution: no tie-breaker).
    for versions in found.values():
        versions.reverse()
    return found


def _assert_one_linear_history(stack: LocalStack, first: Agent, second: Agent) -> int:
    """Never two trainers at once, no step trained twice, the second resumes right after the first's
    confirmed stop step, and S3 holds each step once with latest.json only moving forward."""
    assert first.steps and second.steps, "both instances trained"
    assert first.steps[-1][0] < second.steps[0][0], "the second trainer trained while the first still did"
    trained_first = [step for _, step in first.steps]
    trained_second = [step for _, step in second.steps]
    assert not set(trained_first) & set(trained_second), "a step was trained twice"
    handed = second.said("lease taken over")[0]["stop_step"]
    assert handed is not None and trained_second[0] == handed + 1
    assert max(trained_first) == handed, "the holder's stop step was confirmed before it let go"
    versions = _versions(stack, f"jobs/{JOB}/checkpoints/")
    manifests = {key: v for key, v in versions.items() if key.endswith("/manifest.json")}
    assert manifests and all(len(v) == 1 for v in manifests.values()), "a step folder was written twice"
    latest = [
        json.loads(
            stack.client("s3")
            .get_object(Bucket=stack.bucket, Key=v["Key"], VersionId=v["VersionId"])["Body"]
            .read()
        )
        for v in versions[f"jobs/{JOB}/checkpoints/latest.json"]
    ]
    steps = [x["step"] for x in latest]
    assert steps == sorted(steps) and len(set(steps)) == len(steps), f"latest.json moved back: {steps}"
    assert all("token" in x for x in latest) and [x["token"] for x in latest] == sorted(
        x["token"] for x in latest
    )
    return int(handed)


def test_a_manual_scale_up_gives_one_standby_and_surplus_instances_leave(
    stack: LocalStack, agents: Callable[..., Agent], tmp_path: Path
) -> None:
    """Desired capacity raised by hand on a single-node job: the second instance waits as the standby, a
    third leaves (lowering the capacity it was launched for), and the job completes once, on the holder."""
    autoscaling = stack.client("autoscaling")
    autoscaling.set_desired_capacity(AutoScalingGroupName=stack.group_name, DesiredCapacity=3)
    ids = stack.instance_ids()
    assert len(ids) == 3
    # The holder trains until the other two have booted and decided: it holds at step 3 until released
    # (45 steps of 80 ms could end while a slow machine still boots them, and they would see no job).
    release = tmp_path / "release-the-holder"
    first = agents("first", ids[0], fake={"steps": 45, "hold_at_step": 3, "hold_until": str(release)}).start()
    first.wait_for("trainer starting")
    second = agents("second", ids[1]).start()
    second.wait_for("standby ready")
    third = agents("third", ids[2]).start()
    assert third.join(timeout=90).outcome == "surplus"
    assert third.said("left the group")[0]["decrement"] is True
    assert stack.group()["DesiredCapacity"] == 2
    release.touch()
    assert first.join(timeout=90).outcome == "completed"
    assert second.join(timeout=90).outcome == "standby_ended"
    assert not second.steps and not third.steps
    ledger = _ledger(stack)
    outcomes = sorted(life["outcome"] for life in ledger["lives"])
    assert outcomes == ["completed", "standby_ended", "surplus"]
    assert ledger["consecutive_failures"] == 0 and ledger["interruptions"] == 0
    assert ledger["standby_cost_usd"] > 0


def test_a_replacement_launched_while_the_old_instance_drains_waits_and_resumes_at_its_stop_step(
    stack: LocalStack, agents: Callable[..., Agent]
) -> None:
    """A spot notice: the old instance stops and uploads (slowly: big checkpoints) while the replacement
    already boots. The replacement must not train beside it, nor close its life as interrupted; it takes
    the lease when the old one lets go and resumes at exactly its stop step."""
    holder_id = stack.instance_ids()[0]
    # A fresh holder holds at step 3 until the stop: 60 steps of 80 ms could end before the notice landed.
    first = agents("first", holder_id, fake={"checkpoint_bytes": 2_000_000, "hold_at_step": 3}).start()
    first.wait_for("trainer starting")
    _wait_until(lambda: bool(first.steps), "the holder's first step")  # the notice comes mid-training
    first.imds.inject_spot_notice()
    second = agents("second", "i-0replacement0000", in_group=False).start()
    assert first.join(timeout=90).outcome == "preempted"
    assert second.join(timeout=90).outcome == "completed"
    _assert_one_linear_history(stack, first, second)
    ledger = _ledger(stack)
    outcomes = {life["instance_id"]: life["outcome"] for life in ledger["lives"]}
    assert outcomes == {holder_id: "preempted", "i-0replacement0000": "completed"}
    old = next(life for life in ledger["lives"] if life["instance_id"] == holder_id)
    assert "closed_by" not in old, "the replacement closed a holder that was still beating"
    assert ledger["interruptions"] == 1, "the old life counted once, by itself, not closed by its successor"


def test_a_writer_whose_lease_was_taken_is_refused_and_stops(
    stack: LocalStack, agents: Callable[..., Agent]
) -> None:
    """A holder that was cut off past the stale limit finds a newer token in the lease: it stops writing
    at once (no step folder of its own after that), says so, and its life ends `superseded`."""
    holder_id = stack.instance_ids()[0]
    # Steps without end: the trainer can only stop because the lease moved, however fast this machine is.
    first = agents("first", holder_id, fake={"steps": 10**9}).start()
    first.wait_for("trainer starting")
    _wait_until(lambda: bool(first.steps), "the holder's first step")  # it writes before the lease moves
    s3 = stack.client("s3")
    key = f"jobs/{JOB}/state/lease.json"
    lease = json.loads(s3.get_object(Bucket=stack.bucket, Key=key)["Body"].read())
    before = {v["VersionId"] for versions in _versions(stack, f"jobs/{JOB}/").values() for v in versions}
    taken = {
        **lease,
        "holder": "i-0newholder00000",
        "life_id": "i-0newholder00000@x",
        "token": lease["token"] + 1,
    }
    s3.put_object(Bucket=stack.bucket, Key=key, Body=json.dumps(taken).encode())
    assert first.join(timeout=90).outcome == "superseded"
    stop = first.said("stop requested")[0]
    assert stop["reason"] == "lease_lost"
    assert first.said("lease lost")
    after = [
        k
        for k, versions in _versions(stack, f"jobs/{JOB}/checkpoints/").items()
        for v in versions
        if v["VersionId"] not in before and k.endswith(("manifest.json", "latest.json"))
    ]
    # At most the one commit whose fence check ran just before the lease moved; never a latest.json move.
    assert len(after) <= 1 and not any(k.endswith("latest.json") for k in after), after
    assert (
        json.loads(s3.get_object(Bucket=stack.bucket, Key=key)["Body"].read())["holder"]
        == "i-0newholder00000"
    )
    # It stopped on the agent's request at a step boundary (exit 75), not by finishing or being killed.
    stopped = first.said("trainer stopped")
    assert stopped and stopped[0]["exit_code"] == 75, stopped


def test_a_second_job_starts_at_step_zero_and_leaves_the_first_ones_results_intact(
    stack: LocalStack, agents: Callable[..., Agent]
) -> None:
    first = agents("first", stack.instance_ids()[0], fake={"steps": 12, "log_steps": True}).start()
    assert first.join(timeout=90).outcome == "completed"
    s3 = stack.client("s3")
    first_results = s3.get_object(Bucket=stack.bucket, Key=f"jobs/{JOB}/results/metrics.json")["Body"].read()
    autoscaling = stack.client("autoscaling")
    autoscaling.set_desired_capacity(AutoScalingGroupName=stack.group_name, DesiredCapacity=1)
    second = agents(
        "second", stack.instance_ids()[0], fake={"steps": 8}, job_id="vit-22222222", job_name="vit"
    ).start()
    assert second.join(timeout=90).outcome == "completed"
    assert second.steps[0][1] == 1, "a new job starts at step 0"
    assert second.said("job bound")[0]["previous_job"] == JOB
    again = s3.get_object(Bucket=stack.bucket, Key=f"jobs/{JOB}/results/metrics.json")["Body"].read()
    assert again == first_results
    assert (
        json.loads(
            s3.get_object(Bucket=stack.bucket, Key="jobs/vit-22222222/results/metrics.json")["Body"].read()
        )["steps"]
        == 8
    )
    assert _ledger(stack)["status"] == "completed"
    assert _ledger(stack, "vit-22222222")["status"] == "completed"


def test_a_replacement_after_a_mid_job_pulumi_up_runs_the_jobs_own_code(
    stack: LocalStack, agents: Callable[..., Agent]
) -> None:
    """The running job's record pins its bundle; a replacement whose user-data carries a newer definition
    hands itself over to that code (here recorded instead of exec'd: the test runs in-process)."""
    # Steps without end: the job must still be running when the replacement decides (it is ended below).
    first = agents(
        "first", stack.instance_ids()[0], fake={"steps": 10**9}, bundle_key="code/aaa/bundle.tar.gz"
    ).start()
    first.wait_for("trainer starting")
    second = agents("second", "i-0replacement0000", in_group=False, job_id="vit-22222222", job_name="vit")
    pinned: list[dict[str, Any]] = []

    def record(s3: Any, config: Any, job: dict[str, Any]) -> None:
        pinned.append(job)
        raise SystemExit(0)

    second.life.run_pinned = record
    second.life.prepare_pinned = lambda *args, **kwargs: None  # the bundle's own checks: test_jobbinding.py
    with pytest.raises(SystemExit):
        second.life.run()
    assert pinned and pinned[0]["job_id"] == JOB and pinned[0]["bundle_key"] == "code/aaa/bundle.tar.gz"
    assert second.said("continuing it with the code it started with")[0]["defined_job"] == "vit-22222222"
    first.life.request_shutdown()
    first.join(timeout=90)


# -- a partition of the holder (docs/internals.md, "A partition: the holder stops on its own clock") ------

# Short leases so that a partition longer than one costs seconds: the holder asks its trainer to stop after
# half of it unrenewed and kills it at its end; the standby takes over one drift margin later.
LEASE = 4.0
DRIFT = 1.0


@pytest.fixture()
def cut_off(moto_server: MotoServer) -> Iterator[Callable[[], tuple[AwsClients, S3FaultProxy]]]:
    """One instance's own link to AWS, through a fault proxy the test cuts (the others reach moto directly):
    a partition of that instance only. Its clients give up fast, as the production bounds do in minutes."""
    proxies: list[S3FaultProxy] = []

    def make() -> tuple[AwsClients, S3FaultProxy]:
        proxy = S3FaultProxy(moto_server.endpoint_url).start()
        proxies.append(proxy)
        fast = Config(retries={"mode": "standard", "max_attempts": 2}, connect_timeout=1, read_timeout=3)
        names = ("s3", "autoscaling", "sns", "logs", "ec2", "cloudwatch")
        made = [
            boto3.client(name, region_name="us-east-1", endpoint_url=proxy.endpoint_url, config=fast)  # type: ignore[call-overload]
            for name in names
        ]
        return AwsClients(*made), proxy

    yield make
    for proxy in proxies:
        proxy.set_mode(Pass())
        proxy.stop()


def _no_two_trainers(first: Agent, second: Agent) -> None:
    assert first.steps and second.steps, "both instances trained"
    overlap = first.steps[-1][0] - second.steps[0][0]
    assert overlap < 0, f"the standby trained {overlap:.2f} s before the cut-off holder's last step"


def test_a_partition_longer_than_the_lease_the_holder_stops_on_its_own_clock_before_the_standby_starts(
    stack: LocalStack,
    agents: Callable[..., Agent],
    cut_off: Callable[[], tuple[AwsClients, S3FaultProxy]],
) -> None:
    """The holder's link to S3 is cut for longer than its lease while a warm standby waits: the holder
    cannot renew, stops its trainer at a step boundary before the lease's end by its own clock, and the
    standby takes over after the end plus the drift margin. Never two trainers; one completion, by the
    standby; the holder's life says lease_expired, and it sent nothing."""
    clients, link = cut_off()
    holder_id = stack.instance_ids()[0]
    # Endless steps: only the partition can stop the holder.
    first = agents(
        "first", holder_id, fake={"steps": 10**9}, clients=clients, lease_seconds=LEASE, drift_seconds=DRIFT
    ).start()
    first.wait_for("trainer starting")
    second = agents(
        "second",
        "i-0standby00000000",
        in_group=False,
        fake={"steps": 10**9},
        lease_seconds=LEASE,
        drift_seconds=DRIFT,
    ).start()
    second.wait_for("standby ready")
    _wait_until(lambda: len(first.steps) > 5, "the holder training")
    link.set_mode(Cut())
    cut_at = time.monotonic()
    took = second.wait_for("lease taken over", timeout=60)
    assert took["expired"] is True and took["from"] == holder_id
    assert first.join(timeout=60).outcome == "lease_expired"
    stop = first.said("stop requested")[0]
    assert stop["reason"] == "lease_expiring" and stop["unrenewed_s"] >= LEASE / 2
    stopped = first.said("trainer stopped")
    assert stopped and stopped[0]["exit_code"] == 75, "stopped at a step boundary, not killed"
    _wait_until(lambda: bool(second.steps), "the standby's first step")
    _no_two_trainers(first, second)
    # What the partition cost (docs/internals.md): seconds without a trainer, steps trained again.
    gap = second.steps[0][0] - first.steps[-1][0]
    redone = first.steps[-1][1] - second.steps[0][1] + 1
    # A step's time is when its line reached this process: under load a pipe may deliver it a little late.
    assert first.steps[-1][0] - cut_at < LEASE + 1.5, "the holder trained on past its lease's end"
    assert 0 < gap < LEASE + DRIFT + 10, gap
    assert redone >= 0
    print(f"partition cost: {gap:.2f} s without a trainer, {redone} steps trained again")
    link.set_mode(Pass())
    second.life.stops.request("control")  # the standby trains on; end the story
    second.join(timeout=60)
    ledger = _ledger(stack)
    outcomes = {life["instance_id"]: life["outcome"] for life in ledger["lives"]}
    assert outcomes[holder_id] in ("running", "interrupted", "lease_expired"), outcomes
    versions = _versions(stack, f"jobs/{JOB}/checkpoints/")
    steps = [
        json.loads(
            stack.client("s3")
            .get_object(Bucket=stack.bucket, Key=v["Key"], VersionId=v["VersionId"])["Body"]
            .read()
        )["step"]
        for v in versions[f"jobs/{JOB}/checkpoints/latest.json"]
    ]
    assert steps == sorted(steps), f"latest.json moved back: {steps}"


def test_a_holder_that_reaches_its_last_step_cut_off_ends_nothing_and_the_standby_completes_the_job(
    stack: LocalStack,
    agents: Callable[..., Agent],
    cut_off: Callable[[], tuple[AwsClients, S3FaultProxy]],
    tmp_path: Path,
) -> None:
    """The cut-off holder's trainer finishes during the partition: it cannot prove its lease, so it
    uploads no results, writes no status, sends no e-mail and does not scale the group in; the standby takes
    over from the last confirmed checkpoint, completes the job, and the one completion e-mail is its."""
    clients, link = cut_off()
    holder_id = stack.instance_ids()[0]
    release = tmp_path / "release-the-holder"
    first = agents(
        "first",
        holder_id,
        fake={"steps": 40, "hold_at_step": 38, "hold_until": str(release)},
        clients=clients,
        lease_seconds=LEASE,
        drift_seconds=DRIFT,
    ).start()
    first.wait_for("trainer starting")
    second = agents(
        "second", "i-0standby00000000", in_group=False, lease_seconds=LEASE, drift_seconds=DRIFT
    ).start()
    second.wait_for("standby ready")
    _wait_until(lambda: bool(first.steps) and first.steps[-1][1] >= 38, "the holder at its held step")
    stack.alerts()  # what was sent before the cut is not the question
    link.set_mode(Cut())
    release.touch()  # the holder's last 2 steps take 0.16 s: well within half its lease, even loaded
    result = first.join(timeout=60)
    assert result.outcome == "lease_expired", first.events.getvalue()[-2000:]
    assert first.steps[-1][1] == 40, "the holder's trainer reached its last step"
    assert not first.said("results uploaded") and not first.said("scaled to zero")
    link.set_mode(Pass())
    assert second.join(timeout=90).outcome == "completed"
    assert stack.group()["DesiredCapacity"] == 0, "the standby, now the holder, scaled the group in"
    completions = [a for a in stack.alerts() if "completed" in a["Subject"]]
    assert len(completions) == 1, completions
    assert _ledger(stack)["status"] == "completed"
    # The holder's results never reached the job's results; the standby's are there.
    metrics = json.loads(
        stack.client("s3")
        .get_object(Bucket=stack.bucket, Key=f"jobs/{JOB}/results/metrics.json")["Body"]
        .read()
    )
    assert metrics["steps"] == 40


def test_one_bad_queue_object_never_stops_the_stack_the_good_job_behind_it_runs(
    stack: LocalStack, agents: Callable[..., Agent]
) -> None:
    """Ahead of a good job: a job whose code bundle is missing, a 1 MB job id and an entry nested 200,000
    levels deep. The bad job fails with one line naming its bundle (one e-mail), each bad object is named
    once in the life however often the queue is read, and the good job runs and completes on the instance."""
    s3 = stack.client("s3")
    bad = "broken-0000aaaa"
    record = {
        "job_id": bad,
        "name": "broken",
        "submitted_at": "2026-12-06T10:00:00+00:00",
        "source": "run",
        "bundle_key": "code/gone/bundle.tar.gz",
        "bundle_sha256": "e" * 64,
        "agent": {
            "job_id": bad,
            "job_name": "broken",
            "job": {"fake": STEPS},
            "bundle_key": "code/gone/bundle.tar.gz",
            "bundle_sha256": "e" * 64,
        },
    }
    s3.put_object(Bucket=stack.bucket, Key=f"jobs/{bad}/job.json", Body=json.dumps(record).encode())
    entry = {"job_id": bad, "submitted_at": "2026-12-06T10:00:00+00:00", "now": False}
    s3.put_object(Bucket=stack.bucket, Key=f"queue/{bad}.json", Body=json.dumps(entry).encode())
    s3.put_object(
        Bucket=stack.bucket, Key="queue/huge.json", Body=json.dumps({"job_id": "a" * 1_000_000}).encode()
    )
    s3.put_object(Bucket=stack.bucket, Key="queue/nested.json", Body=b"[" * 200_000)
    time.sleep(1.1)  # the good job is queued after the bad ones by S3's one-second clock
    good = agents("good", stack.instance_ids()[0], fake={"steps": 6}, bundle_key="", bundle_sha256="").start()
    assert good.join(timeout=90).outcome == "completed"
    assert _ledger(stack)["status"] == "completed"
    refused = _ledger(stack, bad)
    assert refused["status"] == "failed" and "code/gone/bundle.tar.gz" in refused["reason"], refused
    assert "is missing; submit the job again" in refused["reason"]
    lines = good.events.getvalue().splitlines()
    assert all(len(line) < 2000 for line in lines), "a value echoed whole into the log"
    for name in ("queue/huge.json", "queue/nested.json", f"job {bad} refused"):
        said = [line for line in lines if name in line]
        assert len(said) == 1, (name, said)
    alerts = [a["Subject"] for a in stack.alerts()]
    assert sum(f"job {bad}" in subject for subject in alerts) == 1, alerts

"""Fault injection: the promise "nothing confirmed is lost, nothing bills unattended" under real faults.

The S3 fault proxy (cut, blackhole, slow) sits between moto and the real agent and persister; spot notices
come from the IMDS simulator; the trainer is the contract's test double (tests/bootstrap/fake_trainer.py)
or, where the promise spans both, the agent run as its own process and killed.
"""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config

from bootstrap.aws import client as aws_client
from bootstrap.eventlog import EventLog
from bootstrap.imds import InstanceIdentity
from bootstrap.ledger import JobLedger, LedgerStore
from bootstrap.lifecycle import AwsClients, InstanceLife, LifeResult
from bootstrap.persist import CheckpointPersister
from demo.fault_proxy import Blackhole, Cut, Pass, S3FaultProxy, Slow
from demo.imds import ImdsSimulator, SimulatedInstance
from demo.stack import LocalStack, create_stack
from tests.checkpoints import commit_step
from tests.conftest import MotoServer

FAKE_TRAINER = [sys.executable, str(Path(__file__).parents[1] / "bootstrap" / "fake_trainer.py")]
# The agent's clients in these tests: the production bounds, shortened so a blackhole costs seconds.
FAST = Config(retries={"mode": "standard", "max_attempts": 2}, connect_timeout=1, read_timeout=2)
REGION = "us-east-1"


def clients_for_a_blackholed_end() -> AwsClients:
    """For a life that ends with every endpoint blackholed, where each hung call costs wall time:
    S3 and the rest wait 1 s per attempt (still one retry for a slow moto before the blackhole), and the
    log shippers (best effort, journald keeps every line) try once for 0.5 s, so closing them takes
    about a second instead of the production 10 s bound."""
    tight = Config(retries={"mode": "standard", "max_attempts": 2}, connect_timeout=1, read_timeout=1)
    once = Config(retries={"mode": "standard", "max_attempts": 1}, connect_timeout=1, read_timeout=0.5)
    clients = AwsClients.for_region(REGION, tight)
    clients.logs = aws_client("logs", REGION, once)
    return clients


@pytest.fixture()
def stack(aws_via_proxy: S3FaultProxy) -> LocalStack:
    return create_stack(name="trainstack-faults")


@pytest.fixture()
def direct(moto_server: MotoServer, stack: LocalStack) -> Any:
    """An S3 client straight to moto, for the test's own reads while the proxy misbehaves."""
    return boto3.client("s3", region_name=REGION, endpoint_url=moto_server.endpoint_url)


@pytest.fixture()
def imds(
    stack: LocalStack, moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ImdsSimulator]:
    # The real IMDS does not depend on S3: the simulator asks moto directly, never through the proxy.
    autoscaling = boto3.client("autoscaling", region_name=REGION, endpoint_url=moto_server.endpoint_url)

    def lifecycle_state(instance_id: str) -> str:
        groups = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[stack.group_name])
        held = [i["InstanceId"] for i in groups["AutoScalingGroups"][0]["Instances"]]
        return "InService" if instance_id in held else "Terminated"

    simulator = ImdsSimulator(
        SimulatedInstance(instance_id=stack.instance_ids()[0]), lifecycle_state=lifecycle_state
    )
    simulator.start()
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", simulator.endpoint)
    yield simulator
    simulator.stop()


def upload_dataset(stack: LocalStack, files: int = 6, size: int = 100) -> None:
    s3 = stack.client("s3")
    for i in range(files):
        split = "train" if i % 3 else "val"
        key = f"data/{split}/class_{i % 2}/{i:03d}.png"
        s3.put_object(Bucket=stack.bucket, Key=key, Body=bytes([i % 256]) * size)


class Recorder:
    """Agent events with the moment they were logged."""

    def __init__(self, life: InstanceLife) -> None:
        self.events: list[tuple[float, dict[str, Any]]] = []
        life.log.add_sink(self)

    def __call__(self, line: str) -> None:
        self.events.append((time.monotonic(), json.loads(line)))

    def first(self, message: str) -> tuple[float, dict[str, Any]]:
        for at, event in self.events:
            if event["message"].startswith(message):
                return at, event
        raise AssertionError(f"no event {message!r} in {[e['message'] for _, e in self.events]}")

    def messages(self) -> list[str]:
        return [event["message"] for _, event in self.events]


MakeLife = Callable[..., InstanceLife]


@pytest.fixture()
def make_life(stack: LocalStack, imds: ImdsSimulator, tmp_path: Path) -> MakeLife:
    lives = iter(range(1, 100))

    def build(
        fake: dict[str, Any] | None = None, clients: AwsClients | None = None, **config: Any
    ) -> InstanceLife:
        values: dict[str, Any] = {
            "poll_seconds": 0.2,
            "scratch_dir": str(tmp_path / f"instance-{next(lives)}"),
            "job": {"fake": fake or {}},
            "stop_deadline_seconds": 8.0,
            **config,
        }
        return InstanceLife(
            stack.agent_config(**values),
            log=EventLog(io.StringIO()),
            clients=clients or AwsClients.for_region(REGION, FAST),
            trainer_command=FAKE_TRAINER,
            identity_wait_seconds=2,
            # No wait for a drain hook: no test here terminates the instance, and the wait polls every 2 s
            # (python -m demo covers the terminating path end to end).
            release_wait_seconds=0,
            state_poll_seconds=0.5,
            tick_seconds=0.1,
        )

    return build


def start(life: InstanceLife) -> Future[LifeResult]:
    return ThreadPoolExecutor(max_workers=1).submit(life.run)


def read_json(s3: Any, bucket: str, key: str) -> dict[str, Any] | None:
    try:
        value = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    except s3.exceptions.NoSuchKey:
        return None
    return value if isinstance(value, dict) else None


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def latest_history(s3: Any, bucket: str) -> list[int]:
    """Every step `checkpoints/latest.json` ever named, oldest first (the bucket is versioned)."""
    versions = s3.list_object_versions(Bucket=bucket, Prefix="checkpoints/latest.json").get("Versions", [])
    steps = []
    # S3 lists a key's versions newest first. Not sorted by LastModified: it has one-second resolution, and
    # two writes in one second (a fast machine) would tie and keep the listing's newest-first order.
    for version in reversed(versions):
        body = s3.get_object(Bucket=bucket, Key=version["Key"], VersionId=version["VersionId"])["Body"].read()
        steps.append(int(json.loads(body)["step"]))
    return steps


def persister(stack: LocalStack, root: Path, client: Any | None = None) -> CheckpointPersister:
    s3 = client or boto3.client("s3", region_name=REGION, config=FAST)
    return CheckpointPersister(
        s3, stack.bucket, "checkpoints", root, EventLog(io.StringIO()), poll_seconds=0.1
    )


# -- 1. checkpoint persistence ------------------------------------------------------------------------


def test_after_an_s3_outage_at_a_stop_latest_names_the_newest_step_and_never_moved_back(
    stack: LocalStack, aws_via_proxy: S3FaultProxy, direct: Any, tmp_path: Path
) -> None:
    local = tmp_path / "instance"
    owner = persister(stack, local)
    owner.restore()
    owner.start()
    commit_step(local, 3)
    wait_until(lambda: owner.confirmed_step == 3, 20, "step 3 confirmed")
    aws_via_proxy.set_mode(Cut())
    for step in (4, 5, 6):  # saved during the outage: only local for now
        commit_step(local, step)
        time.sleep(0.3)
    threading.Timer(1.0, aws_via_proxy.set_mode, args=[Pass()]).start()  # S3 back during the stop
    result = owner.finish(time.monotonic() + 30)
    owner.close()
    assert result.confirmed and result.confirmed_step == 6
    history = latest_history(direct, stack.bucket)
    assert history == sorted(history) and history[-1] == 6, f"latest.json moved back: {history}"
    replacement = persister(stack, tmp_path / "replacement", direct)
    assert replacement.restore() == 6, "the replacement resumes from the newest confirmed step"


def test_a_draining_old_life_cannot_move_latest_back(stack: LocalStack, direct: Any, tmp_path: Path) -> None:
    new = persister(stack, tmp_path / "new")
    commit_step(tmp_path / "new", 6)
    new.persist_newest(deadline=time.monotonic() + 20)
    old = persister(stack, tmp_path / "old")  # still finishing its upload of an older step
    commit_step(tmp_path / "old", 3)
    old.persist_newest(deadline=time.monotonic() + 20)
    assert read_json(direct, stack.bucket, "checkpoints/latest.json")["step"] == 6  # type: ignore[index]
    assert latest_history(direct, stack.bucket) == [6]


def test_an_upload_overtaken_by_a_newer_step_is_dropped_and_the_newest_goes_first(
    stack: LocalStack, aws_via_proxy: S3FaultProxy, direct: Any, tmp_path: Path
) -> None:
    local = tmp_path / "instance"
    owner = persister(stack, local)
    owner.start()
    aws_via_proxy.set_mode(Slow(bytes_per_second=400_000))
    commit_step(local, 1, size=2_000_000)  # about 5 s at this speed
    time.sleep(0.7)
    commit_step(local, 2, size=1000)
    aws_via_proxy.set_mode(Pass())
    result = owner.finish(time.monotonic() + 30)
    owner.close()
    assert result.confirmed_step == 2
    keys = [o["Key"] for o in direct.list_objects_v2(Bucket=stack.bucket).get("Contents", [])]
    assert "checkpoints/step-1/manifest.json" not in keys, "the superseded step was still completed"
    assert latest_history(direct, stack.bucket) == [2]


def test_nothing_confirmed_is_claimed_when_s3_never_comes_back(
    stack: LocalStack, aws_via_proxy: S3FaultProxy, direct: Any, tmp_path: Path
) -> None:
    local = tmp_path / "instance"
    owner = persister(stack, local)
    owner.start()
    commit_step(local, 3)
    wait_until(lambda: owner.confirmed_step == 3, 20, "step 3 confirmed")
    aws_via_proxy.set_mode(Blackhole())
    commit_step(local, 4)
    started = time.monotonic()
    result = owner.finish(started + 3)
    owner.close()
    # The deadline is 3 s; 3 s more of slack for a loaded machine. A flush that ignored it would wait out
    # FAST's read timeouts (2 attempts x 2 s) for each of the step's puts: 8 s at least.
    assert time.monotonic() - started < 6, "the final flush overran its deadline"
    assert not result.confirmed and (result.newest_local_step, result.confirmed_step) == (4, 3)
    aws_via_proxy.set_mode(Pass())
    assert read_json(direct, stack.bucket, "checkpoints/latest.json")["step"] == 3  # type: ignore[index]


# -- 2. spot reaction independent of S3 ---------------------------------------------------------------


@pytest.mark.slow(seconds=14)
def test_notice_to_stop_request_takes_under_two_seconds_with_s3_blackholed(
    make_life: MakeLife, stack: LocalStack, imds: ImdsSimulator, aws_via_proxy: S3FaultProxy, direct: Any
) -> None:
    upload_dataset(stack)
    life = make_life(
        fake={"steps": 5000, "step_seconds": 0.02, "checkpoint_every": 10},
        clients=clients_for_a_blackholed_end(),
        stop_deadline_seconds=4.0,  # the trainer is told at once, so a short deadline proves the same
    )
    events = Recorder(life)
    running = start(life)
    wait_until(
        lambda: (read_json(direct, stack.bucket, "checkpoints/latest.json") or {}).get("step", 0) >= 20,
        60,
        "a confirmed checkpoint",
    )
    aws_via_proxy.set_mode(Blackhole())
    time.sleep(1.0)  # the state poller is now stuck on S3
    imds.inject_spot_notice()
    result = running.result(timeout=120)
    assert result.outcome == "preempted"
    seen, _ = events.first("spot termination notice")
    asked, _ = events.first("stop requested")
    assert asked - seen <= 2.0, f"stop requested {asked - seen:.1f} s after the notice was seen"
    _, stopped = events.first("trainer stopped")
    assert stopped["checkpoint_confirmed"] is False, "nothing newer could be confirmed with S3 down"
    aws_via_proxy.set_mode(Pass())
    confirmed = read_json(direct, stack.bucket, "checkpoints/latest.json")
    assert confirmed is not None and confirmed["step"] == stopped["checkpoint_step"]
    replacement = persister(stack, Path(str(life.config.scratch_dir)) / "replacement", direct)
    assert replacement.restore() == confirmed["step"], "the confirmed checkpoint is intact and restorable"


def test_a_notice_during_the_dataset_sync_aborts_it(
    make_life: MakeLife, stack: LocalStack, imds: ImdsSimulator, aws_via_proxy: S3FaultProxy
) -> None:
    upload_dataset(stack, files=30, size=200_000)
    life = make_life(fake={"steps": 50})
    events = Recorder(life)
    # About 10 s for each 200 KB file, so for the sync whatever the tool's parallelism: at 300 KB/s per
    # connection, a tool fetching all 30 files at once was done in under a second, at times before the notice.
    aws_via_proxy.set_mode(Slow(bytes_per_second=20_000))
    running = start(life)
    wait_until(lambda: "syncing dataset" in events.messages(), 30, "the sync to start")
    time.sleep(0.5)
    imds.inject_spot_notice()
    result = running.result(timeout=60)
    seen, _ = events.first("spot termination notice")
    aborted, _ = events.first("dataset sync aborted")
    assert result.outcome == "preempted"
    assert aborted - seen <= 3.0, f"the sync went on {aborted - seen:.1f} s after the notice"
    assert "trainer starting" not in events.messages()


# -- 3. truthful outcomes -----------------------------------------------------------------------------


def test_sigterm_during_the_data_wait_is_an_interruption_not_a_missing_dataset(
    make_life: MakeLife, stack: LocalStack, direct: Any
) -> None:
    life = make_life(data_wait_minutes=5)
    running = start(life)
    wait_until(
        lambda: (
            (read_json(direct, stack.bucket, "state/ledger.json") or {}).get("status") == "waiting_for_data"
        ),
        30,
        "the data wait",
    )
    life.request_shutdown()
    result = running.result(timeout=30)
    assert (result.outcome, result.exit_code) == ("preempted", 0)
    assert stack.alerts() == [], "no 'no dataset' e-mail for an interruption"
    assert stack.group()["DesiredCapacity"] == 1, "an interruption never scales the job to zero"
    ledger = read_json(direct, stack.bucket, "state/ledger.json")
    assert ledger is not None and ledger["status"] == "running" and ledger["interruptions"] == 1
    assert ledger["lives"][-1]["outcome"] == "preempted"


def test_an_instance_killed_mid_sync_is_closed_as_interrupted_by_the_next_life(
    make_life: MakeLife,
    stack: LocalStack,
    aws_via_proxy: S3FaultProxy,
    moto_server: MotoServer,
    direct: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    upload_dataset(stack, files=30, size=200_000)
    aws_via_proxy.set_mode(Slow(bytes_per_second=300_000))
    config = tmp_path / "agent.yaml"
    config.write_text(stack.agent_config(scratch_dir=str(tmp_path / "doomed"), poll_seconds=0.5).to_yaml())
    with ImdsSimulator(SimulatedInstance(instance_id="i-0doomed000000000")) as doomed_imds:
        env = {
            **moto_server.env(),
            "AWS_ENDPOINT_URL": aws_via_proxy.endpoint_url,
            "AWS_EC2_METADATA_SERVICE_ENDPOINT": doomed_imds.endpoint,
            "PYTHONPATH": str(Path(__file__).parents[2]),
        }
        agent = subprocess.Popen(
            [sys.executable, "-m", "bootstrap.agent", "--config", str(config)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            assert agent.stdout is not None
            # An agent that goes quiet would hold the read below for ever: killed at the deadline, its
            # output ends, and so does the read.
            watchdog = threading.Timer(60, agent.kill)
            watchdog.start()
            try:
                syncing = any("syncing dataset" in line for line in agent.stdout)
            finally:
                watchdog.cancel()
            assert syncing, "the agent never started its sync (within 60 s, or before it exited)"
            agent.send_signal(signal.SIGKILL)  # the instance vanishes: no notice, no last word
        finally:
            agent.kill()
            agent.wait(timeout=30)
    aws_via_proxy.set_mode(Pass())
    result = make_life(fake={"steps": 5}).run()
    assert result.outcome == "completed"
    ledger = read_json(direct, stack.bucket, "state/ledger.json")
    assert ledger is not None
    dead, replacement = ledger["lives"]
    assert dead["instance_id"] == "i-0doomed000000000" and dead["outcome"] == "interrupted"
    assert dead["ended_at"] == dead["heartbeat_at"], "billed up to its last heartbeat"
    assert replacement["outcome"] == "completed"
    assert (ledger["interruptions"], ledger["consecutive_failures"]) == (1, 0)


def test_a_job_that_completes_after_a_stop_request_is_completed_not_preempted(
    make_life: MakeLife, stack: LocalStack, imds: ImdsSimulator, direct: Any
) -> None:
    upload_dataset(stack)
    life = make_life(fake={"steps": 5000, "step_seconds": 0.02, "complete_on_stop": True})
    running = start(life)
    wait_until(lambda: (Path(str(life.config.scratch_dir)) / "output/progress.json").exists(), 60, "training")
    imds.inject_spot_notice()
    assert running.result(timeout=60).outcome == "completed"
    ledger = read_json(direct, stack.bucket, "state/ledger.json")
    assert ledger is not None and ledger["status"] == "completed" and ledger["interruptions"] == 0
    assert stack.group()["DesiredCapacity"] == 0


def test_a_job_ignoring_the_stop_is_killed_at_the_deadline_and_the_confirmed_checkpoint_stays(
    make_life: MakeLife, stack: LocalStack, imds: ImdsSimulator, direct: Any
) -> None:
    upload_dataset(stack)
    life = make_life(
        fake={"steps": 5000, "step_seconds": 0.02, "checkpoint_every": 10, "ignore_stop": True},
        stop_deadline_seconds=4.0,
    )
    events = Recorder(life)
    running = start(life)
    wait_until(
        lambda: (read_json(direct, stack.bucket, "checkpoints/latest.json") or {}).get("step", 0) >= 10,
        60,
        "a confirmed checkpoint",
    )
    imds.inject_spot_notice()
    assert running.result(timeout=60).outcome == "preempted"
    assert any(m.startswith("trainer missed the stop deadline") for m in events.messages())
    latest = read_json(direct, stack.bucket, "checkpoints/latest.json")
    assert latest is not None
    replacement = persister(stack, Path(str(life.config.scratch_dir)) / "replacement", direct)
    assert replacement.restore() == latest["step"]


def test_two_writers_never_lose_each_others_ledger_updates(stack: LocalStack) -> None:
    s3 = boto3.client("s3", region_name=REGION, config=FAST)
    store_a = LedgerStore(s3, stack.bucket, "state/ledger.json")
    store_b = LedgerStore(s3, stack.bucket, "state/ledger.json")
    from datetime import datetime, timezone

    now = datetime.now(timezone.utc)
    store_a.begin_life(InstanceIdentity("i-a", "g6.xlarge", "us-east-1a", REGION, "spot"), 0.5, now)
    interleaved = {"done": False}

    def a_change(ledger: JobLedger) -> None:
        if not interleaved["done"]:
            # B writes between A's read and A's write: A's conditional write must fail and retry.
            interleaved["done"] = True
            store_b.update(lambda other: other.data.setdefault("notes", []).append("b"))
        ledger.data.setdefault("notes", []).append("a")

    store_a.update(a_change)
    final = store_a.load()
    assert sorted(final.data["notes"]) == ["a", "b"], "one writer's update was lost"

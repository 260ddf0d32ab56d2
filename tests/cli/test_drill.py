"""`trainstack drill`: the timeline from a recorded sequence of the agent's events, the one-line refusals, and
one drill end to end: moto's FIS, the notice through the simulated IMDS, the real agent's stop and resume."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from bootstrap.eventlog import EventLog
from bootstrap.lifecycle import InstanceLife, LifeResult
from demo.imds import ImdsSimulator, SimulatedInstance
from demo.stack import STAND_IN_AMI, LocalStack, create_stack
from infra import drill as template
from trainstack import drill
from trainstack.aws import Clients
from trainstack.logs import LogEvent
from trainstack_job.jobs import JobPrefixes
from trainstack_job.records import Ledger

from .conftest import REGION, Deployed, Result, write_project

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)
JOB = "default-1a2b3c4d"
FAKE_TRAINER = [sys.executable, str(Path(__file__).parents[1] / "bootstrap" / "fake_trainer.py")]


def _event(seconds: float, instance: str, stage: str, message: str, **fields: Any) -> LogEvent:
    """One line of the agent's log as CloudWatch holds it (bootstrap/eventlog.py's JSON)."""
    at = T0 + timedelta(seconds=seconds)
    record = {"time": at.isoformat(timespec="milliseconds").replace("+00:00", "Z"), "stage": stage}
    body = json.dumps({**record, "message": message, **fields})
    return LogEvent(int(at.timestamp() * 1000), f"{JOB}/{instance}/agent", body, f"{instance}-{seconds}")


# A drill as a real one goes: the holder i-aaa gets the notice 7 s in, stops at a step boundary with that
# step's checkpoint confirmed; the group's replacement i-bbb boots and restores it.
RECORDED = [
    _event(-600, "i-aaa", "train", "trainer starting", restored_step=0),
    _event(7, "i-aaa", "interruption", "spot termination notice", action="terminate"),
    _event(7.1, "i-aaa", "stop", "stop requested from the trainer", reason="spot"),
    _event(19, "i-aaa", "stop", "trainer stopped; checkpoint confirmed in S3", reason="spot", exit_code=75,
           checkpoint_confirmed=True, checkpoint_step=1200, newest_local_step=1200, reached_step=1200),
    _event(95, "i-bbb", "start", "instance life starting", instance_id="i-bbb", instance_type="g5.xlarge",
           az="us-east-1b", lifecycle="spot"),
    _event(160, "i-bbb", "train", "trainer starting", restored_step=1200),
    LogEvent(int((T0 + timedelta(seconds=161)).timestamp() * 1000), f"{JOB}/i-bbb/trainer", "step 1201", "t"),
]  # fmt: skip


def _at(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).isoformat()


LIVES = Ledger.from_json({"lives": [
    {"started_at": _at(-3575), "ended_at": _at(25), "cost_usd": 0.36, "outcome": "preempted"},
    {"started_at": _at(95), "heartbeat_at": _at(195), "cost_usd": 0.01, "outcome": "running"},
]}).lives  # fmt: skip


def test_the_recorded_drill_reads_as_notice_checkpoint_replacement_resume() -> None:
    timeline = drill.build_timeline(
        T0, drill.agent_events(RECORDED), start_step=1190, total_steps=5000, lives=LIVES,
        ended_at=T0 + timedelta(seconds=195),
    )  # fmt: skip
    rows = [text for _, text in drill.rows(timeline, experiment_id="EXP1", target="i-aaa")]
    assert rows == [
        "FIS experiment EXP1 started; the job is at step 1190/5000 on i-aaa",
        "spot interruption notice reaches i-aaa",
        "i-aaa's trainer stops at step 1200 (exit 75); checkpoint step 1200 confirmed in S3",
        "the replacement i-bbb (g5.xlarge, us-east-1b, spot) boots",
        "i-bbb resumes: training from step 1200/5000",
    ]
    figures = drill.summary(timeline)
    assert figures["steps_lost"] == 0
    assert figures["notice_to_checkpoint_confirmed_s"] == 12.0
    assert figures["notice_to_training_resumed_s"] == 153.0
    assert figures["replacement_boot_to_resumed_s"] == 65.0
    # 25 s of the first life (0.36 USD over 3600 s) and all 100 s of the second (0.01 USD).
    assert figures["cost_usd"] == pytest.approx(0.0025 + 0.01)
    assert all(check.passed for check in timeline.checks())


def test_steps_trained_past_the_confirmed_checkpoint_fail_the_drill() -> None:
    late = [
        e
        if "trainer stopped" not in e.message
        else _event(19, "i-aaa", "stop", "trainer stopped WITHOUT its newest checkpoint in S3; the confirmed "
                    "one is kept", exit_code=-15, checkpoint_confirmed=False, checkpoint_step=1190,
                    newest_local_step=1200, reached_step=1200)
        for e in RECORDED
    ]  # fmt: skip
    late[-2] = _event(160, "i-bbb", "train", "trainer starting", restored_step=1190)
    timeline = drill.build_timeline(T0, drill.agent_events(late))
    assert timeline.steps_lost == 10
    failed = {check.name for check in timeline.checks() if not check.passed}
    assert failed == {"the interrupted instance stopped with a confirmed checkpoint", "steps lost = 0"}


def test_a_warm_standby_taking_over_is_the_recovery() -> None:
    events = [
        *RECORDED[:4],
        _event(21, "i-ccc", "train", "start gate opened: the standby trains", restored_step=1200),
    ]
    timeline = drill.build_timeline(T0, drill.agent_events(events))
    assert timeline.by_standby and timeline.resumed_step == 1200
    assert drill.rows(timeline, experiment_id="E", target="i-aaa")[-1][1] == (
        "the standby i-ccc takes over: training from step 1200"
    )


class Batches:
    """Stands for the drill's LogReader: each read returns the next batch CloudWatch made searchable."""

    def __init__(self, *batches: list[LogEvent]) -> None:
        self.batches = list(batches)

    def read(self) -> list[LogEvent]:
        return self.batches.pop(0) if self.batches else []


class RunningExperiment:
    def get_experiment(self, **_: Any) -> Any:
        return {"experiment": {"id": "EXP1", "state": {"status": "running"}}}


class Outputs:
    bucket = "trainstack-test-data"

    def text(self, _name: str) -> str:
        return "/trainstack/test"


class Stack:
    outputs = Outputs()


def test_a_standby_seen_training_before_the_old_holders_stop_arrives_waits_for_that_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A warm standby trains a second after the old holder's stop, but each instance ships its events in
    batches of its own: the standby's line can be read before the stop. The drill waits for the stop (up to
    LOG_GRACE_SECONDS) instead of failing its checks on an event still in flight."""
    standby = _event(20, "i-ccc", "train", "start gate opened: the standby trains", restored_step=1200)
    batches = Batches([*RECORDED[:3], standby], [], [RECORDED[3]])
    monkeypatch.setattr(drill, "LogReader", lambda *args, **kwargs: batches)
    monkeypatch.setattr(drill, "resolve_job", lambda *args: JobPrefixes.of(JOB))
    monkeypatch.setattr(drill, "read_ledger", lambda *args: Ledger(status="running"))
    started = drill.Started("EXP1", "EXT1", JOB, T0, "i-aaa", 1190, 5000)
    clients = Clients(None, overrides={"fis": RunningExperiment()})

    stack: Any = Stack()
    timeline, ending = drill.watch(
        clients, stack, started, timeout_s=60, poll_seconds=0, sleep=lambda _: None
    )

    assert ending == "resumed" and timeline.by_standby
    assert timeline.stopped is not None and not batches.batches, "the stop's batch was read"
    assert all(check.passed for check in timeline.checks()), timeline.checks()


# -- refusals, each one line --------------------------------------------------------------------------------


def _with_drill(deployed: Deployed, **extra: Any) -> None:
    outputs = {**deployed.outputs, "drill_template_id": "EXTdrill", **extra}
    deployed.outputs_file.write_text(json.dumps(outputs), encoding="utf-8")


def _fis(stub: Callable[[Stubber], None]) -> Clients:
    client = boto3.client("fis", region_name=REGION)
    stubber = Stubber(client)
    stub(stubber)
    stubber.activate()
    return Clients(None, overrides={"fis": client})


def _running(deployed: Deployed) -> None:
    deployed.launch_instance(spot=True)
    deployed.put_state("ledger.json", {"status": "running", "lives": []})
    deployed.put_state("progress.json", {"step": 40, "total_steps": 100})


def test_a_stack_without_the_drill_says_how_to_enable_it(deployed: Deployed) -> None:
    result = deployed.run("drill")
    assert result.code == 1
    assert "pulumi config set trainstack:drill true && pulumi up" in result.err
    assert len(result.err.strip().splitlines()) == 1


def test_no_running_job_is_refused_before_anything_is_interrupted(deployed: Deployed) -> None:
    _with_drill(deployed)
    deployed.put_state("ledger.json", {"status": "completed", "lives": []})
    result = deployed.run("drill", clients=_fis(lambda stub: None))  # no FIS call expected
    assert result.code == 1 and "no running job to interrupt" in result.err and "completed" in result.err


def test_fis_access_denied_names_the_permission(deployed: Deployed) -> None:
    _with_drill(deployed)
    _running(deployed)
    denied = _fis(
        lambda stub: stub.add_client_error(
            "start_experiment",
            "AccessDeniedException",
            "User is not authorized to perform fis:StartExperiment",
        )
    )
    result = deployed.run("drill", clients=denied)
    assert result.code == 1
    assert "fis:StartExperiment" in result.err and "experiment-template/EXTdrill" in result.err


def test_a_failed_experiment_says_why(deployed: Deployed) -> None:
    _with_drill(deployed)
    _running(deployed)
    failed = {
        "id": "EXPfailed",
        "state": {"status": "failed", "reason": "Target resolution returned empty set"},
    }
    clients = _fis(lambda stub: stub.add_response("start_experiment", {"experiment": failed}))
    result = deployed.run("drill", "--no-wait", clients=clients)
    assert result.code == 1
    assert "EXPfailed failed: Target resolution returned empty set" in result.err


# -- one drill end to end ------------------------------------------------------------------------------------


class FisAtTheBoundary:
    """FIS's API is moto's; what FIS then does to the instance, the notice in its metadata, is done here, so
    the drill drives the agent's real path: IMDS poll, stop at a step boundary, checkpoint, resume."""

    def __init__(self, fis: Any, imds: ImdsSimulator) -> None:
        self._fis = fis
        self._imds = imds

    def start_experiment(self, **request: Any) -> Any:
        answer = self._fis.start_experiment(**request)
        self._imds.inject_spot_notice()
        return answer

    def get_experiment(self, **request: Any) -> Any:
        return self._fis.get_experiment(**request)


@pytest.fixture()
def local(aws: Any) -> LocalStack:
    return create_stack(name="trainstack-drill")


def _spot_instance(stack: LocalStack) -> str:
    """A spot instance in the group, as a spot launch of the group's would be (moto's own are on-demand)."""
    ec2 = stack.client("ec2")
    subnet = ec2.describe_subnets()["Subnets"][0]["SubnetId"]
    instance = ec2.run_instances(
        ImageId=STAND_IN_AMI, MinCount=1, MaxCount=1, InstanceType="g6.xlarge", SubnetId=subnet,
        InstanceMarketOptions={"MarketType": "spot"},
    )["Instances"][0]["InstanceId"]  # fmt: skip
    autoscaling = stack.client("autoscaling")
    # Room for it beside the group's own instance, which stands in for the replacement.
    autoscaling.update_auto_scaling_group(AutoScalingGroupName=stack.group_name, MaxSize=2)
    autoscaling.attach_instances(InstanceIds=[instance], AutoScalingGroupName=stack.group_name)
    return str(instance)


def _template(stack: LocalStack) -> str:
    """The template as infra/drill.py declares it, made in moto's FIS."""
    made = stack.client("fis").create_experiment_template(
        description="drill",
        roleArn="arn:aws:iam::123456789012:role/trainstack-drill-drill",
        stopConditions=[{"source": "none"}],
        targets={
            template.TARGET_NAME: {
                "resourceType": template.TARGET_RESOURCE_TYPE,
                "resourceTags": {template.SELECTION_TAG: stack.group_name},
                "selectionMode": template.SELECTION_MODE,
            }
        },
        actions={
            "interrupt": {
                "actionId": template.ACTION_ID,
                "parameters": {"durationBeforeInterruption": template.DURATION_BEFORE_INTERRUPTION},
                "targets": {template.ACTION_TARGET_KEY: template.TARGET_NAME},
            }
        },
    )
    return str(made["experimentTemplate"]["id"])


@pytest.fixture()
def imds(local: LocalStack, monkeypatch: pytest.MonkeyPatch) -> Iterator[ImdsSimulator]:
    simulator = ImdsSimulator(
        SimulatedInstance(instance_id=_spot_instance(local)), lifecycle_state=local.lifecycle_state
    )
    simulator.start()
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", simulator.endpoint)
    yield simulator
    simulator.stop()


def _life(stack: LocalStack, scratch: Path, steps: int) -> InstanceLife:
    config = stack.agent_config(
        poll_seconds=0.2,
        scratch_dir=str(scratch),
        job={"fake": {"steps": steps, "step_seconds": 0.02, "checkpoint_every": 1000}},
    )
    return InstanceLife(
        config, log=EventLog(), trainer_command=FAKE_TRAINER, identity_wait_seconds=2, release_wait_seconds=0,
        state_poll_seconds=0.5, tick_seconds=0.1,
    )  # fmt: skip


def _wait_for_step(scratch: Path, step: int, timeout: float = 60) -> None:
    progress = scratch / "output" / "progress.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads(progress.read_text())["step"] >= step:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"trainer never reached step {step}")


def _replacement(
    stack: LocalStack, imds: ImdsSimulator, first: Future[LifeResult], scratch: Path, done: threading.Event
) -> LifeResult:
    """The group's replacement: once the interrupted life is over, another instance of the group boots."""
    first.result(timeout=120)
    interrupted = imds.instance.instance_id
    imds.clear_events()
    other = next(i for i in stack.instance_ids() if i != interrupted)
    imds.instance = SimulatedInstance(
        instance_id=other, instance_type="g5.xlarge", availability_zone="us-east-1b"
    )
    checkpoint = (stack.read_json("checkpoints/latest.json") or {}).get("step", 0)
    try:
        return _life(stack, scratch, int(checkpoint) + 5).run()
    finally:
        done.set()


def test_drill_end_to_end_interrupts_the_real_agent_and_times_its_recovery(
    local: LocalStack,
    imds: ImdsSimulator,
    tmp_path: Path,
    cli: Callable[..., Result],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s3 = local.client("s3")
    for i in range(6):
        s3.put_object(
            Bucket=local.bucket, Key=f"data/{'train' if i % 3 else 'val'}/c{i % 2}/{i}.png", Body=b"x"
        )
    project = write_project(tmp_path, {"aws:region": REGION})
    outputs = tmp_path / "outputs.json"
    prefixes = {f"{name}_prefix": f"{name}/" for name in ("state", "checkpoints", "results", "data", "code")}
    stack_outputs = {
        **prefixes,
        "region": REGION,
        "bucket_name": local.bucket,
        "group_name": local.group_name,
        "instance_count": 1,
        "instance_types": ["g6.xlarge", "g5.xlarge"],
        "log_group_name": local.log_group,
        "kms_key_arn": local.kms_key_arn,
        "drill_template_id": _template(local),
    }
    outputs.write_text(json.dumps(stack_outputs))
    pool = ThreadPoolExecutor(max_workers=2)
    # Steps without end: only the drill's notice can stop the first life, however long the drill takes to
    # start on a loaded machine (400 steps of 20 ms could end first); the replacement trains 5 past it.
    first = pool.submit(_life(local, tmp_path / "instance-1", 10**9).run)
    _wait_for_step(tmp_path / "instance-1", 10)
    replaced = threading.Event()
    second = pool.submit(_replacement, local, imds, first, tmp_path / "instance-2", replaced)
    monkeypatch.setattr(drill, "POLL_SECONDS", 0.5)
    fis = FisAtTheBoundary(local.client("fis"), imds)
    try:
        result = cli(
            "drill", "--timeout", "2", "--cwd", str(project), "--stack", "test", "--outputs", str(outputs),
            clients=Clients(None, overrides={"fis": fis}),
        )  # fmt: skip
    finally:
        replaced.wait(timeout=120)
        # Both lives end before the test looks (or fails), within a bound: shutdown(wait=True) has none.
        wait([first, second], timeout=120)
        pool.shutdown(wait=False)
    assert result.code == 0, result.out + result.err
    assert first.done() and second.done(), "an instance life did not end within 120 s of the drill"
    assert first.result().outcome == "preempted" and second.result().outcome == "completed"
    lines = result.out
    assert "drill started: FIS experiment" in lines
    for milestone in ("spot interruption notice reaches", "confirmed in S3", "resumes: training from step"):
        assert milestone in lines, milestone
    assert "steps lost" in lines and "PASS steps lost = 0" in lines and "FAIL" not in lines

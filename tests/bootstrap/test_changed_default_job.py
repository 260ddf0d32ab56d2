"""A changed default job is a new job (issue 33, item 5): a `pulumi up` with another training config gives
the stack another default job, and that job starts at step 0, never from the previous job's checkpoint (in S3
or on the instance's scratch disk), unless `trainstack:resumeFrom` names the previous job.

The user's path, end to end: the Pulumi program under mocks (tests/infra/program.py) gives each `pulumi up`'s
objects in the bucket (the job's record and queue entry) and its agent config (the launch template's
user-data); the real in-process agent with the fake trainer runs them against moto. The first job trains to a
checkpoint and is stopped (`trainstack stop`), the config changes, `pulumi up` replaces the default job (the
engine deletes the old job's queue entry: it is not retained), then `trainstack resume` brings an instance
back: on the same scratch disk or a fresh one, it must run the new job from step 0.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from bootstrap.agent import Lives
from bootstrap.cloud_init import AGENT_CONFIG_PATH
from bootstrap.eventlog import EventLog
from bootstrap.imds import ImdsClient
from bootstrap.jobbinding import bind_job
from bootstrap.lifecycle import InstanceLife, LifeResult
from demo.imds import ImdsSimulator, SimulatedInstance
from demo.stack import LocalStack
from tests.bootstrap.conftest import FAKE_TRAINER, upload_dataset
from tests.infra.program import StackRun, example_config, run_stack
from trainstack_job.queue import SOURCE_PULUMI, job_record, queue_entry, queue_key

OBJECT = "aws:s3/bucketObjectv2:BucketObjectv2"
TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
# The first job holds at step 10 (a committed checkpoint) until it is stopped: however fast the machine, it
# is stopped there, mid-job, with step 10 confirmed in S3.
FIRST = {"steps": 30, "step_seconds": 0.02, "checkpoint_every": 5, "hold_at_step": 10, "log_steps": True}
STOP_STEP = 10
SECOND = {"steps": 16, "step_seconds": 0.02, "checkpoint_every": 4, "log_steps": True}
NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)


@dataclass(frozen=True)
class Up:
    """What one `pulumi up` wrote for the stack's default job, and the agent config its template carries."""

    job_id: str
    record: tuple[str, dict[str, Any]]
    entry: tuple[str, str]
    entry_name: str
    entry_retained: bool
    agent: dict[str, Any]


def _up(run: StackRun) -> Up:
    objects = {r.name.rsplit("-", 1)[1]: r for r in run.of_type(OBJECT) if r.parent == "default-job"}
    record, entry = objects["record"], objects["entry"]
    document = yaml.safe_load(base64.b64decode(run.one(TEMPLATE).inputs["userData"]).decode())
    (agent,) = [f for f in document["write_files"] if f["path"] == AGENT_CONFIG_PATH]
    return Up(
        job_id=run.outputs["job_id"],
        record=(record.inputs["key"], json.loads(record.inputs["content"])),
        entry=(entry.inputs["key"], entry.inputs["content"]),
        entry_name=entry.name,
        entry_retained=entry.retain_on_delete,
        agent=dict(yaml.safe_load(agent["content"])),
    )


@pytest.fixture(scope="module")
def ups(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Up]:
    """Three `pulumi up`s of the example stack: its training config, the same config with another learning
    rate (the next experiment), and that one again starting from the first job (`resumeFrom`)."""
    config = example_config()
    trainer = yaml.safe_load(Path(config["trainstack:trainingConfig"]).read_text())
    tuned = tmp_path_factory.mktemp("configs") / "default.yaml"  # the same name: only the definition differs
    tuned.write_text(yaml.safe_dump({**trainer, "train": {**trainer["train"], "lr": 0.0123}}))
    first = _up(run_stack(config))
    changed = {**config, "trainstack:trainingConfig": str(tuned)}
    return {
        "first": first,
        "second": _up(run_stack(changed)),
        "resumed": _up(run_stack({**changed, "trainstack:resumeFrom": first.job_id})),
    }


@dataclass
class Instance:
    """One instance life (several, with a queue) of the in-process agent, and what its trainer printed."""

    life: InstanceLife
    events: io.StringIO
    steps: list[int] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    result: LifeResult | None = None
    thread: threading.Thread | None = None

    def start(self) -> Instance:
        def run() -> None:
            self.result = Lives(self.life).run()

        self.thread = threading.Thread(target=run, name="agent", daemon=True)
        self.thread.start()
        return self

    def join(self, timeout: float) -> LifeResult:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the agent did not end within {timeout} s"
        assert self.result is not None
        return self.result

    def said(self, part: str) -> list[dict[str, Any]]:
        return [e for e in map(json.loads, self.events.getvalue().splitlines()) if part in e["message"]]


@pytest.fixture()
def boot(stack: LocalStack) -> Iterator[Callable[[Up, Path], Instance]]:
    """An instance of the group booting from an up's launch template, with `scratch` as its scratch disk."""
    upload_dataset(stack)
    simulators: list[ImdsSimulator] = []

    def build(up: Up, scratch: Path) -> Instance:
        (instance_id,) = stack.instance_ids()
        imds = ImdsSimulator(
            SimulatedInstance(instance_id=instance_id), lifecycle_state=stack.lifecycle_state
        )
        simulators.append(imds.start())
        # The job fields as the template renders them (no job: the agent takes the queue's), bucket and
        # group the local stack's.
        job = {
            k: up.agent[k]
            for k in ("job_id", "job", "user_job", "resume_from", "bundle_key", "bundle_sha256")
        }
        events = io.StringIO()
        life = InstanceLife(
            stack.agent_config(poll_seconds=0.2, scratch_dir=str(scratch), **job),
            log=EventLog(stream=events),
            imds=ImdsClient(imds.endpoint),
            trainer_command=FAKE_TRAINER,
            identity_wait_seconds=2,
            release_wait_seconds=0,
            state_poll_seconds=0.5,
            tick_seconds=0.1,
        )
        instance = Instance(life, events)

        def sink(line: str) -> None:
            instance.lines.append(line)
            value = json.loads(line) if line.startswith("{") else None
            if isinstance(value, dict) and value.get("event") == "step":
                instance.steps.append(int(value["step"]))

        life.trainer_log_sink = lambda: sink  # type: ignore[method-assign]
        return instance

    yield build
    for simulator in simulators:
        simulator.stop()


def pulumi_up(stack: LocalStack, up: Up, fake: dict[str, Any], replaces: Up | None = None) -> None:
    """What the engine does to the bucket for `up`: the replaced job's entry goes (declared no more, not
    retained), then the new record and entry; the record's trainer config also steers the fake trainer (a
    section the real trainer never reads)."""
    s3 = stack.client("s3")
    if replaces is not None:
        assert replaces.job_id != up.job_id, "another training config is another job"
        assert not replaces.entry_retained and replaces.entry_name != up.entry_name
        s3.delete_object(Bucket=stack.bucket, Key=replaces.entry[0])
    key, record = up.record
    record = {**record, "agent": {**record["agent"], "job": {**record["agent"]["job"], "fake": fake}}}
    s3.put_object(Bucket=stack.bucket, Key=key, Body=json.dumps(record).encode())
    s3.put_object(Bucket=stack.bucket, Key=up.entry[0], Body=up.entry[1].encode())


def train_first_job_and_stop_it(
    stack: LocalStack, boot: Callable[[Up, Path], Instance], up: Up, scratch: Path
) -> None:
    """The first job trains to a confirmed checkpoint; `trainstack stop` ends it there (`stopped`)."""
    pulumi_up(stack, up, FIRST)
    first = boot(up, scratch).start()
    deadline = time.monotonic() + 30
    while STOP_STEP not in first.steps:
        assert time.monotonic() < deadline, (
            f"the first job never reached step {STOP_STEP}: {first.events.getvalue()[-3000:]}"
        )
        time.sleep(0.05)
    control = f"jobs/{up.job_id}/state/control.json"
    stack.client("s3").put_object(
        Bucket=stack.bucket, Key=control, Body=json.dumps({"action": "stop"}).encode()
    )
    assert first.join(timeout=60).outcome == "stopped"
    assert _latest(stack, up.job_id) == STOP_STEP
    assert (scratch / "checkpoints" / f"step-{STOP_STEP}").is_dir(), "the first job's step is on the disk"


def trainstack_resume(stack: LocalStack, up: Up) -> None:
    """`trainstack resume`: the stop request withdrawn, the group back to one instance."""
    stack.client("s3").delete_object(Bucket=stack.bucket, Key=f"jobs/{up.job_id}/state/control.json")
    stack.client("autoscaling").set_desired_capacity(AutoScalingGroupName=stack.group_name, DesiredCapacity=1)


def _latest(stack: LocalStack, job_id: str) -> int | None:
    latest = stack.read_json(f"jobs/{job_id}/checkpoints/latest.json")
    return None if latest is None else int(latest["step"])


def _status(stack: LocalStack, job_id: str) -> str:
    ledger = stack.read_json(f"jobs/{job_id}/state/ledger.json")
    assert ledger is not None
    return str(ledger["status"])


@pytest.mark.parametrize("disk", ["same scratch disk", "fresh scratch disk"])
def test_a_changed_default_job_starts_at_step_zero_not_from_the_previous_jobs_checkpoint(
    stack: LocalStack, boot: Callable[[Up, Path], Instance], ups: dict[str, Up], tmp_path: Path, disk: str
) -> None:
    first, second = ups["first"], ups["second"]
    assert second.agent["job_id"] == "" and second.agent["resume_from"] is None, "the template holds no job"
    scratch = tmp_path / "scratch"
    train_first_job_and_stop_it(stack, boot, first, scratch)

    pulumi_up(stack, second, SECOND, replaces=first)
    trainstack_resume(stack, first)
    instance = boot(second, scratch if disk == "same scratch disk" else tmp_path / "fresh")
    assert instance.start().join(timeout=60).outcome == "completed"

    (bound, *_) = instance.said("job bound")
    assert (bound["job_id"], bound.get("previous_job")) == (second.job_id, first.job_id), (
        "the replaced default job was resumed instead of the new one"
    )
    assert instance.steps[0] == 1, f"the new job started at step {instance.steps[0] - 1}, not 0"
    assert not any('"resumed"' in line for line in instance.lines), instance.lines[:3]
    assert not instance.said("using the checkpoint already on this instance")
    assert (_latest(stack, second.job_id), _status(stack, second.job_id)) == (SECOND["steps"], "completed")
    # The first job is left as it was stopped: its checkpoint, its status.
    assert (_latest(stack, first.job_id), _status(stack, first.job_id)) == (STOP_STEP, "stopped")


def test_a_changed_default_job_with_resume_from_starts_from_the_previous_jobs_checkpoint(
    stack: LocalStack, boot: Callable[[Up, Path], Instance], ups: dict[str, Up], tmp_path: Path
) -> None:
    first, resumed = ups["first"], ups["resumed"]
    assert resumed.job_id not in (first.job_id, ups["second"].job_id), "resumeFrom is part of the definition"
    assert resumed.record[1]["agent"]["resume_from"] == first.job_id
    train_first_job_and_stop_it(stack, boot, first, tmp_path / "scratch")

    pulumi_up(stack, resumed, SECOND, replaces=first)
    trainstack_resume(stack, first)
    instance = boot(resumed, tmp_path / "fresh")
    assert instance.start().join(timeout=60).outcome == "completed"

    assert instance.said("job bound")[0]["job_id"] == resumed.job_id
    (start,) = instance.said("new job: starting from job")
    assert (start["resume_from"], start["step"]) == (first.job_id, STOP_STEP)
    assert instance.steps[0] == STOP_STEP + 1
    # Its own steps go under its own prefix; the first job's stay as they were.
    assert (_latest(stack, resumed.job_id), _latest(stack, first.job_id)) == (SECOND["steps"], STOP_STEP)


def test_a_stopped_job_still_queued_is_resumed_and_a_replaced_one_is_not_queued_again(
    stack: LocalStack,
) -> None:
    """`trainstack resume` goes on with a stopped job while it is still queued (same definition, another
    stack setting); once `pulumi up` replaced it (its entry deleted), nothing brings it back into the queue:
    not the agent re-executed with its pinned code (a config that defines it), which would make it resumed."""
    s3 = stack.client("s3")
    old, new = "default-11111111", "default-22222222"
    for job_id in (old, new):
        agent = {"job_id": job_id, "job_name": "default", "job": {"model": job_id}, "resume_from": None}
        record = job_record(
            job_id=job_id,
            name="default",
            agent=agent,
            submitted_at="2026-12-01T11:00:00Z",
            source=SOURCE_PULUMI,
        )
        s3.put_object(Bucket=stack.bucket, Key=f"jobs/{job_id}/job.json", Body=json.dumps(record).encode())
    s3.put_object(
        Bucket=stack.bucket,
        Key=queue_key(old),
        Body=json.dumps(queue_entry(old, "2026-12-01T11:00:00Z")).encode(),
    )
    no_job = stack.agent_config(job_id="")
    assert (binding := bind_job(s3, no_job, NOW)) is not None and binding.job_id == old
    s3.put_object(
        Bucket=stack.bucket,
        Key=f"jobs/{old}/state/ledger.json",
        Body=json.dumps({"status": "stopped", "lives": []}).encode(),
    )
    # Still the stack's default job: resumed.
    assert (binding := bind_job(s3, no_job, NOW)) is not None and binding.job_id == old
    # Replaced: the new job runs, and the old one's pinned re-execution does not queue it again.
    s3.delete_object(Bucket=stack.bucket, Key=queue_key(old))
    pinned = stack.agent_config(job_id=old, job_name="default", job={"model": old})
    s3.put_object(
        Bucket=stack.bucket,
        Key=queue_key(new),
        Body=json.dumps(queue_entry(new, "2026-12-01T12:00:00Z")).encode(),
    )
    assert (binding := bind_job(s3, pinned, NOW)) is not None
    assert (binding.job_id, binding.switched_from) == (new, old)
    assert stack.read_json(queue_key(old)) is None

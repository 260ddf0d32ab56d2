"""`python -m demo --rebalance`: a hand-over as capacity rebalancing makes one, with one writer at all times.

Instance 1 trains; a rebalance recommendation reaches its IMDS; the group launches instance 2 *before* it lets
instance 1 go (what AWS does with CapacityRebalance: the desired capacity stays 1, the group briefly holds
two instances). Instance 2 finds the job's lease held and waits as the warm standby, its trainer gated;
instance 1 sees a ready standby, stops at a step boundary, confirms its checkpoint, releases the lease and
terminates itself through the group; instance 2 takes the lease, restores that step, opens its gate and
finishes; the group scales to zero (docs/internals.md, "Jobs, the lease and the standby").

Each simulated instance is what the single-node demo boots (demo/instance.py): the rendered user-data, the
bundle verified and unpacked, the real agent as a subprocess. Here the two run at once, each with its own
IMDS simulator and scratch folder. What the story needs to prove one writer at a time is recorded as it
happens (every trained step from each trainer's own log line, the lease as S3 holds it) or read from S3 at the
end (every version of every object under the job's checkpoints prefix: the bucket is versioned).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from demo.environment import (
    JOB_CONFIG,
    MODEL,
    trainer_config,
    upload_bundle,
    upload_dataset,
    write_demo_dataset,
    write_user_data,
)
from demo.imds import ImdsSimulator, SimulatedInstance
from demo.instance import (
    AgentEcho,
    AgentRun,
    agent_config_from_user_data,
    boot_agent,
    install_bundle,
    kill_running,
)
from demo.run import ISOLATED_ENV
from demo.stack import LocalStack, create_stack
from infra.jobdef import define_job
from trainstack_job.jobs import LEASE, JobPrefixes

HOLDER = "instance-1"
STANDBY = "instance-2"
# Instance 1 must still be training when instance 2 has booted, synced the data and warmed its gated trainer
# (about 7 s on a quiet 2-core machine, 12-17 s on a loaded one, where instance 1's steps slow down alike: the
# two share the cores); the at-risk holder then hands over within a second of the standby being ready, and
# instance 2 must still have steps to train after it. The small model's step takes about half resnet18's wall
# time, so instance 1 trains about twice as many steps beside the warming standby: of 144 steps (36 epochs
# of 4) it handed over at step 60 on a loaded 2-core machine, 84 left (resnet18 left 45-55 of 96).
EPOCHS = 36
# Periodic checkpoints beside the one on the recommendation, the hand-over's and the last one: each version
# stays in the versioned bucket (in the moto process's memory), and the small model's is 3 MB.
CHECKPOINT_EVERY_STEPS = 32
# Every step in the trainer's log, stamped on arrival: the two trainers' step timelines the checks compare.
LOG_EVERY_STEPS = 1
# The recommendation comes once instance 1 trains (its first steps reported): the rest of the run is the
# time the replacement has to boot and warm up beside it.
REBALANCE_AFTER_STEP = 3
STORY_TIMEOUT_S = 300
VERSIONS_FILE = "checkpoint-versions.json"
POLL_S = 0.2
# How often the demo reads lease.json itself (a second witness beside the agents' own events).
LEASE_POLL_S = 0.5

STEP_LINE = re.compile(r"epoch \d+/\d+ step (\d+)/(\d+)")
STOPPED_LINE = re.compile(r"stopped at step (\d+)")
RESUMING_LINE = re.compile(r"resuming at step (\d+)")
WARM_LINE = re.compile(r"standby: warm \(.*\) in ([\d.]+)s")
GATE_LINE = re.compile(r"standby: start gate opened after ([\d.]+)s")
COMPLETE_LINE = re.compile(r"training complete: (\d+) steps")

# The agent's events the story is told by: (stage, a part of the message). docs/internals.md names them.
JOB_BOUND = ("job", "job bound")
LEASE_ACQUIRED = ("lease", "lease acquired")
LEASE_RELEASED = ("lease", "lease released")
LEASE_TAKEN_OVER = ("lease", "lease taken over")
STANDBY_WAITING = ("standby", "waiting warm")
STANDBY_READY = ("standby", "standby ready")
REBALANCE_SEEN = ("rebalance", "rebalance recommendation")
HANDOVER = ("handover", "standby is ready")
LEFT_GROUP = ("fleet", "left the group")
TRAINER_STOPPED = ("stop", "trainer stopped")
LIFE_END = ("end", "")


@dataclass
class Life:
    """One simulated instance: what it is, when it booted, when its agent exited and with what."""

    name: str
    instance_id: str
    instance_type: str
    az: str
    booted_at: float
    exited_at: float = 0.0
    exit_code: int | None = None


@dataclass(frozen=True)
class AgentEvent:
    time: float
    instance: str
    stage: str
    message: str
    fields: dict[str, Any]

    def matches(self, what: tuple[str, str]) -> bool:
        stage, part = what
        return self.stage == stage and part in self.message


@dataclass(frozen=True)
class TrainerLine:
    time: float
    instance: str
    line: str


@dataclass(frozen=True)
class StepSeen:
    """A step a trainer trained, from its own log line (log_every_steps=1), stamped when the line arrived."""

    time: float
    instance: str
    step: int


@dataclass(frozen=True)
class LeaseSeen:
    """lease.json as the demo read it from S3 (each change once)."""

    time: float
    holder: str  # the instance id; "" when there is no lease
    token: int | None
    released: bool
    stop_step: int | None


@dataclass(frozen=True)
class ObjectVersion:
    """One version of one object under the job's checkpoints prefix (a delete marker too)."""

    key: str  # relative to the checkpoints prefix: "step-16/model.pt", "latest.json"
    version_id: str
    written_at: float  # epoch seconds, whole seconds as S3 lists them (moto runs on this machine's clock)
    delete_marker: bool = False
    etag: str = ""  # equal for equal bytes uploaded the same way: a re-upload of one file, not new content


@dataclass(frozen=True)
class LatestVersion:
    """One version of latest.json, oldest first: the step (and the lease token) it named."""

    written_at: float
    step: int | None
    token: int | None


@dataclass
class GroupSeen:
    """The group at one moment of the story."""

    time: float
    desired: int
    instances: list[str]


@dataclass
class RebalanceResult:
    """Everything the rebalance timeline and checks need."""

    started: float
    workdir: Path
    bucket: str = ""
    job_id: str = ""
    checkpoints_prefix: str = ""
    user_data_bytes: int = 0
    user_data_valid: str = ""
    lives: list[Life] = field(default_factory=list)
    events: list[AgentEvent] = field(default_factory=list)
    lines: list[TrainerLine] = field(default_factory=list)
    steps: list[StepSeen] = field(default_factory=list)
    leases: list[LeaseSeen] = field(default_factory=list)
    total_steps: int = 0
    rebalance_at: float = 0.0
    rebalance_step: int = 0  # the newest step instance 1's trainer had logged when the recommendation came
    replacement_launched_at: float = 0.0
    # The group right after the replacement launched, and once instance 1's agent had exited.
    group_with_both: GroupSeen | None = None
    group_after_holder: GroupSeen | None = None
    versions: list[ObjectVersion] = field(default_factory=list)
    latest_history: list[LatestVersion] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    artifacts: list[str] = field(default_factory=list)
    desired_capacity: int | None = None
    group_instances: list[str] = field(default_factory=list)
    ec2_states: dict[str, str] = field(default_factory=dict)
    alerts: list[dict[str, str]] = field(default_factory=list)
    ledger: dict[str, Any] = field(default_factory=dict)

    def life(self, name: str) -> Life | None:
        return next((life for life in self.lives if life.name == name), None)

    def find(self, instance: str, what: tuple[str, str]) -> AgentEvent | None:
        return next((e for e in self.events if e.instance == instance and e.matches(what)), None)

    def trained(self, instance: str) -> list[StepSeen]:
        return [s for s in self.steps if s.instance == instance]

    def line(self, instance: str, pattern: re.Pattern[str]) -> tuple[float, re.Match[str]] | None:
        for entry in self.lines:
            if entry.instance == instance:
                found = pattern.search(entry.line)
                if found:
                    return entry.time, found
        return None


@dataclass
class _Instance:
    """A running simulated instance: its IMDS, its agent, its scratch folder."""

    life: Life
    imds: ImdsSimulator
    run: AgentRun
    lines_read: int = 0


def _epoch(moment: Any) -> float:
    return moment.timestamp() if isinstance(moment, datetime) else float(moment)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class RebalanceDemo:
    """Runs the rebalance story; prints each agent's stages and trainer lines as they happen."""

    def __init__(self, workdir: Path, console: Console) -> None:
        self.workdir = workdir
        self.console = console
        self.result = RebalanceResult(started=time.time(), workdir=workdir)
        self._echo = AgentEcho(console, self.result.started)
        self._instances: list[_Instance] = []
        self._lease_key = ""
        self._lease_polled = 0.0

    # -- output -------------------------------------------------------------------------------------

    # -- the story ----------------------------------------------------------------------------------

    def run(self) -> RebalanceResult:
        result = self.result
        stack = create_stack("trainstack-demo")
        result.bucket = stack.bucket
        self.console.print(
            f"[bold]stack[/] bucket s3://{stack.bucket} (SSE-KMS, versioned), topic, log group, "
            f"group {stack.group_name} (desired 1, capacity rebalancing on)"
        )
        count = upload_dataset(stack, write_demo_dataset(self.workdir))
        self.console.print(f"[bold]dataset[/] {count} generated images uploaded to s3://{stack.bucket}/data/")

        bundle = upload_bundle(stack)
        job = trainer_config(EPOCHS, log_every_steps=LOG_EVERY_STEPS)
        job["checkpoint"]["every_steps"] = CHECKPOINT_EVERY_STEPS
        # As `pulumi up` defines it: the job's id names its prefix (jobs/<id>/), where its lease lives.
        definition = define_job(trainer_config=job, training_config_path=JOB_CONFIG)
        result.job_id = definition.job_id
        prefixes = JobPrefixes.of(definition.job_id)
        result.checkpoints_prefix = prefixes.checkpoints
        self._lease_key = prefixes.state + LEASE
        config = stack.agent_config(
            job=job,
            stall_minutes=5.0,
            job_id=definition.job_id,
            job_name=definition.name,
            bundle_key=bundle.key(),
            bundle_sha256=bundle.sha256,
        )
        written = write_user_data(self.workdir, config, bundle)
        user_data = written.text
        result.user_data_bytes, result.user_data_valid = written.size, written.valid
        self.console.print(
            f"[bold]user-data[/] {written.path} ({result.user_data_bytes} bytes, {result.user_data_valid}); "
            f"job {definition.job_id}, {MODEL}, {EPOCHS} epochs"
        )

        boot = (stack, user_data, bundle.key(), bundle.sha256)
        try:
            first = stack.instance_ids()[0]
            self._boot(HOLDER, first, "g6.xlarge", "us-east-1a", *boot)
            self._watch(stack, boot)
        except BaseException:
            kill_running(instance.run for instance in self._instances)
            raise
        finally:
            for instance in self._instances:
                instance.imds.stop()
        time.sleep(0.3)  # let the output pumps drain the last lines
        self._collect()
        self._read_end_state(stack, prefixes)
        return result

    def _boot(
        self,
        name: str,
        instance_id: str,
        instance_type: str,
        az: str,
        stack: LocalStack,
        user_data: str,
        bundle_key: str,
        sha256: str,
    ) -> None:
        """One simulated instance: its own IMDS and scratch, the bundle unpacked, its agent started."""
        root = self.workdir / name
        imds = ImdsSimulator(
            SimulatedInstance(instance_id=instance_id, instance_type=instance_type, availability_zone=az),
            # Asks the group: once instance 1 has terminated itself through it, its IMDS says Terminated.
            lifecycle_state=stack.lifecycle_state,
        ).start()
        env = {
            **ISOLATED_ENV,
            "AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"],
            "AWS_EC2_METADATA_SERVICE_ENDPOINT": imds.endpoint,
        }
        if "OMP_NUM_THREADS" not in os.environ:
            # Two simulated instances share this machine's cores: each trainer gets its half, not all of them.
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // 2))
        code_root = install_bundle(
            stack.client("s3"), stack.bucket, bundle_key, sha256, root / "opt-trainstack"
        )
        config = agent_config_from_user_data(user_data, root / "scratch", poll_seconds=1.0)
        life = Life(name, instance_id, instance_type, az, booted_at=time.time())
        self.console.print(
            f"[bold]{name}[/] boots as {instance_id} ({instance_type}, {az}; IMDS {imds.endpoint}): "
            f"bundle verified and unpacked to {code_root}"
        )
        run = boot_agent(name, code_root, config, env, self._echo.event, self._echo.trainer)
        self.result.lives.append(life)
        self._instances.append(_Instance(life, imds, run))

    def _watch(self, stack: LocalStack, boot: tuple[LocalStack, str, str, str]) -> None:
        """Until every agent has exited: read each trainer's steps and the lease, then `_event` each round."""
        deadline = time.monotonic() + STORY_TIMEOUT_S
        while any(i.life.exit_code is None for i in self._instances):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the agents did not all finish within {STORY_TIMEOUT_S}s")
            for instance in self._instances:
                self._read_steps(instance)
                if instance.life.exit_code is None and instance.run.process.poll() is not None:
                    self._exited(instance, stack)
            self._poll_lease(stack)
            self._event(stack, boot)
            time.sleep(POLL_S)

    def _event(self, stack: LocalStack, boot: tuple[LocalStack, str, str, str]) -> None:
        """The recommendation once instance 1 trains, and the replacement the group launches for it."""
        result = self.result
        holder = self._instances[0]
        trained = [s.step for s in result.steps if s.instance == HOLDER]
        if (
            not result.rebalance_at
            and holder.life.exit_code is None
            and trained
            and max(trained) >= REBALANCE_AFTER_STEP
        ):
            self._rebalance(holder, stack, boot)

    def _read_steps(self, instance: _Instance) -> None:
        """The trainer lines that arrived since the last read: each trained step, with its arrival time."""
        lines = instance.run.trainer_lines
        for moment, line in lines[instance.lines_read : len(lines)]:
            found = STEP_LINE.search(line)
            if found:
                self.result.steps.append(StepSeen(moment, instance.life.name, int(found.group(1))))
                self.result.total_steps = int(found.group(2))
            instance.lines_read += 1

    def _exited(self, instance: _Instance, stack: LocalStack) -> None:
        life = instance.life
        life.exit_code = instance.run.process.wait()
        life.exited_at = time.time()
        self.console.print(f"[bold]{life.name}[/] agent exited with {life.exit_code}")
        if life.name == HOLDER:
            # The simulated instance is gone: its IMDS answers no more (the group already said Terminated).
            instance.imds.stop()
            group = stack.group()
            self.result.group_after_holder = GroupSeen(
                time.time(), int(group["DesiredCapacity"]), [i["InstanceId"] for i in group["Instances"]]
            )

    def _rebalance(
        self, holder: _Instance, stack: LocalStack, boot: tuple[LocalStack, str, str, str]
    ) -> None:
        result = self.result
        result.rebalance_at = time.time()
        result.rebalance_step = max(s.step for s in result.steps if s.instance == HOLDER)
        holder.imds.inject_rebalance()
        self.console.print(
            f"[bold red]>>> rebalance recommendation injected into {HOLDER}'s IMDS "
            f"(its trainer last logged step {result.rebalance_step}/{result.total_steps}); the group "
            "launches a replacement before it lets instance 1 go[/]",
            highlight=False,
        )
        replacement = launch_replacement(stack)
        result.replacement_launched_at = time.time()
        group = stack.group()
        result.group_with_both = GroupSeen(
            time.time(), int(group["DesiredCapacity"]), [i["InstanceId"] for i in group["Instances"]]
        )
        self._boot(STANDBY, replacement, "g5.xlarge", "us-east-1b", *boot)

    def _poll_lease(self, stack: LocalStack) -> None:
        now = time.monotonic()
        if now - self._lease_polled < LEASE_POLL_S:
            return
        self._lease_polled = now
        raw = stack.read_json(self._lease_key) or {}
        seen = LeaseSeen(
            time.time(),
            str(raw.get("holder") or ""),
            _int(raw.get("token")),
            raw.get("released_at") is not None,
            _int(raw.get("stop_step")),
        )
        last = self.result.leases[-1] if self.result.leases else None
        if last is None or (last.holder, last.token, last.released, last.stop_step) != (
            seen.holder,
            seen.token,
            seen.released,
            seen.stop_step,
        ):
            self.result.leases.append(seen)

    # -- what happened ------------------------------------------------------------------------------

    def _collect(self) -> None:
        result = self.result
        for instance in self._instances:
            self._read_steps(instance)
            result.events += [
                AgentEvent(t, instance.life.name, str(e.get("stage")), str(e.get("message")), e)
                for t, e in instance.run.events
            ]
            result.lines += [
                TrainerLine(t, instance.life.name, line) for t, line in instance.run.trainer_lines
            ]
        result.events.sort(key=lambda e: e.time)
        result.lines.sort(key=lambda x: x.time)
        result.steps.sort(key=lambda s: s.time)

    def _read_end_state(self, stack: LocalStack, prefixes: JobPrefixes) -> None:
        result = self.result
        s3 = stack.client("s3")
        result.versions = checkpoint_versions(s3, stack.bucket, prefixes.checkpoints)
        # Kept beside the timeline: what the step-folder check judged, for whoever reads a failed run.
        (self.workdir / VERSIONS_FILE).write_text(
            json.dumps([dataclasses.asdict(v) for v in result.versions], indent=1) + "\n"
        )
        result.latest_history = latest_history(s3, stack.bucket, prefixes.checkpoints, result.versions)
        listing = s3.list_objects_v2(Bucket=stack.bucket, Prefix=prefixes.results).get("Contents", [])
        result.artifacts = [f"s3://{stack.bucket}/{obj['Key']}" for obj in listing]
        result.metrics = stack.read_json(prefixes.results + "metrics.json") or {}
        result.ledger = stack.read_json(prefixes.state + "ledger.json") or {}
        group = stack.group()
        result.desired_capacity = int(group["DesiredCapacity"])
        result.group_instances = [i["InstanceId"] for i in group["Instances"]]
        ids = [life.instance_id for life in result.lives]
        reservations = stack.client("ec2").describe_instances(InstanceIds=ids)["Reservations"]
        result.ec2_states = {
            i["InstanceId"]: i["State"]["Name"] for r in reservations for i in r["Instances"]
        }
        result.alerts = stack.alerts()


def launch_replacement(stack: LocalStack) -> str:
    """Capacity rebalancing's first half: the group launches a replacement and keeps the at-risk instance.

    AWS does this without changing the desired capacity (the group holds desired + 1 until the old instance
    goes). moto has no capacity rebalancing, and none of its calls can make that state: attaching an instance
    raises the desired capacity, and raising it then lowering it terminates the group's oldest instance. moto
    runs in this process (demo/moto_server.py), so the demo asks the group's own launch routine, the one
    moto uses for every instance it launches, for one more instance."""
    from moto.autoscaling.models import autoscaling_backends
    from moto.core import DEFAULT_ACCOUNT_ID

    group = autoscaling_backends[DEFAULT_ACCOUNT_ID][stack.region].autoscaling_groups[stack.group_name]
    before = {state.instance.id for state in group.instance_states}
    group.replace_autoscaling_group_instances(1, group.get_propagated_tags())
    launched = [state.instance.id for state in group.instance_states if state.instance.id not in before]
    if len(launched) != 1:
        raise RuntimeError(f"the group launched {len(launched)} replacement instances, not 1")
    return str(launched[0])


def checkpoint_versions(s3: Any, bucket: str, prefix: str) -> list[ObjectVersion]:
    """Every version (and delete marker) under `prefix`, oldest first per key."""
    found: list[tuple[float, int, ObjectVersion]] = []
    index = 0
    for page in s3.get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=prefix):
        for kind, marker in (("Versions", False), ("DeleteMarkers", True)):
            for entry in page.get(kind, []):
                version = ObjectVersion(
                    entry["Key"][len(prefix) :],
                    str(entry.get("VersionId")),
                    _epoch(entry["LastModified"]),
                    delete_marker=marker,
                    etag=str(entry.get("ETag") or ""),
                )
                # S3 lists a key's versions newest first: that order breaks ties of LastModified.
                found.append((version.written_at, -index, version))
                index += 1
    return [version for *_, version in sorted(found, key=lambda x: (x[2].key, x[0], x[1]))]


def latest_history(s3: Any, bucket: str, prefix: str, versions: list[ObjectVersion]) -> list[LatestVersion]:
    """What each version of latest.json said, oldest first."""
    history: list[LatestVersion] = []
    for version in versions:
        if version.key != "latest.json" or version.delete_marker:
            continue
        body = s3.get_object(Bucket=bucket, Key=prefix + version.key, VersionId=version.version_id)["Body"]
        try:
            raw = json.loads(body.read())
        except ValueError:
            raw = {}
        history.append(LatestVersion(version.written_at, _int(raw.get("step")), _int(raw.get("token"))))
    return history

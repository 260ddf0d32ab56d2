"""`python -m demo --parallel`: several jobs at once, each on the pool that serves it, through a spot notice.

The stack declares two pools (`trainstack:pools`, each its own Auto Scaling group, rendered as `pulumi up`
would: infra/config/ parses the pools, infra/fleet.py `agent_config` renders each pool's agent config):

- `default`: g6.xlarge (an L4), `maxJobs: 2`, `maxInstances: 1`: two one-instance jobs train at once, each
  in its own lane, each with one writer (its lease); its group's maximum is 2 x (1 + 1) = 4;
- `big`: g6e.xlarge (an L40S, 48 GiB), one job at a time: the only pool with that GPU.

A 4-point sweep of the built-in trainer (`trainstack run --config ... --sweep train.lr=...`, the CLI's own
code in this process) is matched to `default`: two points train at once, two wait in the queue for a lane.
A job asking for `--gpus L40S:1` is matched to `big`, whose group wakes for it alone. A spot notice reaches
the instance of one running point: it stops at a step boundary with its checkpoint confirmed, the group
launches a replacement, which resumes that point from the confirmed step while the other point trains on.
Each instance whose job ends takes the next waiting point without a reboot, or leaves its group (one instance
fewer wanted); each pool is at zero at the end. The holder of a lease is protected from scale-in throughout.

Each simulated instance is what the other stories boot (demo/instance.py): its pool's rendered user-data,
the bundle verified and unpacked, the real agent as a subprocess with its own simulated IMDS. The demo boots
an instance as soon as a group launches one. The groups' members and their scale-in protection, each agent's
events and each trainer's step lines are recorded as they happen; the ledgers and the groups are read at the
end (demo/report_parallel.py judges them). Not shown yet: why each waiting job waits (`trainstack jobs`
shows no waiting reasons yet).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.markup import escape

from bootstrap.cloud_init import render_user_data
from demo.environment import (
    REPO,
    one_torch_thread,
    trainer_config,
    upload_bundle,
    validate_user_data,
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
from demo.stack import STAND_IN_AMI, LocalStack, create_stack
from infra.config import Pool, StackConfig, read_stack_config
from trainstack_job.contract import LEDGER
from trainstack_job.jobs import JobPrefixes

STACK = "trainstack-demo"  # <project>-<stack>: the pools' groups are trainstack-demo-gpu[-<pool>]
PROJECT, CLI_STACK = "trainstack", "demo"
DEFAULT_POOL, BIG_POOL = "default", "big"
POOLS: list[dict[str, Any]] = [
    {"name": DEFAULT_POOL, "instanceTypes": ["g6.xlarge"], "maxInstances": 1, "maxJobs": 2},
    {"name": BIG_POOL, "instanceTypes": ["g6e.xlarge"], "maxInstances": 1},
]
ZONES = ("us-east-1a", "us-east-1b")
BIG_GPUS = "L40S:1"  # bootstrap/devices.py: only g6e has an L40S
SWEEP = ("train.lr", ("0.02", "0.01", "0.005", "0.002"))
# Small data: 4 classes of 32 px shapes, 16 training and 4 validation images each (80 files each instance
# syncs from moto); tiny.yaml's global batch of 32 makes 2 steps an epoch.
TRAIN_PER_CLASS, VAL_PER_CLASS, CLASSES = 16, 4, 4
STEPS_PER_EPOCH = CLASSES * TRAIN_PER_CLASS // 32
# Each point: 24 steps (0.2-0.3 s each on a loaded 2-core machine, 3 trainers sharing it; a trainer's start
# and end take 10-15 s more there, and one of the two first points may start 5 s after the other). The
# notice comes once a point has logged NOTICE_FROM and the other point steps too: 21 steps or fewer are
# left, against the ~1-3 steps from the notice to the stop at a step boundary (the demo reads the steps every
# POLL_S, the agent its IMDS every AGENT_POLL_S). The other point trains on throughout the replacement's boot
# and start (10 s and more).
SWEEP_EPOCHS = 12
NOTICE_FROM = 3
# Where the other point's trainer is slower to start, the notice waits for its first step, but no later than
# this many steps before the end of the interrupted one (its replacement's boot and start, 10 s and more, is
# then the time the other point trains on alone).
NOTICE_LATEST_LEFT = 8
BIG_EPOCHS = 4
AGENT_POLL_S = 0.5
POLL_S = 0.25
STORY_TIMEOUT_S = 300

STEP_LINE = re.compile(r"epoch \d+/\d+ step (\d+)/(\d+)")
RESUMING_LINE = re.compile(r"resuming at step (\d+)")


@dataclass(frozen=True)
class StepSeen:
    """A step a trainer trained (its own log line), stamped when the line arrived, with the job it served."""

    time: float
    instance: str
    job_id: str
    step: int


@dataclass(frozen=True)
class AgentEvent:
    time: float
    instance: str
    stage: str
    message: str
    fields: dict[str, Any]


@dataclass
class GroupSample:
    """A pool's group at one moment: desired capacity, its instances and which are protected from scale-in."""

    time: float
    pool: str
    desired: int
    max_size: int
    protected: dict[str, bool]  # instance id -> ProtectedFromScaleIn


@dataclass
class Instance:
    """One simulated instance: what the group launched, and its agent's life."""

    name: str
    instance_id: str
    pool: str
    instance_type: str
    az: str
    booted_at: float
    exited_at: float = 0.0
    exit_code: int | None = None
    # The group no longer holds it; why: "spot" (the demo's notice), else it left or was scaled in.
    gone_at: float = 0.0
    spot_terminated_at: float = 0.0
    device: str = ""


@dataclass
class Job:
    """One submitted job: how, what the demo saw of it, and its ledger at the end."""

    label: str  # "point 1" ... "big"
    job_id: str
    pool: str  # the pool `trainstack run` matched it to
    submitted_at: float
    total_steps: int
    ledger: dict[str, Any] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class Notice:
    at: float = 0.0
    instance: str = ""
    job_id: str = ""
    step: int = 0  # the last step the trainer had logged
    other_job: str = ""  # the point training beside it
    checkpoint_step: int | None = None  # the stop's confirmed checkpoint (the agent's "trainer stopped")
    stop_confirmed_at: float = 0.0
    resumed_instance: str = ""
    resumed_at: float = 0.0
    resumed_step: int | None = None


@dataclass
class ParallelResult:
    started: float
    workdir: Path
    bucket: str = ""
    pools: dict[str, Pool] = field(default_factory=dict)
    user_data: dict[str, str] = field(default_factory=dict)  # pool -> validity
    jobs: list[Job] = field(default_factory=list)
    instances: list[Instance] = field(default_factory=list)
    events: list[AgentEvent] = field(default_factory=list)
    steps: list[StepSeen] = field(default_factory=list)
    samples: list[GroupSample] = field(default_factory=list)
    notice: Notice = field(default_factory=Notice)
    cli: list[tuple[str, int, str]] = field(default_factory=list)  # (command, code, output)
    desired_after_sweep: int | None = None
    desired_after_big: dict[str, int] = field(default_factory=dict)
    desired_end: dict[str, int] = field(default_factory=dict)
    instances_end: dict[str, list[str]] = field(default_factory=dict)
    jobs_table: str = ""
    refused: tuple[int, str] = (0, "")  # an unservable request: its exit code and line

    def job(self, job_id: str) -> Job | None:
        return next((j for j in self.jobs if j.job_id == job_id), None)

    def instance(self, name: str) -> Instance | None:
        return next((i for i in self.instances if i.name == name), None)

    def instance_by_id(self, instance_id: str) -> Instance | None:
        return next((i for i in self.instances if i.instance_id == instance_id), None)

    def events_of(self, name: str) -> list[AgentEvent]:
        return [e for e in self.events if e.instance == name]


@dataclass
class _Running:
    instance: Instance
    imds: ImdsSimulator
    run: AgentRun
    events_read: int = 0
    lines_read: int = 0
    bound: list[tuple[float, str]] = field(default_factory=list)

    def job_at(self, moment: float) -> str:
        return next((job for at, job in reversed(self.bound) if at <= moment), "")


def stack_config() -> StackConfig:
    """The demo stack's config as `pulumi preview` parses it: the two pools."""
    values = {"aws:region": "us-east-1", "trainstack:pools": POOLS}
    return read_stack_config(values, project=PROJECT, stack=CLI_STACK)


def create_pool_groups(stack: LocalStack, config: StackConfig) -> None:
    """One Auto Scaling group per pool, each with its own launch template (its pool's type), all at zero.
    The default pool's group is the embedded stack's own; each group's maximum is its pool's (maxJobs x
    (maxInstances + 1))."""
    autoscaling, ec2 = stack.client("autoscaling"), stack.client("ec2")
    subnets = stack.group()["VPCZoneIdentifier"]
    for pool in config.pools:
        if pool.group_name == stack.group_name:
            autoscaling.update_auto_scaling_group(
                AutoScalingGroupName=pool.group_name, MaxSize=pool.max_size, DesiredCapacity=0
            )
            continue
        template = f"{pool.group_name}-instance"
        ec2.create_launch_template(
            LaunchTemplateName=template,
            LaunchTemplateData={
                "ImageId": STAND_IN_AMI,
                "InstanceType": pool.instance_types[0],
                "MetadataOptions": {"HttpTokens": "required", "HttpPutResponseHopLimit": 1},
            },
        )
        autoscaling.create_auto_scaling_group(
            AutoScalingGroupName=pool.group_name,
            LaunchTemplate={"LaunchTemplateName": template, "Version": "$Latest"},
            MinSize=0,
            MaxSize=pool.max_size,
            DesiredCapacity=0,
            VPCZoneIdentifier=subnets,
            CapacityRebalance=True,
        )


def small_dataset(workdir: Path) -> Path:
    from training.sample_data import write_dataset

    root = workdir / "dataset"
    write_dataset(root, classes=CLASSES, train_per_class=TRAIN_PER_CLASS, val_per_class=VAL_PER_CLASS)
    return root


def write_trainer_config(epochs: int, path: Path) -> Path:
    """tiny.yaml on the stories' small model for `epochs`, every step logged, periodic checkpoints off (the
    notice's stop and the final one remain)."""
    config = trainer_config(epochs, log_every_steps=1)
    config["checkpoint"]["every_steps"] = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class ParallelDemo:
    """Runs the parallel story; prints each agent stage, trainer line and CLI command as it happens."""

    def __init__(self, workdir: Path, console: Console) -> None:
        self.workdir = workdir
        self.console = console
        self.result = ParallelResult(started=time.time(), workdir=workdir)
        self._echo = AgentEcho(console, self.result.started)
        self._project = workdir / "stack"
        self._outputs = self._project / "outputs.json"
        self._running: list[_Running] = []
        self._user_data: dict[str, str] = {}
        self._bundle: tuple[str, str] = ("", "")
        self._groups: dict[str, str] = {}  # pool -> group name
        self._replacement_pending: str = (
            ""  # the group's replacement, booted once the interrupted agent exits
        )

    # -- the CLI ------------------------------------------------------------------------------------

    def _write_cli_stack(self, stack: LocalStack, config: StackConfig) -> None:
        import json

        from infra.pools import pools_output

        self._project.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / "Pulumi.yaml", self._project / "Pulumi.yaml")
        values = {"aws:region": stack.region, "trainstack:pools": POOLS}
        (self._project / f"Pulumi.{CLI_STACK}.yaml").write_text(yaml.safe_dump({"config": values}))
        default = config.default_pool
        outputs = {
            "region": stack.region,
            "bucket_name": stack.bucket,
            "data_prefix": "data/",
            "code_prefix": "code/",
            "checkpoints_prefix": "checkpoints/",
            "results_prefix": "results/",
            "state_prefix": "state/",
            "jobs_prefix": "jobs/",
            "group_name": default.group_name,
            "instance_count": default.max_instances,
            "instance_types": list(default.instance_types),
            "log_group_name": stack.log_group,
            "topic_arn": stack.topic_arn,
            "kms_key_arn": stack.kms_key_arn,
            "pools": pools_output(config.pools),
        }
        self._outputs.write_text(json.dumps(outputs, indent=1))

    def trainstack(self, *argv: str, check: bool = True) -> tuple[int, str]:
        """`trainstack ARGV` through the CLI's own main, pointed at the demo's stack; its output echoed."""
        from trainstack.cli import main

        where = ["--cwd", str(self._project), "--stack", CLI_STACK, "--outputs", str(self._outputs)]
        shown = " ".join(["trainstack", *argv])
        self.console.print(f"[bold]$ {escape(shown)}[/]", highlight=False)
        captured = io.StringIO()
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            code = main([*argv, *where])
        output = captured.getvalue().rstrip()
        for line in output.splitlines():
            self.console.print(f"  {escape(line)}", highlight=False)
        self.result.cli.append((shown, code, output))
        if check and code != 0:
            raise RuntimeError(f"`{shown}` exited {code}: {output.splitlines()[-1] if output else ''}")
        return code, output

    # -- the story ----------------------------------------------------------------------------------

    def run(self) -> ParallelResult:
        result = self.result
        config = stack_config()
        result.pools = {pool.name: pool for pool in config.pools}
        self._groups = {pool.name: pool.group_name for pool in config.pools}
        stack = create_stack(STACK, desired=0)
        create_pool_groups(stack, config)
        result.bucket = stack.bucket
        for pool in config.pools:
            self.console.print(
                f"[bold]pool {pool.name}[/]: group {pool.group_name}, {', '.join(pool.instance_types)}, "
                f"maxJobs {pool.max_jobs}, maxInstances {pool.max_instances} (group maximum "
                f"{pool.max_size}), at zero"
            )
        bundle = upload_bundle(stack)
        self._bundle = (bundle.key(), bundle.sha256)
        self._render_user_data(stack, config, bundle)
        self._write_cli_stack(stack, config)
        self.trainstack("data", "push", os.path.relpath(small_dataset(self.workdir)))

        jobs_dir = self.workdir / "jobs"
        sweep_config = write_trainer_config(SWEEP_EPOCHS, jobs_dir / "sweep" / "tiny.yaml")
        big_config = write_trainer_config(BIG_EPOCHS, jobs_dir / "big" / "l40s.yaml")
        # A request no pool serves is refused at submit, naming each pool and what it offers.
        code, output = self.trainstack(
            "run", "--config", os.path.relpath(big_config), "--gpus", "H100:8", "--detach", check=False
        )
        result.refused = (code, output.splitlines()[-1] if output else "")
        key, values = SWEEP
        _, output = self.trainstack(
            "run",
            "--config",
            os.path.relpath(sweep_config),
            "--sweep",
            f"{key}={','.join(values)}",
            "--detach",
        )
        at = time.time()
        ids = [line.split()[1] for line in output.splitlines() if line.startswith("queued ")]
        total = SWEEP_EPOCHS * STEPS_PER_EPOCH
        result.jobs = [
            Job(f"point {i + 1} ({key.rsplit('.', 1)[-1]}={value})", job_id, DEFAULT_POOL, at, total)
            for i, (job_id, value) in enumerate(zip(ids, values, strict=False))
        ]
        result.desired_after_sweep = int(self._group(stack, DEFAULT_POOL)["DesiredCapacity"])
        _, output = self.trainstack(
            "run", "--config", os.path.relpath(big_config), "--gpus", BIG_GPUS, "--detach"
        )
        result.jobs.append(
            Job(
                f"big ({BIG_GPUS})",
                output.splitlines()[-1].strip(),
                BIG_POOL,
                time.time(),
                BIG_EPOCHS * STEPS_PER_EPOCH,
            )
        )
        result.desired_after_big = {
            pool: int(self._group(stack, pool)["DesiredCapacity"]) for pool in self._groups
        }
        try:
            self._watch(stack)
        except BaseException:
            kill_running(r.run for r in self._running)
            raise
        finally:
            for running in self._running:
                running.imds.stop()
        time.sleep(0.3)  # let the output pumps drain the last lines
        self._collect()
        self._read_end_state(stack)
        return result

    def _render_user_data(self, stack: LocalStack, config: StackConfig, bundle: Any) -> None:
        """Each pool's user-data, from infra/fleet.py's agent config for that pool (its group, `pool` and
        `lanes`), pointed at the embedded stack; a simulated instance has no GPU."""
        from infra.fleet import agent_config

        for pool in config.pools:
            agent = agent_config(
                config,
                bucket=stack.bucket,
                topic_arn=stack.topic_arn,
                log_group=stack.log_group,
                bundle=bundle,
                pool=pool,
            )
            agent = replace(agent, gpu_required=False, stall_minutes=5.0)
            text = render_user_data(agent, bundle_key=bundle.key(), bundle_sha256=bundle.sha256)
            path = self.workdir / f"user-data-{pool.name}.yaml"
            path.write_text(text)
            self._user_data[pool.name] = text
            self.result.user_data[pool.name] = validate_user_data(path)
            self.console.print(
                f"[bold]user-data[/] of pool {pool.name}: {path} ({len(text.encode())} bytes, "
                f"{self.result.user_data[pool.name]}); pool={agent.pool!r}, lanes={agent.lanes}"
            )

    def _group(self, stack: LocalStack, pool: str) -> dict[str, Any]:
        found: dict[str, Any] = stack.client("autoscaling").describe_auto_scaling_groups(
            AutoScalingGroupNames=[self._groups[pool]]
        )["AutoScalingGroups"][0]
        return found

    def _lifecycle_state(self, stack: LocalStack) -> Any:
        autoscaling = stack.client("autoscaling")

        def state(instance_id: str) -> str:
            found = autoscaling.describe_auto_scaling_instances(InstanceIds=[instance_id])
            return "InService" if found["AutoScalingInstances"] else "Terminated"

        return state

    def _watch(self, stack: LocalStack) -> None:
        """Until every pool is at zero and every agent has exited: boot what the groups launch, sample the
        groups, read the agents, inject the notice."""
        deadline = time.monotonic() + STORY_TIMEOUT_S
        while True:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the story did not end within {STORY_TIMEOUT_S}s")
            members = self._sample_groups(stack)
            for running in self._running:
                self._read(running)
                instance = running.instance
                if instance.exit_code is None and running.run.process.poll() is not None:
                    instance.exit_code = running.run.process.wait()
                    instance.exited_at = time.time()
                    running.imds.stop()
                    self.console.print(f"[bold]{instance.name}[/] agent exited with {instance.exit_code}")
            self._notice(stack)
            booted = {r.instance.instance_id for r in self._running}
            for pool, ids in members.items():
                for instance_id in ids:
                    if instance_id in booted:
                        continue
                    if instance_id == self._replacement_pending and not self._interrupted_exited():
                        continue  # the replacement's boot takes longer than the notice's stop (AWS: minutes)
                    self._boot(stack, pool, instance_id)
            alive = any(r.instance.exit_code is None for r in self._running)
            if not alive and self._running and all(not ids for ids in members.values()):
                return
            if (
                not alive
                and self._running
                and not any(i not in booted for ids in members.values() for i in ids)
            ):
                raise RuntimeError(f"every agent exited but the groups still hold {members}")
            time.sleep(POLL_S)

    def _interrupted_exited(self) -> bool:
        interrupted = self.result.instance(self.result.notice.instance)
        return interrupted is not None and interrupted.exit_code is not None

    def _sample_groups(self, stack: LocalStack) -> dict[str, list[str]]:
        """Each group's members (and their protection) now; an instance that left is marked gone."""
        members: dict[str, list[str]] = {}
        now = time.time()
        for pool in self._groups:
            group = self._group(stack, pool)
            protected = {i["InstanceId"]: bool(i.get("ProtectedFromScaleIn")) for i in group["Instances"]}
            self.result.samples.append(
                GroupSample(now, pool, int(group["DesiredCapacity"]), int(group["MaxSize"]), protected)
            )
            members[pool] = list(protected)
        held = {i for ids in members.values() for i in ids}
        for running in self._running:
            if not running.instance.gone_at and running.instance.instance_id not in held:
                running.instance.gone_at = now
        return members

    def _boot(self, stack: LocalStack, pool: str, instance_id: str) -> None:
        index = len(self._running) + 1
        name = f"instance-{index}"
        instance_type = self.result.pools[pool].instance_types[0]
        az = ZONES[(index - 1) % len(ZONES)]
        root = self.workdir / name
        imds = ImdsSimulator(
            SimulatedInstance(instance_id=instance_id, instance_type=instance_type, availability_zone=az),
            lifecycle_state=self._lifecycle_state(stack),
        ).start()
        key, sha256 = self._bundle
        code_root = install_bundle(stack.client("s3"), stack.bucket, key, sha256, root / "opt-trainstack")
        config = agent_config_from_user_data(self._user_data[pool], root / "scratch", AGENT_POLL_S)
        env = {
            **ISOLATED_ENV,
            **one_torch_thread(),
            "AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"],
            "AWS_EC2_METADATA_SERVICE_ENDPOINT": imds.endpoint,
        }
        instance = Instance(name, instance_id, pool, instance_type, az, time.time())
        self.console.print(
            f"[bold]{name}[/] boots as {instance_id} in pool {pool} ({instance_type}, {az}): "
            "the environment's bundle verified and unpacked"
        )
        run = boot_agent(name, code_root, config, env, self._echo.event, self._echo.trainer)
        self.result.instances.append(instance)
        self._running.append(_Running(instance, imds, run))

    def _read(self, running: _Running) -> None:
        """The events and trainer lines that arrived since the last read."""
        events = running.run.events
        for moment, event in events[running.events_read : len(events)]:
            message = str(event.get("message", ""))
            if message == "job bound":
                running.bound.append((moment, str(event.get("job_id"))))
            elif (
                message.startswith("trainer stopped") and running.instance.name == self.result.notice.instance
            ):
                notice = self.result.notice
                if not notice.stop_confirmed_at and moment >= notice.at:
                    notice.stop_confirmed_at = moment
                    checkpoint = event.get("checkpoint_step")
                    notice.checkpoint_step = int(checkpoint) if isinstance(checkpoint, int) else None
            running.events_read += 1
        lines = running.run.trainer_lines
        for moment, line in lines[running.lines_read : len(lines)]:
            found = STEP_LINE.search(line)
            if found:
                self.result.steps.append(
                    StepSeen(moment, running.instance.name, running.job_at(moment), int(found.group(1)))
                )
            running.lines_read += 1

    def _notice(self, stack: LocalStack) -> None:
        """The spot notice, once: on the instance of the first sweep point to log NOTICE_FROM while another
        point has its own instance (it trains on beside the interruption and the resume)."""
        notice = self.result.notice
        if notice.at:
            return
        points = {j.job_id for j in self.result.jobs if j.pool == DEFAULT_POOL}
        serving = {
            r.instance.name: r.bound[-1][1]
            for r in self._running
            if r.instance.exit_code is None and r.bound and r.bound[-1][1] in points
        }
        if len(set(serving.values())) < 2:
            return
        last = SWEEP_EPOCHS * STEPS_PER_EPOCH
        current = [s for s in self.result.steps if s.job_id in points and serving.get(s.instance) == s.job_id]
        # Best when both points step already; else before the first one gets too close to its end.
        stepping = {s.job_id for s in current}
        due = [
            s
            for s in current
            if NOTICE_FROM <= s.step < last and (len(stepping) > 1 or s.step >= last - NOTICE_LATEST_LEFT)
        ]
        if not due:
            return
        target = due[0]
        other = next(job for name, job in serving.items() if job != target.job_id)
        running = next(r for r in self._running if r.instance.name == target.instance)
        notice.at, notice.instance, notice.job_id = time.time(), target.instance, target.job_id
        notice.step = max(s.step for s in self.result.steps if s.job_id == target.job_id)
        notice.other_job = other
        running.imds.inject_spot_notice()
        # What capacity rebalancing does on the notice: the group lets the instance go and launches a
        # replacement, which boots once the interrupted instance is gone (on AWS, minutes later).
        autoscaling = stack.client("autoscaling")
        before = {i["InstanceId"] for i in self._group(stack, DEFAULT_POOL)["Instances"]}
        autoscaling.terminate_instance_in_auto_scaling_group(
            InstanceId=running.instance.instance_id, ShouldDecrementDesiredCapacity=False
        )
        running.instance.spot_terminated_at = time.time()
        after = [i["InstanceId"] for i in self._group(stack, DEFAULT_POOL)["Instances"]]
        launched = [i for i in after if i not in before]
        self._replacement_pending = launched[0] if launched else ""
        label = self.result.job(target.job_id)
        self.console.print(
            f"[bold red]>>> spot interruption notice injected into {target.instance}'s IMDS during "
            f"{label.label if label else target.job_id} (last logged step {notice.step}); the group launches "
            f"a replacement {self._replacement_pending or '(none!)'}[/]",
            highlight=False,
        )

    # -- what happened ------------------------------------------------------------------------------

    def _collect(self) -> None:
        result = self.result
        for running in self._running:
            self._read(running)
            name = running.instance.name
            result.events += [
                AgentEvent(t, name, str(e.get("stage")), str(e.get("message")), e)
                for t, e in running.run.events
            ]
            profile = next(
                (e for _, e in running.run.events if "device profile" in str(e.get("message"))), None
            )
            running.instance.device = str(profile["message"]) if profile else "no device profile"
        result.events.sort(key=lambda e: e.time)
        result.steps.sort(key=lambda s: s.time)
        notice = result.notice
        if notice.at:
            for event in result.events:
                if event.time < notice.at or event.instance == notice.instance:
                    continue
                running = next(r for r in self._running if r.instance.name == event.instance)
                if event.message == "trainer starting" and running.job_at(event.time) == notice.job_id:
                    restored = event.fields.get("restored_step")
                    notice.resumed_instance, notice.resumed_at = event.instance, event.time
                    notice.resumed_step = int(restored) if isinstance(restored, int) else None
                    break
                if (
                    event.message.startswith("start gate opened")
                    and running.job_at(event.time) == notice.job_id
                ):
                    restored = event.fields.get("restored_step")
                    notice.resumed_instance, notice.resumed_at = event.instance, event.time
                    notice.resumed_step = int(restored) if isinstance(restored, int) else None
                    break

    def _read_end_state(self, stack: LocalStack) -> None:
        result = self.result
        for job in result.jobs:
            prefixes = JobPrefixes.of(job.job_id)
            job.ledger = stack.read_json(prefixes.state + LEDGER) or {}
            job.record = stack.read_json(f"jobs/{job.job_id}/job.json") or {}
            job.metrics = stack.read_json(prefixes.results + "metrics.json") or {}
        for pool in self._groups:
            group = self._group(stack, pool)
            result.desired_end[pool] = int(group["DesiredCapacity"])
            result.instances_end[pool] = [i["InstanceId"] for i in group["Instances"]]
        _, result.jobs_table = self.trainstack("jobs")

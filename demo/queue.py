"""`python -m demo` (make demo; `--queue` is the same story): jobs submitted to a stack that stays up, run one
after the other on one instance, through spot notices.

The stack is the environment only: its user-data carries the agent and no job. The dataset is pushed with
`trainstack data push`, three jobs are submitted with `trainstack run --detach` (the CLI's own code, in this
process, against the embedded AWS), the group at zero is woken by the first, and the third is withdrawn with
`trainstack cancel` before it runs:

- job 1, the built-in trainer (`trainstack run --config`), gets a spot notice mid-run on instance 1, a
  g6.xlarge (an L4: bf16); the group's replacement, instance 2, a g4dn.xlarge (a T4: fp16 with a loss scaler)
  in another zone, resumes it from the confirmed checkpoint across precisions and completes it;
- job 2, examples/lightning-mnist-like (PyTorch Lightning), then starts on instance 2 in the same agent
  process (no reboot), gets a spot notice of its own, and instance 3 resumes it: an example as shipped keeps
  the spot promise under the real agent, with its own results;
- job 3, examples/charlm, is cancelled while it waits: it never runs, and with the queue empty the group goes
  to zero.

The trainer's config is training/configs/tiny.yaml on the stories' small model (demo/environment.py),
lengthened through `train.epochs` (periodic checkpoints off); the example is the one shipped in examples/,
shortened only through its job file (`--steps`). Each simulated instance is what demo/run.py boots (the
rendered user-data, the bundle verified and unpacked, the real agent as a subprocess); the agent re-executes
itself with each job's own code bundle.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.markup import escape

from bootstrap.cloud_init import AGENT_CONFIG_PATH
from demo.environment import (
    JOB_CONFIG,
    MODEL,
    REPO,
    STEPS_PER_EPOCH,
    one_torch_thread,
    trainer_config,
    upload_bundle,
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
    kill_tree,
)
from demo.run import ISOLATED_ENV, STOPPED_AT
from demo.stack import LocalStack, create_stack
from trainstack_job.contract import LEDGER
from trainstack_job.jobs import JobPrefixes
from trainstack_job.queue import cancel_key

STACK = "trainstack-demo"
CLI_STACK = "demo"  # the Pulumi stack name the CLI is pointed at (Pulumi.demo.yaml in the project folder)
# The notice must land mid-run on any machine. From the first progress report at or past a job's notice step
# to the trainer's stop: up to POLL_S until the demo reads the report and injects the notice, up to 0.25 s
# until the agent's IMDS poll finds it (it then signals the trainer at once), up to one step to the next step
# boundary, and a job reports its progress every step or two: about 0.4 s and 3 steps. The steps left after
# the notice step must outlast that several times over.
POLL_S = 0.1
# Job 1: the stories' small model on the 128 generated 32 px training images, 4 steps an epoch, lengthened to
# 16 epochs; the notice from step 8 (after 2 epochs) leaves 56 steps. A step takes 0.15-0.45 s on a loaded
# 2-core CI machine (one torch thread, as the tests run it; the L4's and T4's precisions emulated on its CPU;
# measured: it stopped within a step of the notice): 8 s left and more, 20 times the 0.4 s, and still 0.8 s on
# a machine 10 times faster per step, twice the 0.4 s. (resnet18, tiny.yaml's, took twice as long a step
# for three times the CPU and an 86 MB checkpoint.) Periodic checkpoints are off: the story needs only the
# stop's, which the notice makes, and the final one.
TRAINER_EPOCHS = 16
TRAINER_STEPS = TRAINER_EPOCHS * STEPS_PER_EPOCH
TRAINER_NOTICE_FROM = 8
# Job 2: Lightning's small CNN trains about 55 steps a second on that machine, a few times more on a fast one;
# 240 steps with the notice from step 48 leave 192: 3.5 s there, still 1 s at 200 a second. Its length
# differs from job 1's, so one job's progress file is never taken for the other's.
LIGHTNING_STEPS = 240
LIGHTNING_NOTICE_FROM = 48
# One boot after the other, each the group's next instance: an L4, then a T4 (the checkpoint crosses
# precisions), then an A10G.
INSTANCES = (("g6.xlarge", "us-east-1a"), ("g4dn.xlarge", "us-east-1b"), ("g5.xlarge", "us-east-1a"))
STORY_TIMEOUT_S = 420


@dataclass
class Sample:
    """A job's step on one boot at one moment (its progress.json)."""

    time: float
    boot: str
    step: int


@dataclass
class Notice:
    """A spot notice injected into the instance a job ran on, and what the agents did about it."""

    at: float
    boot: str
    step: int  # the last step the job had reported
    total: int
    seen_at: float = 0.0  # the agent's IMDS poll found it
    stop_event: dict[str, Any] = field(default_factory=dict)
    stop_confirmed_at: float = 0.0
    stopped_step: int | None = None  # the step boundary the job said it stopped at
    resumed_boot: str = ""
    resumed_at: float = 0.0
    resumed_step: int | None = None


@dataclass
class QueuedJob:
    """One submitted job: how it was submitted, what the demo saw of it, what S3 holds for it at the end."""

    label: str  # "job 1"
    what: str  # "examples/lightning-mnist-like, 120 steps"
    argv: list[str]  # the `trainstack` command line, as typed
    # The step from which the demo injects a spot notice during the job's first life; None: no notice.
    notice_from: int | None
    total_steps: int | None  # from its config or job file; None for a job that never runs
    # The result files that are the job's own work (the trainer's model and metrics, the example's model).
    own_results: tuple[str, ...] = ()
    # Everything the job writes into its results: another job's file there would be a mix-up.
    writes: tuple[str, ...] = ()
    job_id: str = ""
    submitted_at: float = 0.0
    cancelled_at: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    notice: Notice | None = None
    completed_at: float = 0.0
    # End state, read from S3.
    ledger: dict[str, Any] = field(default_factory=dict)
    results: list[str] = field(default_factory=list)  # keys under its results prefix, relative
    checkpoints: list[str] = field(default_factory=list)  # keys under its checkpoints prefix, relative
    cancel_request: bool = False
    artifacts: list[str] = field(default_factory=list)  # s3:// URIs of its results
    # The built-in trainer: its final accuracy and its resume across precisions are checked too.
    builtin: bool = False
    metrics: dict[str, Any] = field(default_factory=dict)  # its results/metrics.json
    # The trainer's line on what the checkpoint resumed as ("... precision bf16 -> fp16, fresh loss scaler").
    resumed_as: str = ""

    @property
    def interrupt(self) -> bool:
        """The demo interrupts this job with a spot notice."""
        return self.notice_from is not None


@dataclass
class JobStart:
    """The agent's trainer start for a job on one boot."""

    time: float
    job_id: str
    restored_step: int | None


@dataclass
class Boot:
    """One simulated instance: booted once, its agent running job after job until it exits."""

    name: str
    instance_id: str
    instance_type: str
    az: str
    booted_at: float
    device: str = ""  # the agent's device-profile line ("device profile g6.xlarge: 1x L4 24 GiB, bf16")
    exit_code: int | None = None
    exited_at: float = 0.0
    bound: list[tuple[float, str]] = field(default_factory=list)  # (time, job id) of each "job bound"
    starts: list[JobStart] = field(default_factory=list)
    # The agent's "next life on this instance" events: (time, ended job, next job).
    hops: list[tuple[float, str, str]] = field(default_factory=list)
    # Other moments of the queue the timeline shows: a cancelled job skipped, the group scaled to zero.
    notes: list[tuple[float, str]] = field(default_factory=list)
    events: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    trainer_lines: list[tuple[float, str]] = field(default_factory=list)

    def job_at(self, moment: float) -> str:
        """The job this boot's agent was serving at `moment` (the last one bound before it)."""
        return next((job for at, job in reversed(self.bound) if at <= moment), "")


@dataclass
class CliCall:
    argv: list[str]
    code: int
    output: str
    at: float


@dataclass
class QueueResult:
    started: float
    workdir: Path
    bucket: str = ""
    user_data_bytes: int = 0
    user_data_valid: str = ""
    # The job the environment's agent config defines: "" = none, its agent runs what the queue holds.
    user_data_job: str = "?"
    jobs: list[QueuedJob] = field(default_factory=list)
    boots: list[Boot] = field(default_factory=list)
    cli: list[CliCall] = field(default_factory=list)
    desired_before: int | None = None
    desired_after_submit: int | None = None
    desired_capacity: int | None = None
    template_versions: int | None = None
    alerts: list[dict[str, str]] = field(default_factory=list)
    # Objects under the stack's top-level checkpoints/, results/ and state/ledger.json (the legacy job's).
    legacy_objects: list[str] = field(default_factory=list)
    jobs_table: str = ""  # `trainstack jobs` at the end

    def job(self, label: str) -> QueuedJob:
        return next(j for j in self.jobs if j.label == label)

    def boot(self, name: str) -> Boot | None:
        return next((b for b in self.boots if b.name == name), None)


def shortened_example(example: str, steps: int, destination: Path) -> Path:
    """examples/<example> copied as shipped, its job file's `--steps` set to `steps`: its job file's path."""
    job_dir = destination / example
    shutil.copytree(
        REPO / "examples" / example, job_dir, ignore=shutil.ignore_patterns("checkpoints", "output")
    )
    job_file = job_dir / "job.yaml"
    spec = yaml.safe_load(job_file.read_text())
    command = list(spec["command"])
    command[command.index("--steps") + 1] = str(steps)
    spec["command"] = command
    job_file.write_text(yaml.safe_dump(spec, sort_keys=False))
    return job_file


def lengthened_config(epochs: int, destination: Path) -> Path:
    """training/configs/tiny.yaml on the stories' small model, its `train.epochs` set to `epochs` and its
    periodic checkpoints off (the stop's and the final one remain): the copy's path, named as tiny.yaml (the
    job's name)."""
    config = trainer_config(epochs)
    config["checkpoint"]["every_steps"] = 0
    path = destination / JOB_CONFIG.name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _progress(scratch: Path, since: float) -> tuple[int, int] | None:
    """(step, total steps) from the job's progress.json, if written at or after `since`."""
    path = scratch / "output" / "progress.json"
    try:
        if path.stat().st_mtime < since:
            return None
        progress = json.loads(path.read_text())
        return int(progress["step"]), int(progress.get("total_steps") or 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None


class QueueDemo:
    """Runs the queue story; prints each agent stage, trainer line and CLI command as it happens."""

    def __init__(self, workdir: Path, console: Console) -> None:
        self.workdir = workdir
        self.console = console
        self.result = QueueResult(started=time.time(), workdir=workdir)
        self._echo = AgentEcho(console, self.result.started)
        self._project = workdir / "stack"
        self._outputs = self._project / "outputs.json"

    # -- the stack and the CLI -----------------------------------------------------------------------

    def _write_cli_stack(self, stack: LocalStack) -> None:
        """What the CLI reads of a deployed stack: Pulumi.yaml, the stack's config and its outputs."""
        self._project.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / "Pulumi.yaml", self._project / "Pulumi.yaml")
        config = {
            "aws:region": stack.region,
            "trainstack:instanceTypes": [t for t, _ in INSTANCES],
        }
        (self._project / f"Pulumi.{CLI_STACK}.yaml").write_text(yaml.safe_dump({"config": config}))
        outputs = {
            "region": stack.region,
            "bucket_name": stack.bucket,
            "data_prefix": "data/",
            "code_prefix": "code/",
            "checkpoints_prefix": "checkpoints/",
            "results_prefix": "results/",
            "state_prefix": "state/",
            "jobs_prefix": "jobs/",
            "group_name": stack.group_name,
            "instance_count": 1,
            "instance_types": [t for t, _ in INSTANCES],
            "log_group_name": stack.log_group,
            "topic_arn": stack.topic_arn,
            "kms_key_arn": stack.kms_key_arn,
        }
        self._outputs.write_text(json.dumps(outputs, indent=1))

    def trainstack(self, *argv: str) -> CliCall:
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
        call = CliCall(list(argv), code, output, time.time())
        self.result.cli.append(call)
        if code != 0:
            raise RuntimeError(f"`{shown}` exited {code}: {output.splitlines()[-1] if output else ''}")
        return call

    def _submit(self, job: QueuedJob) -> None:
        call = self.trainstack(*job.argv)
        job.job_id = call.output.splitlines()[-1].strip()
        job.submitted_at = call.at

    # -- the story ----------------------------------------------------------------------------------

    def run(self) -> QueueResult:
        result = self.result
        stack = create_stack(STACK, desired=0)
        result.bucket = stack.bucket
        self.console.print(
            f"[bold]stack[/] bucket s3://{stack.bucket} (SSE-KMS), topic, log group, group "
            f"{stack.group_name} at zero: the environment, no job"
        )
        result.desired_before = int(stack.group()["DesiredCapacity"])
        # The environment's bundle: the agent every instance boots with (install-agent.sh); each job then
        # runs its own bundle, uploaded by `trainstack run`.
        bundle = upload_bundle(stack)
        config = stack.agent_config(
            job_id="", stall_minutes=5.0, bundle_key=bundle.key(), bundle_sha256=bundle.sha256
        )
        written = write_user_data(self.workdir, config, bundle)
        user_data = written.text
        result.user_data_bytes, result.user_data_valid = written.size, written.valid
        files = {f["path"]: f["content"] for f in yaml.safe_load(user_data)["write_files"]}
        rendered = yaml.safe_load(files[AGENT_CONFIG_PATH])
        result.user_data_job = str(
            rendered.get("job_id") or ("a user job" if rendered.get("user_job") else "")
        )
        self.console.print(
            f"[bold]user-data[/] {written.path} ({result.user_data_bytes} bytes, "
            f"{result.user_data_valid}); the agent only: it runs what the stack's queue holds"
        )
        self._write_cli_stack(stack)

        # The built-in trainer reads the stack's dataset: pushed as a user would, checked as an ImageFolder.
        self.trainstack("data", "push", os.path.relpath(write_demo_dataset(self.workdir)))
        jobs = self.workdir / "jobs"
        tiny = lengthened_config(TRAINER_EPOCHS, jobs)
        lightning = shortened_example("lightning-mnist-like", LIGHTNING_STEPS, jobs)
        result.jobs = [
            QueuedJob(
                "job 1",
                f"the built-in trainer ({MODEL}), {TRAINER_STEPS} steps",
                ["run", "--config", os.path.relpath(tiny), "--detach"],
                notice_from=TRAINER_NOTICE_FROM,
                total_steps=TRAINER_STEPS,
                own_results=("metrics.json", "model.pt"),
                writes=("curves.png", "metrics.json", "model.pt", "progress.json"),
                builtin=True,
            ),
            QueuedJob(
                "job 2",
                f"examples/lightning-mnist-like, {LIGHTNING_STEPS} steps",
                ["run", os.path.relpath(lightning), "--detach"],
                notice_from=LIGHTNING_NOTICE_FROM,
                total_steps=LIGHTNING_STEPS,
                own_results=("model.pt",),
                writes=("metrics.json", "model.pt", "progress.json"),
            ),
            # Never runs: the example as shipped.
            QueuedJob(
                "job 3",
                "examples/charlm",
                ["run", os.path.relpath(REPO / "examples" / "charlm" / "job.yaml"), "--detach"],
                notice_from=None,
                total_steps=None,
            ),
        ]
        for job in result.jobs:
            self._submit(job)
            if job.label == "job 1":
                result.desired_after_submit = int(stack.group()["DesiredCapacity"])
        third = result.job("job 3")
        self.trainstack("cancel", third.job_id)
        third.cancelled_at = result.cli[-1].at

        imds = ImdsSimulator(lifecycle_state=stack.lifecycle_state).start()
        runs: list[AgentRun] = []
        try:
            self._boot_all(stack, user_data, bundle.key(), bundle.sha256, imds, runs)
        except BaseException:
            for run in runs:
                if run.process.poll() is None:
                    kill_tree(run)
            raise
        finally:
            imds.stop()
        self._read_end_state(stack)
        return result

    def _boot_all(
        self,
        stack: LocalStack,
        user_data: str,
        bundle_key: str,
        sha256: str,
        imds: ImdsSimulator,
        runs: list[AgentRun],
    ) -> None:
        """Boot the group's instances one after the other, as the group launches them, until it is at zero."""
        deadline = time.monotonic() + STORY_TIMEOUT_S
        booted: set[str] = set()
        while True:
            group = stack.group()
            waiting = [i["InstanceId"] for i in group["Instances"] if i["InstanceId"] not in booted]
            if not waiting:
                if int(group["DesiredCapacity"]) == 0:
                    return
                raise RuntimeError(
                    f"the group wants {group['DesiredCapacity']} instance(s) but launched none to boot"
                )
            if len(self.result.boots) >= len(INSTANCES):
                raise RuntimeError(f"the story needs {len(INSTANCES)} boots; the group launched another")
            instance_type, az = INSTANCES[len(self.result.boots)]
            boot = Boot(f"instance-{len(self.result.boots) + 1}", waiting[0], instance_type, az, time.time())
            booted.add(boot.instance_id)
            self.result.boots.append(boot)
            imds.clear_events()
            imds.instance = SimulatedInstance(
                instance_id=boot.instance_id, instance_type=instance_type, availability_zone=az
            )
            root = self.workdir / boot.name
            code_root = install_bundle(
                stack.client("s3"), stack.bucket, bundle_key, sha256, root / "opt-trainstack"
            )
            config = agent_config_from_user_data(user_data, root / "scratch", poll_seconds=0.25)
            self.console.print(
                f"[bold]{boot.name}[/] boots as {boot.instance_id} ({instance_type}, {az}): "
                f"the environment's bundle verified and unpacked to {code_root}"
            )
            env = {
                **ISOLATED_ENV,
                **one_torch_thread(),
                "AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"],
                "AWS_EC2_METADATA_SERVICE_ENDPOINT": imds.endpoint,
            }
            run = boot_agent(boot.name, code_root, config, env, self._echo.event, self._echo.trainer)
            runs.append(run)
            self._watch(boot, run, root / "scratch", imds, stack, deadline)

    def _watch(
        self,
        boot: Boot,
        run: AgentRun,
        scratch: Path,
        imds: ImdsSimulator,
        stack: LocalStack,
        deadline: float,
    ) -> None:
        """Until the agent exits: follow which job it serves, sample that job's steps, inject its notice."""
        read = 0
        while run.process.poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{boot.name}: the story did not end within {STORY_TIMEOUT_S}s")
            read = self._read_events(boot, run, read)
            self._sample(boot, scratch, imds, stack)
            time.sleep(POLL_S)
        boot.exit_code = run.process.wait()
        boot.exited_at = time.time()
        time.sleep(0.3)  # let the output pump drain the last lines
        self._read_events(boot, run, read)
        boot.events, boot.trainer_lines = list(run.events), list(run.trainer_lines)
        self._after_exit(boot)
        self.console.print(f"[bold]{boot.name}[/] agent exited with {boot.exit_code}")

    def _read_events(self, boot: Boot, run: AgentRun, read: int) -> int:
        events = run.events[read:]
        for moment, event in events:
            message = str(event.get("message", ""))
            if message == "job bound":
                boot.bound.append((moment, str(event.get("job_id"))))
            elif message == "trainer starting":
                restored = event.get("restored_step")
                boot.starts.append(
                    JobStart(moment, boot.job_at(moment), int(restored) if restored is not None else None)
                )
            elif event.get("stage") == "queue" and event.get("ended_job") and event.get("next_job"):
                boot.hops.append((moment, str(event.get("ended_job")), str(event.get("next_job"))))
            elif event.get("stage") == "queue" and "cancelled before it ran" in message:
                boot.notes.append((moment, f"{boot.name}'s agent skips {event.get('job_id')}: cancelled"))
            elif event.get("stage") == "fleet" and "desired capacity set to 0" in message:
                boot.notes.append(
                    (moment, f"the queue is empty: {boot.name}'s agent scales the group to zero")
                )
            elif event.get("stage") == "end" and str(message).startswith("completed"):
                job = self._by_id(boot.job_at(moment))
                if job is not None:
                    job.completed_at = moment
        return read + len(events)

    def _by_id(self, job_id: str) -> QueuedJob | None:
        return next((j for j in self.result.jobs if j.job_id == job_id and job_id), None)

    def _sample(self, boot: Boot, scratch: Path, imds: ImdsSimulator, stack: LocalStack) -> None:
        """The step of the job this boot trains now: only once that job's trainer started here, from a
        progress file written since and of the job's own length (the previous job's may be on the disk)."""
        if not boot.starts:
            return
        job = self._by_id(boot.starts[-1].job_id)
        found = _progress(scratch, boot.starts[-1].time)
        if job is None or found is None or found[1] != job.total_steps:
            return
        step, total = found
        if job.samples and job.samples[-1].step == step and job.samples[-1].boot == boot.name:
            return
        job.samples.append(Sample(time.time(), boot.name, step))
        first_boot = job.samples[0].boot == boot.name
        due = job.notice_from is not None and job.notice_from <= step < total
        if due and job.notice is None and first_boot:
            job.notice = Notice(time.time(), boot.name, step, total)
            imds.inject_spot_notice()
            # What capacity rebalancing does on the notice: the group lets this instance go and launches a
            # replacement straight away.
            stack.client("autoscaling").terminate_instance_in_auto_scaling_group(
                InstanceId=boot.instance_id, ShouldDecrementDesiredCapacity=False
            )
            self.console.print(
                f"[bold red]>>> spot interruption notice injected into {boot.name}'s IMDS during "
                f"{job.label} ({job.job_id}, last reported step {step}/{total})[/]",
                highlight=False,
            )

    def _after_exit(self, boot: Boot) -> None:
        """What the agents did about each notice: on the interrupted boot, and the resume on the next one."""
        profile = next((e for _, e in boot.events if "device profile" in str(e.get("message", ""))), None)
        boot.device = str(profile["message"]) if profile else "no device profile"
        for job in self.result.jobs:
            notice = job.notice
            if notice is None:
                continue
            if notice.boot == boot.name:
                for moment, event in boot.events:
                    if moment < notice.at:
                        continue
                    if event.get("stage") == "interruption" and not notice.seen_at:
                        notice.seen_at = moment
                    if "trainer stopped" in str(event.get("message", "")) and not notice.stop_event:
                        notice.stop_confirmed_at, notice.stop_event = moment, event
                        notice.stopped_step = event.get("newest_local_step")
                for moment, line in boot.trainer_lines:
                    said = STOPPED_AT.search(line)
                    if moment >= notice.at and said:
                        notice.stopped_step = int(said.group(1))
                        break
            elif not notice.resumed_boot:
                start = next((s for s in boot.starts if s.job_id == job.job_id), None)
                if start is not None:
                    notice.resumed_boot, notice.resumed_at = boot.name, start.time
                    notice.resumed_step = start.restored_step
                    resumed = next(
                        (
                            line
                            for at, line in boot.trainer_lines
                            if "resumes as" in line and boot.job_at(at) == job.job_id
                        ),
                        "",
                    )
                    job.resumed_as = resumed.split(" INFO ", 1)[-1]

    def _read_end_state(self, stack: LocalStack) -> None:
        result = self.result
        s3 = stack.client("s3")

        def keys(prefix: str) -> list[str]:
            pages = s3.get_paginator("list_objects_v2").paginate(Bucket=stack.bucket, Prefix=prefix)
            return [str(o["Key"])[len(prefix) :] for page in pages for o in page.get("Contents", [])]

        for job in result.jobs:
            prefixes = JobPrefixes.of(job.job_id)
            job.ledger = stack.read_json(prefixes.state + LEDGER) or {}
            job.results = keys(prefixes.results)
            job.artifacts = [f"s3://{stack.bucket}/{prefixes.results}{key}" for key in job.results]
            if job.builtin:
                job.metrics = stack.read_json(prefixes.results + "metrics.json") or {}
            job.checkpoints = keys(prefixes.checkpoints)
            job.cancel_request = stack.read_json(cancel_key(job.job_id)) is not None
        # The stack's own prefixes from before jobs: a queue job never writes there.
        result.legacy_objects = [
            f"{prefix}{key}" for prefix in ("checkpoints/", "results/") for key in keys(prefix)
        ]
        if stack.read_json(f"state/{LEDGER}") is not None:
            result.legacy_objects.append(f"state/{LEDGER}")
        group = stack.group()
        result.desired_capacity = int(group["DesiredCapacity"])
        templates = stack.client("ec2").describe_launch_templates()["LaunchTemplates"]
        result.template_versions = max(int(t["LatestVersionNumber"]) for t in templates)
        result.alerts = stack.alerts()
        result.jobs_table = self.trainstack("jobs").output

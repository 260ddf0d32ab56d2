"""`python -m demo --job DIR`: a user's job through the spot story: the stack in moto with the job as its
default, instance 1 booted and interrupted, instance 2 (another type and zone) resumes it and finishes.

`make demo`'s own story, the built-in trainer and examples through a queue, is demo/queue.py; it shares this
module's isolated environment, and every story prepares its dataset, bundle and user-data with
demo/environment.py."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from bootstrap.agent_config import AgentConfig
from bootstrap.cloud_init import render_user_data
from demo.environment import (
    JOB_CONFIG,
    upload_bundle,
    upload_dataset,
    write_demo_dataset,
    write_user_data,
)
from demo.imds import ImdsSimulator, SimulatedInstance
from demo.instance import AgentEcho, AgentRun, agent_config_from_user_data, boot_agent, install_bundle
from demo.stack import LocalStack, create_stack, end_state
from trainstack_job.jobfile import JobSpec, load_job_spec

# Fake credentials and no config files: nothing in the demo can reach a real AWS account.
ISOLATED_ENV = {
    "AWS_ACCESS_KEY_ID": "demo",
    "AWS_SECRET_ACCESS_KEY": "demo",
    "AWS_SESSION_TOKEN": "demo",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
INTERRUPT_AT_FRACTION = 0.4
STOPPED_AT = re.compile(r"stopped at step (\d+)")
LIFE_TIMEOUT_S = 420
# A heterogeneous fleet, as the default instanceTypes make it: an L4 (bf16) life, then a T4 (fp16 with a loss
# scaler) replacement. On a CPU the agent's device profile makes the trainer use each GPU's precision.
FIRST_TYPE = "g6.xlarge"
REPLACEMENT_TYPE = "g4dn.xlarge"


@dataclass
class Sample:
    """The trainer's step on one instance at one moment (from its progress.json)."""

    time: float
    instance: str
    step: int


@dataclass
class DemoResult:
    """Everything the timeline and the checks need."""

    started: float
    user_data_bytes: int = 0
    user_data_valid: str = ""
    bundle_key: str = ""
    instance_ids: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    notice_at: float = 0.0
    notice_step: int = 0  # the last step the trainer had reported when the notice was injected
    notice_seen_at: float = 0.0  # when the agent's IMDS poll found it
    trainer_stopped_at: float = 0.0
    trainer_stopped_step: int | None = None  # the step boundary the trainer stopped at (its own log line)
    stop_event: dict[str, Any] = field(default_factory=dict)
    stop_confirmed_at: float = 0.0
    instance2_booted_at: float = 0.0
    resumed_at: float = 0.0
    resumed_step: int | None = None
    total_steps: int = 0
    exit_codes: list[int] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    artifacts: list[str] = field(default_factory=list)
    desired_capacity: int | None = None
    alerts: list[dict[str, str]] = field(default_factory=list)
    ledger: dict[str, Any] = field(default_factory=dict)
    bucket: str = ""
    workdir: Path = Path(".demo")
    job_name: str | None = None  # the user's job (`--job`); None: the built-in trainer (made-up results)
    # Per life: the agent's device-profile line ("device profile g6.xlarge: 1x L4 24 GiB, bf16").
    devices: list[str] = field(default_factory=list)
    # The trainer's line on what the checkpoint resumed as ("... precision bf16 -> fp16, fresh loss scaler").
    resumed_as: str = ""


def _progress_step(scratch: Path) -> tuple[int, int] | None:
    try:
        progress = json.loads((scratch / "output" / "progress.json").read_text())
        return int(progress["step"]), int(progress.get("total_steps") or 0)
    except (OSError, ValueError, KeyError):
        return None


class Demo:
    """Runs the story; prints each agent stage as it happens."""

    def __init__(self, workdir: Path, console: Console, job_file: Path) -> None:
        self.workdir = workdir
        self.console = console
        self.result = DemoResult(started=time.time(), workdir=workdir)
        self._echo = AgentEcho(console, self.result.started)
        # The user's job, validated as `pulumi preview` does; its folder is bundled as on a real stack.
        self.job: JobSpec = load_job_spec(job_file)
        self.job_dir = (job_file.parent / self.job.workdir).resolve()
        self.result.job_name = self.job.name

    def _watch(self, run: AgentRun, scratch: Path, interrupt: ImdsSimulator | None, stack: LocalStack) -> int:
        """Sample progress until the agent exits; inject the spot notice mid-training when asked to."""
        deadline = time.monotonic() + LIFE_TIMEOUT_S
        last = -1
        while run.process.poll() is None:
            if time.monotonic() > deadline:
                run.process.kill()
                raise RuntimeError(f"{run.name}: the agent did not finish within {LIFE_TIMEOUT_S}s")
            found = _progress_step(scratch)
            if found is not None and found[0] != last:
                last, total = found
                self.result.total_steps = total or self.result.total_steps
                self.result.samples.append(Sample(time.time(), run.name, last))
                if (
                    interrupt is not None
                    and not self.result.notice_at
                    and last >= INTERRUPT_AT_FRACTION * total
                ):
                    self.result.notice_at = time.time()
                    self.result.notice_step = last
                    interrupt.inject_spot_notice()
                    # What capacity rebalancing does on the notice: the group lets this instance go and
                    # launches a replacement straight away.
                    stack.client("autoscaling").terminate_instance_in_auto_scaling_group(
                        InstanceId=interrupt.instance.instance_id, ShouldDecrementDesiredCapacity=False
                    )
                    self.console.print(
                        f"[bold red]>>> spot interruption notice injected into IMDS "
                        f"(the trainer last reported step {last}/{total}; it stops at the next step "
                        "boundary after the agent's poll finds the notice)[/]",
                        highlight=False,
                    )
            time.sleep(0.2)
        return run.process.wait()

    def run(self) -> DemoResult:
        result = self.result
        stack = create_stack("trainstack-demo")
        result.bucket = stack.bucket
        self.console.print(
            f"[bold]stack[/] bucket s3://{stack.bucket} (SSE-KMS), topic, log group, group {stack.group_name}"
        )

        if self.job.data_sync:
            count = upload_dataset(stack, write_demo_dataset(self.workdir))
            self.console.print(
                f"[bold]dataset[/] {count} generated images uploaded to s3://{stack.bucket}/data/"
            )

        bundle = upload_bundle(stack, job_dir=self.job_dir)
        result.bundle_key = bundle.key()
        self.console.print(f"[bold]job[/] {self.job.name}: {' '.join(self.job.command)} (in {self.job_dir})")
        written = write_user_data(self.workdir, self.agent_config(stack), bundle)
        user_data = written.text
        result.user_data_bytes, result.user_data_valid = written.size, written.valid
        self.console.print(
            f"[bold]user-data[/] {written.path} ({result.user_data_bytes} bytes, {result.user_data_valid})"
        )

        env = {**ISOLATED_ENV, "AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"]}
        first_id = stack.instance_ids()[0]
        with ImdsSimulator(
            SimulatedInstance(instance_id=first_id, instance_type=FIRST_TYPE),
            lifecycle_state=stack.lifecycle_state,
        ) as imds:
            env["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = imds.endpoint
            result.instance_ids.append(first_id)
            result.exit_codes.append(self._life("instance-1", stack, user_data, bundle.sha256, env, imds))
            second_id = next(i for i in stack.instance_ids() if i != first_id)
            result.instance_ids.append(second_id)
            imds.clear_events()
            imds.instance = SimulatedInstance(
                instance_id=second_id, instance_type=REPLACEMENT_TYPE, availability_zone="us-east-1b"
            )
            result.instance2_booted_at = time.time()
            result.exit_codes.append(self._life("instance-2", stack, user_data, bundle.sha256, env, None))

        end = end_state(stack)
        result.metrics, result.artifacts, result.ledger = end.metrics, end.artifacts, end.ledger
        result.desired_capacity, result.alerts = end.desired_capacity, end.alerts
        return result

    def agent_config(self, stack: LocalStack) -> AgentConfig:
        """What `pulumi up` configures the agent with when the `--job` is the stack's default job."""
        job = yaml.safe_load(JOB_CONFIG.read_text())
        return stack.agent_config(job=job, user_job=self.job.to_mapping(), stall_minutes=5.0)

    def user_data(self, stack: LocalStack, bundle_key: str, bundle_sha256: str) -> str:
        """What `pulumi up` renders with the `--job` given as the stack's default job."""
        return render_user_data(self.agent_config(stack), bundle_key=bundle_key, bundle_sha256=bundle_sha256)

    def _life(
        self,
        name: str,
        stack: LocalStack,
        user_data: str,
        sha256: str,
        env: dict[str, str],
        interrupt: ImdsSimulator | None,
    ) -> int:
        scratch = self.workdir / name
        code_root = install_bundle(
            stack.client("s3"),
            stack.bucket,
            self.result.bundle_key,
            sha256,
            self.workdir / name / "opt-trainstack",
        )
        config = agent_config_from_user_data(user_data, scratch / "scratch", poll_seconds=0.25)
        self.console.print(f"[bold]{name}[/] boots: bundle verified and unpacked to {code_root}")
        run = boot_agent(name, code_root, config, env, self._echo.event, self._echo.trainer)
        code = self._watch(run, scratch / "scratch", interrupt, stack)
        time.sleep(0.3)  # let the output pump drain the last lines
        profile = run.find("device profile")
        self.result.devices.append(str(profile[1]["message"]) if profile else "no device profile")
        resumed = next((line for _, line in run.trainer_lines if "resumes as" in line), "")
        self.result.resumed_as = self.result.resumed_as or resumed.split(" INFO ", 1)[-1]
        if interrupt is not None:
            seen = next((t for t, e in run.events if e.get("stage") == "interruption"), None)
            self.result.notice_seen_at = seen or 0.0
            stopped = run.find("trainer stopped")
            if stopped:
                self.result.stop_confirmed_at, self.result.stop_event = stopped
                # Any job: the agent reports the newest step the job committed when it stopped.
                self.result.trainer_stopped_at = stopped[0]
                self.result.trainer_stopped_step = stopped[1].get("newest_local_step")
            for at, line in run.trainer_lines:
                # The job's own word on when it reached that step boundary (the built-in trainer, the helper).
                said = STOPPED_AT.search(line)
                if said:
                    self.result.trainer_stopped_at, self.result.trainer_stopped_step = at, int(said.group(1))
                    break
        else:
            starting = run.find("trainer starting")
            if starting:
                self.result.resumed_at = starting[0]
                restored = starting[1].get("restored_step")
                self.result.resumed_step = int(restored) if restored is not None else None
        self.console.print(f"[bold]{name}[/] agent exited with {code}")
        return code

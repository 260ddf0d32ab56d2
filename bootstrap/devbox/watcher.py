"""The dev box's idle watcher (systemd `trainstack-devidle`): samples every 30 s, reports to
`dev/status.json`, and after the idle limit e-mails the stack's topic and shuts the box down, which
terminates it (the dev template's shutdown behaviour): compute billing stops, the workspace volume stays.

It needs no EC2 permission to stop the bill: `shutdown -h now` is enough. On a spot notice it does nothing
risky: it flushes the page cache to the workspace volume and reports; the volume detaches as the box ends.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bootstrap.devbox.heartbeat import HEARTBEAT_KEY, Heartbeat
from bootstrap.devbox.idle import SAMPLE_SECONDS, IdleDetector, Sample

# Written by the dev template's user-data: the stack outputs the CLI reads, for the box's own CLI and this.
STACK_OUTPUTS_PATH = Path("/etc/trainstack/stack-outputs.json")
# Read from the instance's tags in IMDS: `trainstack dev up --idle-minutes N` sets it per box.
IDLE_MINUTES_TAG = "trainstack:idle-minutes"
DEFAULT_IDLE_MINUTES = 60
SHUTDOWN_COMMAND = ("shutdown", "-h", "now")
DEV_PRINCIPAL = "dev-role"  # the IAM check's name for this role's calls (tests/iam)


def log(message: str, **fields: Any) -> None:
    """One JSON line to the journal."""
    print(json.dumps({"stage": "devidle", "message": message, **fields}), flush=True)


@dataclass(frozen=True)
class WatcherConfig:
    region: str
    bucket: str
    topic_arn: str
    box_name: str

    @classmethod
    def from_outputs(cls, path: Path) -> WatcherConfig:
        """The stack outputs file; a missing key names the file and the fix (the dev template writes it)."""
        try:
            outputs = json.loads(path.read_text(encoding="utf-8"))
            return cls(
                region=str(outputs["region"]),
                bucket=str(outputs["bucket_name"]),
                topic_arn=str(outputs.get("topic_arn") or ""),
                box_name=str(outputs["dev_box_name"]),
            )
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise SystemExit(
                f"devidle: {path}: cannot read the stack outputs ({error!r}); the dev template's user-data "
                "writes it: `pulumi up`, then `trainstack dev down && trainstack dev up`"
            ) from None


def parse_idle_minutes(tag: str | None) -> int:
    """The box's tag, or the default when absent or not a whole number of minutes >= 0."""
    if tag is None:
        return DEFAULT_IDLE_MINUTES
    try:
        minutes = int(tag.strip())
    except ValueError:
        log(f"tag {IDLE_MINUTES_TAG}={tag!r} is not a whole number: using {DEFAULT_IDLE_MINUTES}")
        return DEFAULT_IDLE_MINUTES
    return minutes if minutes >= 0 else DEFAULT_IDLE_MINUTES


class IdleWatcher:
    """One tick: spot notice? sample, verdict, heartbeat; at the idle limit: e-mail, then shut down."""

    def __init__(
        self,
        *,
        config: WatcherConfig,
        instance_id: str,
        idle_minutes: int,
        s3: Any,
        sns: Any,
        sample: Callable[[], Sample],
        spot_notice: Callable[[], bool],
        shutdown_command: Sequence[str] = SHUTDOWN_COMMAND,
        now: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
    ) -> None:
        self._config = config
        self._instance_id = instance_id
        self._detector = IdleDetector(idle_minutes)
        self._s3 = s3
        self._sns = sns
        self._sample = sample
        self._spot_notice = spot_notice
        self._shutdown_command = list(shutdown_command)
        self._now = now
        self._notified = False

    @property
    def idle_minutes(self) -> int:
        return self._detector.limit_minutes

    def tick(self) -> str:
        """watching | interrupted | shut-down (the command ran) | shutdown-failed (retried next tick)."""
        if self._spot_notice():
            # Nothing to save: the workspace is an EBS volume. Flush what the page cache holds for it.
            os.sync()
            self._report(
                Heartbeat(self._instance_id, self._now(), 0.0, self.idle_minutes, state="interrupted")
            )
            log("spot interruption notice: the box ends within 2 minutes; the workspace volume is kept")
            return "interrupted"
        verdict = self._detector.observe(self._sample())
        state = "shutting-down" if verdict.stop else "watching"
        self._report(Heartbeat(self._instance_id, self._now(), verdict.idle_seconds, self.idle_minutes,
                               busy=verdict.busy, state=state))  # fmt: skip
        if not verdict.stop:
            return "watching"
        return self._shut_down(verdict.idle_seconds)

    def run(self, sleep: Callable[[float], None] = time.sleep, interval: float = SAMPLE_SECONDS) -> int:
        limit = "never" if self.idle_minutes == 0 else f"after {self.idle_minutes} idle minutes"
        log(f"watching dev box {self._instance_id}: stops {limit}")
        while True:
            outcome = self.tick()
            if outcome in ("interrupted", "shut-down"):
                return 0
            sleep(interval)

    def _report(self, heartbeat: Heartbeat) -> None:
        try:
            self._s3.put_object(
                Bucket=self._config.bucket,
                Key=HEARTBEAT_KEY,
                Body=heartbeat.to_json().encode(),
                ContentType="application/json",
            )
        except Exception as error:  # a lost heartbeat only blinds `dev status`; never stops the watch
            log("heartbeat not written", error=str(error))

    def _shut_down(self, idle_seconds: float) -> str:
        # The e-mail first but bounded (the client's retries): the shutdown below runs whatever SNS does.
        if not self._notified and self._config.topic_arn:
            self._notified = self._notify(idle_seconds)
        log(f"idle for {idle_seconds / 60:.0f} minutes: shutting down", command=self._shutdown_command)
        try:
            result = subprocess.run(self._shutdown_command, check=False, timeout=60, capture_output=True)
        except (OSError, subprocess.TimeoutExpired) as error:
            log("shutdown failed; retrying at the next sample", error=str(error))
            return "shutdown-failed"
        if result.returncode != 0:
            log("shutdown failed; retrying at the next sample", code=result.returncode,
                stderr=result.stderr.decode(errors="replace")[-500:])  # fmt: skip
            return "shutdown-failed"
        return "shut-down"

    def _notify(self, idle_seconds: float) -> bool:
        name = self._config.box_name
        subject = (
            f"trainstack [{name}]: dev box {self._instance_id} stopped after {idle_seconds / 60:.0f} idle min"
        )
        lines = [
            f"Nobody used dev box {self._instance_id} for {idle_seconds / 60:.0f} minutes (no SSH or "
            "Session Manager session, no Jupyter kernel busy, GPU idle), so it shut itself down: it "
            "terminates now and its compute billing stops.",
            "Your workspace volume is kept; `trainstack dev up` starts a new box on it.",
            "Change the limit with `trainstack dev up --idle-minutes N` "
            f"(this box: {self.idle_minutes}; 0 = never).",
        ]
        try:
            self._sns.publish(
                TopicArn=self._config.topic_arn, Subject=subject[:100], Message="\n".join(lines)
            )
        except Exception as error:  # the e-mail is a courtesy; the shutdown is the promise
            log("idle e-mail not sent", error=str(error))
            return False
        return True


def main(argv: Sequence[str] | None = None) -> int:
    # Imported here: tests drive IdleWatcher with their own clients, probes and IMDS.
    from bootstrap.aws import client
    from bootstrap.devbox.probes import sampler
    from bootstrap.eventlog import EventLog
    from bootstrap.gpumetrics import GpuMetricPublisher
    from bootstrap.imds import ImdsClient, ImdsUnavailableError

    parser = argparse.ArgumentParser(prog="python -m bootstrap.devbox.watcher", description=__doc__)
    parser.add_argument("--outputs", type=Path, default=STACK_OUTPUTS_PATH, help="the stack outputs file")
    args = parser.parse_args(argv)
    config = WatcherConfig.from_outputs(args.outputs)
    imds = ImdsClient()
    instance_id = imds.get("instance-id")
    if instance_id is None:
        raise SystemExit("devidle: IMDS has no instance-id: this runs on the dev box only")

    def spot_notice() -> bool:
        try:
            return imds.get("spot/instance-action") is not None
        except ImdsUnavailableError:
            return False  # IMDS hiccup: look again at the next sample

    # The numbers `trainstack top --dev` shows (GPU, CPU, memory, disk, network), published as a job's are.
    GpuMetricPublisher(
        client("cloudwatch", config.region, principal=DEV_PRINCIPAL), "", EventLog(), instance_id=instance_id
    ).start()
    watcher = IdleWatcher(
        config=config,
        instance_id=instance_id,
        idle_minutes=parse_idle_minutes(imds.get(f"tags/instance/{IDLE_MINUTES_TAG}")),
        s3=client("s3", config.region, principal=DEV_PRINCIPAL),
        sns=client("sns", config.region, principal=DEV_PRINCIPAL),
        sample=sampler(),
        spot_notice=spot_notice,
    )
    return watcher.run()


if __name__ == "__main__":
    sys.exit(main())

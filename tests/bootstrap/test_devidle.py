"""The dev box's idle watcher: the detector on recorded samples, the probes on a fake /proc and a local
Jupyter, and the shutdown path (e-mail, heartbeat, a fake `shutdown`) against moto."""

from __future__ import annotations

import json
import os
import random
import stat
import subprocess
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import boto3
import pytest
from botocore.config import Config

from bootstrap.devbox.heartbeat import HEARTBEAT_KEY, Heartbeat
from bootstrap.devbox.idle import IdleDetector, Sample, decide
from bootstrap.devbox.probes import count_busy_kernels, count_ssh_sessions, count_ssm_sessions, sampler
from bootstrap.devbox.watcher import (
    DEV_PRINCIPAL,
    IdleWatcher,
    WatcherConfig,
    parse_idle_minutes,
)
from demo.stack import LocalStack
from tests.iam.plugin import record_as

MINUTE = 60.0


def recorded(minutes: float, every: float = 30.0, **at_minute: Any) -> list[Sample]:
    """Samples every 30 s for `minutes`; `busy_kernels=(10, 20)` etc. set a field during [from, to)."""
    samples = []
    for i in range(int(minutes * MINUTE / every) + 1):
        t = i * every
        fields = {
            name: value
            for name, (start, end, value) in at_minute.items()
            if start * MINUTE <= t < end * MINUTE
        }
        samples.append(Sample(at=t, **fields))
    return samples


def first_stop(samples: list[Sample], limit: int) -> float | None:
    """Minute of the first sample whose verdict is to stop, fed one by one as the watcher does."""
    detector = IdleDetector(limit)
    for sample in samples:
        if detector.observe(sample).stop:
            return sample.at / MINUTE
    return None


def test_all_idle_stops_at_the_limit_and_not_a_sample_before() -> None:
    samples = recorded(70)
    assert first_stop(samples, 60) == 60.0
    assert not decide(samples[: 2 * 60], 60).stop  # 59.5 minutes idle
    assert decide(samples[: 2 * 60 + 1], 60).idle_seconds == 60 * MINUTE


def test_a_busy_kernel_restarts_the_count() -> None:
    samples = recorded(120, busy_kernels=(20, 35, 1))
    assert first_stop(samples, 60) == pytest.approx(34.5 + 60)
    verdict = decide(samples[: 30 * 2 + 1], 60)  # minute 30: the kernel is running a cell
    assert verdict.busy == ["1 Jupyter kernel(s) busy"] and verdict.idle_seconds == 0 and not verdict.stop


def test_an_open_session_manager_or_ssh_session_keeps_the_box() -> None:
    assert first_stop(recorded(300, ssm_sessions=(0, 301, 1)), 60) is None
    assert first_stop(recorded(300, ssh_sessions=(0, 301, 2)), 60) is None
    assert decide(recorded(5, ssh_sessions=(0, 6, 2)), 60).busy == ["2 SSH session(s)"]


def test_a_busy_gpu_keeps_the_box_an_idle_or_absent_one_does_not() -> None:
    assert first_stop(recorded(200, gpu_percent=(0, 201, 85.0)), 60) is None
    assert first_stop(recorded(70, gpu_percent=(0, 71, 3.0)), 60) == 60.0  # memory held, nothing computing
    assert first_stop(recorded(70), 60) == 60.0  # no GPU visible to NVML: idle
    # A training run left going in tmux after the SSH session closed: the GPU keeps the box.
    samples = recorded(150, ssh_sessions=(0, 10, 1), gpu_percent=(0, 80, 97.0))
    assert first_stop(samples, 60) == pytest.approx(79.5 + 60)


def test_zero_minutes_never_stops() -> None:
    samples = recorded(600, every=300)
    assert first_stop(samples, 0) is None and decide(samples, 0).idle_seconds == 600 * MINUTE


def test_the_running_detector_agrees_with_decide_on_the_whole_recording() -> None:
    rng = random.Random(26)
    samples = [
        Sample(at=i * 30.0, busy_kernels=int(rng.random() < 0.05), gpu_percent=rng.choice([None, 1.0, 50.0]))
        for i in range(600)
    ]
    detector = IdleDetector(30)
    for i, sample in enumerate(samples):
        assert detector.observe(sample) == decide(samples[: i + 1], 30)


# --- probes ---------------------------------------------------------------------------------------------


def fake_proc(root: Path, command_lines: list[list[str]]) -> Path:
    proc = root / "proc"
    for pid, argv in enumerate(command_lines, start=100):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (proc / "self").mkdir()  # not a pid: skipped
    (proc / "999").mkdir()  # a process that ended before its cmdline was read
    return proc


def test_sessions_are_counted_from_process_titles(tmp_path: Path) -> None:
    proc = fake_proc(
        tmp_path,
        [
            ["/usr/bin/ssm-session-worker", "sess-1", "i-0abc"],
            ["/usr/bin/amazon-ssm-agent"],
            ["sshd: /usr/sbin/sshd -D [listener] 0 of 10-100 startups"],
            ["sshd: ubuntu [priv]"],
            ["sshd: ubuntu@pts/0"],
            ["sshd-session: ubuntu@notty"],
            ["/usr/bin/python3", "-m", "jupyter", "lab", "--ip=127.0.0.1"],
        ],
    )
    assert count_ssm_sessions(proc) == 1
    assert count_ssh_sessions(proc) == 2


class Kernels(BaseHTTPRequestHandler):
    states: ClassVar[list[str]] = []
    token = "secret-token"

    def do_GET(self) -> None:
        if self.path != "/lab/api/kernels" or self.headers.get("Authorization") != f"token {self.token}":
            self.send_response(403)
            self.end_headers()
            return
        body = json.dumps([{"id": str(i), "execution_state": s} for i, s in enumerate(self.states)]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture()
def jupyter() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Kernels)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def runtime_file(home: Path, name: str, port: int, token: str) -> None:
    folder = home / ".local/share/jupyter/runtime"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps({"port": port, "base_url": "/lab/", "token": token}))


def test_only_kernels_running_a_cell_count(tmp_path: Path, jupyter: int) -> None:
    home = tmp_path / "home" / "ubuntu"
    runtime_file(home, "jpserver-1.json", jupyter, Kernels.token)
    Kernels.states = ["busy", "idle", "busy", "starting"]
    assert count_busy_kernels([home]) == 2
    Kernels.states = ["idle"]  # a notebook left open in a browser tab
    assert count_busy_kernels([home]) == 0


def test_a_dead_server_a_wrong_token_or_a_broken_runtime_file_count_as_idle(
    tmp_path: Path, jupyter: int
) -> None:
    Kernels.states = ["busy"]
    home = tmp_path / "home" / "ubuntu"
    runtime_file(home, "jpserver-2.json", jupyter, "not-the-token")
    closed = ThreadingHTTPServer(("127.0.0.1", 0), Kernels)
    closed_port = closed.server_address[1]
    closed.server_close()
    runtime_file(home, "jpserver-3.json", closed_port, Kernels.token)
    (home / ".local/share/jupyter/runtime/nbserver-4.json").write_text("{half")
    assert count_busy_kernels([home, tmp_path / "no-such-home"], timeout_s=0.5) == 0


def test_the_sampler_puts_the_probes_together(tmp_path: Path, jupyter: int) -> None:
    proc = fake_proc(tmp_path, [["/usr/bin/ssm-session-worker"], ["sshd: ec2-user@pts/1"]])
    home = tmp_path / "home" / "ec2-user"
    runtime_file(home, "jpserver-5.json", jupyter, Kernels.token)
    Kernels.states = ["busy"]
    sample = sampler(proc=proc, homes=lambda: [home], gpu=lambda: 42.0, clock=lambda: 7.0)()
    assert sample == Sample(at=7.0, ssm_sessions=1, ssh_sessions=1, busy_kernels=1, gpu_percent=42.0)


@pytest.mark.parametrize(("tag", "minutes"), [(None, 60), ("15", 15), ("0", 0), ("soon", 60), ("-3", 60)])
def test_idle_minutes_come_from_the_box_tag(tag: str | None, minutes: int) -> None:
    assert parse_idle_minutes(tag) == minutes


def test_the_stack_outputs_file_must_name_the_bucket(tmp_path: Path) -> None:
    path = tmp_path / "stack-outputs.json"
    path.write_text(json.dumps({"region": "us-east-1", "dev_box_name": "x"}))
    with pytest.raises(SystemExit, match=r"stack-outputs\.json: cannot read the stack outputs"):
        WatcherConfig.from_outputs(path)


# --- the shutdown path ----------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 0.0
        self.start = datetime(2026, 12, 1, 9, 0, tzinfo=timezone.utc)

    def monotonic(self) -> float:
        return self.t

    def now(self) -> datetime:
        return self.start + timedelta(seconds=self.t)

    def sleep(self, seconds: float) -> None:
        self.t += seconds


def fake_shutdown(tmp_path: Path, exit_code: int = 0) -> tuple[list[str], Path]:
    """A `shutdown` that records its arguments instead of halting the machine running the tests."""
    calls = tmp_path / "shutdown-calls"
    script = tmp_path / "shutdown"
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit {exit_code}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return [str(script), "-h", "now"], calls


def watcher(
    stack: LocalStack,
    tmp_path: Path,
    *,
    minutes: int = 2,
    exit_code: int = 0,
    s3: Any = None,
    sns: Any = None,
    busy_until: float = 0.0,
    spot: list[bool] | None = None,
) -> tuple[IdleWatcher, Clock, Path]:
    clock = Clock()
    command, calls = fake_shutdown(tmp_path, exit_code)
    config = WatcherConfig(stack.region, stack.bucket, stack.topic_arn, "trainstack-test-dev")
    notices = iter(spot or [])
    return (
        IdleWatcher(
            config=config,
            instance_id="i-0devbox",
            idle_minutes=minutes,
            s3=s3 or record_as(boto3.client("s3", region_name=stack.region), DEV_PRINCIPAL),
            sns=sns or record_as(boto3.client("sns", region_name=stack.region), DEV_PRINCIPAL),
            sample=lambda: Sample(at=clock.t, ssh_sessions=int(clock.t < busy_until)),
            spot_notice=lambda: next(notices, False),
            shutdown_command=command,
            now=clock.now,
        ),
        clock,
        calls,
    )


def heartbeat(stack: LocalStack) -> Heartbeat:
    body = stack.client("s3").get_object(Bucket=stack.bucket, Key=HEARTBEAT_KEY)["Body"].read()
    return Heartbeat.from_json(body)


def test_after_the_idle_limit_it_emails_then_shuts_down_once(stack: LocalStack, tmp_path: Path) -> None:
    idle, clock, calls = watcher(stack, tmp_path, minutes=2, busy_until=60)

    assert idle.run(sleep=clock.sleep) == 0

    assert calls.read_text().split("\n")[:-1] == ["-h now"]  # once
    assert clock.t == 30 + 120  # the last busy sample at 30 s, then two idle minutes
    beat = heartbeat(stack)
    assert beat.state == "shutting-down" and beat.instance_id == "i-0devbox" and beat.idle_seconds == 120
    [mail] = stack.alerts()
    assert "dev box i-0devbox stopped after 2 idle min" in mail["Subject"]
    assert "workspace volume is kept" in mail["Message"] and "trainstack dev up" in mail["Message"]


def test_while_watching_the_heartbeat_tells_the_cli_the_time_left(stack: LocalStack, tmp_path: Path) -> None:
    idle, clock, calls = watcher(stack, tmp_path, minutes=10)
    for _ in range(5):
        assert idle.tick() == "watching"
        clock.sleep(30)
    beat = heartbeat(stack)
    assert beat.state == "watching" and beat.idle_seconds == 120 and not calls.exists()
    assert beat.idle_left_seconds(beat.sampled_at) == 480


def unreachable(service: str, stack: LocalStack) -> Any:
    """A client whose endpoint is gone (nothing listens on port 9): not recorded, no call reaches AWS."""
    config = Config(retries={"max_attempts": 1}, connect_timeout=0.5)
    make: Any = boto3.client  # any service name: the stubs type each one separately
    return make(service, region_name=stack.region, endpoint_url="http://127.0.0.1:9", config=config)


def test_a_failed_email_never_keeps_the_box_running(stack: LocalStack, tmp_path: Path) -> None:
    idle, clock, calls = watcher(stack, tmp_path, minutes=1, sns=unreachable("sns", stack))
    assert idle.run(sleep=clock.sleep) == 0
    assert calls.read_text() == "-h now\n"


def test_a_failed_shutdown_is_retried_and_emails_only_once(stack: LocalStack, tmp_path: Path) -> None:
    idle, clock, calls = watcher(stack, tmp_path, minutes=1, exit_code=1)
    outcomes = []
    for _ in range(4):
        outcomes.append(idle.tick())
        clock.sleep(30)
    assert outcomes == ["watching", "watching", "shutdown-failed", "shutdown-failed"]
    assert len(calls.read_text().splitlines()) == 2
    assert len(stack.alerts()) == 1


def test_a_spot_notice_reports_and_shuts_nothing_down(stack: LocalStack, tmp_path: Path) -> None:
    idle, clock, calls = watcher(stack, tmp_path, minutes=1, spot=[False, True])
    assert idle.run(sleep=clock.sleep) == 0
    assert heartbeat(stack).state == "interrupted"
    assert not calls.exists() and stack.alerts() == []


def test_an_unwritable_heartbeat_does_not_stop_the_watch(stack: LocalStack, tmp_path: Path) -> None:
    idle, clock, calls = watcher(stack, tmp_path, minutes=1, s3=unreachable("s3", stack))
    assert idle.run(sleep=clock.sleep) == 0
    assert calls.read_text() == "-h now\n"


# --- mounting the workspace (bootstrap/devbox/instance/mount-workspace.sh, in a sandbox) ----------------

MOUNT_SCRIPT = Path(__file__).resolve().parents[2] / "bootstrap/devbox/instance/mount-workspace.sh"
FAKES = {
    # IMDS: a token, then the instance's workspace tag (absent when VOLUME is empty).
    "curl": 'case "$*" in *api/token*) echo token ;; *trainstack:dev-workspace*) '
    '[ -n "$VOLUME" ] && echo "$VOLUME" || exit 22 ;; *) exit 22 ;; esac',
    # blkid -p exits 2 for a device with no filesystem at all, 0 for one with a filesystem.
    "blkid": 'echo "blkid $*" >> "$CALLS"; case "$1" in -p) exit "$PROBE" ;; -s) echo 1234-uuid ;; esac',
    "mkfs.ext4": 'echo "mkfs.ext4 $*" >> "$CALLS"',
    "mount": 'echo "mount $*" >> "$CALLS"',
    "chown": 'echo "chown $*" >> "$CALLS"',
    "mountpoint": "exit 1",
    "id": "echo ubuntu",
}


def mount_workspace(
    tmp_path: Path, *, probe: int, volume: str = "vol-0abc123", attached: bool = True
) -> tuple[int, list[str], Path]:
    """Run the script with fake commands; returns its exit code, the commands it ran and the fstab."""
    bin_dir, disks, homes = tmp_path / "bin", tmp_path / "dev", tmp_path / "home"
    for folder in (bin_dir, disks / "disk" / "by-id", homes / "ubuntu"):
        folder.mkdir(parents=True, exist_ok=True)
    for name, body in FAKES.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    link = disks / "disk" / "by-id" / f"nvme-Amazon_Elastic_Block_Store_{volume.replace('-', '')}"
    if attached and not link.is_symlink():
        (disks / "nvme1n1").write_text("")
        link.symlink_to(disks / "nvme1n1")
    calls, fstab = tmp_path / "calls", tmp_path / "fstab"
    if not fstab.exists():
        fstab.write_text("LABEL=root / ext4 defaults 0 1\n")
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "VOLUME": volume,
        "PROBE": str(probe),
        "CALLS": str(calls),
        "TRAINSTACK_WORKSPACE": str(tmp_path / "workspace"),
        "TRAINSTACK_FSTAB": str(fstab),
        "TRAINSTACK_DISKS": str(disks),
        "TRAINSTACK_HOMES": str(homes),
        "TRAINSTACK_ATTACH_ATTEMPTS": "1",
    }
    done = subprocess.run(["bash", str(MOUNT_SCRIPT)], env=env, capture_output=True, text=True, timeout=30)
    ran = calls.read_text().splitlines() if calls.exists() else []
    return done.returncode, ran, fstab


def test_a_blank_workspace_is_formatted_once_mounted_and_handed_to_the_user(tmp_path: Path) -> None:
    code, ran, fstab = mount_workspace(tmp_path, probe=2)
    device = str(tmp_path / "dev" / "nvme1n1")
    workspace = str(tmp_path / "workspace")
    assert code == 0
    assert f"mkfs.ext4 -q -L workspace {device}" in ran
    assert f"mount {workspace}" in ran and f"chown ubuntu: {workspace}" in ran
    assert f"UUID=1234-uuid {workspace} ext4 defaults,nofail 0 2" in fstab.read_text()
    assert (tmp_path / "home" / "ubuntu" / "workspace").resolve() == Path(workspace)


def test_a_workspace_with_files_is_never_formatted(tmp_path: Path) -> None:
    code, ran, fstab = mount_workspace(tmp_path, probe=0)
    assert code == 0
    assert not [c for c in ran if c.startswith(("mkfs", "chown"))]
    assert f"mount {tmp_path / 'workspace'}" in ran
    code, _, fstab = mount_workspace(tmp_path, probe=0)  # a reboot: one fstab line, not two
    assert code == 0 and fstab.read_text().count("/workspace ext4") == 1


def test_a_device_that_cannot_be_probed_is_left_alone(tmp_path: Path) -> None:
    code, ran, _ = mount_workspace(tmp_path, probe=4)
    assert code == 1
    assert not [c for c in ran if c.startswith(("mkfs", "mount"))]


@pytest.mark.parametrize(("volume", "attached"), [("", True), ("vol-0abc123", False)])
def test_no_tag_or_no_volume_fails_without_touching_a_disk(
    tmp_path: Path, volume: str, attached: bool
) -> None:
    code, ran, _ = mount_workspace(tmp_path, probe=2, volume=volume, attached=attached)
    assert code == 1 and ran == []

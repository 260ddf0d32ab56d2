"""Whole instance lives against moto and the IMDS simulator, with a test-double trainer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from bootstrap.lifecycle import InstanceLife, LifeResult
from bootstrap.trainer import TrainerPaths
from demo.imds import ImdsSimulator
from demo.stack import LocalStack
from tests.bootstrap.conftest import upload_dataset

MakeLife = Callable[..., InstanceLife]


def start(life: InstanceLife) -> Future[LifeResult]:
    return ThreadPoolExecutor(max_workers=1).submit(life.run)


def wait_for_step(life: InstanceLife, step: int, timeout: float = 60) -> None:
    progress = Path(str(life.config.scratch_dir)) / "output" / "progress.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads(progress.read_text())["step"] >= step:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"trainer never reached step {step}")


def test_completion_scales_the_group_to_zero_and_sends_a_summary(
    make_life: MakeLife, stack: LocalStack
) -> None:
    result = make_life(fake={"steps": 12}).run()
    assert (result.outcome, result.exit_code) == ("completed", 0)
    assert stack.group()["DesiredCapacity"] == 0
    (alert,) = stack.alerts()
    assert "training completed" in alert["Subject"]
    assert "val_accuracy: 0.5" in alert["Message"] and "estimated cost" in alert["Message"]
    ledger = stack.read_json("state/ledger.json")
    assert ledger is not None and ledger["status"] == "completed"
    assert stack.read_json("state/progress.json")["step"] == 12  # type: ignore[index]
    instance_id = stack_instance_id(ledger)
    shipped = stack.client("logs").get_log_events(
        logGroupName=stack.log_group, logStreamName=f"{instance_id}/agent"
    )
    assert any('"completed; scaled to zero"' in e["message"] for e in shipped["events"]), (
        "agent log in CloudWatch"
    )


def stack_instance_id(ledger: dict[str, Any]) -> str:
    return str(ledger["lives"][0]["instance_id"])


def test_give_up_after_systemd_start_limit_notifies_and_scales_to_zero(
    make_life: MakeLife, stack: LocalStack
) -> None:
    assert make_life().give_up().exit_code == 0
    assert stack.group()["DesiredCapacity"] == 0
    assert "keeps failing" in stack.alerts()[0]["Subject"]


def test_giving_up_on_a_job_marks_that_jobs_ledger_not_the_stacks_top_level(
    make_life: MakeLife, stack: LocalStack
) -> None:
    """systemd's give-up runs before any life could bind: it still writes the configured job's ledger
    (jobs/<id>/state/), so `trainstack status --job` says failed and no legacy ledger appears."""
    assert make_life(job_id="resnet-11111111").give_up().exit_code == 0
    ledger = stack.read_json("jobs/resnet-11111111/state/ledger.json")
    assert ledger is not None and ledger["status"] == "failed"
    assert stack.read_json("state/ledger.json") is None


def test_spot_interruption_exits_with_a_confirmed_checkpoint_and_the_replacement_resumes_at_that_step(
    make_life: MakeLife, stack: LocalStack, imds: ImdsSimulator, capsys: pytest.CaptureFixture[str]
) -> None:
    # Steps without end: only the notice can stop the first trainer, however late it lands on a loaded
    # machine (400 steps of 20 ms could end before it did); the replacement is given a few steps past it.
    fake = {"steps": 10**9, "step_seconds": 0.02, "checkpoint_every": 1000}
    first = make_life(fake=fake)
    running = start(first)
    wait_for_step(first, 15)
    imds.inject_spot_notice()
    assert running.result(timeout=60).outcome == "preempted"
    latest = stack.read_json("checkpoints/latest.json")
    assert latest is not None and latest["step"] >= 15
    reached = json.loads((Path(str(first.config.scratch_dir)) / "output/progress.json").read_text())["step"]
    assert latest["step"] == reached, "steps were lost between the last progress and the confirmed checkpoint"
    assert stack.group()["DesiredCapacity"] == 1, "a preempted life must leave the group to replace it"

    imds.clear_events()
    capsys.readouterr()
    second = make_life(fake={**fake, "steps": latest["step"] + 5})
    assert second.run().outcome == "completed"
    assert json.dumps({"event": "resumed", "step": latest["step"]}) in capsys.readouterr().out
    ledger = stack.read_json("state/ledger.json")
    assert ledger is not None and ledger["interruptions"] == 1
    assert [life["outcome"] for life in ledger["lives"]] == ["preempted", "completed"]


def test_rebalance_recommendation_takes_an_early_checkpoint_without_stopping(
    make_life: MakeLife, stack: LocalStack, imds: ImdsSimulator
) -> None:
    """The promise, as an order of events: the rebalance's checkpoint reaches S3 while the trainer still
    trains (it has no periodic checkpoint, and it can only finish when this test lets it), training goes on
    past that step, and the job then completes. No step count assumes how fast this machine is."""
    never = 10**9  # neither a periodic checkpoint nor the end comes on its own: only the test ends it
    life = make_life(
        fake={"steps": never, "step_seconds": 0.02, "checkpoint_every": never, "complete_on_stop": True}
    )
    running = start(life)
    wait_for_step(life, 10)
    imds.inject_rebalance()
    # A generous bound (the watcher polls IMDS every 0.2 s, the upload is one small object): it only says
    # when to give up waiting, on a loaded 2-core machine too.
    deadline = time.monotonic() + 60
    while stack.read_json("checkpoints/latest.json") is None and time.monotonic() < deadline:
        time.sleep(0.1)
    early = stack.read_json("checkpoints/latest.json")
    assert early is not None, "no early checkpoint within 60 s of the rebalance recommendation"
    assert early["step"] >= 10, "the early checkpoint was taken after the rebalance"
    assert not running.done(), "the early checkpoint must not stop the trainer"
    wait_for_step(life, early["step"] + 1)  # and training went on past it
    # The fake trainer's `complete_on_stop`: its stop file, touched here, makes it finish (exit 0).
    TrainerPaths(Path(str(life.config.scratch_dir))).stop_file.touch()
    assert running.result(timeout=60).outcome == "completed"


def test_crash_loop_stops_after_max_consecutive_failures_and_scales_to_zero(
    make_life: MakeLife, stack: LocalStack
) -> None:
    # Different steps each time: not the same failure twice, so only the crash-loop guard can stop it.
    outcomes = [
        make_life(fake={"crash_at_step": step}, max_consecutive_failures=3).run() for step in (2, 3, 4)
    ]
    assert [r.exit_code for r in outcomes] == [1, 1, 0], (
        f"systemd restarts failed lives until the guard trips: {[r.outcome for r in outcomes]}"
    )
    assert outcomes[-1].outcome == "gave_up"
    assert stack.group()["DesiredCapacity"] == 0
    (alert,) = stack.alerts()
    assert "failed 3 times in a row" in alert["Subject"]
    assert "simulated trainer crash" in alert["Message"], "the alert carries the trainer's last log lines"
    ledger = stack.read_json("state/ledger.json")
    assert ledger is not None and ledger["status"] == "failed" and ledger["consecutive_failures"] == 3


def test_the_same_failure_at_the_same_step_twice_stops_the_job_without_a_third_life(
    make_life: MakeLife, stack: LocalStack
) -> None:
    outcomes = [make_life(fake={"crash_at_step": 2}, max_consecutive_failures=5).run() for _ in range(2)]
    assert [(r.outcome, r.exit_code) for r in outcomes] == [("failed", 1), ("gave_up", 0)]
    assert stack.group()["DesiredCapacity"] == 0
    (alert,) = stack.alerts()
    assert "failed twice at the same step" in alert["Subject"]
    ledger = stack.read_json("state/ledger.json")
    assert ledger is not None and ledger["status"] == "failed"


@pytest.mark.parametrize(
    ("exit_code", "subject", "fix"),
    [
        (2, "the trainer config is invalid", "trainstack:trainingConfig"),
        (65, "the dataset has too many unreadable files", "trainstack data push"),
    ],
)
def test_a_config_or_dataset_error_stops_the_job_at_once_with_the_fix(
    make_life: MakeLife, stack: LocalStack, exit_code: int, subject: str, fix: str
) -> None:
    result = make_life(fake={"crash_at_step": 0, "exit_code": exit_code}, max_consecutive_failures=3).run()
    assert (result.outcome, result.exit_code) == ("gave_up", 0), "no second life for a permanent failure"
    assert stack.group()["DesiredCapacity"] == 0
    (alert,) = stack.alerts()
    assert subject in alert["Subject"] and fix in alert["Message"]
    ledger = stack.read_json("state/ledger.json")
    assert ledger is not None and ledger["status"] == "failed" and len(ledger["lives"]) == 1


def test_imds_outage_keeps_training_and_the_watcher_retries(
    make_life: MakeLife, stack: LocalStack, imds: ImdsSimulator
) -> None:
    # Steps without end: 120 steps of 30 ms left under 2 s after the outage for the notice to land.
    life = make_life(fake={"steps": 10**9, "step_seconds": 0.03})
    lines: list[str] = []
    life.log.add_sink(lines.append)
    running = start(life)
    wait_for_step(life, 5)
    imds.go_down("refuse")
    time.sleep(1.5)
    imds.come_back()
    imds.inject_spot_notice()
    assert running.result(timeout=60).outcome == "preempted", "the watcher saw the notice after the outage"
    messages = [json.loads(line)["message"] for line in lines]
    assert "IMDS unreachable; training continues, retrying" in messages
    assert "IMDS reachable again" in messages


def test_stop_request_from_the_cli_checkpoints_and_scales_to_zero(
    make_life: MakeLife, stack: LocalStack
) -> None:
    # Steps without end: only the stop request can end this life.
    life = make_life(fake={"steps": 10**9, "step_seconds": 0.02, "checkpoint_every": 1000})
    running = start(life)
    wait_for_step(life, 5)
    stack.client("s3").put_object(
        Bucket=stack.bucket, Key="state/control.json", Body=json.dumps({"action": "stop"}).encode()
    )
    assert running.result(timeout=60).outcome == "stopped"
    assert stack.group()["DesiredCapacity"] == 0
    assert stack.read_json("checkpoints/latest.json") is not None
    assert "stopped on request" in stack.alerts()[0]["Subject"]


def test_cost_cap_checkpoints_notifies_and_scales_to_zero(make_life: MakeLife, stack: LocalStack) -> None:
    life = make_life(
        fake={"steps": 5000, "step_seconds": 0.02, "checkpoint_every": 1000}, max_cost_usd=1000.0
    )
    progress = Path(life.config.scratch_dir or "") / "output" / "progress.json"

    def price(instance_type: str, az: str) -> float:
        # Free until the trainer trains, then $3.6M/h ($1000/s): the cap is crossed about a second into
        # training however long this machine takes to start a trainer (a cap crossed before the trainer
        # has trained stops it with nothing new to save; the confirmed checkpoint, here none, is kept).
        return 3.6e6 if progress.exists() else 0.0

    life.cost_meter.fixed_price = price
    assert life.run().outcome == "cost_cap"
    assert stack.group()["DesiredCapacity"] == 0
    assert stack.read_json("checkpoints/latest.json") is not None, "the cap stops with a checkpoint"
    ledger = stack.read_json("state/ledger.json")
    assert ledger is not None and ledger["status"] == "cost_cap" and ledger["total_cost_usd"] >= 1000.0
    assert "cost cap reached" in stack.alerts()[0]["Subject"]


def test_a_cap_crossed_before_the_trainer_trains_still_stops_the_job_and_scales_to_zero(
    make_life: MakeLife, stack: LocalStack
) -> None:
    """$1000/s from the first heartbeat: the cap is crossed during start-up, before the trainer can have
    saved anything. Nothing is billed further: the job ends as cost_cap, the group goes to zero, the user is
    told; no checkpoint is claimed that was not confirmed."""
    life = make_life(fake={"steps": 5000, "step_seconds": 0.02, "checkpoint_every": 1000}, max_cost_usd=1.0)
    life.cost_meter.fixed_price = lambda instance_type, az: 3.6e6
    lines: list[str] = []
    life.log.add_sink(lines.append)
    assert life.run().outcome == "cost_cap"
    assert stack.group()["DesiredCapacity"] == 0
    ledger = stack.read_json("state/ledger.json")
    assert ledger is not None and ledger["status"] == "cost_cap"
    assert "cost cap reached" in stack.alerts()[0]["Subject"]
    latest = stack.read_json("checkpoints/latest.json")
    events = [json.loads(line) for line in lines]
    # A trainer may or may not have started; if it did, the checkpoint the agent calls confirmed is S3's.
    for stop in (e for e in events if e["stage"] == "stop" and "exit_code" in e):
        confirmed = stop.get("checkpoint_step")
        assert confirmed is None or (latest is not None and latest["step"] == confirmed), stop


def test_a_ledger_total_past_the_cap_at_boot_ends_the_life_before_any_start_up_work(
    make_life: MakeLife, stack: LocalStack
) -> None:
    """Earlier lives (three spot interruptions at a real g6.xlarge price) already cost more than the cap: a
    replacement that boots must not check the GPU, sync the dataset or start a trainer; it ends as
    cost_cap, scales the group to zero and says why. The state poller, which would also see the total, is
    slowed to a minute here so that only the start-of-life check can end this life in time."""
    price, hours, cap = 0.7512, 9.0, 20.0  # $/h for a g6.xlarge spot instance; 3 × 9 h = $20.28 > $20
    earlier = [
        {
            "life_id": f"i-earlier{n}@2030-01-0{n}T00:00:00Z",
            "instance_id": f"i-earlier{n}",
            "instance_type": "g6.xlarge",
            "az": "us-east-1a",
            "lifecycle": "spot",
            "started_at": f"2030-01-0{n}T00:00:00Z",
            "heartbeat_at": f"2030-01-0{n}T09:00:00Z",
            "ended_at": f"2030-01-0{n}T09:00:00Z",
            "price_usd_per_hour": price,
            "cost_usd": round(price * hours, 6),
            "outcome": "preempted",
        }
        for n in (1, 2, 3)
    ]
    total = round(3 * price * hours, 6)
    assert cap < total < cap * 1.02, "crossed, but not by an absurd amount"
    ledger_before = {
        "status": "running",
        "lives": earlier,
        "interruptions": 3,
        "consecutive_failures": 0,
        "total_cost_usd": total,
    }
    stack.client("s3").put_object(
        Bucket=stack.bucket, Key="state/ledger.json", Body=json.dumps(ledger_before).encode()
    )
    life = make_life(fake={"steps": 40}, max_cost_usd=cap, state_poll_seconds=60)
    life.cost_meter.fixed_price = lambda instance_type, az: price
    lines: list[str] = []
    life.log.add_sink(lines.append)
    assert life.run().outcome == "cost_cap"
    stages = [json.loads(line)["stage"] for line in lines]
    assert "preflight" not in stages and "data" not in stages, stages
    output = Path(life.config.scratch_dir or "") / "output"
    assert not (output / "progress.json").exists(), "a trainer was started"
    assert stack.group()["DesiredCapacity"] == 0
    ledger = stack.read_json("state/ledger.json")
    assert ledger is not None and ledger["status"] == "cost_cap"
    assert ledger["total_cost_usd"] >= cap and len(ledger["lives"]) == 4
    assert ledger["lives"][-1]["outcome"] == "cost_cap"
    (alert,) = stack.alerts()
    assert "cost cap reached" in alert["Subject"]
    assert stack.read_json("checkpoints/latest.json") is None, "no checkpoint claimed"


def test_stalled_training_is_restarted_once_then_fails(make_life: MakeLife, stack: LocalStack) -> None:
    life = make_life(fake={"hang_at_step": 3, "steps": 50}, stall_minutes=0.05)  # 3 s without progress
    lines: list[str] = []
    life.log.add_sink(lines.append)
    result = life.run()
    assert (result.outcome, result.exit_code) == ("stalled", 1)
    stall_events = [json.loads(line)["message"] for line in lines if json.loads(line)["stage"] == "stall"]
    assert stall_events == [
        "no training progress; restarting the trainer once",
        "training stalled again after a restart; giving up",
    ]


def test_broken_gpu_is_reported_and_the_instance_replaced(make_life: MakeLife, stack: LocalStack) -> None:
    # No NVIDIA driver on this machine: nvidia-smi fails, the repair finds no driver packages.
    instance_id = stack.instance_ids()[0]
    result = make_life(gpu_required=True).run()
    assert (result.outcome, result.exit_code) == ("replaced", 0)
    health = {i["InstanceId"]: i["HealthStatus"] for i in stack.group()["Instances"]}
    assert health.get(instance_id, "Unhealthy") == "Unhealthy", "the group is told to replace this instance"
    assert stack.group()["DesiredCapacity"] == 1
    assert "GPU broken" in stack.alerts()[0]["Subject"]


def test_a_group_already_at_zero_means_nothing_to_do(make_life: MakeLife, stack: LocalStack) -> None:
    stack.client("autoscaling").set_desired_capacity(AutoScalingGroupName=stack.group_name, DesiredCapacity=0)
    assert make_life().run().outcome == "skipped"
    assert stack.read_json("state/ledger.json") is None


def test_bad_agent_config_is_a_one_line_error_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text(
        "region: us-east-1\nbucket: b-ok-name\ngroup_name: g\ntopic_arn: t\nlog_group: l\npoll_seconds: 30\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "bootstrap.agent", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,  # it refuses the config at once: a hang fails here, naming the command
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "'poll_seconds'" in result.stderr and str(config) in result.stderr


SLOW_DOWN = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"


class SlowDownProxy:
    """HTTP proxy in front of moto answering the first N S3 object reads with 503 SlowDown."""

    def __init__(self, upstream: str, bucket: str, failures: int) -> None:
        import http.server
        import urllib.request

        proxy = self
        self.remaining = failures
        self.injected = 0
        self._lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy._lock:
                    inject = (
                        self.command == "GET" and self.path.startswith(f"/{bucket}/") and proxy.remaining > 0
                    )
                    if inject:
                        proxy.remaining -= 1
                        proxy.injected += 1
                if inject:
                    payload = SLOW_DOWN
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                request = urllib.request.Request(upstream + self.path, data=body or None, method=self.command)
                for key, value in self.headers.items():
                    if key.lower() not in ("host", "content-length"):
                        request.add_header(key, value)
                try:
                    response = urllib.request.urlopen(request, timeout=30)
                except urllib.error.HTTPError as error:
                    response = error
                data = response.read()
                self.send_response(response.status)
                for key, value in response.headers.items():
                    if key.lower() not in (
                        "content-length",
                        "transfer-encoding",
                        "connection",
                        "server",
                        "date",
                    ):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._forward()

            def do_PUT(self) -> None:
                self._forward()

            def do_POST(self) -> None:
                self._forward()

            def do_HEAD(self) -> None:
                self._forward()

            def log_message(self, format: str, *args: Any) -> None:
                return

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_s3_slowdown_is_retried_and_the_life_completes(
    make_life: MakeLife, stack: LocalStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = SlowDownProxy(os.environ["AWS_ENDPOINT_URL"], stack.bucket, failures=2)
    try:
        # Agent and trainer alike now reach S3 only through the proxy.
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        result = make_life(fake={"steps": 5}).run()
    finally:
        proxy.close()
    assert result.outcome == "completed"
    assert proxy.injected == 2, "every injected SlowDown was answered with a retry"


def remove_dataset(stack: LocalStack) -> None:
    s3 = stack.client("s3")
    for obj in s3.list_objects_v2(Bucket=stack.bucket, Prefix="data/").get("Contents", []):
        s3.delete_object(Bucket=stack.bucket, Key=obj["Key"])


def test_no_dataset_after_the_wait_scales_to_zero_without_counting_a_failure(
    make_life: MakeLife, stack: LocalStack
) -> None:
    remove_dataset(stack)
    result = make_life(fake={"steps": 4}, data_wait_minutes=0.02).run()
    assert (result.outcome, result.exit_code) == ("no_data", 0)
    assert stack.group()["DesiredCapacity"] == 0
    (alert,) = stack.alerts()
    assert "no dataset" in alert["Subject"] and "trainstack data push" in alert["Message"]
    ledger = stack.read_json("state/ledger.json")
    assert ledger is not None and ledger["status"] == "no_data" and ledger["consecutive_failures"] == 0


def test_training_starts_when_the_dataset_arrives_during_the_wait(
    make_life: MakeLife, stack: LocalStack
) -> None:
    remove_dataset(stack)
    life = make_life(fake={"steps": 4}, data_wait_minutes=2)
    running = start(life)
    deadline = time.monotonic() + 30
    while (stack.read_json("state/ledger.json") or {}).get("status") != "waiting_for_data":
        assert time.monotonic() < deadline, "the agent never reported that it waits for the dataset"
        time.sleep(0.1)
    upload_dataset(stack)
    assert running.result(timeout=120).outcome == "completed"
    assert stack.group()["DesiredCapacity"] == 0


def test_a_dataset_larger_than_the_disk_stops_the_job_at_once_naming_the_space_needed(
    make_life: MakeLife, stack: LocalStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from bootstrap import datasync

    monkeypatch.setattr(
        datasync.shutil, "disk_usage", lambda _path: shutil._ntuple_diskusage(10**9, 10**9, 10)
    )
    result = make_life(fake={"steps": 4}).run()
    assert (result.outcome, result.exit_code) == ("gave_up", 0)
    (alert,) = stack.alerts()
    assert "not enough disk space" in alert["Subject"] and "rootVolumeSizeGb" in alert["Message"]
    assert stack.group()["DesiredCapacity"] == 0

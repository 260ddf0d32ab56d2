"""`trainstack top`: the write-ups' diagnosis on recorded samples; the screen from metrics put into moto."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import boto3
import pytest

from bootstrap import hostmetrics as hm
from demo.stack import STAND_IN_AMI
from trainstack import top
from trainstack.aws import Clients, new_session
from trainstack.dev.instances import DEV_TAG
from trainstack.stack import Stack
from trainstack.top import Bottleneck, Load, diagnose

from .conftest import BUCKET, REGION, STACK, Deployed

JOB = "resnet-1a2b3c4d"

# (GPU %, CPU %, data wait, GPU memory %) as `top` read them on real runs, and what limited each one.
RECORDED = [
    # ResNet-50 on a g4dn.xlarge (4 vCPUs) decoding JPEGs with 3 workers: the write-ups' case.
    ("jpeg decode on 4 vCPUs", Load(38.0, 99.0, 0.46, 71.0), Bottleneck.INPUT_BOUND),
    # CPU saturated, trainer not reporting its data wait (a user's job): the CPU alone says it.
    ("user job, CPU pegged", Load(52.0, 93.0, None, 40.0), Bottleneck.INPUT_BOUND),
    # Dataset read from a network mount: CPU mostly idle (iowait), steps wait on the loader.
    ("reading over the network", Load(31.0, 22.0, 0.58, 35.0), Bottleneck.INPUT_BOUND),
    ("ResNet-50 from local NVMe, 8 workers", Load(97.0, 64.0, 0.01, 88.0), Bottleneck.COMPUTE_BOUND),
    ("small model, memory to spare", Load(91.0, 40.0, 0.02, 22.0), Bottleneck.COMPUTE_BOUND),
    ("checkpoint upload between epochs", Load(2.0, 7.0, 0.0, 60.0), Bottleneck.WAITING),
    ("dataset still syncing", Load(0.0, 12.0, None, 0.0), Bottleneck.WAITING),
    ("edge: exactly 70% busy", Load(70.0, 99.0, 0.5, 50.0), Bottleneck.COMPUTE_BOUND),
    ("edge: just under, CPU at the line", Load(69.9, 85.0, 0.0, 50.0), Bottleneck.INPUT_BOUND),
    ("no GPU metrics yet", Load(None, 50.0, None, None), Bottleneck.UNKNOWN),
]


@pytest.mark.parametrize(("case", "load", "expected"), RECORDED, ids=[r[0] for r in RECORDED])
def test_diagnosis_on_recorded_samples(case: str, load: Load, expected: Bottleneck) -> None:
    diagnosis = diagnose(load)
    assert diagnosis.bottleneck is expected, diagnosis.line
    opening = {Bottleneck.UNKNOWN: "no GPU metrics yet"}.get(expected, f"{expected.value}: GPU ")
    assert "\n" not in diagnosis.line and diagnosis.line.startswith(opening)


def test_input_bound_suggests_workers_a_local_copy_and_gpu_decoding() -> None:
    line = diagnose(RECORDED[0][1]).line
    assert line.startswith("input-bound: GPU 38% busy, CPU 99%, steps wait on data 46% of the time")
    for fix in ("data.num_workers", "local disk", "decode on the GPU"):
        assert fix in line
    assert "a larger batch may fit" in diagnose(RECORDED[4][1]).line
    assert "a larger batch" not in diagnose(RECORDED[3][1]).line


def _put(instance_id: str, load: hm.HostLoad, gpus: list[hm.GpuSample], age_s: float = 20) -> None:
    """What the agent's publisher puts (bootstrap/hostmetrics.py), `age_s` seconds ago."""
    data = hm.metric_data(load, gpus, instance_id=instance_id, aggregates={"JobId": JOB})
    at = datetime.now(timezone.utc) - timedelta(seconds=age_s)
    cloudwatch = boto3.client("cloudwatch", region_name=REGION)
    for batch in hm.batches(data):
        cloudwatch.put_metric_data(Namespace=hm.NAMESPACE, MetricData=[{**d, "Timestamp": at} for d in batch])


STARVED = hm.HostLoad(98.0, 61.0, 2.5e8, 1.0e6, 4.0e7, 2.0e5)
GPUS = [
    hm.GpuSample(0, 35.0, 10 * 2**30, 24 * 2**30),
    hm.GpuSample(1, 41.0, 12 * 2**30, 24 * 2**30),
]


# When the ledger's lives started and ended (top reads only which of them still run).
T0, T1 = "2026-01-01T10:00:00+00:00", "2026-01-01T11:00:00+00:00"


@pytest.fixture()
def training(deployed: Deployed) -> Iterator[tuple[Deployed, str]]:
    """The current job runs on one instance that published its metrics 20 s ago."""
    instance = deployed.launch_instance()
    deployed.put_state("current-job.json", {"job_id": JOB})
    state = f"jobs/{JOB}/state/"
    life = {"instance_id": instance, "instance_type": "g6.12xlarge", "outcome": "running", "started_at": T1}
    ended = {"instance_id": "i-0gone", "instance_type": "g6.xlarge", "outcome": "preempted", "started_at": T0}
    ended["ended_at"] = T1
    s3 = deployed.s3()
    s3.put_object(
        Bucket=BUCKET,
        Key=state + "ledger.json",
        Body=json.dumps({"status": "running", "lives": [ended, life]}),
    )
    progress = {"step": 1200, "total_steps": 12000, "samples_per_s": 812.5, "data_wait_fraction": 0.46}
    s3.put_object(Bucket=BUCKET, Key=state + "progress.json", Body=json.dumps(progress))
    _put(instance, STARVED, GPUS)
    yield deployed, instance


def test_top_once_shows_each_gpu_the_host_and_the_diagnosis(training: tuple[Deployed, str]) -> None:
    deployed, instance = training

    result = deployed.run("top", "--once")

    assert result.code == 0, result.err
    out = result.out
    assert f"trainstack top: job {JOB}" in out and "step 1200/12000, 812 samples/s" in out
    assert f"{instance} (g6.12xlarge), newest metrics: the 30 s from " in out
    assert "GPU 0" in out and "35%" in out and "memory 10.0 GiB (42%)" in out
    assert "GPU 1" in out and "memory 12.0 GiB (50%)" in out
    assert "98%" in out and "61%" in out and "46%" in out
    assert "read 250.0 MB/s, write 1.0 MB/s" in out and "in 40.0 MB/s, out 0.2 MB/s" in out
    assert "diagnosis: input-bound: GPU 38% busy, CPU 98%, steps wait on data 46% of the time" in out
    # A life that ended is not watched (no metrics panel), only listed among the job's lives.
    assert "i-0gone (g6.xlarge)" not in out and "i-0gone " in out


def test_top_json_is_the_same_snapshot(training: tuple[Deployed, str]) -> None:
    deployed, instance = training

    shot = deployed.run("top", "--json").json()

    [item] = shot["instances"]
    assert item["instance_id"] == instance
    assert [g["index"] for g in item["gpus"]] == [0, 1]
    assert item["CPUUtilization"] == pytest.approx(98.0)
    assert item["GPUUtilization"] == pytest.approx(38.0)
    assert item["data_wait_fraction"] == pytest.approx(0.46)
    assert item["diagnosis"]["bottleneck"] == "input-bound"
    assert 10 <= item["metrics_age_s"] <= 120


def test_a_new_instance_not_yet_listed_per_gpu_shows_the_gpus_mean(
    training: tuple[Deployed, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    deployed, _ = training
    monkeypatch.setattr(top, "gpu_indices", lambda cloudwatch, instance_id: [])

    result = deployed.run("top", "--once")

    assert result.code == 0, result.err
    assert "GPUs (mean)" in result.out and "38%  memory 46% (per GPU soon)" in result.out
    assert "GPU 0" not in result.out


def test_a_job_with_no_running_instance_says_so(deployed: Deployed) -> None:
    deployed.put_state("current-job.json", {"job_id": JOB})
    life = {"instance_id": "i-0old", "outcome": "completed", "started_at": T0, "ended_at": T1}
    ledger = {"status": "completed", "lives": [life]}
    deployed.s3().put_object(Bucket=BUCKET, Key=f"jobs/{JOB}/state/ledger.json", Body=json.dumps(ledger))

    result = deployed.run("top", "--once")

    assert result.code == 0, result.err
    assert f"no instance runs job {JOB} now (status: completed)" in result.out


def test_top_dev_watches_the_dev_box_without_metrics_yet(deployed: Deployed) -> None:
    outputs = {**deployed.outputs, "dev_template_id": "lt-0dev", "dev_box_name": "trainstack-test-dev"}
    deployed.outputs_file.write_text(json.dumps(outputs), encoding="utf-8")
    box = deployed.ec2().run_instances(
        ImageId=STAND_IN_AMI,
        MinCount=1,
        MaxCount=1,
        InstanceType="g6.xlarge",
        TagSpecifications=[
            {"ResourceType": "instance", "Tags": [{"Key": DEV_TAG, "Value": "trainstack-test-dev"}]}
        ],
    )["Instances"][0]["InstanceId"]

    result = deployed.run("top", "--dev", "--once")

    assert result.code == 0, result.err
    assert f"dev box {box}" in result.out and "no metrics in the last 5 minutes" in result.out
    assert "diagnosis: no GPU metrics yet" in result.out


def test_top_refreshes_until_ctrl_c_reading_metrics_once_per_publish_period(
    training: tuple[Deployed, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    deployed, _ = training
    problems: list[str] = []
    draw = top.render

    def render(shot: dict[str, Any], problem: str = "") -> Any:
        problems.append(problem)
        return draw(shot, problem)

    monkeypatch.setattr(top, "render", render)
    reads: list[int] = []
    session = new_session()
    session.events.register("provide-client-params.cloudwatch.GetMetricData", lambda **_: reads.append(1))
    clock = iter([0.0, 5.0, 40.0])  # the failed refresh reads no clock
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 2:
            # The agent rewrites progress.json while top reads it: one refresh fails, top goes on.
            deployed.s3().put_object(
                Bucket=BUCKET, Key=f"jobs/{JOB}/state/progress.json", Body=b'{"step": 12'
            )
        if len(sleeps) == 3:
            deployed.s3().put_object(Bucket=BUCKET, Key=f"jobs/{JOB}/state/progress.json", Body=b"{}")
        if len(sleeps) == 4:
            raise KeyboardInterrupt

    stack = Stack(STACK, project_dir=deployed.project, outputs_file=deployed.outputs_file)
    code = top.run(
        Clients(REGION, session=session),
        stack,
        job_id=None,
        dev=False,
        once=False,
        interval=5.0,
        as_json=False,
        sleep=sleep,
        clock=lambda: next(clock),
    )

    assert code == 0  # Ctrl-C is how one leaves top, not an error
    assert sleeps == [5.0] * 4
    # Screens at 0, 5, (failed) and 40 s: CloudWatch read at 0 s and once 30 s passed, not every 5 s.
    assert len(reads) == 2
    assert problems[0] == problems[1] == problems[3] == ""
    assert problems[2].startswith(
        f"s3://trainstack-test-data/jobs/{JOB}/state/progress.json is not valid JSON"
    )


def test_a_corrupt_progress_file_with_once_is_one_line(training: tuple[Deployed, str]) -> None:
    deployed, _ = training
    deployed.s3().put_object(Bucket=BUCKET, Key=f"jobs/{JOB}/state/progress.json", Body=b"not json")

    result = deployed.run("top", "--once")

    assert result.code == 1
    assert result.err.strip().endswith(
        "progress.json is not valid JSON; it is rewritten by the agent, retry shortly"
    )


def test_too_short_an_interval_is_one_line(deployed: Deployed) -> None:
    result = deployed.run("top", "--interval", "0.5")
    assert result.code == 1 and "--interval 0.5: at least 2 seconds" in result.err


def _lives_measured(deployed: Deployed, instance: str) -> None:
    """The ended life measured its first step and data wait; the running one has not reported yet."""
    ended = {
        "instance_id": "i-0gone",
        "instance_type": "g6.xlarge",
        "outcome": "preempted",
        "started_at": T0,
        "ended_at": T1,
        "first_step_seconds": 187.4,
        "data_wait_fraction": 0.463,
        "data_wait_reports": 12,
        "data_wait_step": 1200,
    }
    running = {
        "instance_id": instance,
        "instance_type": "g6.12xlarge",
        "outcome": "running",
        "started_at": T1,
    }
    deployed.s3().put_object(
        Bucket=BUCKET,
        Key=f"jobs/{JOB}/state/ledger.json",
        Body=json.dumps({"status": "running", "lives": [ended, running]}),
    )


def test_top_shows_each_lifes_time_to_first_step_and_data_wait(training: tuple[Deployed, str]) -> None:
    deployed, instance = training
    _lives_measured(deployed, instance)

    result = deployed.run("top", "--once")

    assert result.code == 0, result.err
    rows = {
        line.split()[0]: line.split() for line in result.out.splitlines() if line.strip().startswith("i-")
    }
    assert rows["i-0gone"][1:] == ["g6.xlarge", "preempted", "3m", "07s", "46%"]
    # Not measured yet: "–", never a 0 that would claim an instant start or no wait at all.
    assert rows[instance][1:] == ["g6.12xlarge", "running", "–", "–"]
    assert "first step after" in result.out and "data wait" in result.out


def test_top_json_lists_the_lives_with_null_for_unknown(training: tuple[Deployed, str]) -> None:
    deployed, instance = training
    _lives_measured(deployed, instance)

    shot = deployed.run("top", "--json").json()

    ended, running = shot["lives"]
    assert (ended["instance_id"], ended["first_step_seconds"], ended["data_wait_fraction"]) == (
        "i-0gone",
        187.4,
        0.463,
    )
    assert (running["instance_id"], running["first_step_seconds"], running["data_wait_fraction"]) == (
        instance,
        None,
        None,
    )


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(None, "–"), (0.0, "0.0s"), (4.25, "4.2s"), (9.96, "10.0s"), (10.0, "10s"), (187.4, "3m 07s")],
)
def test_time_to_first_step_reads_in_tenths_under_10_s(seconds: float | None, shown: str) -> None:
    assert top.first_step_text(seconds) == shown


@pytest.mark.parametrize(("fraction", "shown"), [(None, "–"), (0.0, "0%"), (0.463, "46%"), (1.0, "100%")])
def test_data_wait_reads_as_a_percentage(fraction: float | None, shown: str) -> None:
    assert top.data_wait_text(fraction) == shown

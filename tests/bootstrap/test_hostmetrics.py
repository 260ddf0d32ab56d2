"""The host's load from /proc (files recorded on a g4dn.xlarge training ResNet-50), and what the agent
publishes."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import boto3
import pytest

from bootstrap import gpumetrics
from bootstrap import hostmetrics as hm
from bootstrap.aws import client as agent_client
from bootstrap.eventlog import EventLog
from bootstrap.hostmetrics import GpuSample, HostSampler, ProcFormatError
from demo.imds import ImdsSimulator, SimulatedInstance

STAT_BEFORE = """cpu  1000 10 300 8000 200 0 20 0 0 0
cpu0 250 2 75 2000 50 0 5 0 0 0
intr 123456
ctxt 987654
"""
# 10 s later on 4 vCPUs = 4000 ticks: 3400 busy, 500 idle, 100 iowait.
STAT_AFTER = """cpu  4000 10 600 8500 300 0 120 0 0 0
cpu0 1000 5 150 2125 75 0 30 0 0 0
intr 223456
"""
MEMINFO = """MemTotal:       16000000 kB
MemFree:         1000000 kB
MemAvailable:    4000000 kB
Buffers:          100000 kB
Cached:          3000000 kB
"""
DISKSTATS_BEFORE = """   7       0 loop0 500 0 9000 10 0 0 0 0 0 10 10 0 0 0 0 0 0
 259       0 nvme0n1 1000 0 200000 100 500 0 40000 50 0 300 150 0 0 0 0 0 0
 259       1 nvme0n1p1 990 0 199000 99 500 0 40000 50 0 300 150 0 0 0 0 0 0
 259       2 nvme1n1 2000 0 1000000 900 10 0 800 5 0 900 905 0 0 0 0 0 0
 253       0 dm-0 2000 0 1000000 900 10 0 800 5 0 900 905 0 0 0 0 0 0
"""
# +2,000,000 sectors read on nvme1n1 (the dataset's NVMe), +20,000 written on nvme0n1: 1.024 GB, 10.24 MB.
DISKSTATS_AFTER = """   7       0 loop0 900 0 99000 10 0 0 0 0 0 10 10 0 0 0 0 0 0
 259       0 nvme0n1 1000 0 200000 100 700 0 60000 70 0 320 170 0 0 0 0 0 0
 259       1 nvme0n1p1 990 0 199000 99 700 0 60000 70 0 320 170 0 0 0 0 0 0
 259       2 nvme1n1 9000 0 3000000 5000 10 0 800 5 0 5000 5005 0 0 0 0 0 0
 253       0 dm-0 9000 0 3000000 5000 10 0 800 5 0 5000 5005 0 0 0 0 0 0
"""
NET_HEADER = (
    "Inter-|   Receive                                                |  Transmit\n"
    " face |bytes    packets errs drop fifo frame compressed multicast|"
    "bytes    packets errs drop fifo colls carrier compressed\n"
)
NET_BEFORE = (
    NET_HEADER
    + """    lo: 5000000 100 0 0 0 0 0 0 5000000 100 0 0 0 0 0 0
  ens5: 1000000 900 0 0 0 0 0 0 200000 800 0 0 0 0 0 0
docker0: 777 1 0 0 0 0 0 0 777 1 0 0 0 0 0 0
"""
)
NET_AFTER = (
    NET_HEADER
    + """    lo: 9000000 200 0 0 0 0 0 0 9000000 200 0 0 0 0 0 0
  ens5: 501000000 90000 0 0 0 0 0 0 1200000 8000 0 0 0 0 0 0
docker0: 999999 2 0 0 0 0 0 0 999999 2 0 0 0 0 0 0
"""
)
GPUS = [
    GpuSample(index=0, utilization_percent=41.0, memory_used_bytes=6 * 2**30, memory_total_bytes=15 * 2**30),
    GpuSample(index=1, utilization_percent=45.0, memory_used_bytes=9 * 2**30, memory_total_bytes=15 * 2**30),
]


def write_proc(folder: Path, stat: str, diskstats: str, net: str, meminfo: str = MEMINFO) -> Path:
    (folder / "net").mkdir(parents=True, exist_ok=True)
    (folder / "stat").write_text(stat)
    (folder / "meminfo").write_text(meminfo)
    (folder / "diskstats").write_text(diskstats)
    (folder / "net" / "dev").write_text(net)
    return folder


def test_cpu_busy_leaves_out_idle_and_iowait() -> None:
    before, after = hm.parse_cpu(STAT_BEFORE), hm.parse_cpu(STAT_AFTER)
    assert (after.total - before.total, after.busy - before.busy) == (4000, 3400)
    with pytest.raises(ProcFormatError, match="/proc/stat has no readable aggregate `cpu` line"):
        hm.parse_cpu("cpu0 1 2 3 4\n")


def test_memory_in_use_counts_reclaimable_cache_as_free() -> None:
    assert hm.parse_memory_percent(MEMINFO) == pytest.approx(75.0)
    with pytest.raises(ProcFormatError, match="/proc/meminfo lacks MemTotal or MemAvailable"):
        hm.parse_memory_percent("MemTotal: 100 kB\nMemFree: 50 kB\n")


def test_disk_bytes_count_whole_disks_only() -> None:
    # nvme0n1 + nvme1n1; not the partition (counted in its disk), the loop device or device-mapper.
    assert hm.parse_disk_bytes(DISKSTATS_BEFORE) == ((200000 + 1000000) * 512, (40000 + 800) * 512)
    with pytest.raises(ProcFormatError, match="/proc/diskstats: unreadable line for nvme0n1"):
        hm.parse_disk_bytes(" 259 0 nvme0n1 1 0 x 1 1 0 1 1 0 1 1\n")


def test_network_bytes_leave_out_loopback_and_bridges() -> None:
    assert hm.parse_network_bytes(NET_BEFORE) == (1000000, 200000)
    with pytest.raises(ProcFormatError, match="/proc/net/dev: unreadable line for interface ens5"):
        hm.parse_network_bytes("  ens5: 12 oops\n")


def test_sampler_gives_rates_between_readings_and_never_a_negative_one(tmp_path: Path) -> None:
    proc = write_proc(tmp_path, STAT_BEFORE, DISKSTATS_BEFORE, NET_BEFORE)
    sampler = HostSampler(proc)
    assert sampler.sample(100.0) is None  # the first reading only primes the counters

    write_proc(proc, STAT_AFTER, DISKSTATS_AFTER, NET_AFTER)
    load = sampler.sample(110.0)

    assert load is not None
    assert load.cpu_percent == pytest.approx(85.0)
    assert load.memory_percent == pytest.approx(75.0)
    assert load.disk_read_bps == pytest.approx(2_000_000 * 512 / 10)
    assert load.disk_write_bps == pytest.approx(20_000 * 512 / 10)
    assert load.net_in_bps == pytest.approx(50_000_000)
    assert load.net_out_bps == pytest.approx(100_000)

    # The instance rebooted under a long-lived sampler, or a disk went away: counters fall back.
    write_proc(proc, STAT_AFTER, DISKSTATS_BEFORE, NET_BEFORE)
    dropped = sampler.sample(120.0)
    assert dropped is not None
    assert (dropped.disk_read_bps, dropped.net_in_bps, dropped.cpu_percent) == (0.0, 0.0, 0.0)
    assert sampler.sample(120.0) is None  # no time passed: no rate


def _by_scope(data: list[dict[str, Any]]) -> dict[tuple[tuple[str, str], ...], dict[str, float]]:
    found: dict[tuple[tuple[str, str], ...], dict[str, float]] = {}
    for datum in data:
        scope = tuple((d["Name"], d["Value"]) for d in datum["Dimensions"])
        found.setdefault(scope, {})[datum["MetricName"]] = datum["Value"]
    return found


def test_metric_data_per_instance_per_job_per_group_and_per_gpu() -> None:
    load = hm.HostLoad(97.0, 60.0, 1.0e8, 2.0e6, 5.0e7, 1.0e5)

    data = hm.metric_data(
        load, GPUS, instance_id="i-0abc", aggregates={"JobId": "resnet-1a2b3c4d", "AutoScalingGroupName": "g"}
    )

    scopes = _by_scope(data)
    host = {**load.values(), "GPUUtilization": 43.0, "GPUMemoryUtilization": 50.0}
    for scope in (
        (("InstanceId", "i-0abc"),),
        (("JobId", "resnet-1a2b3c4d"),),
        (("AutoScalingGroupName", "g"),),
    ):
        assert scopes[scope] == pytest.approx(host)
    assert scopes[(("InstanceId", "i-0abc"), ("GPU", "1"))] == pytest.approx(
        {"GPUUtilization": 45.0, "GPUMemoryUtilization": 60.0, "GPUMemoryUsed": 9 * 2**30}
    )
    assert len(scopes) == 5
    assert {d["StorageResolution"] for d in data} == {1}
    units = {d["MetricName"]: d["Unit"] for d in data}
    assert units["NetworkInBytes"] == "Bytes/Second" and units["CPUUtilization"] == "Percent"


def test_without_a_job_or_a_first_reading_only_what_is_known_is_published() -> None:
    data = hm.metric_data(None, [], instance_id="i-0abc", aggregates={"JobId": ""})
    assert data == []
    gpu_only = _by_scope(hm.metric_data(None, GPUS[:1], instance_id="i-0abc", aggregates={"JobId": ""}))
    assert set(gpu_only[(("InstanceId", "i-0abc"),)]) == {"GPUUtilization", "GPUMemoryUtilization"}
    assert (("JobId", ""),) not in gpu_only
    assert [len(b) for b in hm.batches([{}] * 2500)] == [1000, 1000, 500]


def test_the_agent_publishes_what_the_alarm_and_top_read(
    aws: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = write_proc(tmp_path, STAT_BEFORE, DISKSTATS_BEFORE, NET_BEFORE)
    monkeypatch.setattr(gpumetrics, "gpu_samples", lambda: GPUS)
    log = io.StringIO()
    publisher = gpumetrics.GpuMetricPublisher(
        agent_client("cloudwatch", "us-east-1"),
        "trainstack-test-gpu",
        EventLog(log),
        instance_id="i-0abc",
        job_id="resnet-1a2b3c4d",
        proc=proc,
    )
    publisher.prime()  # what start() does before its thread's first put
    write_proc(proc, STAT_AFTER, DISKSTATS_AFTER, NET_AFTER)

    publisher.publish_once()

    cloudwatch = boto3.client("cloudwatch", region_name="us-east-1")
    listed = cloudwatch.list_metrics(Namespace="trainstack")["Metrics"]
    published = {(m["MetricName"], tuple((d["Name"], d["Value"]) for d in m["Dimensions"])) for m in listed}
    # The GPU-idle alarm's metric, exactly as infra/observability.py watches it.
    assert ("GPUUtilization", (("AutoScalingGroupName", "trainstack-test-gpu"),)) in published
    assert ("CPUUtilization", (("InstanceId", "i-0abc"),)) in published
    assert ("CPUUtilization", (("JobId", "resnet-1a2b3c4d"),)) in published
    assert ("GPUMemoryUsed", (("InstanceId", "i-0abc"), ("GPU", "0"))) in published


def test_an_unreadable_proc_still_publishes_the_gpus_and_says_so_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpumetrics, "gpu_samples", lambda: GPUS)

    class Recorder:
        def __init__(self) -> None:
            self.puts: list[list[dict[str, Any]]] = []

        def put_metric_data(self, Namespace: str, MetricData: list[dict[str, Any]]) -> None:  # noqa: N803
            assert Namespace == "trainstack"
            self.puts.append(MetricData)

    recorder, log = Recorder(), io.StringIO()
    publisher = gpumetrics.GpuMetricPublisher(
        recorder, "g", EventLog(log), instance_id="i-0abc", proc=tmp_path / "no-proc"
    )

    publisher.publish_once()
    publisher.publish_once()

    assert len(recorder.puts) == 2
    assert {d["MetricName"] for d in recorder.puts[1]} == {
        "GPUUtilization",
        "GPUMemoryUtilization",
        "GPUMemoryUsed",
    }
    assert log.getvalue().count("host load not readable") == 1


def test_the_dashboard_shows_every_host_metric_of_the_group() -> None:
    from infra.iam.common import METRIC_NAMESPACE
    from infra.observability import dashboard_body

    # The instance role may put metrics only into this namespace (its cloudwatch:namespace condition).
    assert hm.NAMESPACE == METRIC_NAMESPACE

    body = dashboard_body("us-east-1", "trainstack-test-gpu", "/trainstack/test")

    shown = {
        (line[1], tuple(line[2:4]))
        for widget in body["widgets"]
        if widget["type"] == "metric"
        for line in widget["properties"]["metrics"]
        if line[0] == "trainstack"
    }
    for name in (*hm.HOST_METRICS, *hm.GPU_MEAN_METRICS):
        assert (name, ("AutoScalingGroupName", "trainstack-test-gpu")) in shown


def test_an_instance_without_an_agent_publishes_under_its_own_id(
    aws: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dev box runs `python3 -m bootstrap.gpumetrics`: its role's grant is checked by the IAM check."""
    monkeypatch.setattr(gpumetrics, "gpu_samples", lambda: GPUS[:1])
    simulator = ImdsSimulator(SimulatedInstance(instance_id="i-0devbox"))
    simulator.start()
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", simulator.endpoint)
    proc = write_proc(tmp_path, STAT_BEFORE, DISKSTATS_BEFORE, NET_BEFORE)
    try:
        assert (
            gpumetrics.main(["--region", "us-east-1", "--once", "--interval", "0.01", "--proc", str(proc)])
            == 0
        )
    finally:
        simulator.stop()

    listed = boto3.client("cloudwatch", region_name="us-east-1").list_metrics(Namespace="trainstack")[
        "Metrics"
    ]
    scopes = {tuple(d["Name"] for d in m["Dimensions"]) for m in listed}
    assert scopes == {("InstanceId",), ("InstanceId", "GPU")}
    assert {d["Value"] for m in listed for d in m["Dimensions"] if d["Name"] == "InstanceId"} == {"i-0devbox"}

"""CPU, memory, disk and network load read from /proc, as the CloudWatch metrics `trainstack top` shows.

No psutil (not on the instance's lock): the kernel's own counters are a few lines of text. Counters are
cumulative, so a rate needs two readings; the first reading only primes the sampler.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NAMESPACE = "trainstack"

# Metric names (namespace `trainstack`). Host metrics carry the instance's dimension and, where they apply,
# the job's and the group's (aggregated over the job's or the group's instances); per-GPU metrics carry the
# instance and the GPU index.
CPU_UTILIZATION = "CPUUtilization"
MEMORY_UTILIZATION = "MemoryUtilization"
DISK_READ_BYTES = "DiskReadBytes"
DISK_WRITE_BYTES = "DiskWriteBytes"
NETWORK_IN_BYTES = "NetworkInBytes"
NETWORK_OUT_BYTES = "NetworkOutBytes"
GPU_UTILIZATION = "GPUUtilization"
GPU_MEMORY_UTILIZATION = "GPUMemoryUtilization"
GPU_MEMORY_USED = "GPUMemoryUsed"

INSTANCE_DIMENSION = "InstanceId"
JOB_DIMENSION = "JobId"
GROUP_DIMENSION = "AutoScalingGroupName"
GPU_DIMENSION = "GPU"

PERCENT = "Percent"
BYTES_PER_SECOND = "Bytes/Second"
HOST_METRICS: dict[str, str] = {
    CPU_UTILIZATION: PERCENT,
    MEMORY_UTILIZATION: PERCENT,
    DISK_READ_BYTES: BYTES_PER_SECOND,
    DISK_WRITE_BYTES: BYTES_PER_SECOND,
    NETWORK_IN_BYTES: BYTES_PER_SECOND,
    NETWORK_OUT_BYTES: BYTES_PER_SECOND,
}
GPU_MEAN_METRICS: dict[str, str] = {GPU_UTILIZATION: PERCENT, GPU_MEMORY_UTILIZATION: PERCENT}
PER_GPU_METRICS: dict[str, str] = {**GPU_MEAN_METRICS, GPU_MEMORY_USED: "Bytes"}
# 1 = high resolution: `trainstack top` can show 30-second values instead of one-minute averages.
STORAGE_RESOLUTION = 1
# PutMetricData takes at most 1000 data points per call.
MAX_DATA_PER_CALL = 1000

SECTOR_BYTES = 512  # /proc/diskstats counts 512-byte sectors whatever the device's own sector size
# Block devices that are not disks (loop, RAM, device-mapper, optical, compressed swap, software RAID) and
# partitions (their I/O is already counted in their disk's line).
_NOT_A_DISK = re.compile(r"^(loop|ram|dm-|sr|zram|md|nbd)")
_PARTITION = re.compile(r"^(nvme\d+n\d+p\d+|mmcblk\d+p\d+|(sd|xvd|vd|hd)[a-z]+\d+)$")
# Interfaces whose bytes never leave the host.
_VIRTUAL_INTERFACES = re.compile(r"^(lo|docker\d*|veth|br-|virbr)")


class ProcFormatError(ValueError):
    """A /proc file that does not read as the kernel writes it."""


@dataclass(frozen=True)
class CpuTimes:
    busy: int
    total: int


@dataclass(frozen=True)
class Counters:
    """One reading of the host's cumulative counters."""

    at: float  # time.monotonic() of the reading
    cpu: CpuTimes
    memory_percent: float
    disk_read_bytes: int
    disk_write_bytes: int
    net_in_bytes: int
    net_out_bytes: int


@dataclass(frozen=True)
class HostLoad:
    """The host's load over the interval between two readings."""

    cpu_percent: float
    memory_percent: float
    disk_read_bps: float
    disk_write_bps: float
    net_in_bps: float
    net_out_bps: float

    def values(self) -> dict[str, float]:
        return {
            CPU_UTILIZATION: self.cpu_percent,
            MEMORY_UTILIZATION: self.memory_percent,
            DISK_READ_BYTES: self.disk_read_bps,
            DISK_WRITE_BYTES: self.disk_write_bps,
            NETWORK_IN_BYTES: self.net_in_bps,
            NETWORK_OUT_BYTES: self.net_out_bps,
        }


@dataclass(frozen=True)
class GpuSample:
    """One GPU as NVML sees it now."""

    index: int
    utilization_percent: float
    memory_used_bytes: int
    memory_total_bytes: int

    @property
    def memory_percent(self) -> float:
        return 100.0 * self.memory_used_bytes / self.memory_total_bytes if self.memory_total_bytes else 0.0


def parse_cpu(stat: str) -> CpuTimes:
    """The aggregate `cpu` line of /proc/stat: busy = everything but idle and iowait (waiting on I/O is idle
    for the CPU: a loader blocked on disk shows as iowait, not as a saturated CPU)."""
    for line in stat.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            try:
                # user nice system idle iowait irq softirq steal (guest is already inside user).
                ticks = [int(x) for x in fields[1:9]]
            except ValueError:
                break
            if len(ticks) < 4:
                break
            total = sum(ticks)
            idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
            return CpuTimes(busy=total - idle, total=total)
    raise ProcFormatError("/proc/stat has no readable aggregate `cpu` line")


def parse_memory_percent(meminfo: str) -> float:
    """Memory in use as `free` counts it: MemTotal - MemAvailable (page cache the kernel can drop is free)."""
    values: dict[str, int] = {}
    for line in meminfo.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[name.strip()] = int(parts[0])
    total = values.get("MemTotal")
    available = values.get("MemAvailable")
    if not total or available is None:
        raise ProcFormatError("/proc/meminfo lacks MemTotal or MemAvailable (kernel before 3.14?)")
    return 100.0 * (total - available) / total


def parse_disk_bytes(diskstats: str) -> tuple[int, int]:
    """Bytes read and written by the host's disks since boot (whole disks only, no partitions or loops)."""
    read = written = 0
    for line in diskstats.splitlines():
        fields = line.split()
        if len(fields) < 10:
            continue
        name = fields[2]
        if _NOT_A_DISK.match(name) or _PARTITION.match(name):
            continue
        try:
            read += int(fields[5]) * SECTOR_BYTES
            written += int(fields[9]) * SECTOR_BYTES
        except ValueError as error:
            raise ProcFormatError(f"/proc/diskstats: unreadable line for {name}: {error}") from None
    return read, written


def parse_network_bytes(net_dev: str) -> tuple[int, int]:
    """Bytes received and sent by the host's real interfaces since boot (loopback and bridges left out)."""
    received = sent = 0
    for line in net_dev.splitlines():
        if ":" not in line:
            continue  # the two header lines
        name, _, rest = line.partition(":")
        name = name.strip()
        if _VIRTUAL_INTERFACES.match(name):
            continue
        fields = rest.split()
        try:
            received += int(fields[0])
            sent += int(fields[8])
        except (IndexError, ValueError):
            raise ProcFormatError(f"/proc/net/dev: unreadable line for interface {name}") from None
    return received, sent


def read_counters(proc: Path, at: float) -> Counters:
    """One reading of the counters under `proc` (/proc, or a folder of recorded files in tests)."""

    def text(name: str) -> str:
        return (proc / name).read_text(encoding="ascii", errors="replace")

    disk_read, disk_write = parse_disk_bytes(text("diskstats"))
    net_in, net_out = parse_network_bytes(text("net/dev"))
    return Counters(
        at=at,
        cpu=parse_cpu(text("stat")),
        memory_percent=parse_memory_percent(text("meminfo")),
        disk_read_bytes=disk_read,
        disk_write_bytes=disk_write,
        net_in_bytes=net_in,
        net_out_bytes=net_out,
    )


def load_between(before: Counters, after: Counters) -> HostLoad | None:
    """The load over the interval, or None when the interval is empty. A counter that went backwards (a
    device removed, a counter wrapped) reads as 0 for this interval, never as a negative rate."""
    seconds = after.at - before.at
    if seconds <= 0:
        return None

    def rate(old: int, new: int) -> float:
        return max(0, new - old) / seconds

    cpu_total = after.cpu.total - before.cpu.total
    cpu_busy = after.cpu.busy - before.cpu.busy
    cpu_percent = min(100.0, max(0.0, 100.0 * cpu_busy / cpu_total)) if cpu_total > 0 else 0.0
    return HostLoad(
        cpu_percent=cpu_percent,
        memory_percent=after.memory_percent,
        disk_read_bps=rate(before.disk_read_bytes, after.disk_read_bytes),
        disk_write_bps=rate(before.disk_write_bytes, after.disk_write_bytes),
        net_in_bps=rate(before.net_in_bytes, after.net_in_bytes),
        net_out_bps=rate(before.net_out_bytes, after.net_out_bytes),
    )


class HostSampler:
    """Keeps the previous reading; each `sample` gives the load since it (None on the first call)."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc
        self._last: Counters | None = None

    def sample(self, at: float) -> HostLoad | None:
        current = read_counters(self._proc, at)
        previous, self._last = self._last, current
        return None if previous is None else load_between(previous, current)


def _dimensions(pairs: Iterable[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"Name": name, "Value": value} for name, value in pairs]


def metric_data(
    load: HostLoad | None,
    gpus: Sequence[GpuSample],
    *,
    instance_id: str,
    aggregates: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """PutMetricData entries: the host's load and the GPUs' means under the instance's dimension and under
    each of `aggregates` (e.g. JobId, AutoScalingGroupName: one dimension each, so CloudWatch averages over
    the job's or group's instances), and each GPU under (instance, GPU index)."""
    values: dict[str, tuple[float, str]] = {}
    if load is not None:
        values |= {name: (value, HOST_METRICS[name]) for name, value in load.values().items()}
    if gpus:
        values[GPU_UTILIZATION] = (sum(g.utilization_percent for g in gpus) / len(gpus), PERCENT)
        values[GPU_MEMORY_UTILIZATION] = (sum(g.memory_percent for g in gpus) / len(gpus), PERCENT)
    scopes = [[(INSTANCE_DIMENSION, instance_id)], *([(k, v)] for k, v in (aggregates or {}).items() if v)]
    data = [
        _datum(name, value, unit, _dimensions(scope))
        for scope in scopes
        for name, (value, unit) in values.items()
    ]
    for gpu in gpus:
        where = _dimensions([(INSTANCE_DIMENSION, instance_id), (GPU_DIMENSION, str(gpu.index))])
        data += [
            _datum(GPU_UTILIZATION, gpu.utilization_percent, PERCENT, where),
            _datum(GPU_MEMORY_UTILIZATION, gpu.memory_percent, PERCENT, where),
            _datum(GPU_MEMORY_USED, float(gpu.memory_used_bytes), "Bytes", where),
        ]
    return data


def _datum(name: str, value: float, unit: str, dimensions: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "MetricName": name,
        "Dimensions": dimensions,
        "Value": round(value, 3),
        "Unit": unit,
        "StorageResolution": STORAGE_RESOLUTION,
    }


def batches(data: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """`data` in PutMetricData-sized calls."""
    return [list(data[i : i + MAX_DATA_PER_CALL]) for i in range(0, len(data), MAX_DATA_PER_CALL)]

"""`trainstack top`: a job's or the dev box's GPUs, CPU, memory, disk and network, and what limits it.

The numbers are the CloudWatch metrics the instance publishes (bootstrap/hostmetrics.py, every 30 s); the
data-wait share is the trainer's own measure from the job's progress.json. The diagnosis is the write-ups'
two-terminal rule (nvidia-smi beside htop) as a pure function: `diagnose`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from enum import Enum
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from rich.console import Group as RenderGroup
from rich.console import RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from bootstrap import hostmetrics as hm
from trainstack.aws import Clients, explain
from trainstack.dev.instances import require_dev_instance
from trainstack.errors import CliError
from trainstack.output import console, format_duration, print_json
from trainstack.stack import Stack
from trainstack.state import read_ledger, read_progress, resolve_job
from trainstack_job.records import Life, Progress

# The write-ups' rule: a GPU under ~70% busy is waiting on something.
GPU_BUSY_PERCENT = 70.0
# Above this the CPU has no room left for the input pipeline (decode, augment, collate).
CPU_SATURATED_PERCENT = 85.0
# The trainer's own starvation threshold (training/progress.py: DATA_WAIT_WARNING): above it, a step spends
# that share of its time waiting for the loader.
DATA_WAIT_HIGH = 0.30
DEFAULT_INTERVAL_SECONDS = 5.0
MIN_INTERVAL_SECONDS = 2.0
# How far back to look for the newest published value: a few publish periods, so one missed put still
# shows the one before it (with its age).
LOOKBACK = timedelta(minutes=5)
METRICS_PERIOD_SECONDS = 30  # bootstrap/gpumetrics.py: PERIOD_SECONDS (high-resolution metrics)


class Bottleneck(str, Enum):
    INPUT_BOUND = "input-bound"
    COMPUTE_BOUND = "compute-bound"
    WAITING = "waiting"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Load:
    """What the diagnosis looks at, for one instance: None = not known."""

    gpu_percent: float | None
    cpu_percent: float | None
    data_wait_fraction: float | None = None
    gpu_memory_percent: float | None = None


@dataclass(frozen=True)
class Diagnosis:
    bottleneck: Bottleneck
    line: str


INPUT_FIXES = (
    "raise the DataLoader's workers (the built-in trainer's data.num_workers), keep the data on local disk "
    "(the agent syncs the dataset to the instance: read it there, not from S3 per step), or decode on the "
    "GPU (NVIDIA DALI, torchvision.io.decode_jpeg(device='cuda'))"
)


def diagnose(load: Load) -> Diagnosis:
    """One line: what limits the job, by the write-ups' rule. GPU under ~70% busy while the CPU is saturated
    (or the trainer says its steps wait on the loader) → input-bound; GPU busy → compute-bound; both low →
    the job waits on something else."""
    gpu, cpu, wait = load.gpu_percent, load.cpu_percent, load.data_wait_fraction
    if gpu is None:
        return Diagnosis(
            Bottleneck.UNKNOWN,
            "no GPU metrics yet: the instance publishes them every 30 s once the job trains (the dev box: "
            "once it runs); check `trainstack status`",
        )
    cpu_text = f"CPU {cpu:.0f}%" if cpu is not None else "CPU unknown"
    wait_text = f", steps wait on data {100 * wait:.0f}% of the time" if wait is not None else ""
    saturated = cpu is not None and cpu >= CPU_SATURATED_PERCENT
    starved = wait is not None and wait >= DATA_WAIT_HIGH
    if gpu < GPU_BUSY_PERCENT and (saturated or starved):
        why = "the input pipeline cannot keep up" if saturated else "the loader waits on disk or network"
        return Diagnosis(
            Bottleneck.INPUT_BOUND,
            f"input-bound: GPU {gpu:.0f}% busy, {cpu_text}{wait_text}: {why}; {INPUT_FIXES}",
        )
    if gpu >= GPU_BUSY_PERCENT:
        room = ""
        if load.gpu_memory_percent is not None and load.gpu_memory_percent < 60:
            room = f"; GPU memory {load.gpu_memory_percent:.0f}% used: a larger batch may fit"
        return Diagnosis(
            Bottleneck.COMPUTE_BOUND,
            f"compute-bound: GPU {gpu:.0f}% busy, {cpu_text}: the GPU is the limit, as it should be; "
            f"mixed precision (train.precision bf16/fp16) makes it faster{room}",
        )
    return Diagnosis(
        Bottleneck.WAITING,
        f"waiting: GPU {gpu:.0f}% busy, {cpu_text}{wait_text}: neither is the limit, the job waits on "
        "something else (data sync, checkpoint upload, evaluation, a stall): `trainstack logs`",
    )


@dataclass(frozen=True)
class GpuReading:
    index: int
    utilization_percent: float | None
    memory_percent: float | None
    memory_used_bytes: float | None


@dataclass
class InstanceReading:
    """One instance's newest published values (None = nothing published in the last few minutes)."""

    instance_id: str
    instance_type: str
    values: dict[str, float] = field(default_factory=dict)
    gpus: list[GpuReading] = field(default_factory=list)
    newest: datetime | None = None  # start of the newest period with data (CloudWatch's timestamp)

    def value(self, name: str) -> float | None:
        return self.values.get(name)


@dataclass(frozen=True)
class Target:
    """What `top` watches: the job's running instances or the dev box."""

    label: str
    instances: dict[str, str]  # instance id → type
    progress: Progress | None = None
    note: str = ""
    # The job's lives, oldest first: each one's time to first step and mean data wait (the ledger's).
    lives: tuple[Life, ...] = ()


# Shown for a figure a life has not measured (yet): never 0, which would claim an instant first step.
UNKNOWN = "–"


def first_step_text(seconds: float | None) -> str:
    """A life's time to first step: `4.2s`, `42s`, `3m 05s`; "–" while unknown."""
    if seconds is None:
        return UNKNOWN
    # Tenths under 10 s: a warm start's few seconds are what streaming and a standby are for.
    return f"{seconds:.1f}s" if seconds < 10 else format_duration(seconds)


def data_wait_text(fraction: float | None) -> str:
    """A life's mean data wait as a share of step time: `12%`; "–" while unknown."""
    return UNKNOWN if fraction is None else f"{100 * fraction:.0f}%"


def life_summary(life: Life) -> dict[str, Any]:
    """One life as `top --json` lists it (null: not measured)."""
    return {
        "life_id": life.life_id,
        "instance_id": life.instance_id,
        "instance_type": life.instance_type,
        "outcome": life.outcome,
        "started_at": life.started_at,
        "first_step_seconds": life.first_step_seconds,
        "data_wait_fraction": life.data_wait_fraction,
    }


def job_target(clients: Clients, stack: Stack, job_id: str | None) -> Target:
    outputs = stack.outputs
    job = resolve_job(clients, outputs, job_id)
    ledger = read_ledger(clients, outputs.bucket, job)
    running = {
        life.instance_id: life.instance_type or "?"
        for life in (ledger.lives if ledger is not None else [])
        if life.running and not life.ended_at and life.instance_id
    }
    status = ledger.status if ledger is not None else "not started"
    note = "" if running else f"no instance runs job {job.job_id} now (status: {status})"
    progress = read_progress(clients, outputs.bucket, job)
    lives = tuple(ledger.lives) if ledger is not None else ()
    return Target(f"job {job.job_id}", running, progress, note, lives)


def dev_target(clients: Clients, stack: Stack) -> Target:
    box = require_dev_instance(clients, stack.outputs)
    return Target(f"dev box {box.instance_id}", {box.instance_id: box.instance_type})


def _metric(instance_id: str, name: str, gpu: int | None = None) -> dict[str, Any]:
    dimensions = [{"Name": hm.INSTANCE_DIMENSION, "Value": instance_id}]
    if gpu is not None:
        dimensions.append({"Name": hm.GPU_DIMENSION, "Value": str(gpu)})
    return {"Namespace": hm.NAMESPACE, "MetricName": name, "Dimensions": dimensions}


def gpu_indices(cloudwatch: Any, instance_id: str) -> list[int]:
    """The GPUs the instance publishes per-GPU metrics for."""
    found = cloudwatch.list_metrics(
        Namespace=hm.NAMESPACE,
        MetricName=hm.GPU_UTILIZATION,
        Dimensions=[{"Name": hm.INSTANCE_DIMENSION, "Value": instance_id}, {"Name": hm.GPU_DIMENSION}],
    )
    indices = {
        int(d["Value"])
        for metric in found.get("Metrics", [])
        for d in metric.get("Dimensions", [])
        if d.get("Name") == hm.GPU_DIMENSION and str(d.get("Value", "")).isdigit()
    }
    return sorted(indices)


def read_instances(cloudwatch: Any, instances: dict[str, str], now: datetime) -> list[InstanceReading]:
    """The newest value of each instance's host and per-GPU metrics, in one GetMetricData call per 500."""
    readings = {i: InstanceReading(i, t) for i, t in instances.items()}
    queries: list[dict[str, Any]] = []
    where: dict[str, tuple[str, str, int | None]] = {}
    for instance_id in instances:
        wanted: list[tuple[str, int | None]] = [(name, None) for name in hm.HOST_METRICS]
        wanted += [(name, None) for name in hm.GPU_MEAN_METRICS]
        for index in gpu_indices(cloudwatch, instance_id):
            wanted += [(name, index) for name in hm.PER_GPU_METRICS]
        for name, gpu in wanted:
            query_id = f"m{len(queries)}"
            where[query_id] = (instance_id, name, gpu)
            stat = {"Metric": _metric(instance_id, name, gpu), "Period": METRICS_PERIOD_SECONDS}
            queries.append({"Id": query_id, "MetricStat": {**stat, "Stat": "Average"}})
    gpu_values: dict[tuple[str, int], dict[str, float]] = {}
    for start in range(0, len(queries), 500):
        answer = cloudwatch.get_metric_data(
            MetricDataQueries=queries[start : start + 500],
            StartTime=now - LOOKBACK,
            EndTime=now,
            ScanBy="TimestampDescending",
        )
        for result in answer.get("MetricDataResults", []):
            points = sorted(
                zip(result.get("Timestamps", []), result.get("Values", []), strict=False), reverse=True
            )
            if not points:
                continue
            instance_id, name, gpu = where[result["Id"]]
            at, value = points[0]
            reading = readings[instance_id]
            reading.newest = max(at, reading.newest) if reading.newest else at
            if gpu is None:
                reading.values[name] = float(value)
            else:
                gpu_values.setdefault((instance_id, gpu), {})[name] = float(value)
    for (instance_id, index), values in sorted(gpu_values.items()):
        readings[instance_id].gpus.append(
            GpuReading(
                index,
                values.get(hm.GPU_UTILIZATION),
                values.get(hm.GPU_MEMORY_UTILIZATION),
                values.get(hm.GPU_MEMORY_USED),
            )
        )
    return list(readings.values())


def load_of(reading: InstanceReading, progress: Progress | None) -> Load:
    return Load(
        gpu_percent=reading.value(hm.GPU_UTILIZATION),
        cpu_percent=reading.value(hm.CPU_UTILIZATION),
        data_wait_fraction=progress.data_wait_fraction if progress is not None else None,
        gpu_memory_percent=reading.value(hm.GPU_MEMORY_UTILIZATION),
    )


def snapshot(target: Target, readings: Sequence[InstanceReading], now: datetime) -> dict[str, Any]:
    """What one refresh shows, JSON-ready (`--json` prints it; the screen renders it)."""
    instances = []
    for reading in readings:
        load = load_of(reading, target.progress)
        diagnosis = diagnose(load)
        instances.append(
            {
                "instance_id": reading.instance_id,
                "instance_type": reading.instance_type,
                "metrics_age_s": (now - reading.newest).total_seconds() if reading.newest else None,
                "gpus": [vars(g) for g in reading.gpus],
                **{name: reading.value(name) for name in (*hm.HOST_METRICS, *hm.GPU_MEAN_METRICS)},
                "data_wait_fraction": load.data_wait_fraction,
                "diagnosis": {"bottleneck": diagnosis.bottleneck.value, "line": diagnosis.line},
            }
        )
    progress = target.progress
    return {
        "target": target.label,
        "note": target.note,
        "at": now.isoformat(timespec="seconds"),
        "progress": {
            "step": progress.step,
            "total_steps": progress.total_steps,
            "samples_per_s": progress.samples_per_s,
            "updated_at": progress.updated_at,
        }
        if progress is not None
        else None,
        "instances": instances,
        "lives": [life_summary(life) for life in target.lives],
    }


def _bar(percent: float | None) -> RenderableType:
    if percent is None:
        return Text("-")
    return ProgressBar(total=100.0, completed=max(0.0, min(100.0, percent)), width=20)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:,.1f} MB/s"


def render(shot: dict[str, Any], problem: str = "") -> RenderableType:
    """The screen for one snapshot: per instance its GPUs, CPU and memory as bars, I/O rates, a diagnosis;
    `problem`: why this is not the newest one."""
    parts: list[RenderableType] = []
    head = f"trainstack top: {shot['target']}   {shot['at']}"
    progress = shot["progress"]
    if progress and progress.get("step") is not None:
        speed = progress.get("samples_per_s")
        head += f"   step {progress['step']}/{progress.get('total_steps')}"
        head += f", {speed:,.0f} samples/s" if isinstance(speed, int | float) else ""
    parts.append(Text(head, style="bold"))
    if problem:
        parts.append(Text(f"refresh failed, showing the last one (retrying): {problem}", style="red"))
    if shot["note"]:
        parts.append(Text(shot["note"]))
    for item in shot["instances"]:
        age = item["metrics_age_s"]
        table = Table(
            title=f"{item['instance_id']} ({item['instance_type']}), "
            + (
                "no metrics in the last 5 minutes"
                if age is None
                else f"newest metrics: the {METRICS_PERIOD_SECONDS} s from {age:.0f} s ago"
            ),
            title_justify="left",
            show_header=False,
            box=None,
            padding=(0, 1),
        )
        for gpu in item["gpus"]:
            used = gpu["memory_used_bytes"]
            memory = "-" if used is None else f"{used / 2**30:.1f} GiB ({_percent(gpu['memory_percent'])})"
            table.add_row(
                f"GPU {gpu['index']}",
                _bar(gpu["utilization_percent"]),
                _percent(gpu["utilization_percent"]),
                f"memory {memory}",
            )
        mean = item[hm.GPU_UTILIZATION]
        if not item["gpus"] and mean is not None:
            # CloudWatch lists a new instance's per-GPU metrics minutes after their first put; the mean is
            # there from the start.
            memory_mean = f"memory {_percent(item[hm.GPU_MEMORY_UTILIZATION])} (per GPU soon)"
            table.add_row("GPUs (mean)", _bar(mean), _percent(mean), memory_mean)
        table.add_row("CPU", _bar(item[hm.CPU_UTILIZATION]), _percent(item[hm.CPU_UTILIZATION]), "")
        table.add_row("memory", _bar(item[hm.MEMORY_UTILIZATION]), _percent(item[hm.MEMORY_UTILIZATION]), "")
        wait = item["data_wait_fraction"]
        table.add_row(
            "data wait",
            _bar(None if wait is None else 100 * wait),
            "-" if wait is None else f"{100 * wait:.0f}%",
            "share of step time waiting for the loader (the trainer's progress.json)",
        )
        table.add_row(
            "disk",
            "",
            "",
            f"read {_rate(item[hm.DISK_READ_BYTES])}, write {_rate(item[hm.DISK_WRITE_BYTES])}",
        )
        table.add_row(
            "network",
            "",
            "",
            f"in {_rate(item[hm.NETWORK_IN_BYTES])}, out {_rate(item[hm.NETWORK_OUT_BYTES])}",
        )
        parts += [table, Text(f"diagnosis: {item['diagnosis']['line']}")]
    if shot.get("lives"):
        parts.append(lives_table(shot["lives"]))
    return RenderGroup(*parts)


def lives_table(lives: Sequence[dict[str, Any]]) -> Table:
    """Per life (as `life_summary` lists it): its instance, how it ended, how long its data kept it from its
    first step, and its mean data wait."""
    table = Table(title="lives", title_justify="left", box=None, padding=(0, 1))
    for column in ("instance", "type", "outcome", "first step after", "data wait"):
        table.add_column(column, justify="right" if column in {"first step after", "data wait"} else "left")
    for life in lives:
        table.add_row(
            life["instance_id"] or "?",
            life["instance_type"] or "?",
            life["outcome"],
            first_step_text(life["first_step_seconds"]),
            data_wait_text(life["data_wait_fraction"]),
        )
    return table


class Watcher:
    """Refreshes the target every call and the metrics at most once per publish period: GetMetricData is
    billed per metric read, and a value newer than the last put does not exist."""

    def __init__(
        self, read_target: Callable[[], Target], cloudwatch: Any, clock: Callable[[], float] | None = None
    ) -> None:
        self._read_target = read_target
        self._cloudwatch = cloudwatch
        self._clock = clock or time.monotonic
        self._read_at: float | None = None
        self._readings: list[InstanceReading] = []
        self._instances: dict[str, str] = {}

    def refresh(self) -> dict[str, Any]:
        now = datetime.now(timezone.utc)
        target = self._read_target()
        tick = self._clock()
        stale = self._read_at is None or tick - self._read_at >= METRICS_PERIOD_SECONDS
        if stale or target.instances != self._instances:
            self._readings = read_instances(self._cloudwatch, target.instances, now)
            self._instances, self._read_at = dict(target.instances), tick
        return snapshot(target, self._readings, now)


def add_top_command(commands: Any, parents: Sequence[argparse.ArgumentParser]) -> None:
    top = commands.add_parser(
        "top",
        parents=list(parents),
        help="the job's (or dev box's) GPUs, CPU, memory, disk and network, and what limits it",
        description="Per GPU utilisation and memory, CPU and memory load, the trainer's data-wait share, "
        "disk and network throughput, refreshed every few seconds, with a one-line diagnosis: GPU under "
        "~70% busy while the CPU is saturated = input-bound, GPU busy = compute-bound, both low = waiting "
        "on something else. From the CloudWatch metrics the instance publishes every 30 s.",
    )
    which = top.add_mutually_exclusive_group()
    which.add_argument(
        "--job",
        metavar="ID",
        help="the job to watch (default: the current one; `trainstack jobs` lists them)",
    )
    which.add_argument("--dev", action="store_true", help="watch the dev box instead of a job")
    top.add_argument("--once", action="store_true", help="print one refresh and return (--json implies it)")
    top.add_argument(
        "--interval",
        type=float,
        default=DEFAULT_INTERVAL_SECONDS,
        metavar="S",
        help=f"seconds between refreshes (default {DEFAULT_INTERVAL_SECONDS:g})",
    )


def run(
    clients: Clients,
    stack: Stack,
    *,
    job_id: str | None,
    dev: bool,
    once: bool,
    interval: float,
    as_json: bool,
    sleep: Callable[[float], None] | None = None,
    clock: Callable[[], float] | None = None,
) -> int:
    if interval < MIN_INTERVAL_SECONDS:
        raise CliError(
            f"--interval {interval:g}: at least {MIN_INTERVAL_SECONDS:g} seconds (the metrics change every "
            f"{METRICS_PERIOD_SECONDS} s)"
        )

    def read_target() -> Target:
        return dev_target(clients, stack) if dev else job_target(clients, stack, job_id)

    watcher = Watcher(read_target, clients.client("cloudwatch"), clock)
    shot = watcher.refresh()
    if as_json:
        print_json(shot)
        return 0
    out = console()
    if once:
        out.print(render(shot))
        return 0
    pause = sleep or time.sleep
    try:
        with Live(render(shot), console=out, auto_refresh=False) as live:
            while True:
                pause(interval)
                # A progress.json caught mid-rewrite or a throttled read is one bad refresh, not the end.
                try:
                    shot, problem = watcher.refresh(), ""
                except CliError as error:
                    problem = str(error)
                except (BotoCoreError, ClientError) as error:
                    problem = str(explain(error))
                live.update(render(shot, problem), refresh=True)
    except KeyboardInterrupt:
        return 0  # Ctrl-C is how one leaves top

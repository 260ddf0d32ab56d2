"""Publishes the instance's GPU (NVML) and host (/proc, bootstrap/hostmetrics.py) metrics every 30 s: the
group's `trainstack/GPUUtilization` is what infra's GPU-idle alarm watches, the rest is `trainstack top`'s."""

from __future__ import annotations

import argparse
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bootstrap import hostmetrics
from bootstrap.aws import client
from bootstrap.eventlog import EventLog
from bootstrap.hostmetrics import GpuSample, HostSampler, ProcFormatError
from bootstrap.imds import ImdsClient

NAMESPACE = hostmetrics.NAMESPACE
METRIC = hostmetrics.GPU_UTILIZATION
PERIOD_SECONDS = 30.0


def gpu_samples() -> list[GpuSample]:
    """Each GPU's utilisation and memory, or [] without a GPU/driver."""
    try:
        import pynvml  # nvidia-ml-py; present on GPU instances via requirements-instance.txt
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        samples = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            samples.append(
                GpuSample(
                    index=i,
                    utilization_percent=float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                    memory_used_bytes=int(memory.used),
                    memory_total_bytes=int(memory.total),
                )
            )
        return samples
    finally:
        pynvml.nvmlShutdown()


def gpu_utilization_percent() -> float | None:
    """Mean utilisation over this instance's GPUs, or None without a GPU/driver."""
    samples = gpu_samples()
    return sum(s.utilization_percent for s in samples) / len(samples) if samples else None


class GpuMetricPublisher:
    """A background thread; without a GPU only the host's load is published; a failed put is logged and the
    next period puts again."""

    def __init__(
        self,
        cloudwatch: Any,
        group_name: str,
        log: EventLog,
        *,
        instance_id: str,
        job_id: str = "",
        proc: Path = Path("/proc"),
    ) -> None:
        self._cloudwatch = cloudwatch
        self._group_name = group_name
        self._log = log
        self._instance_id = instance_id
        # Per job as well as per instance: a job's numbers outlive its instances (spot replacements).
        self._aggregates = {
            hostmetrics.GROUP_DIMENSION: group_name,
            hostmetrics.JOB_DIMENSION: job_id,
        }
        self._host: HostSampler | None = HostSampler(proc)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-metrics", daemon=True)

    def start(self) -> bool:
        """Starts publishing; False when no GPU is visible (the host's load is published all the same)."""
        gpus = bool(gpu_samples())
        if not gpus:
            self._log.event("metrics", "no GPU visible to NVML; GPU metrics not published")
        self.prime()
        self._thread.start()
        return gpus

    def prime(self) -> None:
        """Reads the /proc counters once, so that the next put already carries rates."""
        self._sample_host()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def publish_once(self) -> None:
        data = hostmetrics.metric_data(
            self._sample_host(), gpu_samples(), instance_id=self._instance_id, aggregates=self._aggregates
        )
        for batch in hostmetrics.batches(data):
            self._cloudwatch.put_metric_data(Namespace=NAMESPACE, MetricData=batch)

    def _sample_host(self) -> hostmetrics.HostLoad | None:
        if self._host is None:
            return None
        try:
            return self._host.sample(time.monotonic())
        except (OSError, ProcFormatError) as exc:
            # Without /proc the GPU metrics still matter (the idle alarm): say it once, go on without.
            self._log.event("metrics", "host load not readable; only GPU metrics published", error=str(exc))
            self._host = None
            return None

    def _run(self) -> None:
        while not self._stop.wait(PERIOD_SECONDS):
            try:
                self.publish_once()
            except Exception as exc:  # one period's data is lost; log and keep going
                self._log.event("metrics", "metrics put failed", error=str(exc))


def main(argv: Sequence[str] | None = None) -> int:
    """`python3 -m bootstrap.gpumetrics`: publish this instance's GPU and host metrics every 30 s until
    SIGTERM, under its instance id only: for an instance that runs no agent (the dev box), so that
    `trainstack top --dev` has numbers. `--once` publishes one interval and returns."""
    parser = argparse.ArgumentParser(prog="python3 -m bootstrap.gpumetrics", description=main.__doc__)
    parser.add_argument("--region", default="", help="default: the instance's own (IMDS)")
    parser.add_argument("--principal", default="dev-role", help="whose role publishes (the IAM check's name)")
    parser.add_argument("--once", action="store_true", help="publish one interval, then return")
    parser.add_argument("--interval", type=float, default=PERIOD_SECONDS, help=argparse.SUPPRESS)
    parser.add_argument("--proc", type=Path, default=Path("/proc"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    identity = ImdsClient().identity(args.region)
    log = EventLog()
    cloudwatch = client("cloudwatch", args.region or identity.region, principal=args.principal)
    # No group and no job on such an instance: its own dimension only.
    publisher = GpuMetricPublisher(cloudwatch, "", log, instance_id=identity.instance_id, proc=args.proc)
    if args.once:
        publisher.prime()
        time.sleep(min(args.interval, 1.0))
        publisher.publish_once()
        return 0
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    publisher.start()
    log.event("metrics", "publishing host and GPU metrics", instance_id=identity.instance_id)
    stop.wait()
    publisher.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

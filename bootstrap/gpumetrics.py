"""Publishes `trainstack/GPUUtilization` from NVML every minute: the metric infra's GPU-idle alarm watches."""

from __future__ import annotations

import threading
from typing import Any

from bootstrap.eventlog import EventLog

NAMESPACE = "trainstack"
METRIC = "GPUUtilization"
PERIOD_SECONDS = 60.0


def gpu_utilization_percent() -> float | None:
    """Mean utilisation over this instance's GPUs, or None without a GPU/driver."""
    try:
        import pynvml  # nvidia-ml-py; present on GPU instances via requirements-instance.txt
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return None
        rates = [
            pynvml.nvmlDeviceGetUtilizationRates(pynvml.nvmlDeviceGetHandleByIndex(i)).gpu
            for i in range(count)
        ]
        return float(sum(rates)) / count
    finally:
        pynvml.nvmlShutdown()


class GpuMetricPublisher:
    """A background thread; a missing GPU disables it, a failed put is logged and retried next period."""

    def __init__(self, cloudwatch: Any, group_name: str, log: EventLog) -> None:
        self._cloudwatch = cloudwatch
        self._group_name = group_name
        self._log = log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-metrics", daemon=True)

    def start(self) -> bool:
        if gpu_utilization_percent() is None:
            self._log.event("metrics", "no GPU visible to NVML; GPUUtilization not published")
            return False
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def publish_once(self) -> None:
        value = gpu_utilization_percent()
        if value is None:
            return
        self._cloudwatch.put_metric_data(
            Namespace=NAMESPACE,
            MetricData=[
                {
                    "MetricName": METRIC,
                    "Dimensions": [{"Name": "AutoScalingGroupName", "Value": self._group_name}],
                    "Value": value,
                    "Unit": "Percent",
                }
            ],
        )

    def _run(self) -> None:
        while not self._stop.wait(PERIOD_SECONDS):
            try:
                self.publish_once()
            except Exception as exc:  # the alarm treats missing data as breaching; log and keep going
                self._log.event("metrics", "GPUUtilization put failed", error=str(exc))

"""The GPU check: nothing is spent on the job (scratch, data, lease) before the GPUs answer."""

from __future__ import annotations

from bootstrap.outcomes import LifeEnd
from bootstrap.phases.base import Ended, Life


class GpuCheck:
    name = "gpu-check"

    def run(self, life: Life) -> Ended | None:
        life.phase = self.name
        gpu_count = life.boot.preflight()
        if life.stops.is_set():
            return life.stops.stopped_before_training()
        if gpu_count is None:
            # A bad GPU: the group replaces this instance (its health), the job waits for the next one.
            return LifeEnd.REPLACE
        life.gpu_count = gpu_count
        return None

"""The phases of an instance life, from its binding to its outcome, each behind `Phase` (base.py).

In order: the GPU check, the scratch space, the job's one writer (holder, standby or surplus), the dataset,
training. A new phase is a file here and one entry in `life_phases`; the life's class (bootstrap/
lifecycle.py) only runs the list.
"""

from __future__ import annotations

from bootstrap.phases.base import Ended, Life, Phase, run_phases
from bootstrap.phases.data import Data
from bootstrap.phases.gpu import GpuCheck
from bootstrap.phases.training import Training
from bootstrap.phases.workspace import Workspace
from bootstrap.phases.writer import OneWriterRole

__all__ = ["Ended", "Life", "Phase", "life_phases", "run_phases"]


def life_phases() -> list[Phase]:
    """A fresh list per life (the phases keep no state of their own, but a test may add to one life's)."""
    return [GpuCheck(), Workspace(), OneWriterRole(), Data(), Training()]

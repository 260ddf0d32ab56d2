"""The life's scratch space (instance store first: bootstrap/scratch.py), claimed for its job alone."""

from __future__ import annotations

from bootstrap.jobbinding import claim_scratch
from bootstrap.phases.base import Ended, Life
from bootstrap.scratch import prepare_scratch
from bootstrap.trainer import TrainerPaths


class Workspace:
    name = "scratch"

    def run(self, life: Life) -> Ended | None:
        # Still the GPU check's phase for a stop: nothing of the job's is on disk yet.
        scratch = prepare_scratch(life.config.scratch_dir, life.log)
        claim_scratch(scratch, life.config.job_id, life.log)
        life.paths = TrainerPaths(scratch=scratch)
        return None

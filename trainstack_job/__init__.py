"""trainstack's job contract and a tiny helper for job authors (standard library only).

    job = trainstack_job.Job.from_env()
    checkpoint = job.latest_checkpoint()          # None on a fresh start
    ...
    with job.save_checkpoint(step) as directory:  # committed when the block ends
        save_state(directory / "state.pt")
    if job.should_stop():
        job.exit_stopped(step)

docs/job-contract.md describes the contract; trainstack_job.lightning and trainstack_job.hf hold the
framework callbacks (imported only by the scripts that use them).
"""

from trainstack_job.context import CheckpointContext
from trainstack_job.job import Checkpoint, Job

__all__ = ["Checkpoint", "CheckpointContext", "Job"]

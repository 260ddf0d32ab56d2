"""The job's dataset: waited for while it is being pushed, then synced to scratch at the job's version
(bootstrap/datasync.py). A job that reads its data itself (`data.sync: false`) skips this phase. A version
pushed as shards (`trainstack data push DIR --format shards`) is streamed instead when the built-in trainer
reads it, or when the job's job.yaml says `data: {mode: stream}`: only the shard indexes are placed, and
the trainer fetches shards on demand into scratch's shard cache (kept across lives on the same disk)."""

from __future__ import annotations

from bootstrap.datasync import DatasetVersionError, DataSync, DiskSpaceError, JobDataset, SyncAborted
from bootstrap.outcomes import Failure, LifeEnd
from bootstrap.phases.base import Ended, Life
from bootstrap.trainer import SHARD_CACHE as SHARD_CACHE  # the job's shard cache, under scratch
from trainstack_job.contract import RESUME_COMMAND


class Data:
    name = "data"

    def run(self, life: Life) -> Ended | None:
        if life.user_job is not None and not life.user_job.data_sync:
            return None
        assert life.paths is not None  # the workspace phase came first
        dataset = DataSync.for_dataset(life.clients.s3, life.stack_config, life.config.dataset, life.log)
        life.phase = "data-wait"
        if not life.boot.wait_for_dataset(dataset, life.job, life.stops, life.state_poll_seconds):
            return life.stops.stopped_before_training() if life.stops.is_set() else LifeEnd.NO_DATA
        life.phase = "data-sync"
        version = JobDataset(life.clients.s3, life.config, life.job, life.log)
        if life.user_job is None or life.user_job.data_mode == "stream":
            # A version pushed as shards is then streamed: its indexes placed, not its files synced.
            dataset.stream_cache = life.paths.shard_cache
        try:
            synced = dataset.sync(
                life.paths.scratch / "data", should_abort=life.stops.is_set, check_version=version.check
            )
        except DatasetVersionError as exc:
            # Every instance finds the same checkpoints and the same version: only the user can settle it.
            life.log.event("failed", "dataset version differs from the job's checkpoints", error=str(exc))
            return Failure(LifeEnd.FAILED, str(exc), list(life.log.tail), fix=exc.fix, permanent=True)
        except SyncAborted:
            life.log.event("data", "dataset sync aborted by the stop", reason=life.stops.reason)
            return life.stops.stopped_before_training()
        except DiskSpaceError as exc:
            # The next instance gets the same disk: retrying would only bill for the same failure.
            life.log.event("failed", "dataset does not fit on this instance", error=str(exc))
            return Failure(
                LifeEnd.FAILED,
                str(exc),
                list(life.log.tail),
                fix="raise trainstack:rootVolumeSizeGb (or use a type with a larger instance store), "
                f"run pulumi up, then {RESUME_COMMAND}",
                permanent=True,
            )
        version.record(synced)
        return None

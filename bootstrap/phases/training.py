"""Training: the checkpoint restored, the job's process started (or a standby's start gate opened once it
holds the lease), supervised to its exit, the last checkpoint uploaded within the stop's deadline, and the
exit classified into the life's end (bootstrap/supervisor.py; a multi-node job's generations,
bootstrap/generations.py). The last phase: it always ends the life."""

from __future__ import annotations

import time

from bootstrap.generations import Generations
from bootstrap.gpumetrics import GpuMetricPublisher
from bootstrap.outcomes import Failure, LifeEnd
from bootstrap.persist import CheckpointPersister, UploadAbandonedError
from bootstrap.phases.base import Ended, Life
from bootstrap.phases.writer import persister_for, wait_as_standby
from bootstrap.standby import Role
from bootstrap.trainer import TrainerPaths, TrainerProcess
from trainstack_job.contract import RESUME_COMMAND
from trainstack_job.jobfile import JobSpecError
from trainstack_job.jobs import JobPrefixes

# After a completion or failure nothing hurries the last upload but the bill.
FINAL_UPLOAD_SECONDS = 300.0


class Training:
    name = "training"

    def run(self, life: Life) -> Ended:
        assert life.paths is not None  # the workspace phase came first
        return train(life, life.paths, life.gpu_count)


def train(life: Life, paths: TrainerPaths, gpu_count: int) -> Ended:
    standby = life.writer is not None and life.writer.role is Role.STANDBY
    reader = persister_for(life, paths, fenced=not standby and life.writer is not None)
    persister = life.persister = reader
    life.phase = "restore"
    try:
        restored = restore(life, reader)
        trainer = job_process(life, paths, gpu_count, restored)
    except (UploadAbandonedError, InterruptedError):
        return life.stops.stopped_before_training()
    except JobSpecError as exc:
        fix = exc.fix or f"fix the job's requirements file, run pulumi up, then {RESUME_COMMAND}"
        return Failure(LifeEnd.FAILED, exc.problems[0], list(life.log.tail), fix=fix, permanent=True)
    if standby:
        ended = wait_as_standby(life, trainer, floor=reader.token_floor() or 0)
        reader.close()
        if ended is not None:
            return ended
        # The holder's stop step, confirmed in S3 before it let go: exactly where this life resumes.
        persister = life.persister = persister_for(life, paths, fenced=True)
        life.phase = "restore"
        try:
            restored = persister.restore(should_abort=life.stops.is_set)
        except (UploadAbandonedError, InterruptedError):
            return life.stops.stopped_before_training()
        if life.user_job is not None:
            trainer = job_process(life, paths, gpu_count, restored)
    if not (standby and life.user_job is None):
        # Heartbeats read the file from the next line on, and trainer.start() deletes an earlier life's copy
        # only later: a report left on this disk (a life of the same job before, on this instance) would
        # be folded into this life's samples/s and data wait in that gap. A gated standby's trainer is
        # already running and its file is its own.
        paths.progress_file.unlink(missing_ok=True)
    life.job.progress_file = paths.progress_file
    assert life.identity is not None  # identified before any phase of the life
    metrics = GpuMetricPublisher(
        life.clients.cloudwatch,
        life.config.group_name,
        life.log,
        instance_id=life.identity.instance_id,
        job_id=life.config.job_id,
    )
    if life.multi_node:
        assert life.identity is not None
        life.generations = Generations.for_node(
            life.config,
            life.log,
            life.stops,
            life.job,
            life.supervisor,
            life.clients.s3,
            life.imds,
            life.identity,
            paths,
            poll_seconds=life.state_poll_seconds,
            fence=life.generation_fence,
        )

    def start() -> TrainerProcess | None:
        life.phase = "training"
        if life.generations is not None:
            return None  # each generation starts it (bootstrap/generations.py)
        if standby and life.user_job is None:
            life.log.event("train", "start gate opened: the standby trains", restored_step=restored)
            trainer.open_gate()
            return trainer
        life.log.event("train", "trainer starting", argv=trainer.argv, restored_step=restored)
        trainer.start()
        return trainer

    if not life.stops.launch(start):
        return life.stops.stopped_before_training()
    persister.start()
    if gpu_count:
        metrics.start()
    try:
        code = (
            life.generations.train(trainer, persister, restored)
            if life.generations is not None
            else life.supervisor.supervise(trainer, persister, watch_silent=life.user_job is None)
        )
    finally:
        metrics.stop()
    life.phase = "final-upload"
    reason, seen_at = life.stops.state()
    deadline = (
        seen_at + life.config.stop_deadline_seconds
        if seen_at is not None
        else time.monotonic() + FINAL_UPLOAD_SECONDS
    )
    kill_at = life.stops.kill_at
    if kill_at is not None:
        # Past the lease's end by this clock the fence refuses every commit anyway.
        deadline = min(deadline, kill_at)
    persisted = persister.finish(deadline)
    persister.close()
    if life.generations is not None:
        persisted = life.generations.job_checkpoint_confirmed(persisted, persister, deadline)
    life.job.upload_progress_quietly()
    # Read again: the final upload may have found the lease lost (or past its end) after the exit.
    reason = life.stops.reason
    return life.supervisor.classify_exit(code, reason, persisted, trainer)


def restore(life: Life, persister: CheckpointPersister) -> int | None:
    """The newest verified checkpoint of this job; for a new job with `resume_from`, that job's."""
    restored = persister.restore(should_abort=life.stops.is_set)
    source = life.config.resume_from
    if restored is not None or not source:
        return restored
    origin = CheckpointPersister(
        life.clients.s3,
        life.config.bucket,
        JobPrefixes.of(source).checkpoints,
        persister.local_dir,
        life.log,
    )
    try:
        restored = origin.restore(should_abort=life.stops.is_set)
    finally:
        origin.close()
    life.log.event(
        "checkpoint",
        f"new job: starting from job {source}'s checkpoint"
        if restored is not None
        else f"new job: job {source} has no checkpoint to start from; starting at step 0",
        resume_from=source,
        step=restored,
    )
    return restored


def job_process(life: Life, paths: TrainerPaths, gpu_count: int, restored: int | None) -> TrainerProcess:
    """The job to run: a user's command in its workdir (and requirements), or the built-in trainer."""
    return life.supervisor.job_process(
        paths,
        gpu_count,
        restored,
        identity=life.identity,
        spot_interruptions=life.ledger.spot_interruptions(),
        log_sink=life.trainer_log_sink,
    )

"""One writer per job: the lease taken before the data sync (holder, standby or surplus), the warm standby's
wait, the fence every commit is checked against, and a pool instance's scale-in protection around them
(bootstrap/standby.py and bootstrap/lease.py do the work; this phase puts them in the life's order).

A multi-node job has no lease: its nodes commit fenced by their generation (bootstrap/generation_fence.py).
"""

from __future__ import annotations

from functools import partial

from bootstrap.errors import one_line
from bootstrap.eventlog import utc_now
from bootstrap.generation_fence import GenerationFence, GenerationSupersededError
from bootstrap.imds import InstanceIdentity
from bootstrap.lease import JobLease, LeaseExpiredError, LeaseLostError
from bootstrap.ledger import TERMINAL_STATUSES
from bootstrap.outcomes import LifeEnd
from bootstrap.persist import TOKEN_RECORD, CheckpointPersister
from bootstrap.phases.base import Ended, Life
from bootstrap.standby import OneWriter, Role, wait_warm
from bootstrap.trainer import TrainerPaths, TrainerProcess


class OneWriterRole:
    """Holder, standby or surplus, before the data sync: a surplus instance leaves at once, a standby syncs
    the data while it waits. A multi-node job's nodes all train (their generation fences them)."""

    name = "one-writer"

    def run(self, life: Life) -> Ended | None:
        if life.multi_node:
            return None
        assert life.paths is not None  # the workspace phase came first
        if take_role(life, life.paths) is Role.SURPLUS:
            return LifeEnd.SURPLUS
        return None


def take_role(life: Life, paths: TrainerPaths) -> Role:
    """Holder, standby or surplus: decided before the data sync, so a surplus instance leaves at once
    and a standby syncs the data while it waits."""
    assert life.identity is not None
    life_id = life.job.ledger_store.life_id or life.identity.instance_id
    life.writer = OneWriter(
        life.clients.s3,
        life.config,
        life.log,
        instance_id=life.identity.instance_id,
        life_id=life_id,
        stale_seconds=life.stale_seconds,
        instance_gone=life.fleet.instance_gone,
        drift_seconds=life.drift_seconds,
    )
    # The floor is the agent's own record of the tokens it wrote, never latest.json's token: the job
    # could write that one, and every later lease's token would start above it.
    reader = persister_for(life, paths)
    try:
        floor = reader.token_floor() or 0
    finally:
        reader.close()  # read once for the floor: its transfer threads are not kept for the life
    role = life.writer.take(floor=floor)
    writer = life.writer
    # From now on the holder (or the standby once it takes over) stops on its own clock when it cannot
    # renew: no network in this thread, so it works while S3 and the state poller hang.
    life.spawn("lease-clock", lambda: writer.watch_own_clock(life.stops, life.background_stop.wait))
    if role is Role.STANDBY:
        life.job.record(lambda ledger: ledger.mark_standby(utc_now()))
        if life.config.lanes > 1:
            # Protected since before its claim; a standby trains nothing, so a lower desired capacity
            # may take it (the holder trains on). Protected again if it takes the lease over.
            protect_from_scale_in(life, False)
    close_dead_holder(life)
    return role


def wait_as_standby(life: Life, trainer: TrainerProcess, floor: int) -> Ended | None:
    """Wait warm for the lease (bootstrap/standby.py); None once this life holds it."""
    assert life.writer is not None
    life.phase = "standby"
    ended = wait_warm(
        life.writer,
        trainer,
        life.stops,
        life.log,
        gated=life.user_job is None,
        job_ended=partial(job_ended, life),
        floor=floor,
    )
    if ended is not None:
        return ended
    life.job.record(lambda ledger: ledger.end_standby(utc_now()))
    close_dead_holder(life)
    if life.config.lanes > 1:
        protect_from_scale_in(life)  # it trains from now on
    if job_ended(life):
        # The holder completed (or the job was given up) just before it let go: nothing to continue.
        life.log.event("standby", "took the lease of a job that has ended; letting it go")
        trainer.request_stop()
        return LifeEnd.STANDBY_ENDED
    return None


def job_ended(life: Life) -> bool:
    """Whether the job's ledger says it has ended (completed, failed, cancelled, stopped)."""
    return life.job.ledger_store.load().status in TERMINAL_STATUSES


def close_dead_holder(life: Life) -> None:
    """A lease taken because it expired names a life whose instance vanished: close it truthfully."""
    dead = life.writer.dead_holder() if life.writer is not None else None
    if dead is None or life.identity is None:
        return
    me = life.identity.instance_id
    life.job.record(lambda ledger: ledger.close_dead_holder(dead, me))


def persister_for(life: Life, paths: TrainerPaths, *, fenced: bool = False) -> CheckpointPersister:
    """The job's checkpoints in S3 ↔ this instance's checkpoint folder; `fenced`: as the lease's holder,
    every commit checked against the lease (a standby only reads). A multi-node job has no lease: its
    commits are always fenced by the generation this node trains in."""
    keep = life.user_job.checkpoint_keep if life.user_job else 3
    lease = life.writer.lease if fenced and life.writer is not None else None
    fence: JobLease | GenerationFence | None = lease
    if fence is None and life.multi_node and life.identity is not None:
        fence = life.generation_fence = GenerationFence(
            life.clients.s3,
            life.config.bucket,
            life.config.prefixes.state,
            instance_id=life.identity.instance_id,
        )
    return CheckpointPersister(
        life.clients.s3,
        life.config.bucket,
        life.config.prefixes.checkpoints,
        paths.checkpoint_dir,
        life.log,
        keep=keep,
        fence=fence,
        on_lease_lost=partial(lease_lost, life) if fence is not None else None,
        # The lease tokens it writes into latest.json, recorded where the job cannot write.
        token_record=life.config.prefixes.state + TOKEN_RECORD,
    )


def lease_lost(life: Life, error: LeaseLostError) -> None:
    """The persister found this life's fence lost at a commit: the matching stop, at once."""
    if isinstance(error, GenerationSupersededError):
        # The others declared this node's generation lost and train on from the confirmed checkpoint.
        life.stops.request("generation_superseded", generation=error.generation, newer_generation=error.newer)
        return
    if isinstance(error, LeaseExpiredError):
        # Not known lost: unproven past its end by this instance's clock; the same stop as the clock's.
        life.stops.request("lease_expiring", unrenewed_s=round(error.unproven_seconds, 1))
        return
    life.stops.request("lease_lost", holder=error.holder, token=error.token)


def leaving_before_binding(life: Life, identity: InstanceIdentity) -> bool:
    """A pool running several jobs at once: this instance is protected from scale-in before it claims a
    job, so a lower desired capacity never takes it between its claim and its lease (the job would wait
    for the dead instance's claim to go stale, minutes). True when scale-in chose it before the
    protection came: it is on its way out and claims nothing. When the group cannot be read it goes on:
    a dead instance's claim still goes stale."""
    protect_from_scale_in(life, True, why="while it looks for a job and serves it")
    try:
        leaving = life.fleet.leaving(identity.instance_id)
    except Exception as exc:
        life.log.event("fleet", "could not read this instance's state in its group", error=one_line(exc))
        return False
    if leaving:
        life.log.event(
            "fleet", "scaled in before it claimed a job: it takes none", group=life.config.group_name
        )
    return leaving


def protect_from_scale_in(life: Life, protected: bool = True, why: str = "while it serves the job") -> None:
    """A pool running several jobs at once: while this instance trains a job (holds its lease), a lower
    desired capacity (a cancel, the cost cap, a scheduler) takes an idle instance or a standby, never
    this one. It comes off when the instance leaves (Fleet.leave_for_good) or waits as a standby. Best
    effort: the lease still keeps one writer."""
    assert life.identity is not None
    try:
        life.fleet.protect(life.identity.instance_id, protected)
    except Exception as exc:
        life.log.event("fleet", "could not set this instance's scale-in protection", error=one_line(exc))
        return
    if protected:
        life.log.event("fleet", f"protected from scale-in {why}", group=life.config.group_name)
    else:
        life.log.event("fleet", "scale-in protection off while it waits as a standby")

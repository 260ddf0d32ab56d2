"""One writer per single-node job, as one life lives it: hold the lease, wait warm as the standby, or leave.

docs/internals.md, "Jobs, the lease and the standby". With capacity rebalancing AWS launches the replacement
before it terminates the at-risk instance, and a manual scale-up or a replacement launched while the old
instance drains does the same: a second instance must never train the job beside the first. The first life
to take the lease trains; the next waits warm (data, checkpoint, trainer built) and takes over the moment
the holder lets go, at exactly the holder's stop step; any further instance leaves the group.

The holder's side runs on the state poller (renew, hand-over decision) and after the final upload (release);
nothing here is on the stop path.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import Enum

from bootstrap.agent_config import AgentConfig
from bootstrap.errors import one_line
from bootstrap.eventlog import EventLog
from bootstrap.lease import DRIFT_SECONDS, JobLease, LeaseLostError, StandbyRecord
from bootstrap.outcomes import Failure, LifeEnd
from bootstrap.stops import StopRequests
from bootstrap.trainer import TrainerProcess
from trainstack_job.jobs import LEASE, STANDBY

# How long a standby's gated trainer may take to warm up (imports, model, first batch) before the standby
# says it is ready anyway: a holder's hand-over then waits on the restore, not on a warm-up that hangs.
WARM_UP_SECONDS = 600.0
# A standby polls the lease this often: a released lease is taken within about a second.
STANDBY_POLL_SECONDS = 1.0
# An at-risk holder asks whether the standby is ready this often (the state poll is 10 s: too slow here).
HANDOVER_POLL_SECONDS = 1.0
# …and beats its own record (and asks whether the job ended) this often.
STANDBY_BEAT_SECONDS = 5.0
# A holder that could not renew its lease for this share of it asks its trainer to stop at the next step
# boundary (docs/internals.md, "A partition: the holder stops on its own clock"): the rest of the lease is
# the trainer's time to reach the boundary and write its stop checkpoint; at the lease's end by the
# holder's own clock the trainer is killed.
LEASE_STOP_SHARE = 0.5
# How often the holder looks at its own clock: a local comparison, no network.
CLOCK_TICK_SECONDS = 0.2


class Role(str, Enum):
    """What a life does for its job."""

    HOLDER = "holder"  # holds the lease: trains and writes the checkpoints
    STANDBY = "standby"  # waits warm for the lease
    SURPLUS = "surplus"  # a holder and a standby exist already: leaves


class OneWriter:
    """This life's lease and standby record, and the decisions made from them."""

    def __init__(
        self,
        s3: object,
        config: AgentConfig,
        log: EventLog,
        *,
        instance_id: str,
        life_id: str,
        stale_seconds: float,
        instance_gone: Callable[[str], bool] | None = None,
        drift_seconds: float = DRIFT_SECONDS,
    ) -> None:
        state = config.prefixes.state
        # Whether the group no longer has an instance (bootstrap/fleet.py): a holder whose instance is gone
        # is dead now, not after the stale limit.
        self._instance_gone = instance_gone
        self.log = log
        self.instance_id = instance_id
        self.lease = JobLease(
            s3,
            config.bucket,
            state + LEASE,
            holder=instance_id,
            life_id=life_id,
            stale_seconds=stale_seconds,
            job_id=config.job_id,
            drift_seconds=drift_seconds,
        )
        self.standby = StandbyRecord(
            s3,
            config.bucket,
            state + STANDBY,
            instance_id=instance_id,
            life_id=life_id,
            stale_seconds=stale_seconds,
        )
        self.role: Role | None = None
        # A rebalance recommendation was seen: hand over as soon as a standby is ready.
        self.at_risk = False
        self._handing_over = False
        self._wait_errors = 0

    @property
    def holding(self) -> bool:
        return self.role is Role.HOLDER

    def _acquire(self, now: float, floor: int, mark: float | None = None) -> int | None:
        """The lease if it is free, or if its holder's instance has left the group (it died silently).
        `mark`: time.monotonic() read before `now`, from which the holder's own deadline counts."""
        mark = time.monotonic() if mark is None else mark
        token = self.lease.try_acquire(now, floor=floor, proof_at=mark)
        if token is not None or self._instance_gone is None:
            return token
        state = self.lease.read()
        if state is None or state.holder == self.instance_id:
            return None
        try:
            gone = self._instance_gone(state.holder)
        except Exception:  # unknown is not gone: the stale limit still decides
            return None
        if not gone:
            return None
        self.log.event("lease", "the lease's holder has left the group: taking over now", holder=state.holder)
        return self.lease.try_acquire(now, floor=floor, gone=state.life_id, proof_at=mark)

    def take(self, floor: int) -> Role:
        """Holder if the lease is free (`floor`: the token latest.json carries), else standby or surplus."""
        mark = time.monotonic()
        now = time.time()
        token = self._acquire(now, floor, mark)
        if token is not None:
            self.role = Role.HOLDER
            replaced = self.lease.replaced
            self.log.event(
                "lease",
                "lease acquired",
                token=token,
                uri=self.lease.uri,
                **({"from": replaced.holder, "stop_step": replaced.stop_step} if replaced else {}),
            )
            return self.role
        holder = self.lease.read()
        if self.standby.claim(now):
            self.role = Role.STANDBY
            self.log.event(
                "standby",
                "the job's lease is held; waiting warm as its standby",
                holder=holder.holder if holder else None,
            )
        else:
            self.role = Role.SURPLUS
            other = self.standby.read()
            self.log.event(
                "standby",
                "the job has a holder and a standby already: this instance leaves",
                holder=holder.holder if holder else None,
                standby=other.instance_id if other else None,
            )
        return self.role

    def dead_holder(self) -> str | None:
        """The life id of the holder whose lease this life took because it expired (it never let go: its
        instance died without a word), or None."""
        replaced = self.lease.replaced
        if replaced is None or replaced.released_at is not None or replaced.life_id == self.lease.life_id:
            return None
        return replaced.life_id

    def ready(self) -> None:
        self.standby.mark_ready(time.time())

    def wait_for_lease(
        self, *, stopping: Callable[[float], bool], job_ended: Callable[[], bool], floor: int
    ) -> int | None:
        """As the standby: the token once the lease is free; None when a stop (`stopping(timeout)` waits
        and says whether one came), the job's end or another standby's claim ended the wait."""
        next_beat = time.monotonic() + STANDBY_BEAT_SECONDS
        next_gone_check = time.monotonic() + STANDBY_BEAT_SECONDS
        while not stopping(STANDBY_POLL_SECONDS):
            try:
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + STANDBY_BEAT_SECONDS
                    if job_ended():
                        self.log.event("standby", "the job ended while this standby waited")
                        return None
                    if not self.standby.heartbeat(time.time()):
                        self.log.event("standby", "another instance took over as standby; leaving")
                        return None
                beat = time.monotonic() >= next_gone_check
                if beat:
                    next_gone_check = time.monotonic() + STANDBY_BEAT_SECONDS
                # Asking the group costs an API call: once per beat, the lease itself every poll.
                mark = time.monotonic()
                token = (
                    self._acquire(time.time(), floor, mark)
                    if beat
                    else self.lease.try_acquire(time.time(), floor=floor, proof_at=mark)
                )
            except Exception as exc:  # S3 hiccup: keep waiting; the holder's lease cannot expire unseen
                self._wait_errors += 1
                if self._wait_errors == 1:
                    self.log.event("standby", "cannot read the lease; will retry", error=one_line(exc))
                continue
            if token is None:
                continue
            self.role = Role.HOLDER
            replaced = self.lease.replaced
            self.log.event(
                "lease",
                "lease taken over",
                token=token,
                stop_step=replaced.stop_step if replaced else None,
                **{"from": replaced.holder if replaced else None},
                expired=replaced is not None and replaced.released_at is None,
            )
            self._clear_standby()
            return token
        return None

    def _clear_standby(self) -> None:
        try:
            self.standby.clear()
        except Exception as exc:  # it goes stale on its own; the next claim replaces it
            self.log.event("standby", "could not clear the standby record", error=one_line(exc))

    def end_standby(self) -> None:
        """A standby that stops waiting without the lease takes its record with it."""
        if self.role is Role.STANDBY:
            self._clear_standby()

    def poll(self) -> str | None:
        """As the holder, once per state poll: renew the lease; the stop reason this life must follow now
        (`lease_lost`, `handover`), or None. Raises what S3 raises (the poller retries next time)."""
        if not self.holding:
            return None
        mark = time.monotonic()
        now = time.time()
        try:
            self.lease.renew(now, proof_at=mark)
        except LeaseLostError as exc:
            self.log.event("lease", "lease lost: this instance stops writing the job", error=str(exc))
            return "lease_lost"
        return self.handover_due(now)

    def confirm(self, *, retry_seconds: float = 1.0) -> bool | None:
        """As the holder, before an act that ends the job (results, status, e-mail, scale-in): prove the
        lease with a conditional write now. True: held, and no other life may take it for `stale_seconds`
        + the drift margin; False: another life holds it (this one must end `superseded`); None: S3 could
        not say before this life's own deadline (the next life here decides). Retries an outage until then.
        """
        if not self.holding:
            return False
        while True:
            mark = time.monotonic()
            try:
                self.lease.renew(time.time(), proof_at=mark)
                return True
            except LeaseLostError as exc:
                self.log.event(
                    "lease", "lease lost before the job's end: this life ends superseded", error=str(exc)
                )
                return False
            except Exception as exc:
                if self.lease.expired(time.monotonic() + retry_seconds):
                    self.log.event(
                        "lease",
                        "cannot prove the lease before its expiry on this instance's clock: the job's end is "
                        "left to the next life",
                        error=one_line(exc),
                    )
                    return None
            time.sleep(retry_seconds)

    def keep(self, done: threading.Event, every_seconds: float) -> None:
        """As the holder, while the life's outcome is acted on: renew every `every_seconds` until `done`.
        Quiet: a failed renewal only means the next `confirm` decides."""
        while not done.wait(every_seconds):
            if not self.holding:
                return
            mark = time.monotonic()
            try:
                self.lease.renew(time.time(), proof_at=mark)
            except Exception:  # confirm() before each act of the end decides, not this
                continue

    def watch_own_clock(self, stops: StopRequests, done: Callable[[float], bool]) -> None:
        """As the holder, until `done(timeout)` says so: once `LEASE_STOP_SHARE` of the lease passed without
        a proof, ask the trainer to stop (`lease_expiring`) and have it killed at the lease's end by this
        instance's own clock. Local only: it keeps working while S3 and the state poller hang."""
        lease = self.lease
        while not done(CLOCK_TICK_SECONDS):
            deadline = lease.own_deadline()
            if not self.holding or deadline is None:
                continue
            if stops.kill_at is not None:
                stops.kill_by(deadline)  # a renewal since moved the lease's end: so moves the kill
            now = time.monotonic()
            if now < deadline - (1 - LEASE_STOP_SHARE) * lease.stale_seconds:
                continue
            # Whatever stop is under way (a spot notice, a cancel) must also end before the lease does.
            stops.kill_by(deadline)
            if stops.reason is None:
                stops.request(
                    "lease_expiring",
                    unrenewed_s=round(now - (lease.proven_at or now), 1),
                    kill_in_s=round(deadline - now, 1),
                )

    def handover_due(self, now: float | None = None) -> str | None:
        """`handover` once this holder is at risk (a rebalance recommendation) and a standby is ready."""
        if not (self.holding and self.at_risk) or self._handing_over:
            return None
        standby = self.standby.ready(time.time() if now is None else now)
        if standby is None or standby.instance_id == self.instance_id:
            return None
        self.log.event(
            "handover",
            "a standby is ready: handing over at the next step boundary",
            standby=standby.instance_id,
        )
        return "handover"

    def release(self, stop_step: int | None) -> None:
        """As the holder, at the end of the life: let the lease go with the confirmed step."""
        if not self.holding:
            return
        try:
            released = self.lease.release(time.time(), stop_step)
        except Exception as exc:  # the lease then expires after the stale limit: a slower hand-over
            self.log.event("lease", "could not release the lease; it expires on its own", error=one_line(exc))
            return
        if released:
            self.log.event("lease", "lease released", stop_step=stop_step)


def wait_warm(
    writer: OneWriter,
    trainer: TrainerProcess,
    stops: StopRequests,
    log: EventLog,
    *,
    gated: bool,
    job_ended: Callable[[], bool],
    floor: int,
) -> LifeEnd | Failure | None:
    """The standby's wait: the built-in trainer started gated (it warms up, then waits at its start gate;
    a user's job is simply started once the lease is taken), the standby marked ready, then the lease
    polled until it is free. None once this life holds the lease; else how the life ends."""
    waited = time.monotonic()
    if gated:

        def start_gated() -> TrainerProcess:
            log.event("train", "trainer starting gated (standby)", argv=trainer.argv)
            trainer.start(gated=True)
            return trainer

        if not stops.launch(start_gated):
            writer.end_standby()
            return LifeEnd.STANDBY_ENDED
        # Ready once warm: the trainer says so on one line (the built-in trainer's start gate).
        while not any("standby: warm" in line for line in list(trainer.tail)):
            if trainer.poll() is not None or stops.is_set() or time.monotonic() - waited > WARM_UP_SECONDS:
                break
            time.sleep(0.1)
    writer.ready()
    log.event("standby", "standby ready", warm_s=round(time.monotonic() - waited, 2))

    def stopping(timeout: float) -> bool:
        return stops.wait(timeout) or (gated and trainer.poll() is not None)

    if writer.wait_for_lease(stopping=stopping, job_ended=job_ended, floor=floor) is not None:
        return None
    code = trainer.poll() if gated else None
    if gated and code is None:
        # A gated trainer exits 75 at once, writing nothing (it never held the lease).
        trainer.request_stop()
        if trainer.wait(timeout=30) is None:
            trainer.kill()
    writer.end_standby()
    if gated and code is not None and not stops.is_set():
        lines = list(trainer.tail)[-25:]
        return Failure(LifeEnd.FAILED, f"trainer exited {code} while waiting as the standby", lines)
    return LifeEnd.STANDBY_ENDED

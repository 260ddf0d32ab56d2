"""One writer per job: the lease (`jobs/<id>/state/lease.json`) and the warm standby (`standby.json`).

Why (docs/internals.md, "Jobs, the lease and the standby"): with capacity rebalancing a replacement instance
boots while the old one still trains, and both would write the job's checkpoints. The lease names the one
life that may write them, with a fencing token that grows by one with every acquisition; the persister
checks it before each write and `latest.json` carries it, so a holder that lost the lease (it stalled past
the stale limit and a standby took over) can no longer move the job's checkpoint.

Both records are only ever written conditionally (If-None-Match: * for the first write, If-Match: <the ETag
read> for every later one, If-Match on the one delete): S3 lets exactly one of two racing writers in, the
other gets 412 (or 409 for a concurrent conditional write) and decides again from a fresh read. Times are
epoch seconds (`time.time()`), injected by the caller; EC2 clocks are NTP-synced (Amazon Time Sync), and
the stale limit is tens of seconds, so skew only shifts ages a little.

A holder must assume it lost the lease when it cannot prove otherwise (the etcd/Chubby rule;
docs/internals.md, "A partition: the holder stops on its own clock"). Every write that proves the lease
(acquire, renew) carries its expiry, `expires_at` = the wall time read when the proof started +
`stale_seconds`, and the holder notes the same instant on its own monotonic clock (`own_deadline`).
Another life takes an unreleased lease only after `expires_at` + `drift_seconds` by its own wall clock, so a
holder that stops training by its own deadline has stopped before anyone else may start, as long as the two
clocks disagree by less than the margin.

Errors: S3 unreachable raises botocore's errors to the caller (the state poller retries on its next poll;
a fence check that cannot read makes the persister retry the upload later, never write unchecked). A record
that is not a record (hand-edited, truncated) counts as absent and is replaced by the next conditional write
against its ETag.
"""

from __future__ import annotations

import time
from typing import Any

from trainstack_job.records import LeaseState, S3Record, StandbyState

# Conflicts in a row before a write gives up for now: each one means another writer got in, which the
# next read sees, so more than a few in a row means something keeps rewriting the record.
ATTEMPTS = 8
# docs/internals.md: 3 × state_poll_seconds (10 s) + 30 s; a holder that has not renewed for this long died.
STALE_SECONDS = 60.0
# What another life adds to a lease's expiry before it takes the lease over: the clock error between two
# instances (Amazon Time Sync keeps it under a millisecond; an instance whose chrony has not synced yet after
# boot can be off by seconds) plus the time a killed trainer takes to die. The holder stops on its own clock
# at the expiry; the taker waits this much longer, so the two never train at once.
DRIFT_SECONDS = 10.0


class LeaseLostError(Exception):
    """The lease no longer names this life's token: another life writes the job's checkpoints now."""

    def __init__(self, holder: str, token: int, uri: str = "") -> None:
        self.holder = holder
        self.token = token
        self.uri = uri
        where = f"{uri}: " if uri else ""
        super().__init__(
            f"{where}lease lost to {holder} (token {token}): "
            "this instance no longer writes the job's checkpoints"
        )


class LeaseExpiredError(LeaseLostError):
    """This life could not prove its lease before the lease's expiry by its own clock: it must act as if
    another life holds it (it may: S3 was unreachable from here, not from there)."""

    def __init__(self, holder: str, token: int, uri: str = "", unproven_seconds: float = 0.0) -> None:
        self.unproven_seconds = unproven_seconds
        super().__init__(holder, token, uri)
        where = f"{uri}: " if uri else ""
        self.args = (
            f"{where}lease not renewed for {unproven_seconds:.1f} s, past its expiry on this instance's "
            "clock: this instance stops writing the job's checkpoints",
        )

    def __str__(self) -> str:
        return str(self.args[0])


def _contended(uri: str) -> RuntimeError:
    return RuntimeError(f"{uri}: {ATTEMPTS} conditional writes lost in a row; will retry")


class JobLease(S3Record):
    """This life's view of the job's lease (`jobs/<id>/state/lease.json`).

    `holder` is the instance id, `life_id` the ledger's id of this life. A lease naming this instance under
    another life id is an earlier agent on this instance, which died (systemd runs one agent per instance and
    stops its trainer with it): it may be taken at once instead of after the stale limit.
    """

    def __init__(
        self,
        s3: Any,
        bucket: str,
        key: str,
        *,
        holder: str,
        life_id: str,
        stale_seconds: float = STALE_SECONDS,
        job_id: str | None = None,
        drift_seconds: float = DRIFT_SECONDS,
    ) -> None:
        super().__init__(s3, bucket, key)
        self.holder = holder
        self.life_id = life_id
        self.stale_seconds = stale_seconds
        self.drift_seconds = drift_seconds
        self.job_id = job_id
        self.held_token: int | None = None
        # time.monotonic() when this life's newest proof of the lease (acquire, renew) started: the lease is
        # this life's until `stale_seconds` after it, by this instance's own clock.
        self.proven_at: float | None = None
        # The lease this life replaced when it acquired (None: there was none): its `stop_step` is where the
        # previous holder stopped, the checkpoint a standby resumes from.
        self.replaced: LeaseState | None = None

    @property
    def token(self) -> int:
        """The fencing token this life acquired (the persister's `Fence.token`)."""
        if self.held_token is None:
            raise RuntimeError(f"{self.uri}: the lease was never acquired by {self.life_id}")
        return self.held_token

    def read(self) -> LeaseState | None:
        """The lease as stored now (None when absent or not a lease record)."""
        raw, _ = self.get()
        return LeaseState.from_record(raw)

    def own_deadline(self) -> float | None:
        """When this life's lease ends by its own monotonic clock (None: never proved): past it, this life
        must act as if another holds the lease."""
        return None if self.proven_at is None else self.proven_at + self.stale_seconds

    def unproven_seconds(self, mono: float | None = None) -> float:
        """Seconds since this life last proved the lease (inf: never)."""
        if self.proven_at is None:
            return float("inf")
        return (time.monotonic() if mono is None else mono) - self.proven_at

    def expired(self, mono: float | None = None) -> bool:
        """Past this life's own deadline (or never proved)."""
        deadline = self.own_deadline()
        return deadline is None or (time.monotonic() if mono is None else mono) >= deadline

    def _expired_error(self) -> LeaseExpiredError:
        return LeaseExpiredError(self.holder, self.held_token or 0, self.uri, self.unproven_seconds())

    def _ours(self, state: LeaseState | None) -> bool:
        return (
            state is not None
            and self.held_token is not None
            and state.token == self.held_token
            and state.life_id == self.life_id
            and state.holder == self.holder
        )

    def _lost(self, state: LeaseState | None) -> LeaseLostError:
        if state is None:
            return LeaseLostError("nobody (the lease is gone)", 0, self.uri)
        holder = state.holder if state.released_at is None else f"{state.holder} (released)"
        return LeaseLostError(holder, state.token, self.uri)

    def _free(self, state: LeaseState | None, now: float, gone: str | None = None) -> bool:
        """May this life take the lease as it is now? `gone`: a life id whose instance is known to be gone
        (the group no longer has it), whose lease need not wait for the stale limit."""
        if state is None or not state.live(now, self.stale_seconds, self.drift_seconds):
            return True
        if gone is not None and state.life_id == gone:
            return True
        # An earlier agent on this instance holds it: that agent died (one agent per instance).
        return state.holder == self.holder and state.life_id != self.life_id

    def try_acquire(
        self, now: float, *, floor: int = 0, gone: str | None = None, proof_at: float | None = None
    ) -> int | None:
        """The token this life now holds, or None while a live holder has the lease.

        Acquiring writes the previous token + 1 (at least `floor` + 1: pass the token `latest.json` carries,
        so a lease that was deleted or damaged by hand never hands out a token below one already used).
        Called again while this life holds the lease, it returns the same token. `proof_at`: time.monotonic()
        read before `now` (default: on entry), from which this life's own deadline counts.
        """
        mark = time.monotonic() if proof_at is None else proof_at
        for _ in range(ATTEMPTS):
            raw, etag = self.get()
            state = LeaseState.from_record(raw)
            if (
                state is not None
                and state.holder == self.holder
                and state.life_id == self.life_id
                and state.released_at is None
            ):
                # Already this life's: a repeated call, or a put that got in although its answer was lost.
                # No new proof: the stored expiry may be older than this call.
                self.held_token = state.token
                return state.token
            if not self._free(state, now, gone):
                return None
            token = max(state.token if state is not None else 0, floor) + 1
            acquired = LeaseState(
                holder=self.holder,
                life_id=self.life_id,
                token=token,
                acquired_at=now,
                heartbeat_at=now,
                job_id=self.job_id,
                expires_at=now + self.stale_seconds,
            )
            if self.put(acquired.to_record(), etag):
                self.held_token = token
                self.replaced = state
                self.proven_at = mark
                return token
        raise _contended(self.uri)

    def renew(self, now: float, *, proof_at: float | None = None) -> LeaseState:
        """Move the heartbeat and the expiry forward; `LeaseLostError` when the lease no longer names this
        life's token. `proof_at` as for `try_acquire`: on success this life's own deadline counts from it."""
        mark = time.monotonic() if proof_at is None else proof_at
        for _ in range(ATTEMPTS):
            raw, etag = self.get()
            state = LeaseState.from_record(raw)
            if state is None or not self._ours(state) or state.released_at is not None:
                raise self._lost(state)
            heartbeat = max(now, state.heartbeat_at)
            renewed = LeaseState(
                **{
                    **state.to_record(),
                    "heartbeat_at": heartbeat,
                    "expires_at": max(now + self.stale_seconds, state.expiry(self.stale_seconds)),
                }
            )
            if self.put(renewed.to_record(), etag):
                # A proof only moves forward: a slow call must not pull the deadline back.
                self.proven_at = mark if self.proven_at is None else max(self.proven_at, mark)
                return renewed
        raise _contended(self.uri)

    def release(self, now: float, stop_step: int | None) -> bool:
        """Let the lease go, saying at which step this life stopped, so a standby takes over at once.

        True when released (now or before); False when the lease is not this life's any more (nothing is
        written then). Never raises on a lost lease; an unreachable S3 still raises.
        """
        for _ in range(ATTEMPTS):
            raw, etag = self.get()
            state = LeaseState.from_record(raw)
            if state is None or not self._ours(state):
                return False
            if state.released_at is not None:
                return True
            released = LeaseState(
                **{**state.to_record(), "heartbeat_at": now, "released_at": now, "stop_step": stop_step}
            )
            if self.put(released.to_record(), etag):
                return True
        raise _contended(self.uri)

    def check(self) -> LeaseState:
        """The fence: one GET; `LeaseLostError` unless the lease still names this life's token and is not
        released. Once half the lease has passed without a renewal (the state poller is late, S3 slow) a GET
        no longer leaves the commit time to finish before the lease's expiry, so the lease is renewed instead;
        past this life's own deadline a failed renewal raises `LeaseExpiredError`. Any other read error
        propagates: the caller must not write unchecked."""
        if self.proven_at is not None and self.unproven_seconds() >= self.stale_seconds / 2:
            mark = time.monotonic()  # read before the wall clock: the own deadline never ends later
            try:
                return self.renew(time.time(), proof_at=mark)
            except LeaseLostError:
                raise
            except Exception as exc:
                if self.expired():
                    raise self._expired_error() from exc
                raise
        state = self.read()
        if state is None or not self._ours(state) or state.released_at is not None:
            raise self._lost(state)
        return state


class StandbyRecord(S3Record):
    """The job's one warm standby (`jobs/<id>/state/standby.json`), from one life's point of view.

    A life claims the record when it is absent, names this instance (an earlier agent here died, or this
    life claims again), or its standby stopped beating; a second live standby would only cost money, so
    whoever finds another live one leaves (`live_other`). `mark_ready`, `heartbeat` and `clear` write only
    while the record names this life, and return False once it does not.
    """

    def __init__(
        self,
        s3: Any,
        bucket: str,
        key: str,
        *,
        instance_id: str,
        life_id: str,
        stale_seconds: float = STALE_SECONDS,
    ) -> None:
        super().__init__(s3, bucket, key)
        self.instance_id = instance_id
        self.life_id = life_id
        self.stale_seconds = stale_seconds

    def read(self) -> StandbyState | None:
        raw, _ = self.get()
        return StandbyState.from_record(raw)

    def _ours(self, state: StandbyState | None) -> bool:
        return state is not None and state.instance_id == self.instance_id and state.life_id == self.life_id

    def claim(self, now: float) -> bool:
        """Become the job's standby; False when another instance's standby is live."""
        for _ in range(ATTEMPTS):
            raw, etag = self.get()
            state = StandbyState.from_record(raw)
            if (
                state is not None
                and state.instance_id != self.instance_id
                and state.live(now, self.stale_seconds)
            ):
                return False
            if self._ours(state) and state is not None:
                # Claimed again by this life: keep when it started waiting and whether it is ready.
                claimed = StandbyState(**{**state.to_record(), "heartbeat_at": now})
            else:
                claimed = StandbyState(
                    self.instance_id, self.life_id, since=now, ready_at=None, heartbeat_at=now
                )
            if self.put(claimed.to_record(), etag):
                return True
        raise _contended(self.uri)

    def _update(self, now: float, **changes: Any) -> bool:
        for _ in range(ATTEMPTS):
            raw, etag = self.get()
            state = StandbyState.from_record(raw)
            if state is None or not self._ours(state):
                return False
            updated = StandbyState(**{**state.to_record(), "heartbeat_at": now, **changes})
            if self.put(updated.to_record(), etag):
                return True
        raise _contended(self.uri)

    def mark_ready(self, now: float) -> bool:
        """Say the standby is prepared (data, checkpoint, job set up): the holder may hand over to it."""
        return self._update(now, ready_at=now)

    def heartbeat(self, now: float) -> bool:
        """Still waiting; False when the record names another life (this one went stale and was replaced)."""
        return self._update(now)

    def clear(self) -> bool:
        """Remove the record if it is this life's (it took the lease, or stopped waiting); False otherwise."""
        for _ in range(ATTEMPTS):
            raw, etag = self.get()
            state = StandbyState.from_record(raw)
            if etag is None or state is None or not self._ours(state):
                return False
            if self.delete(etag):
                return True
        raise _contended(self.uri)

    def live_other(self, now: float, me: str | None = None) -> StandbyState | None:
        """A live standby of another instance than `me` (default: this one), or None."""
        state = self.read()
        me = self.instance_id if me is None else me
        if state is not None and state.instance_id != me and state.live(now, self.stale_seconds):
            return state
        return None

    def ready(self, now: float) -> StandbyState | None:
        """A live standby that is ready to take over (what the holder asks before handing over)."""
        state = self.read()
        if state is not None and state.is_ready and state.live(now, self.stale_seconds):
            return state
        return None

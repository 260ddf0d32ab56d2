"""The one owner of a job's checkpoints in S3: restore before the job, upload while it runs, flush at a stop.

Guarantees (docs/job-contract.md):
- only committed step directories (a `manifest.json` with each file's sha256) are uploaded, the files
  before the manifest, and `latest.json` after the manifest;
- `latest.json` only ever moves forward, through S3 conditional writes (If-Match / If-None-Match), so two
  writers (an old life still draining, a new one starting) cannot move it back;
- an upload overtaken by a newer committed step is cancelled, so at a stop the newest step goes first;
- every network wait is bounded by the caller's deadline; what was confirmed is reported truthfully;
- with a fence (the job's lease, bootstrap/lease.py) only the lease's holder writes: the lease is checked
  before a step's first file, before its manifest and before `latest.json`, which carries the holder's token
  and is never overwritten by a writer with a lower token. A writer that lost the lease stops writing for
  good, says so once and reports its checkpoint as not confirmed;
- only the lease record (which the job cannot write: its role denies `state/`) says who holds the lease:
  a token in `latest.json` above the one the lease names for this holder was never handed out (tokens only
  grow), so it is a forgery (a job that wrote `latest.json` with its own credentials), said once and
  replaced, never a reason to stop. The job's own local `latest.json` is never uploaded (the agent writes
  its own), and the floor for the next lease's token is the agent's own record of the tokens it wrote
  (`token_record`, under the job's `state/`), never `latest.json`;
- a multi-node job is fenced by its generation instead (bootstrap/generation_fence.py): the token is the
  generation the node trains in, carried under `latest.json`'s `"generation"` key, never `"token"`, so a
  lease's tokens and generation numbers are never compared: a `latest.json` without the fence's key (the
  other kind's, an unfenced or older writer's) counts as an earlier writer's and is replaced.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

from bootstrap.checkpoint_restore import CheckpointRestore
from bootstrap.checkpoint_store import (
    TOKEN_RECORD,
    WAIT_TICK,
    CheckpointRefusedError,
    EventSink,
    Fence,
    PersistResult,
    UploadAbandonedError,
    bounded,
    close_when_done,
)
from bootstrap.lease import LeaseLostError
from bootstrap.safefiles import (
    PlantedLinkError,
    fd_path,
    open_inside,
    replace_file,
)
from trainstack_job.layout import (
    LATEST,
    MANIFEST,
    committed_steps,
    latest_json,
    read_manifest,
    step_dir_name,
)
from trainstack_job.records import LeaseState, is_conflict, write_condition

# What callers import from here: the persister's own module stays the one to name.
__all__ = [
    "TOKEN_RECORD",
    "CheckpointPersister",
    "CheckpointRefusedError",
    "EventSink",
    "Fence",
    "PersistResult",
    "UploadAbandonedError",
    "bounded",
]


def _refuse_outside(directory: Path, file_name: str, step: int) -> None:
    """The job writes the manifest and the step folder; the agent uploading them may run as root. A file
    name that leaves the folder (`../`, an absolute path) or a link (to /etc/shadow, to the agent's own
    files) is never read: the step is not uploaded, and says why."""
    path = directory / file_name
    inside = Path(os.path.normpath(path)).is_relative_to(directory) and not Path(file_name).is_absolute()
    links = [p for p in (path, *path.parents) if p.is_symlink() and p.is_relative_to(directory)]
    if not inside or links or (path.exists() and not path.is_file()):
        raise UploadAbandonedError(
            f"step {step}: {file_name!r} is not a regular file inside {directory}; not uploaded "
            "(the job's checkpoint must hold plain files)"
        )


class CheckpointPersister(CheckpointRestore):
    """Mirrors committed `step-<N>/` directories of `local_dir` to `s3://bucket/prefix` (guarantees above).

    `restore()` before the job starts, `start()` while it runs, `finish(deadline)` once it has exited.
    """

    # -- upload -----------------------------------------------------------------------------------------

    def newest_local_step(self) -> int | None:
        steps = committed_steps(self.local_dir)
        return steps[0] if steps else None

    def start(self) -> None:
        """Upload committed steps in the background, newest first, until `finish()`."""
        self._thread = threading.Thread(target=self._run, name="checkpoint-persister", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        backoff = self._poll_seconds
        while not self._stopping.wait(backoff):
            try:
                self.persist_newest(deadline=None, background=True)
                backoff = self._poll_seconds
                if self._failing_since is not None:
                    self._log.event("checkpoint", "S3 uploads work again", confirmed_step=self.confirmed_step)
                    self._failing_since = None
            except LeaseLostError:
                return  # another life writes the job's checkpoints now: nothing left to do here, ever
            except UploadAbandonedError:
                backoff = self._poll_seconds
            except Exception as exc:  # S3 down: keep the local copy, retry with backoff, never crash the job
                if self._failing_since is None:
                    self._failing_since = time.monotonic()
                    self._log.event(
                        "checkpoint",
                        "checkpoint upload failed; retrying (the local copy is kept)",
                        level="warning",
                        uri=self.uri,
                        error=str(exc).splitlines()[0][:200],
                    )
                backoff = min(max(backoff * 2, 1.0), 15.0)

    def persist_newest(self, deadline: float | None, background: bool = False) -> int | None:
        """Upload the newest committed local step if S3 does not have it confirmed; returns that step.

        `LeaseLostError` (with a fence) once the lease is lost: from then on nothing is written.
        """
        if self._lease_lost is not None:
            raise self._lease_lost
        step = self.newest_local_step()
        confirmed = self.confirmed_step
        if step is None or (confirmed is not None and step <= confirmed):
            return confirmed
        self._upload_step(step, deadline, background)
        if background:
            self._prune_remote(step)
        return self.confirmed_step

    # -- the fence --------------------------------------------------------------------------------------

    @property
    def lease_lost(self) -> LeaseLostError | None:
        """Why this persister stopped writing for good (None while it may write)."""
        with self._lock:
            return self._lease_lost

    def _lose(self, error: LeaseLostError) -> LeaseLostError:
        """Stop writing for good; the first loss is logged once and reported to `on_lease_lost`."""
        with self._lock:
            first = self._lease_lost is None
            if first:
                self._lease_lost = error
            error = self._lease_lost or error
        if first:
            # The background thread ends on the error it raised; a final flush stops at its next check.
            self._stopping.set()
            self._log.event(
                "checkpoint",
                getattr(error, "lost_line", None)
                or f"lease lost to {error.holder} (token {error.token}): "
                "this instance no longer writes the job's checkpoints",
                level="warning",
                uri=error.uri or self.uri,
                token=self._fence.token if self._fence is not None else None,
            )
            if self._on_lease_lost is not None:
                try:
                    self._on_lease_lost(error)
                except Exception as exc:  # the caller's reaction must not undo the stop of our writes
                    self._log.event(
                        "checkpoint", "on_lease_lost failed", level="warning", error=str(exc)[:200]
                    )
        return error

    def _fence_check(self, deadline: float | None) -> object:
        """Before every write of a fenced persister: the lease must still name its token. Returns what the
        fence read (the lease record, for a `JobLease`)."""
        if self._fence is None:
            return None
        if self._lease_lost is not None:
            raise self._lease_lost
        fence = self._fence
        try:
            return bounded(fence.check, deadline, "check-lease")
        except LeaseLostError as exc:
            raise self._lose(exc) from None

    def _abandon_check(self, step: int, deadline: float | None, background: bool) -> None:
        if deadline is not None and time.monotonic() >= deadline:
            raise UploadAbandonedError(f"step {step}: deadline passed")
        if background and self._stopping.is_set():
            raise UploadAbandonedError(f"step {step}: a stop began; the final flush takes over")
        newest = self.newest_local_step()
        if newest is not None and newest > step:
            raise UploadAbandonedError(f"step {step}: superseded by step {newest}")

    def _upload_step(self, step: int, deadline: float | None, background: bool) -> None:
        started = time.monotonic()
        name = step_dir_name(step)
        directory = self.local_dir / name
        manifest = read_manifest(directory)
        if manifest is None:
            raise UploadAbandonedError(f"step {step}: removed locally before its upload")
        self._fence_check(deadline)
        for file_name, entry in manifest["files"].items():
            relative = f"{name}/{file_name}"
            _refuse_outside(directory, file_name, step)
            # A stop interrupts the background upload between files: the final flush then uploads only
            # what is missing, not a multi-GB file already in S3 (it would eat the two-minute notice).
            if self._uploaded.get(relative) == entry.get("sha256"):
                continue
            self._upload_file(directory / file_name, relative, step, deadline, background)
            self._uploaded[relative] = entry.get("sha256")
        self._abandon_check(step, deadline, background)
        # Files take a while: the lease may have moved on meanwhile, and a manifest makes a step real.
        self._fence_check(deadline)
        body = (directory / MANIFEST).read_bytes()
        bounded(
            lambda: self._s3.put_object(
                Bucket=self.bucket, Key=self._key(f"{name}/{MANIFEST}"), Body=body, ChecksumAlgorithm="SHA256"
            ),
            deadline,
            "put-manifest",
        )
        self._advance_latest(step, manifest.get("epoch"), deadline)
        seconds = time.monotonic() - started
        self.upload_seconds.append(seconds)
        self._log.event("checkpoint", "checkpoint confirmed in S3", step=step, upload_s=round(seconds, 2))

    def _upload_file(
        self, path: Path, relative: str, step: int, deadline: float | None, background: bool
    ) -> None:
        if not path.is_file():
            raise UploadAbandonedError(f"step {step}: {path} removed locally before its upload")
        step_name, file_name = relative.split("/", 1)
        # _refuse_outside looked at the names; the job may swap a link in since. The upload reads the file
        # it opened here, without following a link at any step of the way, not whatever the name says later.
        try:
            handle = open_inside(self.local_dir / step_name, file_name)
        except FileNotFoundError:
            raise UploadAbandonedError(f"step {step}: {path} removed locally before its upload") from None
        except PlantedLinkError:
            raise UploadAbandonedError(
                f"step {step}: {file_name!r} is not a regular file inside {self.local_dir / step_name}; not "
                "uploaded (the job's checkpoint must hold plain files)"
            ) from None
        try:
            future = self._transfers.upload(
                str(fd_path(handle, path)),
                self.bucket,
                self._key(relative),
                extra_args={"ChecksumAlgorithm": "SHA256"},
            )
        except BaseException:
            os.close(handle)
            raise
        while not future.done():
            try:
                self._abandon_check(step, deadline, background)
            except UploadAbandonedError:
                # Stops the remaining parts; a request already on the wire ends at its own timeout. Its
                # part may still open the descriptor's path: the descriptor stays open until the transfer's
                # last task ends, else a file the agent opens meanwhile could take its number.
                future.cancel()
                threading.Thread(
                    target=close_when_done, args=(future, handle), name="s3-upload-close", daemon=True
                ).start()
                raise
            time.sleep(WAIT_TICK)
        try:
            future.result()  # returns once every part's task has ended, not only when the status is set
        finally:
            os.close(handle)

    def _advance_latest(self, step: int, epoch: Any, deadline: float | None) -> None:
        """Move S3 `latest.json` to `step` unless it already names this step or a newer one.

        Fenced, the token decides first: a higher token than ours is the lease lost (stop for good); a lower
        one (or none) is an earlier holder's, replaced even at a higher step, because this holder resumed
        from the checkpoint that holder handed over and its own steps are the job's from here on (a step
        above is a superseded holder's last write, made between its last check and losing the lease).
        """
        token = self._fence.token if self._fence is not None else None
        for _ in range(8):
            self._fence_check(deadline)
            current, current_token, etag = self._read_latest(deadline)
            if token is not None and current_token is not None and current_token > token:
                # A newer holder moved latest.json between our check and now: the lease names it.
                record = self._fence_check(deadline)
                uri = f"{self.uri}/{LATEST}"
                if isinstance(record, LeaseState) and record.token < current_token:
                    # The lease record still names this holder's token, and a lease's tokens only grow: no
                    # lease ever handed out the higher one. Whoever wrote it (the job, with its own
                    # credentials) does not decide who holds the lease; it is replaced like any earlier
                    # writer's latest.json.
                    self._say_forged(current_token, record.token, uri)
                else:
                    superseded = getattr(self._fence, "superseded", None)
                    lost = (
                        superseded(current_token, uri)
                        if superseded is not None
                        else LeaseLostError(f"the writer of {LATEST}", current_token, uri)
                    )
                    raise self._lose(lost)
            ours = token is None or current_token == token
            if current is not None and current >= step and ours:
                # Someone (an earlier upload, another life) already moved past this step: never move it back.
                self._confirm(step)
                return
            condition = write_condition(etag)

            def put(condition: dict[str, str] = condition) -> Any:
                return self._s3.put_object(
                    Bucket=self.bucket,
                    Key=self._key(LATEST),
                    Body=self._latest_body(step, epoch, token),
                    ContentType="application/json",
                    **condition,
                )

            try:
                bounded(put, deadline, "put-latest")
            except ClientError as exc:
                if is_conflict(exc):
                    continue
                raise
            self._confirm(step)
            # The job owns local_dir: a link it put at latest.json (or at the temporary name) is never
            # followed, so it cannot make the agent write over another file.
            replace_file(
                self.local_dir / LATEST, self._latest_body(step, epoch, token), say=self._planted_link
            )
            if token is not None and self._token_key == "token":
                self._record_token(token, deadline)
            return
        raise RuntimeError(f"{self.uri}/{LATEST}: too many concurrent writers; will retry")

    def _say_forged(self, forged: int, held: int, uri: str) -> None:
        """One warning per forged token: what latest.json carried, and what the lease really says."""
        if forged in self._forged:
            return
        self._forged.add(forged)
        self._log.event(
            "checkpoint",
            f"latest.json carries token {forged}, but the lease names this holder with token {held}: "
            "replaced (a token above the lease's was never handed out; only the lease record says who "
            "writes the job's checkpoints)",
            level="warning",
            uri=uri,
            token=held,
        )

    def _latest_body(self, step: int, epoch: Any, token: int | None) -> bytes:
        """`latest.json` with the fence's token under the fence's own key."""
        if token is None or self._token_key == "token":
            return latest_json(step, epoch, token)
        value = json.loads(latest_json(step, epoch))
        value[self._token_key] = token
        return json.dumps(value).encode()

    def _prune_remote(self, latest: int) -> None:
        """Keep the newest `keep` steps at or below latest.json; older ones (and old partial uploads) go."""
        if self._lease_lost is not None:
            return  # deletes are writes too: only the lease's holder prunes
        try:
            for step in [s for s in self.remote_steps() if s <= latest][self.keep :]:
                paginator = self._s3.get_paginator("list_objects_v2")
                for page in paginator.paginate(
                    Bucket=self.bucket, Prefix=self._key(step_dir_name(step) + "/")
                ):
                    objects = [{"Key": item["Key"]} for item in page.get("Contents", [])]
                    if objects:
                        self._s3.delete_objects(
                            Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True}
                        )
        except Exception as exc:  # pruning is housekeeping: the next confirmed step tries again
            self._log.event(
                "checkpoint",
                "pruning old S3 checkpoints failed",
                level="warning",
                error=str(exc).splitlines()[0][:200],
            )

    # -- the end ----------------------------------------------------------------------------------------

    def finish(self, deadline: float) -> PersistResult:
        """Stop the background uploads and confirm the newest local step before `deadline` if at all possible.

        Returns where things stand; `PersistResult.confirmed` is False when the newest step is only local.
        """
        self._stopping.set()
        if self._thread is not None:
            # The background upload notices the stop within a tick and cancels; a hung S3 call is not awaited.
            self._thread.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        newest = self.newest_local_step()
        error = ""
        while time.monotonic() < deadline and self._lease_lost is None:
            try:
                self.persist_newest(deadline)
                break
            except LeaseLostError:
                break  # said once already, by _lose
            except UploadAbandonedError as exc:
                error = str(exc)
                break
            except Exception as exc:  # retry until the deadline: every second of S3 back is worth a try
                error = str(exc).splitlines()[0][:200]
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        result = PersistResult(newest, self.confirmed_step, lease_lost=self._lease_lost is not None)
        if result.lease_lost:
            self._log.event(
                "checkpoint",
                getattr(self._lease_lost, "not_confirmed_line", None)
                or "this instance's checkpoints were not confirmed: it lost the job's lease, "
                "and the new holder continues the job from its own",
                level="warning",
                newest_local_step=newest,
                confirmed_step=result.confirmed_step,
            )
        elif result.confirmed:
            self._log.event("checkpoint", "newest checkpoint confirmed in S3", step=result.confirmed_step)
        else:
            self._log.event(
                "checkpoint",
                "newest checkpoint NOT confirmed in S3; the replacement resumes from the confirmed one",
                level="warning",
                newest_local_step=newest,
                confirmed_step=result.confirmed_step,
                error=error,
            )
        return result

    def close(self) -> None:
        """Release the transfer threads without waiting on a hung request."""
        self._stopping.set()
        threading.Thread(target=lambda: self._transfers.shutdown(cancel=True), daemon=True).start()

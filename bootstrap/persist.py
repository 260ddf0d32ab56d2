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

import contextlib
import json
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.exceptions import ClientError

from bootstrap.lease import LeaseLostError, LeaseState
from bootstrap.safefiles import (
    PlantedLinkError,
    fd_path,
    open_directory,
    open_inside,
    outside_name,
    remove_entry,
    replace_file,
)
from trainstack_job.layout import (
    LATEST,
    MANIFEST,
    STEP_DIR,
    committed_steps,
    latest_json,
    read_manifest,
    step_dir_name,
    verify_dir,
)

# 64 MiB parts: a multi-GB checkpoint goes up as parallel parts, each with its own SHA256 checksum.
TRANSFER = TransferConfig(multipart_threshold=64 * 2**20, multipart_chunksize=64 * 2**20, max_concurrency=8)
_WAIT_TICK = 0.1
_T = TypeVar("_T")


class EventSink(Protocol):
    def event(self, stage: str, message: str, **fields: Any) -> None: ...


# Under the job's state prefix: the newest lease token this agent wrote into `latest.json`, kept where the job
# cannot write (its role and session deny `state/`): the floor for the next lease's token (`token_floor`).
TOKEN_RECORD = "latest-token.json"

# S3's codes for an SSE-KMS object whose key KMS refuses to use: off (disabled, or pending deletion), or gone.
_KMS_KEY_OFF = frozenset({"KMS.DisabledException", "KMS.KMSInvalidStateException"})
_KMS_KEY_GONE = "KMS.NotFoundException"


class Fence(Protocol):
    """Who may write the job's checkpoints: `bootstrap.lease.JobLease` once acquired.

    `check()` returns when the lease still names `token` and raises `LeaseLostError` when it does not; any
    other error (S3 unreachable) means "unknown", and the persister retries rather than write unchecked.
    What it returns is what it read: a `LeaseState` (the lease record) lets the persister tell a higher
    token in `latest.json` that no lease handed out (a forgery, replaced) from a newer holder's (lost).
    A fence may also name the key `latest.json` carries its token under (`latest_key`, default "token") and
    word a loss to a newer `latest.json` (`superseded(token, uri)`): bootstrap/generation_fence.py does.
    """

    @property
    def token(self) -> int: ...

    def check(self) -> object: ...


class UploadAbandonedError(Exception):
    """An upload given up on purpose: a newer step superseded it, the deadline passed, or a stop began."""


class CheckpointRefusedError(Exception):
    """S3 refused to hand over a file of a confirmed checkpoint (access denied, a key it cannot decrypt with,
    an outage outlasting botocore's retries), or the agent refused it: its manifest names a file outside the
    step's folder, which restoring (as root) would write anywhere on the instance. Unlike a damaged checkpoint
    it is not skipped for nothing: with no older checkpoint left, restore fails rather than start the job
    over, which would write a lower step over the one `latest.json` names."""


@dataclass(frozen=True)
class PersistResult:
    """Where persistence stands at the end of a job: the newest local step and the newest confirmed one."""

    newest_local_step: int | None
    confirmed_step: int | None
    # This instance lost the job's lease: its checkpoints are no longer the job's, whatever it uploaded.
    lease_lost: bool = False

    @property
    def confirmed(self) -> bool:
        """True when nothing the job saved is missing from S3 (never after the lease was lost)."""
        if self.lease_lost:
            return False
        if self.newest_local_step is None:
            return True
        return self.confirmed_step is not None and self.confirmed_step >= self.newest_local_step


def _is_conflict(exc: ClientError) -> bool:
    """412 (the ETag moved) or 409 (a concurrent conditional write): read again and retry."""
    error = exc.response.get("Error", {})
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return error.get("Code") in {"PreconditionFailed", "ConditionalRequestConflict"} or status in {409, 412}


def _is_missing(exc: ClientError) -> bool:
    return exc.response.get("Error", {}).get("Code") in {"NoSuchKey", "404", "NotFound"}


def bounded(fn: Callable[[], _T], deadline: float | None, what: str) -> _T:
    """Run one blocking AWS call, giving up at `deadline` (time.monotonic()) even if the socket hangs.

    The call runs on a daemon thread: a blackholed request keeps it until botocore's own timeout, but
    neither the caller nor the process exit waits for it.
    """
    if deadline is None:
        return fn()
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, name=f"s3-{what}", daemon=True).start()
    if not done.wait(max(0.0, deadline - time.monotonic())):
        raise UploadAbandonedError(f"{what}: no answer from S3 before the deadline")
    if "error" in box:
        raise box["error"]
    value: _T = box["value"]
    return value


def _close_when_done(future: Any, handle: int) -> None:
    """Close an upload's file descriptor once its transfer (cancelled or not) has no task left."""
    try:
        # A cancelled transfer's error was reported where it was cancelled.
        with contextlib.suppress(BaseException):
            future.result()
    finally:
        os.close(handle)


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


class CheckpointPersister:
    """Mirrors committed `step-<N>/` directories of `local_dir` to `s3://bucket/prefix` (guarantees above).

    `restore()` before the job starts, `start()` while it runs, `finish(deadline)` once it has exited.
    """

    def __init__(
        self,
        s3: Any,
        bucket: str,
        prefix: str,
        local_dir: Path,
        log: EventSink,
        *,
        keep: int = 3,
        poll_seconds: float = 0.5,
        fence: Fence | None = None,
        on_lease_lost: Callable[[LeaseLostError], None] | None = None,
        token_record: str | None = None,
    ) -> None:
        self._s3 = s3
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.local_dir = Path(local_dir)
        self._log = log
        self.keep = max(1, keep)
        self._poll_seconds = poll_seconds
        self._transfers = create_transfer_manager(s3, TRANSFER)
        self._lock = threading.Lock()
        self._confirmed_step: int | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing_since: float | None = None
        self.upload_seconds: list[float] = []
        # Files of a step already in S3 (relative key → sha256), uploaded by this persister.
        self._uploaded: dict[str, Any] = {}
        self._fence = fence
        # Tokens of different fences count different things (lease acquisitions, generations): each is read
        # and written under its own key, so they are never compared.
        self._token_key: str = getattr(fence, "latest_key", "token")
        self._on_lease_lost = on_lease_lost
        self._lease_lost: LeaseLostError | None = None
        # The agent's own record of the lease tokens it wrote into latest.json (a key under the job's
        # state/, TOKEN_RECORD), and the token it last recorded there; None: no record is kept.
        self._token_record = token_record
        self._recorded_token: int | None = None
        # Forged tokens found in latest.json, each said once.
        self._forged: set[int] = set()

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def _key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    @property
    def confirmed_step(self) -> int | None:
        with self._lock:
            return self._confirmed_step

    def _confirm(self, step: int) -> None:
        with self._lock:
            if self._confirmed_step is None or step > self._confirmed_step:
                self._confirmed_step = step

    # -- S3 reads ---------------------------------------------------------------------------------------

    def read_latest(self, deadline: float | None = None) -> tuple[int | None, str | None]:
        """(step, ETag) of S3 `latest.json`; (None, None) when absent; an unreadable one counts as absent
        but keeps its ETag, so the next conditional write replaces it."""
        step, _, etag = self._read_latest(deadline)
        return step, etag

    def latest_token(self, deadline: float | None = None) -> int | None:
        """The lease token S3 `latest.json` carries (None: absent, or written unfenced). Never a lease's
        floor: whoever could write latest.json (a job, with its own credentials, before its session denied
        it) could raise every later token with it; `token_floor` is the floor."""
        return self._read_latest(deadline)[1]

    def token_floor(self, deadline: float | None = None) -> int | None:
        """The newest lease token this agent recorded writing into latest.json (`token_record`; None: none
        recorded, or no record kept): the `floor` to pass to `JobLease.try_acquire`, so a lease deleted or
        damaged by hand never hands out a token already used. Read from the job's `state/`, which only the
        agent writes, so a job can never raise it."""
        if self._token_record is None:
            return None
        return self._read_token_record(deadline)[0]

    def _read_token_record(self, deadline: float | None) -> tuple[int | None, str | None]:
        """(token, ETag) of the token record; (None, None) when absent, (None, ETag) when not a record."""
        assert self._token_record is not None
        key = self._token_record
        try:
            response = bounded(
                lambda: self._s3.get_object(Bucket=self.bucket, Key=key), deadline, "read-token-record"
            )
        except ClientError as exc:
            if _is_missing(exc):
                return None, None
            raise
        etag = str(response["ETag"])
        try:
            token = json.loads(response["Body"].read()).get("token")
        except (ValueError, AttributeError):
            return None, etag
        valid = isinstance(token, int) and not isinstance(token, bool)
        return (token if valid else None), etag

    def _record_token(self, token: int, deadline: float | None) -> None:
        """Keep `token` in the agent's own record once latest.json carries it; the record only moves up
        (conditional writes: a slower, older holder never lowers it). A failure is said and retried with the
        next commit: the lease record still holds the token meanwhile."""
        if self._token_record is None or self._recorded_token == token:
            return
        key = self._token_record
        try:
            for _ in range(8):
                recorded, etag = self._read_token_record(deadline)
                if recorded is not None and recorded >= token:
                    break
                condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
                body = json.dumps({"token": token, "uri": f"{self.uri}/{LATEST}"}).encode()

                def put(condition: dict[str, str] = condition, body: bytes = body) -> Any:
                    return self._s3.put_object(
                        Bucket=self.bucket, Key=key, Body=body, ContentType="application/json", **condition
                    )

                try:
                    bounded(put, deadline, "put-token-record")
                except ClientError as exc:
                    if _is_conflict(exc):
                        continue
                    raise
                break
            else:
                raise RuntimeError("too many concurrent writers")
        except Exception as exc:  # housekeeping for a lease rebuilt by hand: never fails the commit
            self._log.event(
                "checkpoint",
                "could not record the lease token written into latest.json; retried with the next commit",
                level="warning",
                uri=f"s3://{self.bucket}/{key}",
                error=str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__,
            )
            return
        self._recorded_token = token

    def _read_latest(self, deadline: float | None) -> tuple[int | None, int | None, str | None]:
        """(step, token, ETag) of S3 `latest.json`; the token is None when it carries none."""
        try:
            response = bounded(
                lambda: self._s3.get_object(Bucket=self.bucket, Key=self._key(LATEST)),
                deadline,
                "read-latest",
            )
        except ClientError as exc:
            if _is_missing(exc):
                return None, None, None
            raise
        etag = str(response["ETag"])
        try:
            value = json.loads(response["Body"].read())
            token = value.get(self._token_key)
            valid = isinstance(token, int) and not isinstance(token, bool)
            return int(value["step"]), (token if valid else None), etag
        except (ValueError, KeyError, TypeError, AttributeError):
            self._log.event(
                "checkpoint",
                "S3 latest.json is unreadable; it will be replaced",
                level="warning",
                uri=self.uri,
            )
            return None, None, etag

    def remote_steps(self) -> list[int]:
        """Steps with at least one object under `step-<N>/` in S3, newest first."""
        paginator = self._s3.get_paginator("list_objects_v2")
        base = self._key("")
        steps: set[int] = set()
        for page in paginator.paginate(Bucket=self.bucket, Prefix=base, Delimiter="/"):
            for common in page.get("CommonPrefixes", []):
                match = STEP_DIR.match(common["Prefix"][len(base) :].rstrip("/"))
                if match:
                    steps.add(int(match.group(1)))
        return sorted(steps, reverse=True)

    # -- restore ----------------------------------------------------------------------------------------

    def restore(self, should_abort: Callable[[], bool] = lambda: False) -> int | None:
        """Make the newest verified checkpoint available in `local_dir`; returns its step (None: fresh job).

        S3 candidates are `latest.json`'s step and older ones (a step above it is a partial upload); each is
        verified against its manifest's sha256 before it replaces anything local. A local step at least as
        new (this instance's earlier life) wins and is uploaded by `start()` if S3 lacks it. A step S3 refuses
        to hand over is skipped for an older one; with none left, `CheckpointRefusedError` names the object.
        So is a step whose manifest names a file outside the step's folder: nothing of it is written.
        """
        self.local_dir.mkdir(parents=True, exist_ok=True)
        for leftover in self.local_dir.glob(".step-*"):
            remove_entry(leftover)  # a link the job left here goes, never what it points to
        local = self._newest_verified_local()
        latest, _ = self.read_latest()
        if latest is not None:
            # A refused manifest here is judged again, step by step, below.
            with contextlib.suppress(CheckpointRefusedError):
                manifest = self._remote_manifest(latest)
                if manifest is not None and self._outside(latest, manifest) is None:
                    self._confirm(latest)
        candidates = [s for s in self.remote_steps() if latest is None or s <= latest]
        refused: CheckpointRefusedError | None = None
        for step in candidates:
            if local is not None and step <= local:
                break
            if should_abort():
                raise UploadAbandonedError("restore interrupted")
            try:
                restored = self._download(step, should_abort)
            except CheckpointRefusedError as exc:
                refused = refused or exc  # the newest one S3 refused is the one to name
                continue
            if restored:
                self._log.event("checkpoint", "restored checkpoint from S3", step=step, uri=self.uri)
                return step
        if local is not None:
            self._log.event("checkpoint", "using the checkpoint already on this instance", step=local)
            return local
        if refused is not None:
            raise refused
        return None

    def _newest_verified_local(self) -> int | None:
        for step in committed_steps(self.local_dir):
            manifest, why = verify_dir(self.local_dir / step_dir_name(step))
            if manifest is not None:
                return step
            self._log.event(
                "checkpoint", "skipping a damaged local checkpoint", level="warning", step=step, why=why
            )
        return None

    def _refused(self, key: str, step: int, exc: ClientError) -> CheckpointRefusedError:
        code = exc.response.get("Error", {}).get("Code") or "no error code"
        # S3 passes a KMS refusal of the object's key on under KMS's own code. A key that is off needs turning
        # on, a key that is gone can never decrypt it, any other refusal needs a grant; anything else
        # (throttling, an outage past botocore's retries) passes, and each later life tries again until the
        # crash-loop guard gives up.
        if code in _KMS_KEY_OFF:
            fix = (
                "its KMS key is disabled or pending deletion: enable it (aws kms enable-key; first aws kms "
                "cancel-key-deletion if its deletion is scheduled)"
            )
        elif code == _KMS_KEY_GONE:
            fix = (
                "its KMS key no longer exists, so S3 can never decrypt it: delete the job's checkpoints "
                f"under {self.uri}/ to start the job over"
            )
        elif code == "AccessDenied" or code.startswith("KMS"):
            fix = (
                "grant the identity reading it (on an instance, the instance role) s3:GetObject on it and "
                "kms:Decrypt on its key"
            )
        else:
            fix = "S3 did not serve it; a later start tries again"
        return CheckpointRefusedError(
            f"s3://{self.bucket}/{key}: S3 refused to read it ({code}) and no older checkpoint is left: "
            f"not starting the job over without its step {step}; {fix}"
        )

    def _remote_manifest(self, step: int) -> dict[str, Any] | None:
        """The step's manifest from S3; None when missing or unreadable (a damaged checkpoint); a read S3
        refuses raises CheckpointRefusedError (the step is there, this life just cannot have it)."""
        key = self._key(f"{step_dir_name(step)}/{MANIFEST}")
        try:
            body = self._s3.get_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if _is_missing(exc):
                return None
            raise self._refused(key, step, exc) from None
        try:
            value = json.loads(body["Body"].read())
        except ValueError:
            return None
        return value if isinstance(value, dict) and isinstance(value.get("files"), dict) else None

    def _outside(self, step: int, manifest: dict[str, Any]) -> CheckpointRefusedError | None:
        """The refusal of a manifest that names a file outside its step's folder (`../../etc/x`, `/abs/x`),
        or None. Whoever can write the job's S3 prefix (the job itself) writes its manifests: restored as
        listed, such a name is a file root writes anywhere on the instance."""
        key = self._key(f"{step_dir_name(step)}/{MANIFEST}")
        for file_name in manifest["files"]:
            why = outside_name(file_name)
            if why is not None:
                folder = f"{self.uri}/{step_dir_name(step)}/"
                return CheckpointRefusedError(
                    f"s3://{self.bucket}/{key}: names {file_name!r} ({why}), outside the step's folder, so "
                    f"it is never restored, and no older checkpoint is left: not starting the job over "
                    f"without its step {step}; delete the step (aws s3 rm --recursive {folder}) to resume "
                    "from an older checkpoint or start over, and fix what wrote that manifest (its names "
                    "are relative to the step's folder)"
                )
        return None

    def _download(self, step: int, should_abort: Callable[[], bool]) -> bool:
        name = step_dir_name(step)
        manifest = self._remote_manifest(step)
        if manifest is None:
            self._log.event(
                "checkpoint", "skipping an S3 checkpoint without a manifest", level="warning", step=step
            )
            return False
        outside = self._outside(step, manifest)
        if outside is not None:
            self._log.event(
                "checkpoint",
                "skipping an S3 checkpoint whose manifest names a file outside its folder",
                level="warning",
                step=step,
                uri=f"{self.uri}/{name}/{MANIFEST}",
                error=str(outside),
            )
            raise outside
        # The job owns local_dir and may run meanwhile (a standby's warm trainer): a fresh random name it
        # cannot have prepared, a folder only the agent can write in, and every write through the folder's
        # descriptor (fd_path), so even a link the job puts at the staging folder's name is never followed.
        staging = self.local_dir / f".{name}.download-{secrets.token_hex(4)}"
        staging.mkdir()
        try:
            with open_directory(staging) as held:
                into = fd_path(held, staging)
                for file_name in manifest["files"]:
                    if should_abort():
                        raise UploadAbandonedError("restore interrupted")
                    target = into / file_name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    key = self._key(f"{name}/{file_name}")
                    self._s3.download_file(self.bucket, key, str(target), Config=TRANSFER)
                (into / MANIFEST).write_text(json.dumps(manifest))
                verified, why = verify_dir(into)
                if verified is None:
                    self._log.event(
                        "checkpoint",
                        "skipping an S3 checkpoint that fails verification",
                        level="warning",
                        step=step,
                        why=why.replace(str(into), str(staging)),
                    )
                    return False
                final = self.local_dir / name
                remove_entry(final)  # a link the job put at the step's name is removed, not followed
                staging.rename(final)
                # Only the folder verified here counts as restored, not one the job renamed into its place.
                placed = os.lstat(final)
                held_stat = os.fstat(held)
                if (placed.st_dev, placed.st_ino) != (held_stat.st_dev, held_stat.st_ino):
                    self._log.event(
                        "checkpoint",
                        "skipping an S3 checkpoint whose folder was replaced while it was restored",
                        level="warning",
                        step=step,
                        uri=f"{self.uri}/{name}/",
                    )
                    remove_entry(final)
                    return False
            replace_file(
                self.local_dir / LATEST, latest_json(step, manifest.get("epoch")), say=self._planted_link
            )
            self._confirm(step)
            return True
        except ClientError as exc:
            self._log.event(
                "checkpoint",
                "skipping an S3 checkpoint that cannot be read",
                level="warning",
                step=step,
                error=str(exc),
            )
            if _is_missing(exc):
                return False  # a file gone from S3: a damaged checkpoint, like one that fails verification
            raise self._refused(key, step, exc) from None
        finally:
            remove_entry(staging)

    def _planted_link(self, line: str) -> None:
        self._log.event("checkpoint", line, level="warning")

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
                    target=_close_when_done, args=(future, handle), name="s3-upload-close", daemon=True
                ).start()
                raise
            time.sleep(_WAIT_TICK)
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
            condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}

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
                if _is_conflict(exc):
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

"""The job's checkpoints in S3 as bootstrap/persist.py reads them: the plumbing every part of the persister
shares (bounded waits, the errors, the fence's protocol, the result of a flush) and the reads (`latest.json`,
the committed steps in S3, the agent's own record of the lease tokens it wrote). The guarantees are
persist.py's (its docstring); bootstrap/checkpoint_restore.py restores, persist.py uploads and fences.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.exceptions import ClientError

from bootstrap.lease import LeaseLostError
from trainstack_job.layout import (
    LATEST,
    STEP_DIR,
)

# Raised from here (checkpoint_restore.py, persist.py import it here); defined beside the checkpoint layout so
# the trainer run by hand names it without importing the agent.
from trainstack_job.layout import CheckpointRefusedError as CheckpointRefusedError
from trainstack_job.records import is_conflict, is_missing, write_condition

# 64 MiB parts: a multi-GB checkpoint goes up as parallel parts, each with its own SHA256 checksum.
TRANSFER = TransferConfig(multipart_threshold=64 * 2**20, multipart_chunksize=64 * 2**20, max_concurrency=8)
WAIT_TICK = 0.1
_T = TypeVar("_T")


class EventSink(Protocol):
    def event(self, stage: str, message: str, **fields: Any) -> None: ...


# Under the job's state prefix: the newest lease token this agent wrote into `latest.json`, kept where the job
# cannot write (its role and session deny `state/`): the floor for the next lease's token (`token_floor`).
TOKEN_RECORD = "latest-token.json"

# S3's codes for an SSE-KMS object whose key KMS refuses to use: off (disabled, or pending deletion), or gone.
KMS_KEY_OFF = frozenset({"KMS.DisabledException", "KMS.KMSInvalidStateException"})
KMS_KEY_GONE = "KMS.NotFoundException"


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


def close_when_done(future: Any, handle: int) -> None:
    """Close an upload's file descriptor once its transfer (cancelled or not) has no task left."""
    try:
        # A cancelled transfer's error was reported where it was cancelled.
        with contextlib.suppress(BaseException):
            future.result()
    finally:
        os.close(handle)


class CheckpointStore:
    """One job's checkpoints: `s3://bucket/prefix` and the local `step-<N>/` folders, with what the persister
    confirmed so far; the reads of S3 that restore and upload share."""

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
            if is_missing(exc):
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
                body = json.dumps({"token": token, "uri": f"{self.uri}/{LATEST}"}).encode()

                condition = write_condition(etag)

                def put(condition: dict[str, str] = condition, body: bytes = body) -> Any:
                    return self._s3.put_object(
                        Bucket=self.bucket, Key=key, Body=body, ContentType="application/json", **condition
                    )

                try:
                    bounded(put, deadline, "put-token-record")
                except ClientError as exc:
                    if is_conflict(exc):
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
            if is_missing(exc):
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

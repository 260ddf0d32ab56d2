"""The records trainstack's processes share through the stack bucket, one definition of each; stdlib only.

The agent writes them, the CLI and both Lambdas read them, and a user's job writes its progress: all of them
read and write through the classes here, so a field is added in one place. Every record reads tolerantly:
`from_json` takes whatever JSON the object held, and a field of the wrong type reads as absent (or the record
as None), never as an exception that would stop a reader. `to_json` writes back the fields it does not know
(`extra`), so an older reader that rewrites a record keeps what a newer agent added.

- the job's ledger (`state/ledger.json`): `Ledger` and its `Life`s, the ended statuses;
- the job's progress (`state/progress.json`): `Progress`;
- the lease and the warm standby (`state/lease.json`, `state/standby.json`): `LeaseState`, `StandbyState`;
- a pool's current-job pointer (`state/current-job*.json`): `JobPointer`;
- the one conditional write every writer of these uses: `S3Record`, `write_condition`, `is_conflict`.

Where each lives in the bucket is trainstack_job/contract.py's and trainstack_job/jobs.py's to say.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from typing import Any, TypeGuard

from trainstack_job.contract import JobStatus, LifeOutcome

# -- statuses ---------------------------------------------------------------------------------------

# A job in one of these is over: it trains no more, the queue (and its lane) moves on. stopped, cost_cap and
# no_data are also resumable (`trainstack resume`). JobStatus is a str enum: these match the ledger's strings.
ENDED_STATUSES = frozenset(
    {
        JobStatus.COMPLETED,
        JobStatus.FAILED,
        JobStatus.STOPPED,
        JobStatus.COST_CAP,
        JobStatus.NO_DATA,
        JobStatus.CANCELLED,
    }
)
# Ends that `trainstack resume` continues: a new boot serves the current job again after one of these
# (unless a stop or cancel request is still in force); a life that goes on to the next job on the same
# instance does not.
RESUMABLE_STATUSES = frozenset({JobStatus.STOPPED, JobStatus.COST_CAP, JobStatus.NO_DATA})
# A job no instance trains, so nothing bills for it: ended, or yielded to a `--now` job and waiting in the
# queue. Any other status, one a reader does not know included, may still bill.
IDLE_STATUSES = ENDED_STATUSES | {JobStatus.QUEUED}


# -- conditional writes -----------------------------------------------------------------------------

# S3's answers to a conditional write that lost: 412 (the ETag moved, or the object exists for
# If-None-Match) and 409 (a concurrent conditional write to the same key is in progress).
CONFLICT_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict"})
MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


def error_code(exc: BaseException) -> str:
    """The AWS error code of a botocore ClientError ("" for anything else): read by shape, so this module
    stays standard-library only and the Lambdas need no botocore import to use it."""
    response = getattr(exc, "response", None)
    error = response.get("Error") if isinstance(response, dict) else None
    return str(error.get("Code", "")) if isinstance(error, dict) else ""


def _http_status(exc: BaseException) -> Any:
    response = getattr(exc, "response", None)
    meta = response.get("ResponseMetadata") if isinstance(response, dict) else None
    return meta.get("HTTPStatusCode") if isinstance(meta, dict) else None


def is_conflict(exc: BaseException) -> bool:
    """A conditional write (or delete) lost a race: read again and retry."""
    return error_code(exc) in CONFLICT_CODES or _http_status(exc) in {409, 412}


def is_missing(exc: BaseException) -> bool:
    """The object is not there (S3 answers 404, or 403 to a role that may not list: see S3Record.get)."""
    return error_code(exc) in MISSING_CODES


def write_condition(etag: str | None) -> dict[str, str]:
    """The condition of a read-modify-write: unchanged since read (If-Match its ETag), or still absent."""
    return {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}


class S3Record:
    """One small JSON object in S3, read with its ETag and written only conditionally."""

    def __init__(self, s3: Any, bucket: str, key: str) -> None:
        self._s3 = s3
        self.bucket = bucket
        self.key = key

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def get(self) -> tuple[Any, str | None]:
        """The parsed JSON (None if absent or not JSON) and the ETag (None if absent)."""
        try:
            response = self._s3.get_object(Bucket=self.bucket, Key=self.key)
        except Exception as exc:
            if is_missing(exc):
                return None, None
            raise
        etag = str(response["ETag"])
        try:
            return json.loads(response["Body"].read()), etag
        except ValueError:  # not JSON (or not UTF-8): counts as absent, replaced against its ETag
            return None, etag

    def put(self, body: dict[str, Any], etag: str | None) -> bool:
        """Write unless the object changed since `etag` was read (None: unless it exists); False on a
        lost race (412/409), for the caller to read again."""
        try:
            self._s3.put_object(
                Bucket=self.bucket,
                Key=self.key,
                Body=json.dumps(body, indent=2, default=str).encode(),
                ContentType="application/json",
                **write_condition(etag),
            )
        except Exception as exc:
            if is_conflict(exc):
                return False
            raise
        return True

    def delete(self, etag: str) -> bool:
        """Delete unless the object changed since `etag` was read; False on a lost race. Already gone
        counts as deleted."""
        try:
            self._s3.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=etag)
        except Exception as exc:
            if is_conflict(exc):
                return False
            if is_missing(exc):
                return True
            raise
        return True


# -- field readers ----------------------------------------------------------------------------------


def _number(value: Any) -> TypeGuard[int | float]:
    # JSON has one number type; bool is an int in Python but never a valid time, price or token.
    return isinstance(value, int | float) and not isinstance(value, bool)


def _count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(raw: dict[str, Any], key: str) -> str | None:
    value = raw.get(key)
    return value if isinstance(value, str) else None


def _float(raw: dict[str, Any], key: str) -> float | None:
    value = raw.get(key)
    return float(value) if _number(value) else None


def _int(raw: dict[str, Any], key: str) -> int | None:
    value = raw.get(key)
    return value if _count(value) else None


def _extra(cls: type, raw: dict[str, Any]) -> dict[str, Any]:
    known = {f.name for f in fields(cls)} - {"extra"}
    return {k: v for k, v in raw.items() if k not in known}


def _written(record: Any) -> dict[str, Any]:
    """A record's JSON: its known fields, then what it read and does not know (never overriding a field)."""
    body = {f.name: getattr(record, f.name) for f in fields(record) if f.name != "extra"}
    return {**record.extra, **body}


# -- the ledger -------------------------------------------------------------------------------------


@dataclass
class Life:
    """One instance life of a job, as its ledger keeps it (docs/internals.md, "The ledger")."""

    life_id: str
    instance_id: str
    started_at: str
    outcome: str = LifeOutcome.RUNNING.value
    instance_type: str | None = None
    az: str | None = None
    lifecycle: str | None = None  # "spot" or "on-demand", from IMDS
    heartbeat_at: str | None = None
    ended_at: str | None = None
    purchase_option: str | None = None
    price_source: str | None = None
    price_usd_per_hour: float | None = None
    storage_usd_per_hour: float = 0.0
    instance_cost_usd: float = 0.0
    storage_cost_usd: float = 0.0
    cost_usd: float = 0.0
    # Up to when instance and storage cost were added up; None in lives written before per-option pricing.
    priced_at: str | None = None
    # What the life measured (trainstack_job/throughput.py): the mean of the trainer's samples/s over its
    # progress reports (`throughput_reports` of them, the last at `throughput_step`), the precision it trained
    # in and the model it trained (its "family"). None (absent from the JSON) until the trainer reports one.
    samples_per_second: float | None = None
    throughput_reports: int | None = None
    throughput_step: int | None = None
    precision: str | None = None
    model_family: str | None = None
    # How long the life's data kept it from training (docs/internals.md, "The ledger"): the seconds from its
    # start to its trainer's first completed optimizer step (what streaming shortens: no full dataset sync
    # first), and the mean share of step time the trainer waited on its data loader over its progress reports
    # (`data_wait_reports` of them, the last at `data_wait_step`). None (absent from the JSON) until the
    # trainer reports them: a job that reports no progress (or none of these) never has them.
    first_step_seconds: float | None = None
    data_wait_fraction: float | None = None
    data_wait_reports: int | None = None
    data_wait_step: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def running(self) -> bool:
        return self.outcome == LifeOutcome.RUNNING

    @property
    def generation(self) -> int | None:
        """The multi-node generation the life trained in (None for a single-node job)."""
        value = self.extra.get("generation")
        return value if _count(value) else None

    @property
    def standby_seconds(self) -> float:
        value = self.extra.get("standby_seconds")
        return float(value) if _number(value) else 0.0

    @property
    def standby_cost_usd(self) -> float:
        value = self.extra.get("standby_cost_usd")
        return float(value) if _number(value) else 0.0

    @classmethod
    def opened(
        cls,
        *,
        instance_id: str,
        instance_type: str,
        az: str,
        lifecycle: str,
        started_at: str,
        price_usd_per_hour: float | None,
    ) -> Life:
        """A life that begins now, not yet priced: its id is its instance and its start."""
        return cls(
            life_id=f"{instance_id}@{started_at}",
            instance_id=instance_id,
            instance_type=instance_type,
            az=az,
            lifecycle=lifecycle,
            started_at=started_at,
            heartbeat_at=started_at,
            purchase_option="spot" if lifecycle == "spot" else "on-demand",
            price_usd_per_hour=price_usd_per_hour,
            priced_at=started_at,
        )

    @classmethod
    def from_json(cls, raw: Any) -> Life | None:
        """None for anything that is not a life (no start: it cannot be priced or ordered). A life without its
        id or instance (hand-edited, damaged) still counts, with those empty: a reader that sums cost must
        not lose what it bills."""
        started_at = _text(raw, "started_at") if isinstance(raw, dict) else None
        if not isinstance(raw, dict) or started_at is None:
            return None
        return cls(
            life_id=_text(raw, "life_id") or "",
            instance_id=_text(raw, "instance_id") or "",
            started_at=started_at,
            outcome=_text(raw, "outcome") or LifeOutcome.RUNNING.value,
            instance_type=_text(raw, "instance_type"),
            az=_text(raw, "az"),
            lifecycle=_text(raw, "lifecycle"),
            heartbeat_at=_text(raw, "heartbeat_at"),
            ended_at=_text(raw, "ended_at"),
            purchase_option=_text(raw, "purchase_option"),
            price_source=_text(raw, "price_source"),
            price_usd_per_hour=_float(raw, "price_usd_per_hour"),
            storage_usd_per_hour=_float(raw, "storage_usd_per_hour") or 0.0,
            instance_cost_usd=_float(raw, "instance_cost_usd") or 0.0,
            storage_cost_usd=_float(raw, "storage_cost_usd") or 0.0,
            cost_usd=_float(raw, "cost_usd") or 0.0,
            priced_at=_text(raw, "priced_at"),
            samples_per_second=_float(raw, "samples_per_second"),
            throughput_reports=_int(raw, "throughput_reports"),
            throughput_step=_int(raw, "throughput_step"),
            precision=_text(raw, "precision"),
            model_family=_text(raw, "model_family"),
            first_step_seconds=_float(raw, "first_step_seconds"),
            data_wait_fraction=_float(raw, "data_wait_fraction"),
            data_wait_reports=_int(raw, "data_wait_reports"),
            data_wait_step=_int(raw, "data_wait_step"),
            extra=_extra(cls, raw),
        )

    def to_json(self) -> dict[str, Any]:
        body = _written(self)
        for measured in _MEASURED_LIFE_FIELDS:
            if body[measured] is None:
                del body[measured]  # absent until measured, as in lives written before throughput
        return body


_MEASURED_LIFE_FIELDS = (
    "samples_per_second",
    "throughput_reports",
    "throughput_step",
    "precision",
    "model_family",
    "first_step_seconds",
    "data_wait_fraction",
    "data_wait_reports",
    "data_wait_step",
)


@dataclass
class Ledger:
    """A job's ledger (`state/ledger.json`): its status, its lives, and the sums the agent keeps of them.

    bootstrap/ledger.py is its one writer (every change a conditional read-modify-write); this is what every
    reader sees, and the shape a new ledger starts from."""

    status: str = JobStatus.RUNNING.value
    lives: list[Life] = field(default_factory=list)
    interruptions: int = 0
    consecutive_failures: int = 0
    total_cost_usd: float = 0.0
    standby_cost_usd: float = 0.0
    handovers: int = 0
    updated_at: str | None = None
    # Why a job ended without a life of its own (its record unreadable, its code refused): one line.
    reason: str | None = None
    # The dataset version the job trains on: {"version", "synced_at", ...} (bootstrap/datasync.py).
    dataset: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ended(self) -> bool:
        return self.status in ENDED_STATUSES

    @property
    def idle(self) -> bool:
        """Nothing trains the job, so nothing bills for it (IDLE_STATUSES)."""
        return self.status in IDLE_STATUSES

    @classmethod
    def from_json(cls, raw: Any) -> Ledger:
        """The ledger a reader acts on: anything that is not a JSON object reads as a new ledger, a life that
        is not a life is left out, and a count or sum of the wrong type reads as zero."""
        if not isinstance(raw, dict):
            return cls()
        lives = raw.get("lives")
        dataset = raw.get("dataset")
        return cls(
            status=_text(raw, "status") or JobStatus.RUNNING.value,
            lives=[life for life in map(Life.from_json, lives if isinstance(lives, list) else []) if life],
            interruptions=_int(raw, "interruptions") or 0,
            consecutive_failures=_int(raw, "consecutive_failures") or 0,
            total_cost_usd=_float(raw, "total_cost_usd") or 0.0,
            standby_cost_usd=_float(raw, "standby_cost_usd") or 0.0,
            handovers=_int(raw, "handovers") or 0,
            updated_at=_text(raw, "updated_at"),
            reason=_text(raw, "reason"),
            dataset=dataset if isinstance(dataset, dict) else None,
            extra=_extra(cls, raw),
        )

    def to_json(self) -> dict[str, Any]:
        body = _written(self)
        body["lives"] = [life.to_json() for life in self.lives]
        for optional in ("updated_at", "reason", "dataset"):
            if body[optional] is None:
                del body[optional]  # absent, as the agent wrote ledgers before these fields
        return body


# -- progress ---------------------------------------------------------------------------------------


def first_step_stamp(moment: datetime) -> str:
    """`Progress.first_step_at` as every writer spells it: UTC, to the millisecond, with a `Z`."""
    return moment.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class Progress:
    """How far a job is (`state/progress.json`): written by the built-in trainer and by a user's job through
    trainstack_job (its `report_progress`), followed by the agent's stall watchdog and shown by the CLI."""

    step: int
    total_steps: int | None = None
    # ISO 8601 UTC; files from trainstack_job versions before it say "written_at".
    updated_at: str | None = None
    epoch: int | None = None
    epochs: int | None = None
    loss: float | None = None
    samples_per_s: float | None = None
    # The share of step time spent waiting for the data loader (0..1): the data-starvation measure.
    data_wait_fraction: float | None = None
    # When this process completed its first optimizer step (ISO 8601 UTC, wall clock): set once per process,
    # so a resumed life's is its own. The agent turns it into its life's `first_step_seconds`.
    first_step_at: str | None = None
    eta_s: int | None = None
    world_size: int | None = None
    # The precision the trainer runs in (bf16, fp16, fp32) and its model's name: what a life's throughput is
    # measured for (trainstack_job/throughput.py). None from a job that does not say.
    precision: str | None = None
    model: str | None = None
    # A job's own metrics and the trainer's GPU samples (gpu_util_percent, gpu_memory_gib, ...).
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, raw: Any) -> Progress | None:
        """None for anything without a step (a file caught mid-write reads as not there yet)."""
        if not isinstance(raw, dict) or not _count(raw.get("step")):
            return None
        extra = _extra(cls, raw)
        written_at = extra.pop("written_at", None)
        return cls(
            step=raw["step"],
            total_steps=_int(raw, "total_steps"),
            updated_at=_text(raw, "updated_at") or (written_at if isinstance(written_at, str) else None),
            epoch=_int(raw, "epoch"),
            epochs=_int(raw, "epochs"),
            loss=_float(raw, "loss"),
            samples_per_s=_float(raw, "samples_per_s"),
            data_wait_fraction=_float(raw, "data_wait_fraction"),
            first_step_at=_text(raw, "first_step_at"),
            eta_s=_int(raw, "eta_s"),
            world_size=_int(raw, "world_size"),
            precision=_text(raw, "precision"),
            model=_text(raw, "model"),
            extra=extra,
        )

    def to_json(self) -> dict[str, Any]:
        # Only what this writer measured: a user's job that reports a step alone writes a step alone, and a
        # metric of its own that shares a name with an unmeasured field is kept.
        known = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        measured = {k: v for k, v in known.items() if v is not None or k == "total_steps"}
        return {**self.extra, **measured}


# -- the lease and the warm standby -----------------------------------------------------------------


@dataclass(frozen=True)
class LeaseState:
    """The lease as stored: who holds it, with which token, since when, and whether it was let go."""

    holder: str
    life_id: str
    token: int
    acquired_at: float
    heartbeat_at: float
    released_at: float | None = None
    stop_step: int | None = None
    job_id: str | None = None
    # When the holder's last proof ends (wall clock); None in records written before leases carried it.
    expires_at: float | None = None

    def expiry(self, stale_seconds: float) -> float:
        """When the lease ends unless renewed: its `expires_at`, else `stale_seconds` after its heartbeat."""
        return self.expires_at if self.expires_at is not None else self.heartbeat_at + stale_seconds

    def live(self, now: float, stale_seconds: float, drift_seconds: float = 0.0) -> bool:
        """Held by a holder that still renews: not released, and `now` before its expiry plus
        `drift_seconds` (the margin another life waits past the expiry for clock error)."""
        return self.released_at is None and now < self.expiry(stale_seconds) + drift_seconds

    def to_record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_record(cls, raw: Any) -> LeaseState | None:
        """None for anything that is not a complete lease record."""
        if not isinstance(raw, dict):
            return None
        if not (
            isinstance(raw.get("holder"), str)
            and isinstance(raw.get("life_id"), str)
            and _count(raw.get("token"))
            and _number(raw.get("acquired_at"))
            and _number(raw.get("heartbeat_at"))
            and (raw.get("released_at") is None or _number(raw["released_at"]))
            and (raw.get("stop_step") is None or _count(raw["stop_step"]))
            and (raw.get("job_id") is None or isinstance(raw["job_id"], str))
            and (raw.get("expires_at") is None or _number(raw["expires_at"]))
        ):
            return None
        return cls(
            holder=raw["holder"],
            life_id=raw["life_id"],
            token=raw["token"],
            acquired_at=float(raw["acquired_at"]),
            heartbeat_at=float(raw["heartbeat_at"]),
            released_at=None if raw.get("released_at") is None else float(raw["released_at"]),
            stop_step=raw.get("stop_step"),
            job_id=raw.get("job_id"),
            expires_at=None if raw.get("expires_at") is None else float(raw["expires_at"]),
        )


@dataclass(frozen=True)
class StandbyState:
    """The job's warm standby as stored: which life waits, since when, and whether it is ready to train."""

    instance_id: str
    life_id: str
    since: float
    ready_at: float | None
    heartbeat_at: float

    def live(self, now: float, stale_seconds: float) -> bool:
        return now - self.heartbeat_at < stale_seconds

    @property
    def is_ready(self) -> bool:
        return self.ready_at is not None

    def to_record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_record(cls, raw: Any) -> StandbyState | None:
        if not isinstance(raw, dict):
            return None
        if not (
            isinstance(raw.get("instance_id"), str)
            and isinstance(raw.get("life_id"), str)
            and _number(raw.get("since"))
            and _number(raw.get("heartbeat_at"))
            and (raw.get("ready_at") is None or _number(raw["ready_at"]))
        ):
            return None
        return cls(
            instance_id=raw["instance_id"],
            life_id=raw["life_id"],
            since=float(raw["since"]),
            ready_at=None if raw.get("ready_at") is None else float(raw["ready_at"]),
            heartbeat_at=float(raw["heartbeat_at"]),
        )


# -- the stack's run slots (trainstack_job/slots.py) ------------------------------------------------


@dataclass(frozen=True)
class RunSlot:
    """One of the stack's `maxConcurrentJobs` run slots: the job that holds it and `since` when (ISO 8601
    UTC). Free again once that job has ended, or if it never started within the staleness window."""

    job_id: str
    since: str | None = None

    @classmethod
    def from_json(cls, raw: Any) -> RunSlot | None:
        """None for anything that is not a slot (no job id): a free slot, replaced against its ETag."""
        if not isinstance(raw, dict) or not isinstance(raw.get("job_id"), str) or not raw["job_id"]:
            return None
        return cls(raw["job_id"], _text(raw, "since"))

    def to_json(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "since": self.since}


# -- the current-job pointer ------------------------------------------------------------------------


@dataclass(frozen=True)
class JobPointer:
    """Which job a pool's lane serves (trainstack_job/jobs.py `pointer_name`), moved only by conditional
    writes: `since` when it moved there (ISO 8601 UTC), `previous` the job it moved from."""

    job_id: str
    since: str | None = None
    previous: str | None = None

    @classmethod
    def from_json(cls, raw: Any) -> JobPointer | None:
        """None for anything that is not a pointer (no job id): the agent replaces it against its ETag."""
        if not isinstance(raw, dict) or not isinstance(raw.get("job_id"), str):
            return None
        return cls(raw["job_id"], _text(raw, "since"), _text(raw, "previous"))

    def to_json(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "since": self.since, "previous": self.previous}

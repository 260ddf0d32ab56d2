"""Job identity and where a job's objects live in the stack bucket (docs/internals.md, "Jobs"); stdlib only.

A job is one training run: one definition (the trainer config or a user's job spec, its code, where it starts
from), one id, one prefix. Everything the job writes — checkpoints, results, ledger, progress, lease — lives
under `jobs/<job-id>/`; the stack keeps only which job is current (`state/current-job.json`). A stack created
before jobs existed keeps its objects where they were: they are the job `legacy`, read at the old prefixes.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from trainstack_job.text import CLIP, clip

JOBS_PREFIX = "jobs/"
# Under the stack's state/ prefix: {"job_id": ..., "since": ISO}, moved only by conditional writes.
CURRENT_JOB = "current-job.json"


def pointer_name(pool: str, lane: int = 0) -> str:
    """The current-job pointer of a pool's instances (trainstack_job/resources.py): the default pool (`""`)
    keeps the stack's `current-job.json`, so a stack from before pools reads on; another pool has its own.
    A pool that runs several jobs at once (`maxJobs`) has one pointer per lane; lane 0's is the pool's."""
    name = f"current-job-{pool}" if pool else "current-job"
    return f"{name}-lane{lane}.json" if lane else f"{name}.json"


# Under a job's own prefix: what the job is (its definition and pinned code), written once.
JOB_RECORD = "job.json"
# Under a job's state prefix: who writes the job's checkpoints (bootstrap/lease.py) and who waits to.
LEASE = "lease.json"
STANDBY = "standby.json"
# Under a job's state prefix, in a pool that runs several jobs at once: which lane of its pool took the job
# ({"pool", "lane", "since"}), written once, so no other lane starts it too.
LANE_CLAIM = "lane.json"
# A stack's objects from before job identity: checkpoints/, results/, state/ at the bucket's top level.
LEGACY_JOB_ID = "legacy"
_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_SLUG = re.compile(r"[^a-z0-9]+")
DIGEST_CHARS = 8


class JobIdError(ValueError):
    """A job id that cannot name a job; the message says what an id looks like."""


def slug(name: str) -> str:
    """A readable, S3- and log-stream-safe name part: lowercase letters, digits and dashes, at most 40."""
    text = _SLUG.sub("-", name.lower()).strip("-")[:40].strip("-")
    return text or "job"


def definition_digest(definition: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of a job definition: equal definitions, equal digests."""
    canonical = json.dumps(definition, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def make_job_id(name: str, digest: str) -> str:
    """`<name>-<8 hex>`: readable in `trainstack jobs`, different for every different definition."""
    return f"{slug(name)}-{digest[:DIGEST_CHARS]}"


def check_job_id(value: str, key: str = "job id") -> str:
    """`value` when it is a job id; else JobIdError, `key` saying where the value came from. Both are clipped:
    callers put the value in `key` too (`--job VALUE`), and either may be as long as the user typed it."""
    if not isinstance(value, str) or not _ID.match(value):
        label = key if len(key) <= CLIP else clip(key)
        raise JobIdError(
            f"{label}: {clip(value)} is not a job id (lowercase letters, digits and dashes, "
            "e.g. 'default-1a2b3c4d'; `trainstack jobs` lists them)"
        )
    return value


@dataclass(frozen=True)
class JobPrefixes:
    """The bucket prefixes of one job (each ends with '/')."""

    job_id: str
    root: str
    checkpoints: str
    results: str
    state: str

    @classmethod
    def of(cls, job_id: str) -> JobPrefixes:
        if job_id == LEGACY_JOB_ID:
            return cls(job_id, "", "checkpoints/", "results/", "state/")
        check_job_id(job_id)
        root = f"{JOBS_PREFIX}{job_id}/"
        return cls(job_id, root, f"{root}checkpoints/", f"{root}results/", f"{root}state/")

    @property
    def record(self) -> str:
        """The job record's key (the legacy job has none)."""
        return f"{self.root}{JOB_RECORD}" if self.root else ""

    def log_stream(self, instance_id: str, source: str) -> str:
        """CloudWatch log stream of one instance life's `agent` or `trainer` output, named by the job (the
        legacy job's streams keep their old names, `<instance-id>/<source>`)."""
        if self.job_id == LEGACY_JOB_ID:
            return f"{instance_id}/{source}"
        return f"{self.job_id}/{instance_id}/{source}"

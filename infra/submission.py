"""A job submission: its id, code bundle, record and queue entry, built one way for `pulumi up` (the stack's
default job) and `trainstack run` (docs/internals.md, "The job queue")."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bootstrap.trainer import TrainerPaths
from infra.bundle import REPO_ROOT, CodeBundle, build_bundle
from infra.jobdef import define_job
from training.config import ConfigError, apply_overrides, build_config
from trainstack_job.contract import BucketPrefix
from trainstack_job.credentials import find_secret_values
from trainstack_job.jobfile import JobSpec
from trainstack_job.jobs import JobPrefixes, definition_digest, make_job_id
from trainstack_job.queue import job_record, queue_entry, queue_key
from trainstack_job.resources import RESOURCES_KEY
from trainstack_job.secret_refs import parse_secrets

JSON = "application/json"
GZIP = "application/gzip"


@dataclass(frozen=True)
class Submission:
    """One job, ready to upload: `objects()` in the order the queue's contract needs (bundle, record, entry),
    so the agent never finds an entry whose record or code is not there yet."""

    job_id: str
    name: str
    bundle: CodeBundle
    record: dict[str, Any]
    entry: dict[str, Any]

    @property
    def record_key(self) -> str:
        return JobPrefixes.of(self.job_id).record

    @property
    def entry_key(self) -> str:
        return queue_key(self.job_id)

    def with_code_prefix(self, code_prefix: str) -> Submission:
        """The same submission for a stack whose code prefix is not the default `code/`."""
        key = self.bundle.key(code_prefix)
        agent = {**self.record["agent"], "bundle_key": key}
        return replace(self, record={**self.record, "bundle_key": key, "agent": agent})

    def objects(self, code_prefix: str = BucketPrefix.CODE.value) -> list[tuple[str, bytes, str]]:
        """(key, body, content type) in upload order: the bundle, the record, the queue entry."""
        record = self.with_code_prefix(code_prefix).record
        return [
            (self.bundle.key(code_prefix), self.bundle.data, GZIP),
            (self.record_key, _json(record), JSON),
            (self.entry_key, _json(self.entry), JSON),
        ]


def _json(value: Mapping[str, Any]) -> bytes:
    return json.dumps(value, indent=2, sort_keys=True).encode()


def instance_overrides() -> list[str]:
    """What the agent sets on the instance, with placeholder paths: the file's own values for these keys never
    reach the trainer, so a check neither looks at them nor needs the folders to exist."""
    paths = TrainerPaths(scratch=Path("/scratch"))
    # The agent also passes the instance's GPU count (bootstrap/trainer.py: default_trainer_command).
    return [*paths.overrides(), "train.processes=1"]


def training_config_problems(config: Mapping[str, Any], where: str) -> list[str]:
    """Every problem of a built-in trainer config, one line each starting with `where` (the file, the key):
    the agent's `secrets:` section, no credential-looking value, then the trainer's own validator (no torch
    import), so a typo fails on the laptop, not on a GPU instance."""
    # `secrets:` is the agent's and `resources:` the submission's (trainstack_job/resources.py): the trainer
    # never sees either.
    sections = {key: value for key, value in config.items() if key not in ("secrets", RESOURCES_KEY)}
    problems = list(parse_secrets(config.get("secrets"), f"{where}: secrets")[1])
    problems.extend(find_secret_values(sections, where))
    try:
        build_config(apply_overrides(sections, instance_overrides()))
    except ConfigError as exc:
        problems.extend(f"{where}: {problem}" for problem in exc.problems)
    return problems


def prepare_submission(
    *,
    trainer_config: Mapping[str, Any] | None,
    training_config_path: Path | None,
    user_job: JobSpec | None,
    user_job_dir: Path | None,
    resume_from: str = "",
    submitted_at: str,
    source: str,
    name: str | None = None,
    unique: bool,
    sweep: Mapping[str, Any] | None = None,
    dataset: Mapping[str, Any] | None = None,
    now: bool = False,
    instances: int | None = None,
    root: Path = REPO_ROOT,
    pool: str = "",
    resources: Mapping[str, Any] | None = None,
    priority: int = 0,
) -> Submission:
    """Build one job's submission from an already validated definition (infra/config/ for the stack's
    default job, trainstack/run.py for `trainstack run`).

    The id is infra/jobdef.py's definition digest: `unique=False` gives equal definitions equal ids (the
    stack's default job: a second `pulumi up` submits the same job again, a no-op); `unique=True` puts
    `submitted_at` into the digest, so every `trainstack run` is a new job even for the same definition.
    `name` replaces the job's own (job file `name`, else the training config's stem) in the id.
    `dataset` ({"name", "version"}; "" = the default dataset / the version current when the job starts) is
    what the agent syncs for the job (its `dataset`, `dataset_version` fields). `instances`: the instances
    the job trains on when not the stack's instanceCount (the record's `instance_count` override). `pool`:
    the pool it was matched to ("" = the default pool), carried by its record and its queue entry, and
    `resources` what it asked for. `priority`: higher runs first in its pool's queue.
    """
    if user_job is None and (trainer_config is None or training_config_path is None):
        raise ValueError("prepare_submission: the built-in trainer needs trainer_config and its path")
    definition = define_job(
        trainer_config=trainer_config or {},
        training_config_path=training_config_path or Path("job"),
        user_job=user_job,
        user_job_dir=user_job_dir,
        resume_from=resume_from,
        root=root,
    )
    digest = definition.digest
    if unique:
        digest = definition_digest({"definition": digest, "submitted_at": submitted_at})
    job_name = name or definition.name
    job_id = make_job_id(job_name, digest)
    bundle = build_bundle(root, job_dir=user_job_dir if user_job is not None else None)
    agent: dict[str, Any] = {
        "job_id": job_id,
        "job_name": job_name,
        "resume_from": definition.resume_from,
        "job": dict(trainer_config or {}),
        "user_job": user_job.to_mapping() if user_job is not None else None,
        "bundle_key": bundle.key(),
        "bundle_sha256": bundle.sha256,
    }
    if dataset:
        agent["dataset"] = str(dataset.get("name") or "")
        agent["dataset_version"] = str(dataset.get("version") or "")
    if instances is not None:
        agent["instance_count"] = instances
    record = job_record(
        job_id=job_id,
        name=job_name,
        agent=agent,
        submitted_at=submitted_at,
        source=source,
        sweep=sweep,
        dataset=dataset,
        pool=pool,
        resources=resources,
    )
    return Submission(
        job_id=job_id,
        name=job_name,
        bundle=bundle,
        record=record,
        entry=queue_entry(job_id, submitted_at, now=now, pool=pool, priority=priority),
    )

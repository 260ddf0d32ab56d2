"""A job's definition and id (docs/internals.md, "Jobs, the lease and the standby"), fixed when it is
submitted: the stack's default job by `pulumi up` (infra/defaultjob.py), any other by `trainstack run`
(infra/submission.py, which may add the submission time to make each run a job of its own).

A job is its definition: what it runs (the trainer config or a user's job spec), the job's own code and where
it starts from (`trainstack:resumeFrom`). Equal definitions give equal ids on any machine and in any run: only
file names relative to the repository (or the job's workdir) and file contents go in, never mtimes or absolute
paths. Instance types, counts, cost caps and trainstack's own agent code (`bootstrap/`, `trainstack_job/`) are
not part of it: changing them keeps the job, and its checkpoints, as they are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from infra.bundle import REPO_ROOT, job_files, package_files
from trainstack_job.jobfile import JobSpec
from trainstack_job.jobs import definition_digest, make_job_id

TRAINER = "trainer"
USER = "user"
# The built-in trainer's code is training/ less its example configs: the trainer reads the config the agent
# writes from `AgentConfig.job` (already in the definition), so editing another config file is no new job.
_TRAINER_PACKAGE = "training"
_NOT_TRAINER_CODE = "training/configs/"


@dataclass(frozen=True)
class JobDefinition:
    """The job a stack defines: `<name>-<8 hex>`, its name, the full definition digest, its starting point."""

    job_id: str
    name: str
    digest: str
    resume_from: str | None = None


def code_sha256(files: Iterable[tuple[str, Path]]) -> str:
    """sha256 over (name in the bundle, sha256 of the content) of each file, in name order."""
    digest = hashlib.sha256()
    for name, path in sorted(files):
        digest.update(f"{name}\0{hashlib.sha256(path.read_bytes()).hexdigest()}\n".encode())
    return digest.hexdigest()


def trainer_code_files(root: Path = REPO_ROOT) -> list[tuple[str, Path]]:
    """The built-in trainer's own code as the bundle holds it (`training/`, without its config files)."""
    return [(n, p) for n, p in package_files(root, _TRAINER_PACKAGE) if not n.startswith(_NOT_TRAINER_CODE)]


def define_job(
    *,
    trainer_config: Mapping[str, Any],
    training_config_path: Path,
    user_job: JobSpec | None = None,
    user_job_dir: Path | None = None,
    resume_from: str = "",
    root: Path = REPO_ROOT,
) -> JobDefinition:
    """The job of a stack that runs `trainer_config` (the built-in trainer) or `user_job` from `user_job_dir`.

    Name: the job file's `name`, else the training config file's stem. Digest: `definition_digest` of the
    kind, the trainer config or the job spec, the sha256 of the job's code and `resume_from` (None if empty).
    """
    if user_job is not None:
        if user_job_dir is None:
            raise ValueError("define_job: a user's job needs its workdir (user_job_dir)")
        kind, spec, files, name = USER, user_job.to_mapping(), job_files(user_job_dir), user_job.name
    else:
        kind, spec, files = TRAINER, dict(trainer_config), trainer_code_files(root)
        name = training_config_path.stem
    start = resume_from or None
    definition = {"kind": kind, "spec": spec, "code_sha256": code_sha256(files), "resume_from": start}
    digest = definition_digest(definition)
    return JobDefinition(job_id=make_job_id(name, digest), name=name, digest=digest, resume_from=start)


class StackJob(Protocol):
    """What a stack's config says about its default job: infra/config/'s StackConfig is one. Named here,
    not imported from there: the config defines its job (the `resumeFrom` check) while it parses, so it
    imports this module."""

    @property
    def job(self) -> Mapping[str, Any]: ...

    @property
    def training_config(self) -> Path: ...

    @property
    def user_job(self) -> JobSpec | None: ...

    @property
    def user_job_dir(self) -> Path | None: ...

    @property
    def resume_from(self) -> str: ...


def define_stack_job(config: StackJob, root: Path = REPO_ROOT) -> JobDefinition:
    """The job a validated stack config defines."""
    return define_job(
        trainer_config=config.job,
        training_config_path=config.training_config,
        user_job=config.user_job,
        user_job_dir=config.user_job_dir,
        resume_from=config.resume_from,
        root=root,
    )

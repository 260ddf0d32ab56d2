"""The stack's default job: the trainer's config or a user's job file, checked before anything is deployed."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from infra.bundle import BundleError, job_files
from infra.config.groups import MAX_NODES, GroupKeys
from infra.config.values import NAMESPACE, PRICE, REPO_ROOT, Problems
from infra.jobdef import define_job
from infra.submission import training_config_problems
from trainstack_job.jobfile import JobSpec, JobSpecError, load_job_spec
from trainstack_job.jobs import LEGACY_JOB_ID, JobIdError, check_job_id
from trainstack_job.text import not_utf8


def check_job_id_format(resume_from: str, problems: Problems) -> bool:
    if resume_from == LEGACY_JOB_ID:
        return True
    try:
        check_job_id(resume_from, "resumeFrom")
    except JobIdError:
        problems.add(
            "resumeFrom",
            f"{resume_from!r} is not a job id (lowercase letters, digits and dashes, e.g. default-1a2b3c4d, "
            "or legacy for the stack's checkpoints from before jobs); `trainstack jobs` lists them",
            "default-1a2b3c4d",
        )
        return False
    return True


def check_resume_from(
    resume_from: str,
    training_path: Path,
    job: dict[str, Any],
    user_job: JobSpec | None,
    user_job_dir: Path | None,
    problems: Problems,
) -> None:
    """A job id (or legacy) other than this job's own: a job cannot start from its own checkpoints."""
    if not check_job_id_format(resume_from, problems):
        return
    own = define_job(
        trainer_config=job,
        training_config_path=training_path,
        user_job=user_job,
        user_job_dir=user_job_dir,
        resume_from=resume_from,
    )
    if own.job_id == resume_from:
        problems.add(
            "resumeFrom",
            f"{resume_from!r} is this stack's own job; name the earlier job to start from "
            "(`trainstack jobs` lists them), or empty to start from scratch",
            "''",
        )


def parse_expected_hours(text: str, problems: Problems) -> float | None:
    """The job's expected length for `trainstack estimate`; empty = unknown."""
    if not text:
        return None
    if PRICE.match(text) and float(text) > 0:
        return float(text)
    problems.add("expectedHours", f"{text!r} is not a positive number of hours; empty = unknown", "24")
    return None


def check_default_job_fits(
    job: dict[str, Any],
    user_job: JobSpec | None,
    count: Any,
    min_nodes: Any,
    keys: GroupKeys,
    problems: Problems,
) -> None:
    """The stack's default job on a group of `count` instances: a user's job on one, the built-in trainer's
    global batch over every node count it can have."""
    if user_job is not None and isinstance(count, int) and count > 1:
        anywhere = (
            "; until jobs are placed on pools, any pool may run the stack's default job" if keys.pool else ""
        )
        problems.add(
            keys(keys.count),
            f"{count} nodes with trainstack:job: a user's job runs on one instance (multi-node runs "
            "the built-in trainer, trainstack:trainingConfig); set 1, or a multi-GPU type for more GPUs "
            f'(e.g. instanceTypes ["g6.12xlarge"], 4 x L4){anywhere}',
            "1",
        )
    elif (
        isinstance(count, int)
        and isinstance(min_nodes, int)
        and 1 < count <= MAX_NODES
        and 1 <= min_nodes <= count
    ):
        # Only for node counts that are themselves valid (already refused otherwise): the check's least
        # common multiple over an absurd count is a number no error line could hold.
        _check_global_batch(job, min_nodes, count, problems, keys)


def _check_global_batch(
    job: dict[str, Any], low: int, high: int, problems: Problems, keys: GroupKeys | None = None
) -> None:
    """The global batch is kept when nodes come and go: it must split evenly over every node count the job
    can have (one rank per node at least; the trainer checks the GPUs per node when it starts)."""
    keys = keys or GroupKeys()
    train = job.get("train") if isinstance(job, dict) else None
    batch = train.get("batch_size") if isinstance(train, dict) else None
    if not isinstance(batch, int) or isinstance(batch, bool):
        return
    uneven = [n for n in range(low, high + 1) if batch % n]
    if uneven:
        multiple = math.lcm(*range(low, high + 1))
        problems.add(
            keys("minNodes"),
            f"train.batch_size {batch} of trainstack:trainingConfig does not split over "
            f"{', '.join(map(str, uneven))} node(s), and the job keeps its global batch whatever the "
            f"number of nodes (minNodes..{keys.count} = {low}..{high}): use a multiple of {multiple}, "
            "or raise minNodes",
            str(high),
        )


def load_training_config(path_text: str, problems: Problems) -> tuple[Path, dict[str, Any]]:
    path = Path(path_text)
    if not path.is_absolute():
        path = REPO_ROOT / path
    example = "training/configs/default.yaml"
    try:
        job = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        problems.add("trainingConfig", f"cannot read {path} ({exc.strerror})", example)
        return path, {}
    except UnicodeDecodeError as exc:  # a file saved in another encoding, or not text at all
        problems.add(
            "trainingConfig",
            f"{path}: {not_utf8(exc)}",
            example,
        )
        return path, {}
    except yaml.YAMLError as exc:
        problems.add("trainingConfig", f"{path} is not valid YAML ({str(exc).splitlines()[0]})", example)
        return path, {}
    if not isinstance(job, dict):
        problems.add("trainingConfig", f"{path} must hold a YAML mapping (the trainer's config)", example)
        return path, {}
    shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    # The same checks as `trainstack run --config` (the agent's `secrets:`, no credential-looking value, the
    # trainer's own validator without torch), so a typo fails `pulumi preview`, not a GPU instance.
    problems.lines.extend(training_config_problems(job, f"{NAMESPACE}:trainingConfig: {shown}"))
    return path, job


def load_user_job(path_text: str, problems: Problems) -> tuple[JobSpec | None, Path | None]:
    """The job file named by trainstack:job, validated by the agent's own parser (workdir and requirements
    must exist), so a bad job file fails `pulumi preview` naming the key."""
    path = Path(path_text)
    if not path.is_absolute():
        path = REPO_ROOT / path
    try:
        spec = load_job_spec(path)
    except JobSpecError as exc:
        problems.lines.extend(f"{NAMESPACE}:job: {problem}" for problem in exc.problems)
        return None, None
    workdir = (path.parent / spec.workdir).resolve()
    try:
        job_files(workdir)
    except BundleError as exc:
        problems.lines.append(str(exc))
        return None, None
    return spec, workdir

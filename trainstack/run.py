"""`trainstack run JOB.yaml | --config TRAINING.yaml`: validate the job here, upload its code bundle
(content-addressed, once, under job-code/: run as the job's user, never as root), write its record and queue
entry (each created, never overwritten), wake the group if it sleeps, then follow it.

Submitting touches only the bucket and the group's desired capacity: never the launch template, never
Pulumi state (docs/internals.md, "The job queue").
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import yaml
from botocore.exceptions import ClientError

from bootstrap.devices import device_profile
from infra.bundle import BundleError, LinkOutsideError, job_files

# Re-exported: the check behind load_definition's refusal of links, where tests/cli/test_run_links.py looks.
from infra.bundle import links_outside as links_outside
from infra.submission import Submission, prepare_submission, training_config_problems
from trainstack import datasets, follow
from trainstack.aws import Clients, is_not_found
from trainstack.errors import CliError
from trainstack.jobs import describe
from trainstack.output import console, print_error, print_json
from trainstack.stack import Stack, StackOutputs
from trainstack.state import Group, encryption_args, free_lanes, read_group, running_in_slots
from trainstack.sweep import SweepError, SweepPoint, grid, parse_axes, trainer_point, user_job_point
from trainstack_job.datasets import DEFAULT_DATASET, DatasetError, check_dataset_name, label, push_command
from trainstack_job.jobfile import JobSpec, JobSpecError, load_job_spec
from trainstack_job.queue import JOB_CODE_PREFIX, SOURCE_RUN
from trainstack_job.records import is_conflict
from trainstack_job.resources import (
    RESOURCES_KEY,
    PoolOffer,
    ResourceError,
    ResourceRequest,
    TypeOffer,
    match_pool,
    parse_gpus,
    parse_resources,
    pool_offers,
)
from trainstack_job.text import not_utf8

_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")
EXAMPLE_CONFIG = "training/configs/default.yaml"


@dataclass(frozen=True)
class RunRequest:
    """What the user asked `trainstack run` for."""

    job_file: Path | None = None
    config_file: Path | None = None
    name: str | None = None
    detach: bool = False
    now: bool = False
    sweeps: Sequence[str] = field(default_factory=tuple)
    dataset: str | None = None
    instances: int | None = None
    # What the job asks for on the command line, over its file's `resources:` (trainstack_job/resources.py).
    pool: str | None = None
    gpus: str | None = None
    min_gpu_memory_gb: float | None = None
    # Higher runs first in its pool's queue; a sweep runs at most `parallel` of its points at once.
    priority: int = 0
    parallel: int | None = None


class InvalidJobError(CliError):
    """Every problem of the job asked for, one line each naming the file (or flag) and key."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class Definition:
    """The job as read from its file: the built-in trainer's config, or a user's job and its workdir."""

    name: str
    trainer_config: dict[str, Any] | None = None
    config_path: Path | None = None
    user_job: JobSpec | None = None
    user_job_dir: Path | None = None
    source: str = ""
    # What the job asks for: its file's `resources:` with the command line's flags over it.
    resources: ResourceRequest = field(default_factory=ResourceRequest)


def _asked(request: RunRequest, from_file: ResourceRequest, where: str) -> tuple[ResourceRequest, list[str]]:
    """The file's request with `--pool`, `--gpus`, `--min-gpu-memory-gb` and `--instances` over it."""
    problems: list[str] = []
    asked = from_file
    if request.pool is not None:
        asked = replace(asked, pool=request.pool)
    if request.gpus is not None:
        try:
            model, count = parse_gpus(request.gpus, "--gpus")
            asked = replace(asked, gpu_model=model, gpus=count)
        except ResourceError as error:
            problems += error.problems
    if request.min_gpu_memory_gb is not None:
        if request.min_gpu_memory_gb <= 0:
            problems.append(f"--min-gpu-memory-gb {request.min_gpu_memory_gb:g}: a size in GB, e.g. 24")
        else:
            asked = replace(asked, min_gpu_memory_gb=request.min_gpu_memory_gb)
    if request.instances is not None:
        asked = replace(asked, instances=request.instances)
    if asked.instances not in (None, 1) and where == "job":
        flag = "--instances" if request.instances is not None else "resources.instances"
        problems.append(
            f"{flag} {asked.instances}: a user's job runs on one instance (multi-node runs the "
            "built-in trainer, --config); use a multi-GPU instance type for more GPUs"
        )
    return asked, problems


def _read_training_config(path: Path) -> tuple[dict[str, Any] | None, list[str]]:
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        return None, [f"--config {path}: cannot read it ({exc.strerror})"]
    except UnicodeDecodeError as exc:  # saved in another encoding, or not a text file at all
        return None, [f"--config {path}: {not_utf8(exc)}"]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        return None, [f"--config {path}{where}: not valid YAML; fix the syntax there"]
    if not isinstance(config, dict):
        return None, [
            f"--config {path}: must hold a YAML mapping (the trainer's config, e.g. {EXAMPLE_CONFIG})"
        ]
    return config, training_config_problems(config, str(path))


def load_definition(request: RunRequest) -> Definition:
    """Read and validate the job file or training config with the validators `pulumi preview` uses."""
    if (request.job_file is None) == (request.config_file is None):
        raise CliError(
            "trainstack run: give a job file (trainstack run examples/charlm/job.yaml) or a training config "
            f"for the built-in trainer (trainstack run --config {EXAMPLE_CONFIG}), one of the two"
        )
    problems: list[str] = []
    if request.name is not None and not _NAME.match(request.name):
        problems.append(
            f"--name {request.name!r}: lowercase letters, digits and '-', at most 40 (e.g. --name resnet-lr)"
        )
    if request.parallel is not None and (request.parallel < 1 or not request.sweeps):
        problems.append(
            f"--parallel {request.parallel}: how many points of a --sweep run at once (1 or more); give it "
            "with --sweep"
        )
    if not -1000 <= request.priority <= 1000:
        problems.append(f"--priority {request.priority}: from -1000 to 1000 (higher runs first; default 0)")
    if request.instances is not None and request.instances < 1:
        problems.append(f"--instances {request.instances}: a job trains on at least 1 instance")
    if request.dataset is not None:
        try:
            check_dataset_name(request.dataset, f"--data {request.dataset}")
        except DatasetError as error:
            problems.append(str(error))
    if request.config_file is not None:
        path = request.config_file
        config, found = _read_training_config(path)
        problems += found
        from_file = ResourceRequest()
        if config is not None:
            try:
                from_file = parse_resources(config.get(RESOURCES_KEY), f"{path}: {RESOURCES_KEY}")
            except ResourceError as error:
                problems += error.problems
        resources, more = _asked(request, from_file, "config")
        problems += more
        if problems or config is None:
            raise InvalidJobError(problems)
        return Definition(
            request.name or path.stem,
            trainer_config=config,
            config_path=path,
            source=str(path),
            resources=resources,
        )
    assert request.job_file is not None
    try:
        spec = load_job_spec(request.job_file)
    except JobSpecError as exc:
        raise InvalidJobError(problems + exc.problems) from None
    resources, more = _asked(request, spec.resources, "job")
    problems += more
    workdir = (request.job_file.parent / spec.workdir).resolve()
    try:
        job_files(workdir)
    except LinkOutsideError as exc:
        problems += exc.problems  # each names the link itself, the job's folder and the fix
    except BundleError as exc:
        # The bundle's message names the stack key that points at the job; here it is the file given.
        problems.append(f"{request.job_file}: {str(exc).removeprefix('trainstack:job: ')}")
    if problems:
        raise InvalidJobError(problems)
    return Definition(
        request.name or spec.name,
        user_job=spec,
        user_job_dir=workdir,
        source=str(request.job_file),
        resources=resources,
    )


@dataclass(frozen=True)
class Variant:
    """One job to submit: the job itself, or one point of its sweep (named after its values)."""

    name: str
    trainer_config: dict[str, Any] | None
    user_job: JobSpec | None
    point: dict[str, Any] | None = None


@dataclass(frozen=True)
class PreparedJob:
    """A request whose job file (or training config) and every sweep point were read and validated."""

    request: RunRequest
    definition: Definition
    variants: list[Variant]

    @property
    def sweep(self) -> str | None:
        return self.definition.name if self.request.sweeps else None


def read_job(request: RunRequest) -> PreparedJob:
    """The job and each point of its sweep, every problem of all of them in one InvalidJobError; reads no
    stack and calls no AWS API, so a typo is found before credentials or the stack's outputs are needed."""
    points: list[SweepPoint] = []
    problems: list[str] = []
    try:
        points = grid(parse_axes(request.sweeps)) if request.sweeps else []
    except SweepError as error:
        problems = error.problems
    try:
        definition = load_definition(request)
    except InvalidJobError as error:
        raise InvalidJobError(error.problems + problems) from None
    if problems:
        raise InvalidJobError(problems)
    if not points:
        return PreparedJob(
            request, definition, [Variant(definition.name, definition.trainer_config, definition.user_job)]
        )
    variants: list[Variant] = []
    for point in points:
        name = f"{definition.name}-{point.label}"
        try:
            if definition.user_job is not None:
                spec = user_job_point(definition.user_job, point, definition.source)
                variants.append(Variant(name, None, spec, point.to_json()))
            else:
                assert definition.trainer_config is not None
                config = trainer_point(definition.trainer_config, point)
                problems += training_config_problems(config, f"{definition.source} (--sweep {point.label})")
                variants.append(Variant(name, config, None, point.to_json()))
        except SweepError as error:
            problems += error.problems
    if problems:
        raise InvalidJobError(problems)
    return PreparedJob(request, definition, variants)


def build_submissions(
    job: PreparedJob, submitted_at: datetime, dataset: dict[str, str] | None, *, pool: str
) -> list[Submission]:
    """One submission per variant. Each job's `submitted_at` is one microsecond after the previous one's, so
    the queue (FIFO by that time) runs a sweep in grid order."""
    request, definition = job.request, job.definition
    return [
        prepare_submission(
            trainer_config=variant.trainer_config,
            training_config_path=definition.config_path,
            user_job=variant.user_job,
            user_job_dir=definition.user_job_dir,
            submitted_at=_queue_time(submitted_at + timedelta(microseconds=index)),
            source=SOURCE_RUN,
            name=variant.name,
            unique=True,
            sweep=_sweep(job, variant.point),
            dataset=dataset,
            now=request.now,
            instances=definition.resources.instances if definition.user_job is None else 1,
            pool=pool,
            resources=definition.resources.to_mapping(),
            priority=request.priority,
        )
        for index, variant in enumerate(job.variants)
    ]


def _sweep(job: PreparedJob, point: dict[str, Any] | None) -> dict[str, Any] | None:
    """A sweep point's record field: its sweep's name, its values and how many points run at once."""
    if point is None:
        return None
    sweep: dict[str, Any] = {"name": job.sweep, "point": point}
    if job.request.parallel is not None:
        sweep["parallel"] = job.request.parallel
    return sweep


def _queue_time(moment: datetime) -> str:
    # The form `pulumi up` writes its default job's entry in (UTC, `Z`), to the microsecond.
    return moment.astimezone(timezone.utc).replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


def dataset_for(
    clients: Clients, outputs: StackOutputs, name: str | None, *, image_folder: bool
) -> dict[str, str] | None:
    """The dataset the job trains on, pinned to its current version when `--data` names one (the job then
    never trains on a later push by surprise); None = the default dataset, whatever version is current when
    the job starts. A pushed version the built-in trainer will read must be an ImageFolder."""
    where = datasets.place(outputs, name or DEFAULT_DATASET)
    manifest, _ = datasets.read_manifest(clients, outputs.bucket, where)
    if manifest is None:
        if name:
            raise CliError(
                f"--data {name}: {label(name)} has no pushed version (no "
                f"s3://{outputs.bucket}/{where.manifest_key}): push it first with `{push_command(name)}`"
            )
        return None
    if image_folder:
        datasets.check_image_folder(manifest, f"s3://{outputs.bucket}/{where.prefix}".rstrip("/"))
    return {"name": name, "version": manifest.version} if name else None


def instances_needed(request: RunRequest, definition: Definition, outputs: StackOutputs) -> int:
    """A user's job runs on one instance; the built-in trainer on `--instances`, else the stack's
    instanceCount."""
    if definition.user_job is not None:
        return 1
    return definition.resources.instances or outputs.instance_count


def type_offer(instance_type: str) -> TypeOffer:
    """What one instance type has, from the agent's catalogue (bootstrap/devices.py)."""
    profile = device_profile(instance_type)
    if profile is None:
        return TypeOffer(instance_type, None, 0, 0)
    return TypeOffer(instance_type, profile.gpu_model, profile.gpu_count, profile.memory_gib)


def choose_pool(outputs: StackOutputs, asked: ResourceRequest, instances: int) -> PoolOffer:
    """The pool that serves the job (trainstack_job/resources.py match_pool), else one line naming every pool
    and what it offers."""
    try:
        return match_pool(asked, pool_offers(outputs.pools, type_offer), instances=instances, where="the job")
    except ResourceError as error:
        raise CliError(str(error)) from None


def check_capacity(group: Group, needed: int) -> None:
    if needed > group.max_size:
        raise CliError(
            f"the job needs {needed} instances and group {group.name} allows at most {group.max_size}: "
            "ask for fewer (--instances N), or raise trainstack:instanceCount and `pulumi up` first"
        )


def upload(clients: Clients, outputs: StackOutputs, submissions: Sequence[Submission]) -> list[str]:
    """Every bundle (once each, skipped when its content-addressed object is already there), then every
    record, then every entry, both written only if absent: the agent never sees an entry without its record
    and code, and a sweep that fails half-way has queued nothing unless all its records were written.
    Returns the bundle keys uploaded now."""
    s3, bucket, encryption = clients.s3(), outputs.bucket, encryption_args(outputs)
    # A submission's code goes under job-code/, never the environment's code prefix: the agent runs that as
    # root, and only `pulumi up` writes it (SECURITY.md, "A submitter").
    objects = [(s.job_id, s.objects(JOB_CODE_PREFIX)) for s in submissions]
    uploaded: list[str] = []
    for key, bundle, content_type in dict.fromkeys(found[0] for _, found in objects):
        if not _exists(clients, bucket, key) and _create(s3, bucket, key, bundle, content_type, encryption):
            uploaded.append(key)
    for stage in (1, 2):  # the records, then the queue entries
        for job_id, found in objects:
            key, body, content_type = found[stage]
            try:
                s3.put_object(
                    Bucket=bucket, Key=key, Body=body, ContentType=content_type, IfNoneMatch="*", **encryption
                )
            except ClientError as error:
                if is_conflict(error):
                    raise CliError(
                        f"s3://{bucket}/{key} already exists: job {job_id} was submitted before; "
                        "`trainstack jobs` lists it (run again for a new job)"
                    ) from None
                raise
    return uploaded


def _create(
    s3: Any, bucket: str, key: str, body: bytes, content_type: str, encryption: dict[str, str]
) -> bool:
    """Write a content-addressed object unless it is there (If-None-Match: the bucket refuses a submitter any
    other write of it); False when another submission wrote the same bytes first."""
    try:
        s3.put_object(
            Bucket=bucket, Key=key, Body=body, ContentType=content_type, IfNoneMatch="*", **encryption
        )
    except ClientError as error:
        if is_conflict(error):
            return False
        raise
    return True


def _exists(clients: Clients, bucket: str, key: str) -> bool:
    try:
        clients.s3().head_object(Bucket=bucket, Key=key)
    except ClientError as error:
        if is_not_found(error):
            return False
        raise
    return True


def wake_group(clients: Clients, group: Group, needed: int, *, free_lanes: int) -> int | None:
    """A group at zero gets the job's instances; one already up takes the job when its current one ends. A
    pool running several jobs at once with a lane free (`free_lanes`) gets the job's instances more now
    (never past its maximum): the job starts beside the others instead of waiting for one to end. The new
    desired capacity, or None when it stays."""
    if group.desired == 0:
        wanted = needed
    elif free_lanes > 0:
        wanted = min(group.max_size, group.desired + needed)
    else:
        return None
    if wanted <= group.desired:
        return None
    clients.autoscaling().update_auto_scaling_group(AutoScalingGroupName=group.name, DesiredCapacity=wanted)
    return wanted


def submit(clients: Clients, stack: Stack, job: PreparedJob) -> dict[str, Any]:
    """Refuse what the group cannot run, upload, wake the group; what was done, as JSON."""
    request, definition = job.request, job.definition
    outputs = stack.outputs
    dataset = dataset_for(clients, outputs, request.dataset, image_folder=definition.user_job is None)
    submitted_at = datetime.now(timezone.utc)
    needed = instances_needed(request, definition, outputs)
    pool = choose_pool(outputs, definition.resources, needed)
    submissions = build_submissions(job, submitted_at, dataset, pool="" if pool.default else pool.name)
    group = read_group(clients, str(outputs.pools[pool.name]["group_name"]), lifecycles=False)
    check_capacity(group, needed)
    uploaded = upload(clients, outputs, submissions)
    lanes = int(outputs.pools[pool.name].get("max_jobs") or 1)
    free = free_lanes(clients, outputs, "" if pool.default else pool.name, lanes)
    # A sweep's points start together, as many as the pool's free lanes take (one pool at zero: its first).
    starting = max(1, min(free, len(submissions), request.parallel or len(submissions))) if lanes > 1 else 1
    # The stack's maxConcurrentJobs: no instance is woken for a job that could not start (the scheduler
    # function wakes one when a running job ends).
    running = running_in_slots(clients, outputs, submitted_at)
    if running is not None:
        starting = min(starting, max(0, outputs.max_concurrent_jobs - running))
    woken = wake_group(clients, group, needed * starting, free_lanes=free) if starting else None
    return {
        "jobs": [
            {
                "job_id": s.job_id,
                "name": s.name,
                "sweep": s.record["sweep"],
                "bundle_key": s.bundle.key(JOB_CODE_PREFIX),
            }
            for s in submissions
        ],
        "sweep": job.sweep,
        "bundles_uploaded": uploaded,
        "group": group.name,
        "pool": pool.name,
        "scaled_up_to": woken,
        "now": request.now,
        "dataset": dataset,
        "submitted_at": submitted_at.isoformat(timespec="seconds"),
    }


def report_invalid(invalid: InvalidJobError) -> int:
    """Each problem on its own stderr line, then what happened; the exit status."""
    for problem in invalid.problems:
        print_error(problem)
    count = len(invalid.problems)
    print_error(f"nothing submitted: {count} problem{'s' if count > 1 else ''}; fix and run again")
    return 1


def run(clients: Clients, stack: Stack, job: PreparedJob, *, as_json: bool) -> int:
    request = job.request
    result = submit(clients, stack, job)
    if as_json:
        print_json(result)
        return 0
    out = console()
    jobs = result["jobs"]
    woke = (
        f"; group {result['group']} scaled up to {result['scaled_up_to']}" if result["scaled_up_to"] else ""
    )
    if len(jobs) > 1:
        for queued in jobs:
            out.print(f"queued {queued['job_id']}", markup=False)
        out.print(
            f"sweep {result['sweep']}: {len(jobs)} jobs queued{woke}; compare them with "
            f"`trainstack jobs --sweep {result['sweep']}`",
            markup=False,
        )
        return 0
    job_id = jobs[0]["job_id"]
    if request.detach:
        out.print(job_id, markup=False)
        return 0
    row = describe(clients, stack.outputs, job_id)
    place = f", position {row['queue_position']}" if row["queue_position"] else ""
    out.print(
        f"submitted {job_id} (queued{place}){woke}; Ctrl-C stops following, never the job", markup=False
    )
    since = datetime.fromisoformat(result["submitted_at"]) - timedelta(minutes=1)
    return follow.follow(clients, stack.outputs, job_id, since=since)

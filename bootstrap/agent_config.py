"""The agent's configuration: one definition that infra/ renders into user-data and the agent loads."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainstack_job.contract import BucketPrefix
from trainstack_job.datasets import DatasetError, check_dataset_name, check_version
from trainstack_job.jobfile import JobSpec, JobSpecError
from trainstack_job.jobs import JOBS_PREFIX, LEGACY_JOB_ID, JobIdError, check_job_id

DEFAULT_PATH = Path("/etc/trainstack/agent.yaml")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_POOL = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
_REGION = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_ROLE_ARN = re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]{1,64}$")


class AgentConfigError(ValueError):
    """A bad agent config; the message names the key and the fix on one line."""


@dataclass(frozen=True)
class Prefixes:
    """Where each kind of object lives in the bucket (each ends with '/').

    `data` and `code` are the stack's; each job lives under `jobs/<job-id>/` (trainstack_job.jobs:
    JobPrefixes).
    `checkpoints`, `results` and `state` are the legacy job's (a stack from before jobs), and `state` also
    holds the stack's own `current-job.json` and `data-manifest.json`.
    """

    data: str = BucketPrefix.DATA.value
    code: str = BucketPrefix.CODE.value
    checkpoints: str = BucketPrefix.CHECKPOINTS.value
    results: str = BucketPrefix.RESULTS.value
    state: str = BucketPrefix.STATE.value
    jobs: str = JOBS_PREFIX


@dataclass(frozen=True)
class AgentConfig:
    """Everything one instance life needs to know about its stack and its job."""

    region: str
    bucket: str
    group_name: str
    topic_arn: str
    log_group: str
    stack: str = "dev"
    prefixes: Prefixes = field(default_factory=Prefixes)
    gpu_required: bool = True
    poll_seconds: float = 5.0
    # Of the two-minute spot notice: leaves time for the last upload to be confirmed.
    stop_deadline_seconds: float = 100.0
    stall_minutes: float = 30.0
    # Right after `pulumi up` the bucket has no dataset yet: wait this long for `trainstack data push`,
    # then scale to zero rather than bill a GPU that has nothing to train on.
    data_wait_minutes: float = 20.0
    max_consecutive_failures: int = 3
    max_cost_usd: float | None = None
    instance_count: int = 1
    # A multi-node job (instance_count > 1) trains on while at least this many nodes remain.
    min_nodes: int = 1
    # The instance has an Elastic Fabric Adapter: the job gets bootstrap/efa.py's environment.
    efa: bool = False
    # The root EBS volume (gp3): priced into each life's storage cost.
    root_volume_gb: int = 150
    scratch_dir: str | None = None
    # The group's EC2_INSTANCE_TERMINATING hook (infra/fleet.py LIFECYCLE_HOOK_NAME) that the agent
    # completes once its last upload is confirmed; null = the group has none.
    lifecycle_hook: str | None = "trainstack-drain"
    job: dict[str, Any] = field(default_factory=dict)
    # A user's own job (bootstrap/job.py JobSpec.to_mapping()); null = the built-in trainer with `job`.
    user_job: dict[str, Any] | None = None
    # The job this config defines (infra/jobdef.py): its id, fixed by `pulumi up`, and its readable name.
    # "legacy" = a config from before jobs: the stack's top-level checkpoints/, results/, state/.
    # "" = the config defines no job: the agent runs what the stack's queue holds (docs/internals.md,
    # "The job queue"), and with nothing queued scales the group to zero.
    job_id: str = LEGACY_JOB_ID
    job_name: str = ""
    # A job id (or "legacy") whose newest checkpoint a new job's first life starts from (fine-tuning).
    resume_from: str | None = None
    # The code bundle this config was rendered with: a job keeps running it after a `pulumi up` changes the
    # code (the object is retained in S3), so its record names it. Empty = unknown (a config built by hand).
    bundle_key: str = ""
    bundle_sha256: str = ""
    # The stack's job role (infra/identity.py): the agent assumes it with a session policy for this job and
    # hands the job those narrower credentials (bootstrap/jobuser.py). None = the job gets no AWS credentials
    # of its own (and, running as the agent's own user off an instance, inherits the agent's environment).
    job_role_arn: str | None = None
    # The dataset the job trains on ("" = the stack's default under data/; else datasets/<name>/) and the
    # version it was submitted with ("" = the version current when it starts); trainstack_job/datasets.py.
    dataset: str = ""
    dataset_version: str = ""
    # Resume the job's checkpoints even on another version of its dataset than they were trained on.
    allow_data_change: bool = False
    # The pool this instance's group is (trainstack:pools): it takes only that pool's queued jobs and keeps
    # that pool's current-job pointer. "" = the stack's default pool, the only one before pools.
    pool: str = ""
    # How many jobs the pool runs at once (its `maxJobs`): each has a lane, with its own current-job pointer
    # (bootstrap/jobbinding.py). 1 = one job at a time, as before.
    lanes: int = 1
    # The stack's `maxConcurrentJobs`: at most this many jobs run at once across every pool, each holding a
    # run slot (trainstack_job/slots.py). 0 = no stack-wide limit (each pool's own lanes still apply).
    max_concurrent_jobs: int = 0

    def to_yaml(self) -> str:
        values = asdict(self)
        # A config at these defaults renders as it did before pools: no new launch template version.
        if not self.pool:
            del values["pool"]
        if self.lanes == 1:
            del values["lanes"]
        if not self.max_concurrent_jobs:
            del values["max_concurrent_jobs"]
        return yaml.safe_dump(values, sort_keys=False)

    @classmethod
    def from_mapping(cls, raw: Any, source: str = "agent config") -> AgentConfig:
        """Validate a parsed mapping; every problem is reported, each naming its key."""
        if not isinstance(raw, dict):
            raise AgentConfigError(
                f"{source}: expected a YAML mapping at the top level; see docs/internals.md"
            )
        problems: list[str] = []
        known = set(cls.__dataclass_fields__)
        problems += [f"unknown key '{k}' (known: {', '.join(sorted(known))})" for k in raw if k not in known]
        for key in ("region", "bucket", "group_name", "topic_arn", "log_group"):
            if not isinstance(raw.get(key), str) or not raw.get(key):
                problems.append(f"'{key}' is required and must be a non-empty string")
        if isinstance(raw.get("bucket"), str) and raw["bucket"] and not _BUCKET.match(raw["bucket"]):
            problems.append(
                f"'bucket' {raw['bucket']!r} is not a valid S3 bucket name (e.g. 'trainstack-dev-data')"
            )
        if isinstance(raw.get("region"), str) and raw["region"] and not _REGION.match(raw["region"]):
            problems.append(f"'region' {raw['region']!r} is not an AWS region (e.g. 'us-east-1')")
        prefixes_raw = raw.get("prefixes", {})
        prefixes = Prefixes()
        if not isinstance(prefixes_raw, dict):
            problems.append(
                "'prefixes' must be a mapping of data/code/checkpoints/results/state/jobs to 'name/'"
            )
        else:
            bad = [k for k in prefixes_raw if k not in Prefixes.__dataclass_fields__]
            problems += [f"unknown key 'prefixes.{k}'" for k in bad]
            for k, v in prefixes_raw.items():
                if k in bad:
                    continue
                if not isinstance(v, str) or not v.endswith("/") or v.startswith("/"):
                    problems.append(f"'prefixes.{k}' must be a relative prefix ending in '/', e.g. '{k}/'")
            if not problems:
                prefixes = Prefixes(**prefixes_raw)
        _check_number(
            raw, "poll_seconds", problems, low=0.1, high=5.0, why="AWS asks for spot polling every ≤5 s"
        )
        _check_number(
            raw, "stop_deadline_seconds", problems, low=1.0, high=115.0, why="must fit the 120 s notice"
        )
        _check_number(raw, "stall_minutes", problems, low=0.05, high=24 * 60.0)
        _check_number(raw, "data_wait_minutes", problems, low=0.0, high=24 * 60.0)
        _check_number(raw, "max_consecutive_failures", problems, low=1, high=100, integer=True)
        _check_number(raw, "instance_count", problems, low=1, high=1000, integer=True)
        _check_number(raw, "root_volume_gb", problems, low=1, high=65536, integer=True)
        _check_number(raw, "lanes", problems, low=1, high=256, integer=True)
        _check_number(raw, "max_concurrent_jobs", problems, low=0, high=256, integer=True)
        count = raw.get("instance_count", 1)
        _check_number(
            raw,
            "min_nodes",
            problems,
            low=1,
            high=count if isinstance(count, int) and count >= 1 else 1000,
            integer=True,
            why="a job needs at least one node and cannot wait for more than the group holds",
        )
        if raw.get("max_cost_usd") is not None:
            _check_number(raw, "max_cost_usd", problems, low=0.01, high=1e7)
        if "gpu_required" in raw and not isinstance(raw["gpu_required"], bool):
            problems.append("'gpu_required' must be true or false")
        if "efa" in raw and not isinstance(raw["efa"], bool):
            problems.append("'efa' must be true or false")
        if "job" in raw and not isinstance(raw["job"], dict):
            problems.append("'job' must be a mapping (the trainer's YAML config)")
        if raw.get("user_job") is not None:
            try:
                JobSpec.from_mapping(raw["user_job"], "'user_job'")
            except JobSpecError as exc:
                problems += exc.problems
        _check_job_fields(raw, problems)
        if raw.get("scratch_dir") is not None and not isinstance(raw["scratch_dir"], str):
            problems.append(
                "'scratch_dir' must be a path or null (null = instance-store NVMe, else root volume)"
            )
        role = raw.get("job_role_arn")
        if role is not None and (not isinstance(role, str) or not _ROLE_ARN.match(role)):
            problems.append(f"'job_role_arn' must be an IAM role ARN or null, got {role!r}")
        if raw.get("lifecycle_hook") is not None and not isinstance(raw["lifecycle_hook"], str):
            problems.append("'lifecycle_hook' must be the group's termination hook name or null")
        for key, check in (("dataset", check_dataset_name), ("dataset_version", check_version)):
            try:
                check(raw.get(key, ""), f"'{key}'")
            except DatasetError as exc:
                problems.append(str(exc))
        if "allow_data_change" in raw and not isinstance(raw["allow_data_change"], bool):
            problems.append("'allow_data_change' must be true or false")
        pool = raw.get("pool", "")
        if not isinstance(pool, str) or (pool and not _POOL.match(pool)):
            problems.append(f"'pool' must be a pool name (a-z, 0-9 and '-') or empty, got {pool!r}")
        if problems:
            raise AgentConfigError(f"{source}: " + "; ".join(problems))
        values = {k: v for k, v in raw.items() if k != "prefixes"}
        return cls(prefixes=prefixes, **values)

    @classmethod
    def load(cls, path: Path = DEFAULT_PATH) -> AgentConfig:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise AgentConfigError(
                f"{path}: cannot read the agent config ({exc.strerror}); pass --config FILE"
            ) from exc
        except UnicodeDecodeError as exc:  # damaged, or not the file infra rendered
            raise AgentConfigError(
                f"{path}: cannot read the agent config (not UTF-8 text, byte {exc.start}: {exc.reason}); "
                "pass --config FILE"
            ) from exc
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise AgentConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from exc
        return cls.from_mapping(raw, source=str(path))


def _check_job_id(value: Any, key: str, problems: list[str]) -> None:
    if value == LEGACY_JOB_ID:
        return
    try:
        check_job_id(value, f"'{key}'")
    except JobIdError as exc:
        problems.append(str(exc))


def _check_job_fields(raw: dict[str, Any], problems: list[str]) -> None:
    """The job's identity as infra wrote it; a bad one would put the job's objects under a wrong prefix."""
    if "job_id" in raw and raw["job_id"] != "":
        _check_job_id(raw["job_id"], "job_id", problems)
    if raw.get("resume_from") is not None:
        _check_job_id(raw["resume_from"], "resume_from", problems)
    for key in ("job_name", "bundle_key"):
        if key in raw and not isinstance(raw[key], str):
            problems.append(f"'{key}' must be a string")
    sha = raw.get("bundle_sha256", "")
    if not isinstance(sha, str) or (sha and not _SHA256.match(sha)):
        problems.append(
            f"'bundle_sha256' must be the bundle's lowercase sha256 hex digest or empty, got {sha!r}"
        )


def _check_number(
    raw: dict[str, Any],
    key: str,
    problems: list[str],
    *,
    low: float,
    high: float,
    integer: bool = False,
    why: str = "",
) -> None:
    if key not in raw:
        return
    value = raw[key]
    number_ok = isinstance(value, int) or (not integer and isinstance(value, float))
    if isinstance(value, bool) or not number_ok or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        reason = f" ({why})" if why else ""
        problems.append(f"'{key}' must be {kind} between {low:g} and {high:g}, got {value!r}{reason}")

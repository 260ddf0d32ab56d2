"""The contracts every part of trainstack keeps: exit codes, a job's environment, file names, bucket layout,
job statuses and life outcomes, stack output names. Standard library only: infra, bootstrap, training, the
CLI and users' jobs all import it. docs/job-contract.md and docs/internals.md describe the same values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from pathlib import Path
from typing import Any

from trainstack_job.atomic import write_atomic


class ExitCode(IntEnum):
    """What a job's exit status means to the agent."""

    COMPLETED = 0
    # Any other status not listed here is an ordinary failure: the next life retries.
    FAILED = 1
    # Permanent failures: another instance cannot fix them, so the job stops at once.
    CONFIG_ERROR = 2
    DATA_ERROR = 65  # sysexits EX_DATAERR
    # Stopped on request with its newest checkpoint committed in the checkpoint directory.
    STOPPED = 75  # sysexits EX_TEMPFAIL


class JobEnv(str, Enum):
    """Environment variables the agent sets for a job (docs/job-contract.md)."""

    CHECKPOINT_DIR = "TRAINSTACK_CHECKPOINT_DIR"
    OUTPUT_DIR = "TRAINSTACK_OUTPUT_DIR"
    DATA_DIR = "TRAINSTACK_DATA_DIR"
    STOP_FILE = "TRAINSTACK_STOP_FILE"
    CHECKPOINT_REQUEST_FILE = "TRAINSTACK_CHECKPOINT_REQUEST_FILE"
    PROGRESS_FILE = "TRAINSTACK_PROGRESS_FILE"
    RESTORED_STEP = "TRAINSTACK_RESTORED_STEP"
    # s3://<bucket>/<the job's results prefix>: what outlives the instance between lives (the built-in
    # trainer's TensorBoard run by default); the job may write there, never outside its own job.
    RESULTS_URI = "TRAINSTACK_RESULTS_URI"
    # Mean hours between spot interruptions observed in the ledger, and a phrase saying so; set once the
    # ledger has enough history (the built-in trainer's `checkpoint.every_minutes: auto` reads them).
    CHECKPOINT_KEEP = "TRAINSTACK_CHECKPOINT_KEEP"
    MTBI_HOURS = "TRAINSTACK_MTBI_HOURS"
    MTBI_SOURCE = "TRAINSTACK_MTBI_SOURCE"
    # A job spread over several instances ("nodes"): each node's trainer launcher joins one torch elastic c10d
    # rendezvous per generation. "address:port" of the store host, the generation's run id, "1" on the node
    # that hosts the store (else "0"), "min:max" nodes (as torchrun --nnodes), this node's private address,
    # where the launcher writes its node's result (JSON), and the seconds to wait for the minimum of nodes.
    RDZV_ENDPOINT = "TRAINSTACK_RDZV_ENDPOINT"
    RDZV_ID = "TRAINSTACK_RDZV_ID"
    RDZV_HOST = "TRAINSTACK_RDZV_HOST"
    NNODES = "TRAINSTACK_NNODES"
    NODE_ADDR = "TRAINSTACK_NODE_ADDR"
    NODE_EXIT_FILE = "TRAINSTACK_NODE_EXIT_FILE"
    RDZV_JOIN_TIMEOUT = "TRAINSTACK_RDZV_JOIN_TIMEOUT"
    # What this life runs as, recorded in every checkpoint's context (trainstack_job/context.py): the job's
    # id, the code bundle's sha256, and the instance's device profile (bootstrap/devices.py): its type, GPU
    # model, GPUs, memory per GPU in GiB, and the precision that GPU trains in (bf16, or fp16 on T4/V100).
    JOB_ID = "TRAINSTACK_JOB_ID"
    CODE_HASH = "TRAINSTACK_CODE_HASH"
    INSTANCE_TYPE = "TRAINSTACK_INSTANCE_TYPE"
    GPU_MODEL = "TRAINSTACK_GPU_MODEL"
    GPU_COUNT = "TRAINSTACK_GPU_COUNT"
    GPU_MEMORY_GIB = "TRAINSTACK_GPU_MEMORY_GIB"
    PRECISION = "TRAINSTACK_PRECISION"


# Files inside a job's checkpoint directory (trainstack_job/layout.py reads and writes them).
MANIFEST = "manifest.json"
LATEST = "latest.json"
STEP_DIR_PREFIX = "step-"

# Objects under the stack bucket's state/ prefix.
LEDGER = "ledger.json"
PROGRESS = "progress.json"
CONTROL = "control.json"
DATA_MANIFEST = "data-manifest.json"
# Beside a synced dataset on the instance (bootstrap/datasync.py): key -> [size, ETag] of every object synced;
# its hash is the dataset version a checkpoint's context records (trainstack_job/context.py).
SYNC_MANIFEST = ".trainstack-sync.json"


class BucketPrefix(str, Enum):
    """Top-level prefixes of the stack bucket."""

    DATA = "data/"
    CODE = "code/"
    CHECKPOINTS = "checkpoints/"
    RESULTS = "results/"
    STATE = "state/"


class JobStatus(str, Enum):
    """`status` of state/ledger.json."""

    WAITING_FOR_DATA = "waiting_for_data"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"
    COST_CAP = "cost_cap"
    NO_DATA = "no_data"
    # The job queue (docs/internals.md, "The job queue"): `trainstack cancel` ended it (a queued job is
    # skipped, a running one checkpoints first); a job that yielded to a `--now` job waits to resume.
    CANCELLED = "cancelled"
    QUEUED = "queued"


class LifeOutcome(str, Enum):
    """`outcome` of one instance life in state/ledger.json."""

    RUNNING = "running"
    COMPLETED = "completed"
    PREEMPTED = "preempted"  # stopped on a spot notice, scale-in or shutdown
    INTERRUPTED = "interrupted"  # the instance vanished; closed by the next life from its heartbeat
    STOPPED = "stopped"
    COST_CAP = "cost_cap"
    FAILED = "failed"
    STALLED = "stalled"
    NO_DATA = "no_data"
    # One writer per job (docs/internals.md, "Jobs, the lease and the standby"): none of these lost work or
    # counts as a failure or an interruption.
    HANDED_OVER = "handed_over"  # stopped at a step boundary so that the warm standby continues from it
    SUPERSEDED = "superseded"  # lost the job's lease to a newer holder: stopped writing at once
    # could not renew the lease (S3 unreachable from this instance): stopped on its own clock before the
    # lease's end, so that a standby may take over; the next life on this instance serves the job again
    LEASE_EXPIRED = "lease_expired"
    SURPLUS = "surplus"  # found a holder and a standby already: left without training
    STANDBY_ENDED = "standby_ended"  # a standby whose wait ended (the job ended, its own notice) untaken
    # The job queue: stopped with a confirmed checkpoint on `trainstack cancel`, or to let a `--now` job run
    # on this instance (the job stays queued and resumes from that checkpoint; neither is a failure).
    CANCELLED = "cancelled"
    YIELDED = "yielded"


class StackOutput(str, Enum):
    """`pulumi stack output` names the CLI reads."""

    REGION = "region"
    BUCKET_NAME = "bucket_name"
    DATA_PREFIX = "data_prefix"
    CODE_PREFIX = "code_prefix"
    CHECKPOINTS_PREFIX = "checkpoints_prefix"
    RESULTS_PREFIX = "results_prefix"
    STATE_PREFIX = "state_prefix"
    # Every job lives under jobs/<job-id>/; job_id is the job the stack's last `pulumi up` defined.
    JOBS_PREFIX = "jobs_prefix"
    JOB_ID = "job_id"
    DATA_UPLOAD_COMMAND = "data_upload_command"
    GROUP_NAME = "group_name"
    # trainstack:maxConcurrentJobs: at most this many jobs run at once across every pool (0: no limit).
    MAX_CONCURRENT_JOBS = "max_concurrent_jobs"
    INSTANCE_COUNT = "instance_count"
    INSTANCE_TYPES = "instance_types"
    LOG_GROUP_NAME = "log_group_name"
    TOPIC_ARN = "topic_arn"
    KMS_KEY_ARN = "kms_key_arn"
    DASHBOARD_URL = "dashboard_url"
    SSM_SESSION_COMMAND = "ssm_session_command"
    # Only when trainstack:drill is on: the AWS FIS experiment template `trainstack drill` starts.
    DRILL_TEMPLATE_ID = "drill_template_id"
    # Only when trainstack:devBox is on (infra/devbox.py): the dev box's launch template, and the name its
    # instance and workspace volume carry in the `trainstack:dev` tag (`trainstack dev up` tags them).
    DEV_TEMPLATE_ID = "dev_template_id"
    DEV_BOX_NAME = "dev_box_name"
    # The stack's subnets, one per zone: `dev up` launches in the zone of the box's workspace volume.
    DEV_SUBNET_IDS = "dev_subnet_ids"
    # What `trainstack dev` checks a box against before it trusts its host key (trainstack/dev/identity.py):
    # from Pulumi's state, which no EC2 principal can change.
    DEV_INSTANCE_PROFILE_ARN = "dev_instance_profile_arn"
    DEV_TEMPLATE_VERSION = "dev_template_version"
    # Every pool (infra/pools.py): name -> {group_name, instance_types, max_instances, default}. A stack from
    # before pools has one, described by group_name, instance_types and instance_count.
    POOLS = "pools"


# What resumes a job the agent scaled to zero (stopped, cost cap, failed, no data): never `pulumi up` alone.
RESUME_COMMAND = "trainstack resume"


@dataclass(frozen=True)
class NodeExit:
    """The node exit file (JobEnv.NODE_EXIT_FILE): what one node's ranks did in the generation that just
    ended. training/launch.py writes it when its ranks exit; the agent (bootstrap/multinode.py) reads it."""

    exit_code: int | None
    stopped_step: int | None = None  # the step every rank stopped at, with its checkpoint
    rank0_here: bool = False  # global rank 0 ran on this node: it owns the job's results and completion
    rendezvous_failed: bool = False  # the generation never formed: not a failure of the job
    world_size: int | None = None
    # Ranks of this node ran in the generation: however it ended, it trained (never "never formed").
    trained: bool = False
    # What ended the generation outside the ranks (the rendezvous store lost, a timeout), or None.
    ended_by: str | None = None
    # Global rank -> its real exit code: written for people reading the file; the agent acts on the
    # node's summary above, so `read` leaves it out.
    ranks: dict[int, int] = field(default_factory=dict)

    def write(self, path: Path) -> None:
        # Atomic: the agent may read it the moment the launcher exits, and must never see half of it.
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {
            "exit_code": self.exit_code,
            "ranks": {str(rank): code for rank, code in sorted(self.ranks.items())},
            "stopped_step": self.stopped_step,
            "rank0_here": self.rank0_here,
            "rendezvous_failed": self.rendezvous_failed,
            "world_size": self.world_size,
            "trained": self.trained,
            "ended_by": self.ended_by,
        }
        write_atomic(path, json.dumps(body).encode())

    @classmethod
    def read(cls, path: Path) -> NodeExit | None:
        """None when the launcher left no record (it was killed, or never got that far)."""
        try:
            raw: Any = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(raw, dict):
            return None

        def number(key: str) -> int | None:
            value = raw.get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        return cls(
            exit_code=number("exit_code"),
            stopped_step=number("stopped_step"),
            rank0_here=raw.get("rank0_here") is True,
            rendezvous_failed=raw.get("rendezvous_failed") is True,
            world_size=number("world_size"),
            trained=raw.get("trained") is True,
            ended_by=raw["ended_by"] if isinstance(raw.get("ended_by"), str) else None,
        )

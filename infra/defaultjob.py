"""The stack's default job (`trainstack:job` / `trainingConfig`), submitted to the stack's queue by
`pulumi up` as `trainstack run` submits any job: its code bundle, its record and its queue entry
(docs/internals.md, "The job queue"). The launch template carries no job: a new one rolls no template version.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from datetime import datetime, timezone

import pulumi
import pulumi_aws as aws

from infra.bundle import CodeBundle
from infra.config import StackConfig
from infra.submission import GZIP, JSON, Submission, prepare_submission
from trainstack_job.queue import SOURCE_PULUMI


def submission_time() -> str:
    """Now, as the queue orders entries (ISO 8601, UTC, seconds)."""
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def submit_stack_job(config: StackConfig, submitted_at: str | None = None) -> Submission:
    """The default job of a validated stack config; equal definitions give one id (`unique=False`)."""
    return prepare_submission(
        trainer_config=config.job,
        training_config_path=config.training_config,
        user_job=config.user_job,
        user_job_dir=config.user_job_dir,
        resume_from=config.resume_from,
        submitted_at=submitted_at or submission_time(),
        source=SOURCE_PULUMI,
        unique=False,
    )


@dataclass
class DefaultJobArgs:
    submission: Submission
    bucket_name: pulumi.Input[str]
    kms_key_arn: pulumi.Input[str]
    code_prefix: str
    # The agent's own bundle and its object (infra/fleet.py): the built-in trainer's job runs that very code,
    # so its record names that object rather than declaring a second one under the same key.
    agent_bundle: CodeBundle
    agent_bundle_object: aws.s3.BucketObjectv2
    tags: dict[str, str] = field(default_factory=dict)


class DefaultJob(pulumi.ComponentResource):
    """Three S3 objects, declared in the order the queue needs them: the code, the record, then the entry.

    A job is written once, as `trainstack run` writes it (`If-None-Match`): its logical names carry its id,
    and a later `pulumi up` of the same definition changes none of its objects (`ignore_changes`), so the
    first deployment of a definition fixes its `submitted_at` (its place in the FIFO queue) and the code it
    runs, and an up with no change changes nothing. The time cannot be derived from the definition (it would
    not be a time) nor taken afresh at each up (every up would rewrite the record and requeue the job); the
    Pulumi state keeps the first one. A new definition is a new id, hence new resources, never an update of
    the old job's objects.

    Its bundle and record are retained when the definition changes: a job already running keeps its code and
    record (`bootstrap/pinned.py`). Its queue entry is not: a superseded default job that has not started
    leaves the queue, as a new `trainstack:job` replaced the stack's job before there was a queue, and one
    that was stopped is not resumed (`bootstrap/jobbinding.py` resumes only a job still queued): the new
    job starts at step 0, not from the old job's checkpoint.
    """

    bundle_object: aws.s3.BucketObjectv2
    record_object: aws.s3.BucketObjectv2
    entry_object: aws.s3.BucketObjectv2

    def __init__(self, name: str, args: DefaultJobArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("trainstack:queue:DefaultJob", name, None, opts)
        submission = args.submission
        (bundle_key, bundle_data, _), (record_key, record, _), (entry_key, entry, _) = submission.objects(
            args.code_prefix
        )
        prefix = f"{name}-{submission.job_id}"
        if submission.bundle.sha256 == args.agent_bundle.sha256:
            self.bundle_object = args.agent_bundle_object
        else:
            self.bundle_object = self._object(
                f"{prefix}-bundle",
                args,
                key=bundle_key,
                content_base64=base64.b64encode(bundle_data).decode(),
                content_type=GZIP,
                retain=True,
                written_once=("key", "content_base64"),
                after=[],
            )
        self.record_object = self._object(
            f"{prefix}-record",
            args,
            key=record_key,
            content=record.decode(),
            content_type=JSON,
            retain=True,
            written_once=("content",),
            after=[self.bundle_object],
        )
        self.entry_object = self._object(
            f"{prefix}-entry",
            args,
            key=entry_key,
            content=entry.decode(),
            content_type=JSON,
            retain=False,
            written_once=("content",),
            after=[self.record_object],
        )
        self.register_outputs(
            {
                "job_id": submission.job_id,
                "bundle_key": self.bundle_object.key,
                "record_key": self.record_object.key,
                "entry_key": self.entry_object.key,
            }
        )

    def _object(
        self,
        name: str,
        args: DefaultJobArgs,
        *,
        key: str,
        content_type: str,
        retain: bool,
        written_once: tuple[str, ...],
        after: list[pulumi.Resource],
        content: str | None = None,
        content_base64: str | None = None,
    ) -> aws.s3.BucketObjectv2:
        # The bucket policy refuses any upload not SSE-KMS with the stack's key
        # (infra/iam/resource_policies.py), the deployer's included.
        return aws.s3.BucketObjectv2(
            name,
            bucket=args.bucket_name,
            key=key,
            content=content,
            content_base64=content_base64,
            content_type=content_type,
            server_side_encryption="aws:kms",
            kms_key_id=args.kms_key_arn,
            bucket_key_enabled=True,
            tags=args.tags,
            opts=pulumi.ResourceOptions(
                parent=self, retain_on_delete=retain, ignore_changes=list(written_once), depends_on=after
            ),
        )

"""The scheduler: one small function for the stack that raises each pool's desired capacity to what its
waiting jobs need (lambdas/scheduler/handler.py), invoked when a queue entry is created (the bucket sends
its events to EventBridge), when an instance of a pool ends, and every five minutes. No controller VM:
nothing bills while nothing runs (docs/internals.md, "The scheduler")."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pulumi
import pulumi_aws as aws

from infra.capacity import function_code, invoke_on
from infra.config import Pool
from infra.iam import common, service_roles
from trainstack_job.queue import QUEUE_PREFIX

HANDLER = Path(__file__).resolve().parents[1] / "lambdas" / "scheduler" / "handler.py"
SCHEDULE = "rate(5 minutes)"


@dataclass
class SchedulerArgs:
    name: str
    stack: str
    partition: str
    region: str
    account_id: str
    pools: Sequence[Pool]
    bucket_name: pulumi.Input[str]
    bucket_arn: pulumi.Input[str]
    kms_key_arn: pulumi.Input[str]
    log_group_name: str
    log_retention_days: int
    # trainstack:maxConcurrentJobs (0: none): the function starts no more instances than the slots allow.
    max_concurrent_jobs: int = 0
    depends_on: list[pulumi.Resource] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)

    @property
    def function_name(self) -> str:
        return f"{self.name}-scheduler"

    def pools_variable(self) -> str:
        """What the function knows of each pool: its queue name ("" = the default), group, lanes, size."""
        return json.dumps(
            [
                {
                    "pool": "" if pool.default else pool.name,
                    "group": pool.group_name,
                    "lanes": pool.max_jobs,
                    "max_instances": pool.max_instances,
                }
                for pool in self.pools
            ],
            separators=(",", ":"),
        )

    def variables(self) -> dict[str, pulumi.Input[str]]:
        """The function's environment; the limit only when set, so a stack without one diffs to nothing."""
        variables: dict[str, pulumi.Input[str]] = {"BUCKET": self.bucket_name, "POOLS": self.pools_variable()}
        if self.max_concurrent_jobs:
            variables["MAX_CONCURRENT_JOBS"] = str(self.max_concurrent_jobs)
        return variables

    def group_arns(self) -> list[str]:
        return [
            common.autoscaling_group_arn(
                partition=self.partition,
                region=self.region,
                account_id=self.account_id,
                group_name=p.group_name,
            )
            for p in self.pools
        ]


def queue_events_pattern(bucket_name: str) -> dict[str, Any]:
    """A queue entry created in the stack's bucket (S3's EventBridge events: "Object Created")."""
    return {
        "source": ["aws.s3"],
        "detail-type": ["Object Created"],
        "detail": {"bucket": {"name": [bucket_name]}, "object": {"key": [{"prefix": QUEUE_PREFIX}]}},
    }


def pool_events_pattern(group_names: Sequence[str]) -> dict[str, Any]:
    """An instance of a pool ended (a lane may be free for a waiting job with no idle instance)."""
    return {
        "source": ["aws.autoscaling"],
        "detail-type": ["EC2 Instance Terminate Successful"],
        "detail": {"AutoScalingGroupName": list(group_names)},
    }


class Scheduler(pulumi.ComponentResource):
    """The function, its role and encrypted log group, the bucket's EventBridge events and three rules."""

    function: aws.lambda_.Function
    log_group: aws.cloudwatch.LogGroup
    role: aws.iam.Role

    def __init__(self, name: str, args: SchedulerArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("trainstack:scheduler:Scheduler", name, None, opts)
        self._name = name
        self._args = args
        self._child = pulumi.ResourceOptions(parent=self)
        # Named under the stack's log prefix: the key policy lets CloudWatch Logs encrypt exactly those.
        self.log_group = aws.cloudwatch.LogGroup(
            f"{name}-logs",
            name=args.log_group_name,
            retention_in_days=args.log_retention_days,
            kms_key_id=args.kms_key_arn,
            tags=args.tags,
            opts=self._child,
        )
        self.role = aws.iam.Role(
            f"{name}-role",
            name=args.function_name,
            description=f"{args.name} scheduler: reads the queue, raises its pools' desired capacity",
            assume_role_policy=json.dumps(common.assume_role_policy("lambda.amazonaws.com")),
            max_session_duration=3600,
            tags=args.tags,
            opts=self._child,
        )
        aws.iam.RolePolicy(
            f"{name}-policy",
            role=self.role.id,
            policy=pulumi.Output.all(args.bucket_arn, args.kms_key_arn, self.log_group.arn).apply(
                lambda arns: json.dumps(
                    service_roles.scheduler_policy(
                        bucket_arn=arns[0],
                        key_arn=arns[1],
                        region=args.region,
                        group_arns=args.group_arns(),
                        log_group_arn=arns[2],
                    )
                )
            ),
            opts=self._child,
        )
        self.function = aws.lambda_.Function(
            f"{name}-function",
            name=args.function_name,
            description=f"trainstack {args.stack}: gives each pool the instances its waiting jobs need",
            runtime=aws.lambda_.Runtime.PYTHON3D13,
            architectures=["arm64"],
            handler="handler.handler",
            code=function_code(HANDLER),
            role=self.role.arn,
            timeout=60,
            memory_size=128,
            # One pass at a time is enough (a second would compute the same numbers); it also bounds the
            # S3 reads a burst of submissions costs.
            reserved_concurrent_executions=1,
            environment=aws.lambda_.FunctionEnvironmentArgs(variables=args.variables()),
            logging_config=aws.lambda_.FunctionLoggingConfigArgs(
                log_format="Text", log_group=self.log_group.name
            ),
            tags=args.tags,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.log_group]),
        )
        # S3 sends the bucket's object events to EventBridge (all of them; the rule below picks the queue's).
        events = aws.s3.BucketNotification(
            f"{name}-bucket-events", bucket=args.bucket_name, eventbridge=True, opts=self._child
        )
        self._invoke_on(
            "queue-entries",
            "a queue entry created",
            event_pattern=pulumi.Output.from_input(args.bucket_name).apply(
                lambda bucket: json.dumps(queue_events_pattern(bucket))
            ),
            depends_on=[events],
        )
        self._invoke_on(
            "pool-events",
            "an instance of a pool ended",
            event_pattern=json.dumps(pool_events_pattern([p.group_name for p in args.pools])),
        )
        self._invoke_on("schedule", f"scheduling pass, {SCHEDULE}", schedule=SCHEDULE)
        self.register_outputs({"function_name": self.function.name})

    def _invoke_on(
        self,
        role: str,
        description: str,
        *,
        event_pattern: pulumi.Input[str] | None = None,
        schedule: str | None = None,
        depends_on: list[pulumi.Resource] | None = None,
    ) -> None:
        args = self._args
        invoke_on(
            self,
            f"{self._name}-{role}",
            self.function,
            name=f"{args.name}-scheduler-{role}",
            description=f"trainstack {args.stack}: {description} -> scheduler",
            event_pattern=event_pattern,
            schedule=schedule,
            depends_on=[*args.depends_on, *(depends_on or [])],
            tags=args.tags,
        )

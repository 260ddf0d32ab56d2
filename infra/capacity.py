"""Capacity fallback: a small function that launches on-demand when spot capacity is missing, then returns;
and the cost cap enforced outside the instance: at `maxCostUsd` it scales the group to zero, whatever the
instance (or a hostile job on it) does."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pulumi
import pulumi_aws as aws

from infra.iam import common, service_roles

# The role's document and the group's ARN are pure functions in infra/iam/ (tests/iam evaluates them
# without importing Pulumi); the names stay importable from here.
from infra.iam.common import autoscaling_group_arn as group_arn_pattern
from infra.iam.service_roles import capacity_fallback_policy as function_policy
from trainstack_job.jobs import CURRENT_JOB

REPO_ROOT = Path(__file__).resolve().parent.parent
HANDLER = Path(__file__).resolve().parents[1] / "lambdas" / "capacity_fallback" / "handler.py"
# trainstack_job is standard library only: a function's handler imports its one definition of the records
# (trainstack_job/records.py), the pointer names and the queue entry, never a copy. Its framework callbacks
# import their frameworks, and no function needs them; nor the job file's schema, which imports PyYAML (not in
# the Lambda runtime).
NOT_PACKAGED = ("lightning.py", "hf.py", "jobfile.py")
SCHEDULE = "rate(5 minutes)"


@dataclass
class CapacityFallbackArgs:
    name: str
    stack: str
    partition: str
    region: str
    account_id: str
    group_name: str
    fallback_minutes: int
    # The group's configured OnDemandPercentageAboveBaseCapacity: the value "back to spot" restores.
    spot_on_demand_percentage: int
    kms_key_arn: pulumi.Input[str]
    log_group_name: str
    log_retention_days: int
    # Created after the group exists, so its first launch failures already reach the function.
    depends_on: list[pulumi.Resource] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)
    # The cost cap (trainstack:maxCostUsd; None = no cap): the function reads the current job's ledger in
    # the bucket and tells the topic when it stops the group.
    max_cost_usd: float | None = None
    bucket_name: pulumi.Input[str] | None = None
    bucket_arn: pulumi.Input[str] | None = None
    topic_arn: pulumi.Input[str] | None = None
    # The pool whose group this function watches (trainstack:pools): its AWS names end with it. "" = the
    # single group's pool (infra/config/ LEGACY_POOL), whose names carry none.
    pool: str = ""
    # The current-job pointer of the pool's instances (trainstack_job.jobs.pointer_name): the cost cap reads
    # the job it names. The default pool's is the stack's `current-job.json` (no variable: nothing changes).
    pointer: str = CURRENT_JOB

    @property
    def caps_cost(self) -> bool:
        return self.max_cost_usd is not None

    @property
    def function_name(self) -> str:
        """The function's and its role's name (at most 64 characters: infra/config/ checks a pool's)."""
        return f"{self.name}-capacity-fallback" + (f"-{self.pool}" if self.pool else "")

    def rule_name(self, role: str) -> str:
        return f"{self.name}-capacity-" + (f"{self.pool}-{role}" if self.pool else role)


def declared(fallback_minutes: int, max_cost_usd: float | None) -> bool:
    """One function for both jobs: declared when either is on. A stack with spotFallbackMinutes 0 still
    gets it for the cost cap (its fallback decision then always stays), rather than a second function with
    its own role, log group and schedule for the same five-minute look at the same group."""
    return fallback_minutes > 0 or max_cost_usd is not None


def group_events_pattern(group_name: str) -> dict[str, Any]:
    """Unsuccessful launches (spot capacity may be gone), terminations (an on-demand life may have ended)."""
    return {
        "source": ["aws.autoscaling"],
        "detail-type": ["EC2 Instance Launch Unsuccessful", "EC2 Instance Terminate Successful"],
        "detail": {"AutoScalingGroupName": [group_name]},
    }


class CapacityFallback(pulumi.ComponentResource):
    """Lambda function, its role and encrypted log group, and the two EventBridge rules that invoke it."""

    function: aws.lambda_.Function
    log_group: aws.cloudwatch.LogGroup
    role: aws.iam.Role

    def __init__(
        self, name: str, args: CapacityFallbackArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("trainstack:capacity:CapacityFallback", name, None, opts)
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
        self.role = self._create_role()
        self.function = self._create_function()
        self._invoke_on(
            "group-events",
            "launch failures and terminations" + (f" in {args.group_name}" if args.pool else ""),
            event_pattern=json.dumps(group_events_pattern(args.group_name)),
        )
        self._invoke_on("schedule", f"capacity check, {SCHEDULE}", schedule=SCHEDULE)
        self.register_outputs({"function_name": self.function.name, "log_group_name": self.log_group.name})

    def _create_role(self) -> aws.iam.Role:
        args = self._args
        role = aws.iam.Role(
            f"{self._name}-role",
            name=args.function_name,
            description=f"{args.name} capacity fallback: reads and switches {args.group_name} only",
            assume_role_policy=json.dumps(common.assume_role_policy("lambda.amazonaws.com")),
            max_session_duration=3600,
            tags=args.tags,
            opts=self._child,
        )
        group_arn = group_arn_pattern(
            partition=args.partition,
            region=args.region,
            account_id=args.account_id,
            group_name=args.group_name,
        )
        aws.iam.RolePolicy(
            f"{self._name}-policy",
            role=role.id,
            policy=pulumi.Output.all(
                self.log_group.arn, args.bucket_arn or "", args.kms_key_arn, args.topic_arn or ""
            ).apply(
                lambda arns: json.dumps(
                    function_policy(
                        group_arn=group_arn,
                        log_group_arn=arns[0],
                        cost_cap=service_roles.CostCapAccess(
                            bucket_arn=arns[1],
                            key_arn=arns[2],
                            topic_arn=arns[3],
                            region=args.region,
                            pointer=args.pointer,
                        )
                        if args.caps_cost
                        else None,
                    )
                )
            ),
            opts=self._child,
        )
        return role

    def _environment(self) -> dict[str, pulumi.Input[str]]:
        args = self._args
        variables: dict[str, pulumi.Input[str]] = {
            "GROUP_NAME": args.group_name,
            "FALLBACK_MINUTES": str(args.fallback_minutes),
            "SPOT_ON_DEMAND_PERCENTAGE": str(args.spot_on_demand_percentage),
        }
        if args.caps_cost:
            if args.bucket_name is None or args.topic_arn is None:
                raise ValueError("the cost cap needs the stack's bucket_name and topic_arn")
            variables |= {
                "MAX_COST_USD": f"{args.max_cost_usd:g}",
                "BUCKET": args.bucket_name,
                "TOPIC_ARN": args.topic_arn,
            }
            if args.pointer != CURRENT_JOB:
                variables["CURRENT_JOB"] = args.pointer
        return variables

    def _create_function(self) -> aws.lambda_.Function:
        args = self._args
        return aws.lambda_.Function(
            f"{self._name}-function",
            name=args.function_name,
            description=_description(args),
            runtime=aws.lambda_.Runtime.PYTHON3D13,
            architectures=["arm64"],
            handler="handler.handler",
            # stdlib, boto3 (in the runtime), trainstack_job: no build step; the paths hold from any cwd.
            code=function_code(HANDLER),
            role=self.role.arn,
            timeout=30,
            memory_size=128,
            environment=aws.lambda_.FunctionEnvironmentArgs(variables=self._environment()),
            logging_config=aws.lambda_.FunctionLoggingConfigArgs(
                log_format="Text", log_group=self.log_group.name
            ),
            tags=args.tags,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.log_group]),
        )

    def _invoke_on(
        self, role: str, description: str, *, event_pattern: str | None = None, schedule: str | None = None
    ) -> None:
        args = self._args
        invoke_on(
            self,
            f"{self._name}-{role}",
            self.function,
            name=args.rule_name(role),
            description=f"trainstack {args.stack}: {description} -> capacity fallback",
            event_pattern=event_pattern,
            schedule=schedule,
            depends_on=args.depends_on,
            tags=args.tags,
        )


def function_code(handler: Path) -> pulumi.AssetArchive:
    """A function's package: its handler.py and trainstack_job's stdlib modules, listed file by file so that
    no cache or editor file changes the archive's hash."""
    assets: dict[str, pulumi.Asset | pulumi.Archive] = {"handler.py": pulumi.FileAsset(str(handler))}
    for path in sorted((REPO_ROOT / "trainstack_job").glob("*.py")):
        if path.name not in NOT_PACKAGED:
            assets[f"trainstack_job/{path.name}"] = pulumi.FileAsset(str(path))
    return pulumi.AssetArchive(assets)


def invoke_on(
    owner: pulumi.ComponentResource,
    logical: str,
    function: aws.lambda_.Function,
    *,
    name: str,
    description: str,
    event_pattern: pulumi.Input[str] | None = None,
    schedule: str | None = None,
    depends_on: list[pulumi.Resource] | None = None,
    tags: dict[str, str] | None = None,
) -> None:
    """An EventBridge rule (an event pattern or a schedule) that invokes `function`, with the permission for
    EventBridge to, scoped to that rule: `<logical>`, `<logical>-invoke`, `<logical>-target` under `owner`.
    The capacity function and the scheduler are both invoked this way."""
    rule = aws.cloudwatch.EventRule(
        logical,
        name=name,
        description=description,
        event_pattern=event_pattern,
        schedule_expression=schedule,
        tags=tags or {},
        opts=pulumi.ResourceOptions(parent=owner, depends_on=depends_on or []),
    )
    permission = aws.lambda_.Permission(
        f"{logical}-invoke",
        action="lambda:InvokeFunction",
        function=function.name,
        principal="events.amazonaws.com",
        source_arn=rule.arn,
        opts=pulumi.ResourceOptions(parent=owner),
    )
    aws.cloudwatch.EventTarget(
        f"{logical}-target",
        rule=rule.name,
        arn=function.arn,
        opts=pulumi.ResourceOptions(parent=owner, depends_on=[permission]),
    )


def _description(args: CapacityFallbackArgs) -> str:
    jobs = []
    if args.fallback_minutes > 0:
        jobs.append(f"on-demand after {args.fallback_minutes} min without a spot launch")
    if args.caps_cost:
        jobs.append(f"scale to zero at the {args.max_cost_usd:g} USD cost cap")
    return f"{args.name}: " + "; ".join(jobs)

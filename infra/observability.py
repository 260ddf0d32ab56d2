"""Observability: the log group, the alert topic, readable event alerts, GPU-idle alarm, dashboard, budget."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_aws as aws

from bootstrap import hostmetrics
from infra.config import Pool
from infra.iam import common, resource_policies
from trainstack_job.contract import StackOutput

GPU_IDLE_THRESHOLD_PERCENT = 10
GPU_IDLE_MINUTES = 30
_PERIOD_SECONDS = 300


@dataclass
class ObservabilityArgs:
    name: str
    stack: str
    region: str
    partition: str
    account_id: str
    kms_key_arn: pulumi.Input[str]
    log_group_name: str
    log_retention_days: int
    group_name: str
    alert_email: str
    monthly_budget_usd: int
    tags: dict[str, str] = field(default_factory=dict)
    # Every pool (trainstack:pools; infra/config/ StackConfig.pools): each group's launches and terminations
    # reach the topic, and each pool gets a GPU-idle alarm. Empty: `group_name`'s alone, as before pools.
    pools: tuple[Pool, ...] = ()


@dataclass(frozen=True)
class EventAlert:
    """One EventBridge rule and the sentence its SNS message reads as."""

    role: str
    description: str
    pattern: dict[str, Any]
    input_paths: dict[str, str]
    template: str


def event_alerts(stack: str, group_name: str, group_names: Sequence[str] = ()) -> list[EventAlert]:
    """The events worth a message, each turned into one plain sentence (not a JSON blob) by EventBridge.
    `group_names`: every pool's group (default: `group_name` alone)."""
    groups = list(group_names) or [group_name]
    return [
        EventAlert(
            role="spot-warning",
            description="Spot interruption warning (two minutes' notice)",
            pattern={"source": ["aws.ec2"], "detail-type": ["EC2 Spot Instance Interruption Warning"]},
            input_paths={
                "instance": "$.detail.instance-id",
                "action": "$.detail.instance-action",
                "time": "$.time",
            },
            template=(
                f"trainstack {stack}: spot interruption warning for <instance> (action <action>) at <time>. "
                "The agent checkpoints now; the group launches a replacement that resumes from it."
            ),
        ),
        EventAlert(
            role="rebalance",
            description="Rebalance recommendation (elevated interruption risk)",
            pattern={"source": ["aws.ec2"], "detail-type": ["EC2 Instance Rebalance Recommendation"]},
            input_paths={"instance": "$.detail.instance-id", "time": "$.time"},
            template=(
                f"trainstack {stack}: rebalance recommendation for <instance> at <time>. The agent takes an "
                "early checkpoint; capacity rebalancing may start a replacement."
            ),
        ),
        EventAlert(
            role="group-activity",
            description=f"Launches and terminations in {', '.join(groups)}",
            pattern={
                "source": ["aws.autoscaling"],
                "detail-type": [
                    "EC2 Instance Launch Successful",
                    "EC2 Instance Terminate Successful",
                    "EC2 Instance Launch Unsuccessful",
                    "EC2 Instance Terminate Unsuccessful",
                ],
                "detail": {"AutoScalingGroupName": groups},
            },
            input_paths={
                "event": "$.detail-type",
                "instance": "$.detail.EC2InstanceId",
                "cause": "$.detail.Cause",
                "status": "$.detail.StatusMessage",
                "time": "$.time",
            },
            template=(
                f"trainstack {stack}: <event> for <instance> at <time>. Cause: <cause> <status> "
                "(`trainstack status` shows the job's state)"
            ),
        ),
    ]


class Observability(pulumi.ComponentResource):
    """Everything that tells a human what happened, and what it costs."""

    log_group: aws.cloudwatch.LogGroup
    topic: aws.sns.Topic
    dashboard_name: str

    def __init__(
        self, name: str, args: ObservabilityArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("trainstack:observability:Observability", name, None, opts)
        self._name = name
        self._args = args
        self._child = pulumi.ResourceOptions(parent=self)
        self.log_group = aws.cloudwatch.LogGroup(
            f"{name}-logs",
            name=args.log_group_name,
            retention_in_days=args.log_retention_days,
            kms_key_id=args.kms_key_arn,
            tags=args.tags,
            opts=self._child,
        )
        self.topic = self._create_topic()
        self._create_event_rules()
        self._create_gpu_idle_alarm()
        self.dashboard_name = args.name
        self._create_dashboard()
        self._create_budget()
        self.register_outputs(
            {
                StackOutput.LOG_GROUP_NAME.value: self.log_group.name,
                StackOutput.TOPIC_ARN.value: self.topic.arn,
                "dashboard": self.dashboard_name,
            }
        )

    def _create_topic(self) -> aws.sns.Topic:
        args, name = self._args, self._name
        # A customer managed key, not alias/aws/sns: the AWS-managed key cannot grant EventBridge, Budgets
        # or CloudWatch the right to encrypt, and their messages would be dropped without a trace.
        topic = aws.sns.Topic(
            f"{name}-alerts", name=f"{args.name}-alerts", kms_master_key_id=args.kms_key_arn, tags=args.tags,
            opts=self._child,
        )  # fmt: skip
        aws.sns.TopicPolicy(
            f"{name}-alerts-policy",
            arn=topic.arn,
            policy=topic.arn.apply(
                lambda arn: json.dumps(
                    resource_policies.topic_policy(
                        topic_arn=arn,
                        account_id=args.account_id,
                        partition=args.partition,
                        region=args.region,
                    )
                )
            ),
            opts=self._child,
        )
        if args.alert_email:
            aws.sns.TopicSubscription(
                f"{name}-alerts-email",
                topic=topic.arn,
                protocol="email",
                endpoint=args.alert_email,
                opts=self._child,
            )
        return topic

    def _create_event_rules(self) -> None:
        args, name = self._args, self._name
        groups = [pool.group_name for pool in args.pools]
        for alert in event_alerts(args.stack, args.group_name, groups):
            rule = aws.cloudwatch.EventRule(
                f"{name}-{alert.role}",
                name=f"{args.name}-{alert.role}",
                description=f"trainstack {args.stack}: {alert.description}",
                event_pattern=json.dumps(alert.pattern),
                tags=args.tags,
                opts=self._child,
            )
            aws.cloudwatch.EventTarget(
                f"{name}-{alert.role}-to-sns",
                rule=rule.name,
                arn=self.topic.arn,
                input_transformer=aws.cloudwatch.EventTargetInputTransformerArgs(
                    input_paths=alert.input_paths,
                    # A JSON string template makes SNS deliver plain text instead of an event document.
                    input_template=json.dumps(alert.template),
                ),
                opts=self._child,
            )

    def _create_gpu_idle_alarm(self) -> None:
        """One alarm per pool's group, named as the group's pool is (infra/config/ Pool.suffixed)."""
        args = self._args
        for pool in args.pools:
            self._create_gpu_idle_alarm_for(pool.group_name, pool.suffixed(""))
        if not args.pools:
            self._create_gpu_idle_alarm_for(args.group_name, "")

    def _create_gpu_idle_alarm_for(self, group_name: str, suffix: str) -> None:
        args = self._args
        # The agent publishes trainstack/GPUUtilization per group. With no instance running there is no
        # data, and missing data is "not breaching": the alarm speaks only while instances are in service.
        aws.cloudwatch.MetricAlarm(
            f"{self._name}-gpu-idle{suffix}",
            name=f"{args.name}-gpu-idle{suffix}",
            alarm_description=(
                f"trainstack {args.stack}: average GPU utilisation below {GPU_IDLE_THRESHOLD_PERCENT}% for "
                f"{GPU_IDLE_MINUTES} minutes: the job is stuck or starved of data while instances bill. "
                "Check `trainstack logs` (data_wait_fraction) or `trainstack stop`."
                + (f" (group {group_name})" if suffix else "")
            ),
            namespace=common.METRIC_NAMESPACE,
            metric_name="GPUUtilization",
            dimensions={"AutoScalingGroupName": group_name},
            statistic="Average",
            period=_PERIOD_SECONDS,
            evaluation_periods=GPU_IDLE_MINUTES * 60 // _PERIOD_SECONDS,
            threshold=GPU_IDLE_THRESHOLD_PERCENT,
            comparison_operator="LessThanThreshold",
            treat_missing_data="notBreaching",
            alarm_actions=[self.topic.arn],
            ok_actions=[self.topic.arn],
            tags=args.tags,
            opts=self._child,
        )

    def _create_dashboard(self) -> None:
        args = self._args
        aws.cloudwatch.Dashboard(
            f"{self._name}-dashboard",
            dashboard_name=self.dashboard_name,
            dashboard_body=json.dumps(dashboard_body(args.region, args.group_name, args.log_group_name)),
            opts=self._child,
        )

    def _create_budget(self) -> None:
        args = self._args
        subscribers: dict[str, Any] = (
            {"subscriber_email_addresses": [args.alert_email]}
            if args.alert_email
            else {"subscriber_sns_topic_arns": [self.topic.arn]}
        )
        aws.budgets.Budget(
            f"{self._name}-budget",
            name=f"{args.name}-monthly",
            budget_type="COST",
            time_unit="MONTHLY",
            limit_amount=str(args.monthly_budget_usd),
            limit_unit="USD",
            notifications=[
                aws.budgets.BudgetNotificationArgs(
                    notification_type="ACTUAL",
                    comparison_operator="GREATER_THAN",
                    threshold=80,
                    threshold_type="PERCENTAGE",
                    **subscribers,
                ),
                aws.budgets.BudgetNotificationArgs(
                    notification_type="FORECASTED",
                    comparison_operator="GREATER_THAN",
                    threshold=100,
                    threshold_type="PERCENTAGE",
                    **subscribers,
                ),
            ],
            tags=args.tags,
            opts=self._child,
        )


def dashboard_body(region: str, group_name: str, log_group_name: str) -> dict[str, Any]:
    """GPU utilisation, instances in service, the instances' load (`trainstack top`'s numbers, averaged
    over the group) and the agent's latest log lines on one page."""
    group = {"AutoScalingGroupName": group_name}

    def load(x: int, title: str, metrics: dict[str, str], y_axis: dict[str, Any]) -> dict[str, Any]:
        lines = [
            [common.METRIC_NAMESPACE, name, *_flatten(group), {"label": label}]
            for name, label in metrics.items()
        ]
        properties = {"title": title, "region": region, "stat": "Average", "period": 60, "metrics": lines}
        return {"type": "metric", "x": x, "y": 6, "width": 8, "height": 6, "properties": properties | y_axis}

    percent = {"yAxis": {"left": {"min": 0, "max": 100}}}
    return {
        "widgets": [
            {
                "type": "metric",
                "x": 0,
                "y": 0,
                "width": 12,
                "height": 6,
                "properties": {
                    "title": "GPU utilisation (%)",
                    "region": region,
                    "stat": "Average",
                    "period": 60,
                    "metrics": [
                        [common.METRIC_NAMESPACE, "GPUUtilization", "AutoScalingGroupName", group_name]
                    ],
                    "yAxis": {"left": {"min": 0, "max": 100}},
                },
            },
            {
                "type": "metric",
                "x": 12,
                "y": 0,
                "width": 12,
                "height": 6,
                "properties": {
                    "title": "Instances in service",
                    "region": region,
                    "stat": "Maximum",
                    "period": 60,
                    "metrics": [["AWS/AutoScaling", "GroupInServiceInstances", *_flatten(group)]],
                },
            },
            load(
                0,
                "CPU, memory and GPU memory (%)",
                {
                    hostmetrics.CPU_UTILIZATION: "CPU busy",
                    hostmetrics.MEMORY_UTILIZATION: "memory used",
                    hostmetrics.GPU_MEMORY_UTILIZATION: "GPU memory used",
                },
                percent,
            ),
            load(
                8,
                "Disk (bytes/s)",
                {hostmetrics.DISK_READ_BYTES: "read", hostmetrics.DISK_WRITE_BYTES: "write"},
                {},
            ),
            load(
                16,
                "Network (bytes/s)",
                {hostmetrics.NETWORK_IN_BYTES: "in", hostmetrics.NETWORK_OUT_BYTES: "out"},
                {},
            ),
            {
                "type": "log",
                "x": 0,
                "y": 12,
                "width": 24,
                "height": 8,
                "properties": {
                    "title": "Agent and trainer log",
                    "region": region,
                    "query": f"SOURCE '{log_group_name}' | fields @timestamp, @logStream, @message "
                    "| sort @timestamp desc | limit 100",
                    "view": "table",
                },
            },
        ]
    }


def _flatten(dimensions: dict[str, str]) -> list[str]:
    return [item for pair in dimensions.items() for item in pair]

"""Drill: an AWS Fault Injection Service experiment template that sends one real spot interruption to one
of this stack's instances, and the role FIS assumes to send it (`trainstack drill` starts it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_aws as aws

from infra.iam import common

# The FIS action and target resource type, as the FIS actions reference names them.
ACTION_ID = "aws:ec2:send-spot-instance-interruptions"
TARGET_RESOURCE_TYPE = "aws:ec2:spot-instance"
# The action's own key for its target (FIS: "SpotInstances"), and our name for the target.
ACTION_TARGET_KEY = "SpotInstances"
TARGET_NAME = "stack-spot-instance"
# The notice a real reclaim gives: two minutes (FIS accepts 2 to 15). Longer would test a kinder world.
DURATION_BEFORE_INTERRUPTION = "PT2M"
# One instance per drill: a multi-node job loses one node, as a real reclaim usually takes one.
SELECTION_MODE = "COUNT(1)"
# The tag FIS selects by: every instance of the group carries Name=<group name> (infra/fleet.py puts it in
# the launch template's instance tags and in the group's propagated tags), and the group's name is unique in
# the account and region, so no other stack's instance, nor an instance outside the group, is ever picked.
SELECTION_TAG = "Name"
# DescribeInstances takes no resource ARN (IAM requires "*"); FIS calls it to resolve the target.
RESOURCE_STAR_REQUIRED = frozenset({"ec2:DescribeInstances"})


@dataclass
class DrillArgs:
    name: str
    project: str
    stack: str
    partition: str
    region: str
    account_id: str
    group_name: str
    tags: dict[str, str] = field(default_factory=dict)


def drill_role_policy(
    *, partition: str, region: str, account_id: str, project: str, stack: str, group_name: str
) -> common.Document:
    """What FIS may do with the role: interrupt this stack's instances, and read instances to find them.

    SendSpotInstanceInterruptions names the account's instance ARNs and requires the stack's own tags on the
    instance (IAM ANDs the keys of one condition block): even a template edited to select another tag could
    not interrupt an instance of another stack.
    """
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "InterruptThisStacksSpotInstances",
                "Effect": "Allow",
                "Action": "ec2:SendSpotInstanceInterruptions",
                "Resource": f"arn:{partition}:ec2:{region}:{account_id}:instance/*",
                "Condition": {
                    "StringEquals": {
                        "aws:ResourceTag/trainstack:project": project,
                        "aws:ResourceTag/trainstack:stack": stack,
                        f"aws:ResourceTag/{SELECTION_TAG}": group_name,
                    }
                },
            },
            {
                "Sid": "FindTheTargetInstances",
                "Effect": "Allow",
                "Action": sorted(RESOURCE_STAR_REQUIRED),
                "Resource": "*",
            },
        ],
    }


def fis_trust_policy(*, partition: str, region: str, account_id: str) -> common.Document:
    """FIS may assume the role only for this account's experiments (confused-deputy guard)."""
    document = common.assume_role_policy("fis.amazonaws.com", account_id=account_id)
    statement: dict[str, Any] = document["Statement"][0]
    statement["Condition"]["ArnLike"] = {
        "aws:SourceArn": f"arn:{partition}:fis:{region}:{account_id}:experiment/*"
    }
    return document


class Drill(pulumi.ComponentResource):
    """The experiment template and its role; declared only when `trainstack:drill` is true."""

    role: aws.iam.Role
    template: aws.fis.ExperimentTemplate

    def __init__(self, name: str, args: DrillArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("trainstack:drill:Drill", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.role = aws.iam.Role(
            f"{name}-role",
            name=f"{args.name}-drill",
            description=f"{args.name}: AWS FIS sends one spot interruption to this stack's instances",
            assume_role_policy=json.dumps(
                fis_trust_policy(partition=args.partition, region=args.region, account_id=args.account_id)
            ),
            max_session_duration=3600,
            tags=args.tags,
            opts=child,
        )
        policy = aws.iam.RolePolicy(
            f"{name}-policy",
            role=self.role.id,
            policy=json.dumps(
                drill_role_policy(
                    partition=args.partition,
                    region=args.region,
                    account_id=args.account_id,
                    project=args.project,
                    stack=args.stack,
                    group_name=args.group_name,
                )
            ),
            opts=child,
        )
        self.template = aws.fis.ExperimentTemplate(
            f"{name}-template",
            description=f"{args.name}: one spot interruption ({DURATION_BEFORE_INTERRUPTION} notice) of one "
            f"instance of {args.group_name}",
            role_arn=self.role.arn,
            actions=[
                aws.fis.ExperimentTemplateActionArgs(
                    name="interrupt-one-spot-instance",
                    action_id=ACTION_ID,
                    description="the two-minute spot interruption notice, then the interruption",
                    parameters=[
                        aws.fis.ExperimentTemplateActionParameterArgs(
                            key="durationBeforeInterruption", value=DURATION_BEFORE_INTERRUPTION
                        )
                    ],
                    target=aws.fis.ExperimentTemplateActionTargetArgs(
                        key=ACTION_TARGET_KEY, value=TARGET_NAME
                    ),
                )
            ],
            targets=[
                aws.fis.ExperimentTemplateTargetArgs(
                    name=TARGET_NAME,
                    resource_type=TARGET_RESOURCE_TYPE,
                    selection_mode=SELECTION_MODE,
                    resource_tags=[
                        aws.fis.ExperimentTemplateTargetResourceTagArgs(
                            key=SELECTION_TAG, value=args.group_name
                        )
                    ],
                    # A stopped or terminating instance has nothing to interrupt.
                    filters=[
                        aws.fis.ExperimentTemplateTargetFilterArgs(path="State.Name", values=["running"])
                    ],
                )
            ],
            # The drill is one notice and one interruption; `trainstack drill` watches the job, not an alarm.
            stop_conditions=[aws.fis.ExperimentTemplateStopConditionArgs(source="none")],
            # No running spot instance: the experiment fails and says so, not passes having done nothing.
            experiment_options=aws.fis.ExperimentTemplateExperimentOptionsArgs(
                account_targeting="single-account", empty_target_resolution_mode="fail"
            ),
            tags=args.tags,
            # FIS checks the role when the experiment starts; the policy must be in place by then.
            opts=pulumi.ResourceOptions(parent=self, depends_on=[policy]),
        )
        self.register_outputs({"template_id": self.template.id, "role_arn": self.role.arn})

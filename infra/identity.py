"""Identity: the instance role and profile, allowed exactly what one training instance needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

from infra import policies

# Session Manager (instead of SSH) needs the AWS-managed core policy; everything else is written here.
SSM_CORE_POLICY = "arn:{partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"


@dataclass
class IdentityArgs:
    name: str
    partition: str
    region: str
    account_id: str
    bucket_arn: pulumi.Input[str]
    kms_key_arn: pulumi.Input[str]
    topic_arn: pulumi.Input[str]
    log_group_arn: pulumi.Input[str]
    group_name: str
    tags: dict[str, str] = field(default_factory=dict)


class Identity(pulumi.ComponentResource):
    """Instance role (SSM core + the stack's least-privilege policy) and its instance profile."""

    role: aws.iam.Role
    instance_profile: aws.iam.InstanceProfile

    def __init__(self, name: str, args: IdentityArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("trainstack:identity:Identity", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.role = aws.iam.Role(
            f"{name}-instance-role",
            name=f"{args.name}-instance",
            description=f"{args.name} GPU instances: this stack's bucket, key, topic, logs and group only",
            assume_role_policy=json.dumps(policies.assume_role_policy("ec2.amazonaws.com")),
            max_session_duration=3600,
            tags=args.tags,
            opts=child,
        )
        aws.iam.RolePolicyAttachment(
            f"{name}-ssm-core",
            role=self.role.name,
            policy_arn=SSM_CORE_POLICY.format(partition=args.partition),
            opts=child,
        )
        group_arn = (
            f"arn:{args.partition}:autoscaling:{args.region}:{args.account_id}:autoScalingGroup:*:"
            f"autoScalingGroupName/{args.group_name}"
        )
        aws.iam.RolePolicy(
            f"{name}-instance-policy",
            role=self.role.id,
            policy=pulumi.Output.all(
                args.bucket_arn, args.kms_key_arn, args.topic_arn, args.log_group_arn
            ).apply(
                lambda arns: json.dumps(
                    policies.instance_policy(
                        bucket_arn=arns[0],
                        key_arn=arns[1],
                        topic_arn=arns[2],
                        log_group_arn=arns[3],
                        group_arn_pattern=group_arn,
                    )
                )
            ),
            opts=child,
        )
        self.instance_profile = aws.iam.InstanceProfile(
            f"{name}-instance-profile",
            name=f"{args.name}-instance",
            role=self.role.name,
            tags=args.tags,
            opts=child,
        )
        self.register_outputs({"role_arn": self.role.arn, "instance_profile_arn": self.instance_profile.arn})

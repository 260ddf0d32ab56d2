"""Identity: the instance role and profile, allowed exactly what one training instance needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

from infra.iam import common, machine_roles

# No AWS managed policy is attached: AmazonSSMManagedInstanceCore grants ssm:GetParameter(s) on `*` (any
# process on the instance could read every SSM parameter in the region); Session Manager's few actions are
# written here instead (infra/iam/machine_roles.py session_manager_policy).


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
    # Every pool's group (trainstack:pools), the default pool's first; empty: `group_name` alone.
    group_names: tuple[str, ...] = ()


class Identity(pulumi.ComponentResource):
    """Instance role (Session Manager + the stack's least-privilege policy), its instance profile, and the
    job role the agent narrows to one job for the job's own credentials (bootstrap/jobuser.py)."""

    role: aws.iam.Role
    instance_profile: aws.iam.InstanceProfile
    job_role: aws.iam.Role
    job_role_arn: str

    def __init__(self, name: str, args: IdentityArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("trainstack:identity:Identity", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.role = aws.iam.Role(
            f"{name}-instance-role",
            name=f"{args.name}-instance",
            description=f"{args.name} GPU instances: this stack's bucket, key, topic, logs and group only",
            assume_role_policy=json.dumps(common.assume_role_policy("ec2.amazonaws.com")),
            max_session_duration=3600,
            tags=args.tags,
            opts=child,
        )
        aws.iam.RolePolicy(
            f"{name}-session-manager",
            role=self.role.id,
            policy=json.dumps(
                machine_roles.session_manager_policy(
                    partition=args.partition, region=args.region, account_id=args.account_id
                )
            ),
            opts=child,
        )
        self.job_role_arn = machine_roles.job_role_arn(
            partition=args.partition, account_id=args.account_id, name=args.name
        )
        self.job_role = self._create_job_role(name, args, child)
        # The stack's groups by name, each one (never a wildcard name: another stack's group could match);
        # one group, as before pools, is the one ARN.
        group_arns = [
            common.autoscaling_group_arn(
                partition=args.partition, region=args.region, account_id=args.account_id, group_name=group
            )
            for group in args.group_names or (args.group_name,)
        ]
        group_arn: str | list[str] = group_arns[0] if len(group_arns) == 1 else group_arns
        aws.iam.RolePolicy(
            f"{name}-instance-policy",
            role=self.role.id,
            policy=pulumi.Output.all(
                args.bucket_arn, args.kms_key_arn, args.topic_arn, args.log_group_arn
            ).apply(
                lambda arns: json.dumps(
                    machine_roles.instance_policy(
                        bucket_arn=arns[0],
                        key_arn=arns[1],
                        topic_arn=arns[2],
                        log_group_arn=arns[3],
                        group_arn_pattern=group_arn,
                        job_role_arn=self.job_role_arn,
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
        self.register_outputs(
            {
                "role_arn": self.role.arn,
                "instance_profile_arn": self.instance_profile.arn,
                "job_role_arn": self.job_role.arn,
            }
        )

    def _create_job_role(self, name: str, args: IdentityArgs, child: pulumi.ResourceOptions) -> aws.iam.Role:
        """The job's own role: taken only by the instance role, at most `jobs/*` and `data/*`, never state.

        One hour, the most AWS allows a chained role session; the agent refreshes the job's credentials
        before they expire (bootstrap/jobuser.py)."""
        instance_role_arn = f"arn:{args.partition}:iam::{args.account_id}:role/{args.name}-instance"
        role = aws.iam.Role(
            f"{name}-job-role",
            name=f"{args.name}-job",
            description=f"{args.name} job credentials: its jobs/<id>/ prefix, the dataset, its log stream",
            assume_role_policy=json.dumps(
                machine_roles.job_role_trust_policy(
                    partition=args.partition, account_id=args.account_id, instance_role_arn=instance_role_arn
                )
            ),
            max_session_duration=3600,
            tags=args.tags,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.role]),
        )
        aws.iam.RolePolicy(
            f"{name}-job-policy",
            role=role.id,
            policy=pulumi.Output.all(args.bucket_arn, args.kms_key_arn, args.log_group_arn).apply(
                lambda arns: json.dumps(
                    machine_roles.job_role_policy(
                        bucket_arn=arns[0], key_arn=arns[1], region=args.region, log_group_arn=arns[2]
                    )
                )
            ),
            opts=child,
        )
        return role

"""Dev box: the launch template and role `trainstack dev up` starts one interactive GPU instance from.

Pulumi declares the template, never the instance: the box comes and goes with `dev up`/`dev down` and its
idle watcher, without a `pulumi up`. The template has the job instances' baseline (IMDSv2 with one hop, an
encrypted root disk with the stack's key, the stack's security group, which admits nothing inbound) and
`InstanceInitiatedShutdownBehavior=terminate`, so the box ends its own bill with a plain `shutdown` and its
role needs no EC2 permission. The box boots its own bundle (the agent's packages plus the CLI's), uploaded
here: `trainstack run` works on the box, while the job instances' bundle stays the agent's alone.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_aws as aws

from bootstrap.cloud_init import UserDataError
from bootstrap.devbox.cloud_init import render_dev_user_data
from infra.baseline import code_bundle_object, encrypted_root, metadata_options, primary_interface
from infra.bundle import CodeBundle
from infra.config import NAMESPACE, StackConfig, StackConfigError
from infra.fleet import MachineImage
from infra.iam import common, machine_roles


@dataclass
class DevBoxArgs:
    config: StackConfig
    image: MachineImage
    # The dev bundle (infra/bundle.py DEV_BOX_PACKAGES): the agent's packages, the idle watcher's
    # (bootstrap/devbox/) among them, plus trainstack/ and infra/ for the box's own `trainstack`.
    bundle: CodeBundle
    bucket_name: pulumi.Input[str]
    partition: str
    account_id: str
    bucket_arn: pulumi.Input[str]
    kms_key_arn: pulumi.Input[str]
    topic_arn: pulumi.Input[str]
    log_group_arn: pulumi.Input[str]
    security_group_id: pulumi.Input[str]
    # The stack's outputs the CLI reads, written on the box for its own `trainstack` (run, jobs, logs).
    stack_outputs: Mapping[str, pulumi.Input[Any]]
    tags: dict[str, str] = field(default_factory=dict)


class DevBox(pulumi.ComponentResource):
    """The dev box's role and instance profile, its bundle in the bucket, and its launch template."""

    role: aws.iam.Role
    instance_profile: aws.iam.InstanceProfile
    bundle_object: aws.s3.BucketObjectv2
    launch_template: aws.ec2.LaunchTemplate

    def __init__(self, name: str, args: DevBoxArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("trainstack:devbox:DevBox", name, None, opts)
        self._name = name
        self._args = args
        self._child = pulumi.ResourceOptions(parent=self)
        self.role = self._create_role()
        self.instance_profile = aws.iam.InstanceProfile(
            f"{name}-instance-profile",
            name=args.config.dev_box_name,
            role=self.role.name,
            tags=args.tags,
            opts=self._child,
        )
        self.bundle_object = self._upload_bundle()
        self.launch_template = self._create_launch_template()
        self.register_outputs(
            {
                "role_arn": self.role.arn,
                "instance_profile_arn": self.instance_profile.arn,
                "bundle_key": self.bundle_object.key,
                "launch_template_id": self.launch_template.id,
            }
        )

    def _upload_bundle(self) -> aws.s3.BucketObjectv2:
        args = self._args
        # As the agent's (infra/fleet.py): content-addressed, and retained when a later `pulumi up` replaces
        # it, so a box launched from the template version before still finds the bundle it names.
        return code_bundle_object(
            self._name,
            bucket=args.bucket_name,
            bundle=args.bundle,
            kms_key_arn=args.kms_key_arn,
            tags=args.tags,
            parent=self,
        )

    def _create_role(self) -> aws.iam.Role:
        args, config = self._args, self._args.config
        role = aws.iam.Role(
            f"{self._name}-role",
            name=config.dev_box_name,
            description=f"{config.name} dev box: its data, code, dev/ folder, job submission and the topic",
            assume_role_policy=json.dumps(common.assume_role_policy("ec2.amazonaws.com")),
            max_session_duration=3600,
            tags=args.tags,
            opts=self._child,
        )
        # Session Manager as on the job instances: the stack's own policy, not AmazonSSMManagedInstanceCore.
        aws.iam.RolePolicy(
            f"{self._name}-session-manager",
            role=role.id,
            policy=json.dumps(
                machine_roles.session_manager_policy(
                    partition=args.partition, region=config.region, account_id=args.account_id
                )
            ),
            opts=self._child,
        )
        group_arn = common.autoscaling_group_arn(
            partition=args.partition,
            region=config.region,
            account_id=args.account_id,
            group_name=config.group_name,
        )
        aws.iam.RolePolicy(
            f"{self._name}-policy",
            role=role.id,
            policy=pulumi.Output.all(
                args.bucket_arn, args.kms_key_arn, args.topic_arn, args.log_group_arn
            ).apply(
                lambda arns: json.dumps(
                    machine_roles.dev_role_policy(
                        bucket_arn=arns[0],
                        key_arn=arns[1],
                        topic_arn=arns[2],
                        region=config.region,
                        log_group_arn=arns[3],
                        group_arn_pattern=group_arn,
                    )
                )
            ),
            opts=self._child,
        )
        return role

    def _create_launch_template(self) -> aws.ec2.LaunchTemplate:
        args, config = self._args, self._args.config
        bundle_key = args.bundle.key()
        user_data = pulumi.Output.from_input(dict(args.stack_outputs)).apply(
            lambda outputs: _user_data(outputs, bundle_key, args.bundle.sha256)
        )
        name = config.dev_box_name
        return aws.ec2.LaunchTemplate(
            f"{self._name}-launch-template",
            name=name,
            description=f"{config.name}: the dev box (`trainstack dev up`)",
            image_id=args.image.id,
            instance_type=config.instance_types[0],
            iam_instance_profile=aws.ec2.LaunchTemplateIamInstanceProfileArgs(arn=self.instance_profile.arn),
            # `shutdown -h now` on the box (its idle watcher, or its user) terminates it: compute billing
            # stops with no EC2 permission on the box; the workspace is a separate volume and stays.
            instance_initiated_shutdown_behavior="terminate",
            network_interfaces=[
                primary_interface(args.security_group_id, private_subnets=config.private_subnets)
            ],
            metadata_options=metadata_options(),
            block_device_mappings=[
                encrypted_root(args.image.root_device_name, config.root_volume_size_gb, args.kms_key_arn)
            ],
            user_data=user_data,
            update_default_version=True,
            tag_specifications=[
                aws.ec2.LaunchTemplateTagSpecificationArgs(
                    resource_type="instance", tags={**args.tags, "Name": name, "trainstack:dev": name}
                ),
                aws.ec2.LaunchTemplateTagSpecificationArgs(
                    resource_type="volume", tags={**args.tags, "Name": f"{name}-root"}
                ),
                aws.ec2.LaunchTemplateTagSpecificationArgs(resource_type="network-interface", tags=args.tags),
            ],
            tags=args.tags,
            # A box launched as soon as `pulumi up` ends finds its bundle in the bucket.
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.bundle_object]),
        )


def _user_data(outputs: Mapping[str, Any], bundle_key: str, bundle_sha256: str) -> str:
    try:
        text = render_dev_user_data(outputs, bundle_key=bundle_key, bundle_sha256=bundle_sha256)
    except UserDataError as exc:
        raise StackConfigError(f"{NAMESPACE}:devBox: {exc}") from exc
    return base64.b64encode(text.encode()).decode()

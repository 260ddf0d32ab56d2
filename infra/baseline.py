"""The launch-template baseline every trainstack instance gets (the job group's and the dev box's): IMDSv2
only with one hop, an encrypted gp3 root volume under the stack's key, a primary interface in the stack's
security group (no inbound rule); and the code bundle each boots, stored the same way. One definition, so the
two templates can never drift apart; the policy pack (policypack/) checks each template against the same
rules."""

from __future__ import annotations

import base64
from typing import Any

import pulumi
import pulumi_aws as aws

from infra.bundle import CodeBundle


def code_bundle_object(
    name: str, *, bucket: Any, bundle: CodeBundle, kms_key_arn: Any, tags: Any, parent: pulumi.Resource
) -> aws.s3.BucketObjectv2:
    """The bundle an instance boots, content-addressed under the stack's key and retained when a later
    `pulumi up` replaces it: an instance (or a job) started from the template version before still finds the
    code it names."""
    return aws.s3.BucketObjectv2(
        f"{name}-bundle",
        bucket=bucket,
        key=bundle.key(),
        content_base64=base64.b64encode(bundle.data).decode(),
        content_type="application/gzip",
        server_side_encryption="aws:kms",
        kms_key_id=kms_key_arn,
        bucket_key_enabled=True,
        tags=tags,
        opts=pulumi.ResourceOptions(parent=parent, retain_on_delete=True),
    )


def metadata_options() -> aws.ec2.LaunchTemplateMetadataOptionsArgs:
    return aws.ec2.LaunchTemplateMetadataOptionsArgs(
        http_endpoint="enabled",
        http_tokens="required",
        # One hop: a container on the instance cannot borrow the instance role's credentials. A job is no
        # container: its user is kept from IMDS by a firewall rule (bootstrap/jobuser.py).
        http_put_response_hop_limit=1,
        # The agent and the dev box read their own tags (the dev box: its workspace volume and idle limit).
        instance_metadata_tags="enabled",
    )


def encrypted_root(
    device_name: pulumi.Input[str], size_gb: int, kms_key_arn: pulumi.Input[str]
) -> aws.ec2.LaunchTemplateBlockDeviceMappingArgs:
    """The root volume: disposable (files to keep go to S3 or the dev box's workspace volume)."""
    return aws.ec2.LaunchTemplateBlockDeviceMappingArgs(
        device_name=device_name,
        ebs=aws.ec2.LaunchTemplateBlockDeviceMappingEbsArgs(
            volume_size=size_gb,
            volume_type="gp3",
            encrypted="true",
            kms_key_id=kms_key_arn,
            delete_on_termination="true",
        ),
    )


def primary_interface(
    security_group_id: pulumi.Input[str], *, private_subnets: bool
) -> aws.ec2.LaunchTemplateNetworkInterfaceArgs:
    return aws.ec2.LaunchTemplateNetworkInterfaceArgs(
        device_index=0,
        security_groups=[security_group_id],
        # Public subnets have no NAT, so instances need an address to reach AWS APIs; the security group
        # still admits nothing inbound. Private subnets: never a public address.
        associate_public_ip_address="false" if private_subnets else "true",
        delete_on_termination="true",
    )

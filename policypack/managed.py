"""What some AWS managed policies allow: their documents are not in the stack, yet they grant as much.

Abridged to the statements the pack's effective-permission rules judge (copied from the AWS Managed Policy
Reference Guide; Actions and Resources as AWS publishes them). A policy not listed here is judged by its
name only (iam-no-admin-managed-policies); admin, power-user and *FullAccess policies are refused by name
and so are not listed.
"""

from __future__ import annotations

import re
from typing import Any

_AWS_MANAGED_POLICY = re.compile(r"^arn:aws[a-z-]*:iam::aws:policy/(?:[\w+=,.@-]+/)*(?P<name>[\w+=,.@-]+)$")


def _allow(actions: list[str], resource: str = "*") -> dict[str, Any]:
    return {"Effect": "Allow", "Action": actions, "Resource": resource}


_SSM_INSTANCE_ACTIONS = [
    "ssm:DescribeAssociation",
    "ssm:GetDeployablePatchSnapshotForInstance",
    "ssm:GetDocument",
    "ssm:DescribeDocument",
    "ssm:GetManifest",
    "ssm:GetParameter",
    "ssm:GetParameters",
    "ssm:ListAssociations",
    "ssm:ListInstanceAssociations",
    "ssm:PutInventory",
    "ssm:PutComplianceItems",
    "ssm:PutConfigurePackageResult",
    "ssm:UpdateAssociationStatus",
    "ssm:UpdateInstanceAssociationStatus",
    "ssm:UpdateInstanceInformation",
]
_SSM_CHANNELS = [
    "ssmmessages:CreateControlChannel",
    "ssmmessages:CreateDataChannel",
    "ssmmessages:OpenControlChannel",
    "ssmmessages:OpenDataChannel",
]
_EC2_MESSAGES = [
    "ec2messages:AcknowledgeMessage",
    "ec2messages:DeleteMessage",
    "ec2messages:FailMessage",
    "ec2messages:GetEndpoint",
    "ec2messages:GetMessages",
    "ec2messages:SendReply",
]

DOCUMENTS: dict[str, dict[str, Any]] = {
    "AmazonS3ReadOnlyAccess": {
        "Statement": [
            _allow(["s3:Get*", "s3:List*", "s3:Describe*", "s3-object-lambda:Get*", "s3-object-lambda:List*"])
        ]
    },
    "AmazonSSMManagedInstanceCore": {
        "Statement": [_allow(_SSM_INSTANCE_ACTIONS), _allow(_SSM_CHANNELS), _allow(_EC2_MESSAGES)]
    },
    "AmazonSSMReadOnlyAccess": {"Statement": [_allow(["ssm:Describe*", "ssm:Get*", "ssm:List*"])]},
    "AmazonEC2RoleforSSM": {
        "Statement": [
            _allow(
                [*_SSM_INSTANCE_ACTIONS, "ssm:ListCommands", "ssm:ListCommandInvocations", "ssm:SendCommand"]
            ),
            _allow(_EC2_MESSAGES),
            _allow(
                [
                    "s3:PutObject",
                    "s3:GetObject",
                    "s3:GetEncryptionConfiguration",
                    "s3:AbortMultipartUpload",
                    "s3:ListMultipartUploadParts",
                    "s3:ListBucket",
                    "s3:ListBucketMultipartUploads",
                ]
            ),
        ]
    },
    "SecretsManagerReadWrite": {"Statement": [_allow(["secretsmanager:*"])]},
    "ReadOnlyAccess": {
        "Statement": [
            _allow(["s3:Get*", "s3:List*", "ssm:Describe*", "ssm:Get*", "ssm:List*", "ec2:Describe*"])
        ]
    },
}


def aws_managed_name(arn: str) -> str | None:
    """`AmazonS3ReadOnlyAccess` out of arn:aws:iam::aws:policy/AmazonS3ReadOnlyAccess; None if not AWS's."""
    match = _AWS_MANAGED_POLICY.match(arn.strip())
    return match.group("name") if match else None


def document(arn: str) -> dict[str, Any] | None:
    """The (abridged) document of a listed AWS managed policy, else None."""
    name = aws_managed_name(arn)
    return DOCUMENTS.get(name) if name else None

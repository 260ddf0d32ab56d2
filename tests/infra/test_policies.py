"""Every IAM document the program makes: no wildcard grants, `*` only where AWS requires, parliament-clean."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest

from infra.iam.common import RESOURCE_STAR_REQUIRED
from tests.infra.program import StackRun

with warnings.catch_warnings():
    # parliament still imports pkg_resources, which warns on import.
    warnings.simplefilter("ignore")
    from parliament import analyze_policy_string

# Findings parliament (an identity-policy linter) raises on a KMS key policy that are required by KMS itself:
# - RESOURCE_STAR: in a key policy "Resource": "*" means "this key"; KMS accepts nothing else there.
# - PERMISSIONS_MANAGEMENT_ACTIONS: kms:PutKeyPolicy for the account (KMS refuses a policy that would lock
#   out its creator) and kms:CreateGrant for Auto Scaling's service-linked role (EBS needs a grant to
#   attach an encrypted volume; the statement requires kms:GrantIsForAWSResource).
KEY_POLICY_EXPECTED = {"RESOURCE_STAR", "PERMISSIONS_MANAGEMENT_ACTIONS"}
KEY_POLICY_PERMISSION_ACTIONS = {"kms:putkeypolicy", "kms:creategrant"}


def _documents(stack: StackRun) -> dict[str, dict[str, Any]]:
    """Every policy document the program registers, by resource name."""
    found: dict[str, dict[str, Any]] = {}
    for type_token, field in (
        ("aws:iam/rolePolicy:RolePolicy", "policy"),
        ("aws:kms/key:Key", "policy"),
        ("aws:s3/bucketPolicy:BucketPolicy", "policy"),
        ("aws:sns/topicPolicy:TopicPolicy", "policy"),
        ("aws:iam/role:Role", "assumeRolePolicy"),
    ):
        for resource in stack.of_type(type_token):
            found[f"{resource.name}.{field}"] = json.loads(resource.inputs[field])
    return found


def _statements(document: dict[str, Any]) -> list[dict[str, Any]]:
    return list(document["Statement"])


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def test_the_program_creates_the_documents_this_file_checks(example_stack: StackRun) -> None:
    names = set(_documents(example_stack))
    assert {
        "identity-instance-policy.policy",
        "network-flow-logs-policy.policy",
        "storage-key.policy",
        "storage-policy.policy",
        "observability-alerts-policy.policy",
        "identity-instance-role.assumeRolePolicy",
        "network-flow-logs-role.assumeRolePolicy",
    } <= names


def test_no_document_allows_a_wildcard_action(example_stack: StackRun) -> None:
    for name, document in _documents(example_stack).items():
        for statement in _statements(document):
            if statement["Effect"] == "Allow":
                for action in _as_list(statement["Action"]):
                    assert "*" not in action, f"{name}: {action}"


def test_wildcard_actions_appear_only_in_deny_statements_of_the_bucket_policy(
    example_stack: StackRun,
) -> None:
    # Denying `s3:*` without TLS is the point of S3.5, and outside the VPC endpoint for the instances' roles
    # the point of the data perimeter: a deny can only be too broad in the safe direction.
    denies = {"DenyInsecureTransport", "DenyInstanceRoleOutsideTheVpcEndpoint"}
    for name, document in _documents(example_stack).items():
        for statement in _statements(document):
            if any("*" in action for action in _as_list(statement["Action"])):
                assert name in ("storage-policy.policy", "storage-access-logs-policy.policy"), name
                assert statement["Effect"] == "Deny" and statement["Sid"] in denies, (name, statement)


def test_resource_star_only_for_actions_that_accept_no_resource(example_stack: StackRun) -> None:
    for name, document in _documents(example_stack).items():
        if name == "storage-key.policy" or name.endswith("assumeRolePolicy"):
            continue  # key policies must say "*" (this key); trust policies have no Resource
        for statement in _statements(document):
            if statement["Effect"] == "Allow" and "*" in _as_list(statement.get("Resource", [])):
                extra = set(_as_list(statement["Action"])) - RESOURCE_STAR_REQUIRED
                assert not extra, f"{name}: {sorted(extra)} granted on every resource"


def test_instance_policy_is_scoped_to_this_stacks_resources(example_stack: StackRun) -> None:
    document = _documents(example_stack)["identity-instance-policy.policy"]
    bucket = f"arn:aws:s3:::{example_stack.outputs['bucket_name']}"
    by_sid = {s["Sid"]: s for s in _statements(document)}
    assert by_sid["ReadDataAndCode"]["Resource"] == [
        f"{bucket}/data/*",
        f"{bucket}/code/*",
        f"{bucket}/job-code/*",  # a submitted job's own code: unpacked by the agent, run as the job
        f"{bucket}/datasets/*",
    ]
    assert by_sid["ReadWriteJobsAndLegacyJob"]["Resource"] == [
        f"{bucket}/jobs/*",
        f"{bucket}/checkpoints/*",
        f"{bucket}/results/*",
        f"{bucket}/state/*",
    ]
    # The key only as S3 and SNS use it for the instance: nothing on it calls KMS itself (no DescribeKey).
    region = example_stack.outputs["region"]
    assert by_sid["UseStackKeyThroughS3AndSns"] == {
        "Sid": "UseStackKeyThroughS3AndSns",
        "Effect": "Allow",
        "Action": ["kms:Decrypt", "kms:GenerateDataKey"],
        "Resource": example_stack.outputs["kms_key_arn"],
        "Condition": {
            "StringEquals": {"kms:ViaService": [f"s3.{region}.amazonaws.com", f"sns.{region}.amazonaws.com"]}
        },
    }
    # Every other use of the key names the service it goes through (secrets: SSM, Secrets Manager).
    for statement in _statements(document):
        if any(str(a).startswith("kms:") for a in _as_list(statement["Action"])):
            assert "kms:ViaService" in statement["Condition"]["StringEquals"], statement["Sid"]
    assert by_sid["PublishAlerts"]["Resource"] == example_stack.outputs["topic_arn"]
    assert by_sid["ScaleOwnGroup"]["Resource"].endswith(
        f"autoScalingGroupName/{example_stack.outputs['group_name']}"
    )
    assert by_sid["PublishGpuMetrics"]["Condition"] == {
        "StringEquals": {"cloudwatch:namespace": "trainstack"}
    }
    assert "s3:DeleteObject" not in by_sid["ReadDataAndCode"]["Action"]
    # Listing: the datasets, the bundles, every job's prefix and the legacy job's (checkpoints are listed).
    assert by_sid["ListOwnPrefixes"]["Condition"]["StringLike"]["s3:prefix"] == [
        "data/*", "code/*", "job-code/*", "datasets/*", "jobs/*", "checkpoints/*", "results/*", "state/*",
    ]  # fmt: skip


def test_trust_policies_let_exactly_one_service_assume_the_role(example_stack: StackRun) -> None:
    for name, document in _documents(example_stack).items():
        # The job role is taken by the instance role, not a service (tests/infra/test_least_privilege.py).
        if name.endswith("assumeRolePolicy") and name != "identity-job-role.assumeRolePolicy":
            (statement,) = _statements(document)
            assert statement["Action"] == "sts:AssumeRole", name
            assert set(statement["Principal"]) == {"Service"}, name
            assert isinstance(statement["Principal"]["Service"], str), name


@pytest.mark.parametrize(
    "document_name",
    [
        "identity-instance-policy.policy",
        "identity-session-manager.policy",
        "identity-job-policy.policy",
        "network-flow-logs-policy.policy",
        "storage-policy.policy",
        "observability-alerts-policy.policy",
    ],
)
def test_parliament_with_community_auditors_finds_nothing(
    example_stack: StackRun, document_name: str
) -> None:
    document = _documents(example_stack)[document_name]
    findings = analyze_policy_string(json.dumps(document), include_community_auditors=True).findings
    if document_name == "identity-instance-policy.policy":
        # The one finding by design: sts:AssumeRole returns credentials (CREDENTIALS_EXPOSURE). The agent
        # takes the job role, on that one role only, to give the job narrower credentials than its own.
        assert [(f.issue, f.location.get("actions")) for f in findings] == [
            ("CREDENTIALS_EXPOSURE", ["sts:assumerole"])
        ]
        return
    assert not findings, [(f.issue, f.detail) for f in findings]


def test_parliament_finds_only_what_kms_requires_in_the_key_policy(example_stack: StackRun) -> None:
    document = _documents(example_stack)["storage-key.policy"]
    findings = analyze_policy_string(json.dumps(document), include_community_auditors=True).findings
    assert {f.issue for f in findings} <= KEY_POLICY_EXPECTED, [(f.issue, f.detail) for f in findings]
    for finding in findings:
        if finding.issue == "PERMISSIONS_MANAGEMENT_ACTIONS":
            assert set(finding.location["actions"]) <= KEY_POLICY_PERMISSION_ACTIONS

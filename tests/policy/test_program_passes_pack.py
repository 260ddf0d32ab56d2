"""The whole trainstack program, run under Pulumi mocks, passes every policy of the pack."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pulumi.runtime.mocks import MockResourceArgs

from tests.infra.program import DEFAULT_OFFERINGS, RecordedResource, _Mocks, shared_run
from tests.infra.test_multinode_infra import CLUSTER_TYPES, EFA_OFFERINGS
from tests.infra.test_multinode_infra import _run as run_multinode
from tests.policy.harness import Resource, Violation, check

_MOCKS = _Mocks(DEFAULT_OFFERINGS, "x86_64", ami_parameter_found=True)


def _as_engine_sees_it(recorded: list[RecordedResource]) -> list[Resource]:
    """Recorded inputs plus the ID and ARN each resource got, as stack policies see outputs after `up`.

    tests/infra/program.py's mocks give every resource the ID f"{name}-id" and an ARN in account
    123456789012 (the ARNs tell the exposure policies which account is the stack's); were that to change,
    the stack policies would find no configurers and this test would fail loudly, not pass silently.
    """
    engine: list[Resource] = []
    for r in recorded:
        resource_id, state = _MOCKS.new_resource(MockResourceArgs(r.type, r.name, dict(r.inputs)))
        engine.append(Resource(r.type, r.name, {**r.inputs, "id": resource_id, "arn": state["arn"]}))
    return engine


def _violations(overrides: dict[str, Any]) -> list[Violation]:
    return check(_as_engine_sees_it(shared_run(overrides).resources))


def _explain(violations: list[Violation]) -> str:
    return "\n".join(f"{v.policy}: {v.message}" for v in violations)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"trainstack:privateSubnets": True},
        {"trainstack:sshIngressCidrs": ["203.0.113.7/32"], "trainstack:alertEmail": "ml-team@example.com"},
        {"trainstack:retainDataOnDestroy": False},
    ],
    ids=["example-stack", "private-subnets", "ssh-and-email", "no-retain"],
)
def test_trainstack_program_has_zero_violations(overrides: dict[str, Any]) -> None:
    violations = _violations(overrides)
    assert violations == [], _explain(violations)


def test_multinode_efa_program_has_zero_violations() -> None:
    """Two nodes of EFA types in a cluster placement group in private subnets, one EFA per network card."""
    run = run_multinode(
        {
            "trainstack:instanceTypes": CLUSTER_TYPES,
            "trainstack:placementStrategy": "cluster",
            "trainstack:privateSubnets": "true",
        },
        offerings=EFA_OFFERINGS,
    )
    violations = check(_as_engine_sees_it(run.resources))
    assert violations == [], _explain(violations)


def test_the_exposure_policies_know_the_programs_account() -> None:
    """Guard against a silent pass: the recorded program names its account, so another account is judged."""
    resources = _as_engine_sees_it(shared_run().resources)
    key = next(r for r in resources if r.type == "aws:kms/key:Key")
    assert key.props["arn"].startswith("arn:aws:kms:us-east-1:123456789012:")
    policy = json.loads(key.props["policy"])
    policy["Statement"][0]["Principal"] = {"AWS": "arn:aws:iam::999988887777:root"}
    key.props["policy"] = json.dumps(policy)
    violations = check(resources)
    assert [v.policy for v in violations] == ["kms-key-policy-not-public"], _explain(violations)


def test_program_resources_are_the_ones_the_pack_reads() -> None:
    """Guard against a silent pass: the program's resources reach the policies that check them."""
    types = {resource.type for resource in shared_run().resources}
    assert {
        "aws:ec2/launchTemplate:LaunchTemplate",
        "aws:autoscaling/group:Group",
        "aws:s3/bucket:Bucket",
        "aws:s3/bucketPolicy:BucketPolicy",
        "aws:kms/key:Key",
        "aws:ec2/vpc:Vpc",
        "aws:ec2/flowLog:FlowLog",
        "aws:ec2/defaultSecurityGroup:DefaultSecurityGroup",
        "aws:sns/topic:Topic",
        "aws:cloudwatch/logGroup:LogGroup",
        "aws:iam/rolePolicy:RolePolicy",
        "aws:ec2/vpcEndpoint:VpcEndpoint",
        "aws:lambda/permission:Permission",
        "aws:sns/topicPolicy:TopicPolicy",
        "aws:s3/bucketLogging:BucketLogging",
    } <= types


def test_pack_catches_a_weakened_trainstack_program() -> None:
    """The same recorded program, with IMDSv1 allowed and the bucket policy dropped (its TLS-only Deny, the
    Deny of the instances' roles outside the S3 endpoint and the create-only Denies of submissions and the
    environment's code with it), fails."""
    resources = [
        r for r in _as_engine_sees_it(shared_run().resources) if r.type != "aws:s3/bucketPolicy:BucketPolicy"
    ]
    template = next(r for r in resources if r.type == "aws:ec2/launchTemplate:LaunchTemplate")
    template.props["metadataOptions"] = {**template.props["metadataOptions"], "httpTokens": "optional"}
    assert {v.policy for v in check(resources)} == {
        "imdsv2-required",
        "s3-tls-only",
        "s3-instance-roles-through-endpoint",
        "s3-submissions-create-only",
    }

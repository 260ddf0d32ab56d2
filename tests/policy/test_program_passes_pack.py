"""The whole trainstack program, run under Pulumi mocks, passes every policy of the pack."""

from __future__ import annotations

from typing import Any

import pytest

from tests.infra.program import RecordedResource, example_config, run_stack
from tests.policy.harness import Resource, Violation, check


def _as_engine_sees_it(recorded: list[RecordedResource]) -> list[Resource]:
    """Recorded inputs plus the ID each resource got, as stack policies see outputs after `up`.

    tests/infra/program.py's mocks give every resource the ID f"{name}-id"; were that to change, the
    stack policies would find no configurers and this test would fail loudly, not pass silently.
    """
    return [Resource(r.type, r.name, {**r.inputs, "id": f"{r.name}-id"}) for r in recorded]


def _violations(overrides: dict[str, Any]) -> list[Violation]:
    config = {**example_config(), **overrides}
    return check(_as_engine_sees_it(run_stack(config).resources))


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


def test_program_resources_are_the_ones_the_pack_reads() -> None:
    """Guard against a silent pass: the program's resources reach the policies that check them."""
    types = {resource.type for resource in run_stack().resources}
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
        "aws:iam/rolePolicyAttachment:RolePolicyAttachment",
        "aws:s3/bucketLogging:BucketLogging",
    } <= types


def test_pack_catches_a_weakened_trainstack_program() -> None:
    """The same recorded program, with IMDSv1 allowed and the TLS-only bucket policy dropped, fails."""
    resources = [
        r for r in _as_engine_sees_it(run_stack().resources) if r.type != "aws:s3/bucketPolicy:BucketPolicy"
    ]
    template = next(r for r in resources if r.type == "aws:ec2/launchTemplate:LaunchTemplate")
    template.props["metadataOptions"] = {**template.props["metadataOptions"], "httpTokens": "optional"}
    assert {v.policy for v in check(resources)} == {"imdsv2-required", "s3-tls-only"}

"""A multi-node stack's peer rules and placement group pass the pack; anything wider does not."""

from __future__ import annotations

from tests.policy.golden import multinode_efa_stack, multinode_stack, named
from tests.policy.harness import Resource, check

_ALL_TRAFFIC = {"protocol": "-1", "fromPort": 0, "toPort": 0}


def _multinode_stack() -> list[Resource]:
    return multinode_stack()


def test_self_referencing_peer_rules_pass() -> None:
    resources = _multinode_stack()
    # The same rule written as separate resources: source group = the rule's own group.
    resources += [
        Resource(
            "aws:ec2/securityGroupRule:SecurityGroupRule",
            "peers-rule",
            {"type": "ingress", **_ALL_TRAFFIC, "securityGroupId": "sg-1", "sourceSecurityGroupId": "sg-1"},
        ),
        Resource(
            "aws:ec2/securityGroupRule:SecurityGroupRule",
            "peers-self",
            {"type": "ingress", **_ALL_TRAFFIC, "securityGroupId": "sg-1", "self": True},
        ),
        Resource(
            "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule",
            "peers-ingress-rule",
            {"securityGroupId": "sg-1", "ipProtocol": "-1", "referencedSecurityGroupId": "sg-1"},
        ),
    ]
    assert check(resources) == []


def test_one_zone_passes_only_in_a_placement_group() -> None:
    resources = _multinode_stack()
    assert check(resources) == []
    del named(resources, "group").props["placementGroup"]
    violations = check(resources)
    assert [v.policy for v in violations] == ["group-spans-zones-and-types"]
    assert "two or more Availability Zones" in violations[0].message


def test_a_placement_group_does_not_excuse_a_single_instance_type() -> None:
    resources = _multinode_stack()
    named(resources, "group").props["mixedInstancesPolicy"]["launchTemplate"]["overrides"] = [
        {"instanceType": "p5.48xlarge"}
    ]
    assert [v.policy for v in check(resources)] == ["group-spans-zones-and-types"]


def test_peer_rules_of_a_multinode_stack_still_refuse_another_group() -> None:
    resources = _multinode_stack()
    named(resources, "instances").props["ingress"][-1] = {**_ALL_TRAFFIC, "securityGroups": ["sg-0other"]}
    violations = check(resources)
    assert [v.policy for v in violations] == ["no-unrestricted-ingress"]
    assert "admits security group sg-0other" in violations[0].message


def test_the_efa_variant_passes_every_policy() -> None:
    assert check(multinode_efa_stack()) == []

"""Infra for multi-node jobs: peer rules, cluster placement in one zone, EFA on the types that take one.

The whole-program runs swap in the example stack's validated config with a larger `instance_count`.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import pytest
import yaml

import infra.config
from bootstrap.agent_config import AgentConfig
from bootstrap.efa import efa_environment, supports_device_rdma
from infra.config import DEFAULTS, StackConfigError, parse_stack_config
from infra.efa import (
    EFA_INSTANCE_TYPES,
    EFA_TYPES,
    EfaInterface,
    EfaTableError,
    all_support_efa,
    efa_interfaces,
    supports_efa,
)
from infra.fleet import agent_config
from tests.infra.program import DEFAULT_OFFERINGS, REGION, StackRun, example_config, run_stack
from tests.policy.harness import Resource, check

SECURITY_GROUP = "aws:ec2/securityGroup:SecurityGroup"
PLACEMENT_GROUP = "aws:ec2/placementGroup:PlacementGroup"
GROUP = "aws:autoscaling/group:Group"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
# Two types with the same 32 network cards: the group's one launch template serves both.
CLUSTER_TYPES = ["p5.48xlarge", "p5e.48xlarge"]
EFA_OFFERINGS = {
    "us-east-1a": ("p5.48xlarge", "p5e.48xlarge", "p4d.24xlarge", "g6e.48xlarge", "g6e.12xlarge"),
    "us-east-1b": ("p4d.24xlarge", "g6e.48xlarge", "g6e.12xlarge"),
    "us-east-1d": ("p5.48xlarge",),
}


def _run(
    overrides: Mapping[str, Any],
    *,
    instance_count: int = 2,
    offerings: Mapping[str, Iterable[str]] = DEFAULT_OFFERINGS,
) -> StackRun:
    """The whole program under mocks with `overrides`, as if instanceCount = `instance_count` were allowed."""
    validated = infra.config.load_stack_config
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            infra.config,
            "load_stack_config",
            lambda: dataclasses.replace(validated(), instance_count=instance_count),
        )
        return run_stack({**example_config(), **overrides}, offerings=offerings)


@pytest.fixture(scope="module")
def spread_multinode() -> StackRun:
    """Two nodes of the default (non-EFA) types, no placement group."""
    return _run({})


@pytest.fixture(scope="module")
def cluster_efa() -> StackRun:
    """Two nodes of EFA types in a cluster placement group."""
    return _run(
        {
            "trainstack:instanceTypes": CLUSTER_TYPES,
            "trainstack:placementStrategy": "cluster",
            "trainstack:privateSubnets": "true",
        },
        offerings=EFA_OFFERINGS,
    )


@pytest.fixture(scope="module")
def cluster_without_efa() -> StackRun:
    """Two nodes of the default types (g6.xlarge takes no EFA) in a cluster placement group."""
    return _run({"trainstack:placementStrategy": "cluster"})


def _peer_rules(stack: StackRun, direction: str) -> list[dict[str, Any]]:
    return [rule for rule in stack.one(SECURITY_GROUP).inputs.get(direction, []) if rule.get("self")]


def _interfaces(stack: StackRun) -> list[dict[str, Any]]:
    return [dict(interface) for interface in stack.one(LAUNCH_TEMPLATE).inputs["networkInterfaces"]]


def _interface(stack: StackRun) -> dict[str, Any]:
    (interface,) = _interfaces(stack)
    return interface


def _agent_yaml(stack: StackRun) -> dict[str, Any]:
    user_data = yaml.safe_load(base64.b64decode(stack.one(LAUNCH_TEMPLATE).inputs["userData"]).decode())
    (entry,) = [f for f in user_data["write_files"] if f["path"] == "/etc/trainstack/agent.yaml"]
    return dict(yaml.safe_load(entry["content"]))


def test_single_instance_stack_has_no_peer_rule_placement_group_or_efa(example_stack: StackRun) -> None:
    assert _peer_rules(example_stack, "ingress") == [] and _peer_rules(example_stack, "egress") == []
    assert example_stack.of_type(PLACEMENT_GROUP) == []
    assert "placementGroup" not in example_stack.one(GROUP).inputs
    assert "interfaceType" not in _interface(example_stack)
    assert _agent_yaml(example_stack)["efa"] is False


def test_multinode_instances_may_reach_each_other_and_nothing_else_new(spread_multinode: StackRun) -> None:
    ingress = spread_multinode.one(SECURITY_GROUP).inputs.get("ingress", [])
    assert ingress == _peer_rules(spread_multinode, "ingress")
    for direction in ("ingress", "egress"):
        (rule,) = _peer_rules(spread_multinode, direction)
        assert rule["protocol"] == "-1" and rule["self"] is True
        assert not any(rule.get(key) for key in ("cidrBlocks", "ipv6CidrBlocks", "securityGroups"))


def test_no_placement_group_keeps_every_zone(spread_multinode: StackRun, example_stack: StackRun) -> None:
    assert spread_multinode.of_type(PLACEMENT_GROUP) == []
    zones = spread_multinode.one(GROUP).inputs["vpcZoneIdentifiers"]
    assert len(zones) >= 2 and zones == example_stack.one(GROUP).inputs["vpcZoneIdentifiers"]


def test_cluster_placement_puts_the_group_in_one_zone(cluster_without_efa: StackRun) -> None:
    placement = cluster_without_efa.one(PLACEMENT_GROUP)
    assert placement.inputs["strategy"] == "cluster"
    group = cluster_without_efa.one(GROUP).inputs
    assert group["placementGroup"] == placement.inputs.get("name", placement.name)
    # The first zone's subnet only (us-east-1a: the first zone that offers the types).
    assert group["vpcZoneIdentifiers"] == ["network-public-us-east-1a-id"]


def _shape(stack: StackRun) -> list[tuple[int, int, str]]:
    return [(i["networkCardIndex"], i["deviceIndex"], i["interfaceType"]) for i in _interfaces(stack)]


def test_p5_in_a_cluster_gets_one_efa_on_each_of_its_32_network_cards(cluster_efa: StackRun) -> None:
    # The primary (card 0, device 0) is an EFA with ENA: the instance's address; cards 1-31 EFA-only.
    assert _shape(cluster_efa) == [(0, 0, "efa"), *((card, 1, "efa-only") for card in range(1, 32))]
    interfaces = _interfaces(cluster_efa)
    assert all(i["securityGroups"] == interfaces[0]["securityGroups"] for i in interfaces)
    # EC2 refuses AssociatePublicIpAddress with several interfaces: none is set, and the subnets are private.
    assert not any("associatePublicIpAddress" in i for i in interfaces)
    assert all(i["deleteOnTermination"] == "true" for i in interfaces)
    assert all("private" in subnet for subnet in cluster_efa.one(GROUP).inputs["vpcZoneIdentifiers"])
    assert _agent_yaml(cluster_efa)["efa"] is True


@pytest.mark.parametrize(
    ("instance_type", "expected"),
    [
        # p4d: 4 cards; EFA-only is not documented for it, so full EFAs (each with ENA) on cards 1-3.
        ("p4d.24xlarge", [(0, 0, "efa"), (1, 1, "efa"), (2, 1, "efa"), (3, 1, "efa")]),
        ("g6e.48xlarge", [(0, 0, "efa"), (1, 1, "efa-only"), (2, 1, "efa-only"), (3, 1, "efa-only")]),
        # One card: the single EFA on the primary, with its public address in a public subnet as before.
        ("g6e.12xlarge", [(0, 0, "efa")]),
    ],
)
def test_each_efa_type_gets_one_interface_per_network_card(
    instance_type: str, expected: list[tuple[int, int, str]]
) -> None:
    private = "true" if len(expected) > 1 else "false"
    stack = _run(
        {
            "trainstack:instanceTypes": [instance_type],
            "trainstack:placementStrategy": "cluster",
            "trainstack:privateSubnets": private,
        },
        offerings=EFA_OFFERINGS,
    )
    assert _shape(stack) == expected
    if len(expected) == 1:
        assert _interface(stack)["associatePublicIpAddress"] == "true"


def test_the_efa_table_gives_every_type_one_interface_per_card() -> None:
    for instance_type, cards in EFA_TYPES.items():
        interfaces = efa_interfaces([instance_type])
        assert [i.network_card_index for i in interfaces] == list(range(cards.network_cards)), instance_type
        assert interfaces[0] == EfaInterface(0, 0, "efa")
        extra = "efa-only" if cards.efa_only else "efa"
        assert all((i.device_index, i.interface_type) == (1, extra) for i in interfaces[1:]), instance_type
    assert len(efa_interfaces(["p5en.48xlarge"])) == 16 and len(efa_interfaces(["p6-b200.48xlarge"])) == 8


def test_types_with_different_cards_or_unknown_cards_are_refused_in_one_line() -> None:
    with pytest.raises(EfaTableError, match=r"p5.48xlarge \(32 network cards\), p4d.24xlarge \(4"):
        efa_interfaces(["p5.48xlarge", "p4d.24xlarge"])
    with pytest.raises(EfaTableError, match=r"p5\.4xlarge has no entry in the EFA table"):
        efa_interfaces(["p5.4xlarge"])


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            {"instanceTypes": ["p5.4xlarge"]},
            "trainstack:instanceTypes: p5.4xlarge has no entry in the EFA table (its network cards are "
            "unknown); add it to EFA_TYPES in infra/efa.py",
        ),
        (
            {"instanceTypes": ["p5.48xlarge", "p4d.24xlarge"], "privateSubnets": "true"},
            "trainstack:instanceTypes: p5.48xlarge (32 network cards), p4d.24xlarge (4 network cards) need "
            "different EFA interfaces and the group has one launch template",
        ),
        (
            {"instanceTypes": ["p5.48xlarge"]},
            "trainstack:privateSubnets: p5.48xlarge gets 32 EFA interfaces (one per network card) and AWS "
            "gives no public address",
        ),
    ],
)
def test_preview_refuses_an_efa_cluster_the_table_cannot_build(raw: dict[str, Any], expected: str) -> None:
    cluster = {"instanceCount": 2, "minNodes": 2, "placementStrategy": "cluster", "job": ""}
    cluster["trainingConfig"] = "training/configs/tiny.yaml"
    with pytest.raises(StackConfigError) as error:
        _config(**cluster, **raw)
    (line,) = [line for line in str(error.value).splitlines() if line.startswith("  - ")]
    assert expected in line


def test_preview_accepts_a_p5_cluster_in_private_subnets_and_single_card_types_anywhere() -> None:
    cluster = {"instanceCount": 2, "minNodes": 2, "placementStrategy": "cluster", "job": ""}
    cluster["trainingConfig"] = "training/configs/tiny.yaml"
    assert _config(**cluster, instanceTypes=CLUSTER_TYPES, privateSubnets="true").efa
    assert _config(**cluster, instanceTypes=["g6e.12xlarge", "g5.12xlarge"]).efa


def test_g6_xlarge_gets_no_efa_even_in_a_cluster(cluster_without_efa: StackRun) -> None:
    assert "interfaceType" not in _interface(cluster_without_efa)
    assert _agent_yaml(cluster_without_efa)["efa"] is False


def test_multinode_cluster_efa_stack_passes_the_policy_pack(cluster_efa: StackRun) -> None:
    resources = [Resource(r.type, r.name, {**r.inputs, "id": f"{r.name}-id"}) for r in cluster_efa.resources]
    violations = check(resources)
    assert violations == [], "\n".join(f"{v.policy}: {v.message}" for v in violations)


def _config(**raw: Any) -> infra.config.StackConfig:
    values = {key: value for key, value in example_config().items() if key.startswith("trainstack:")}
    merged = {key.split(":", 1)[1]: value for key, value in values.items()} | raw
    return parse_stack_config(merged, region=REGION, project="trainstack", stack="dev")


def test_placement_strategy_defaults_to_none_and_accepts_cluster() -> None:
    assert DEFAULTS["placementStrategy"] == ""
    assert _config().placement_strategy == ""
    assert _config(placementStrategy="cluster").cluster_placement


def test_unknown_placement_strategy_is_refused_naming_the_key() -> None:
    with pytest.raises(StackConfigError, match=r"trainstack:placementStrategy: unknown strategy 'spread'"):
        _config(placementStrategy="spread")


def test_instance_count_above_one_is_a_multi_node_job_of_the_built_in_trainer() -> None:
    config = _config(instanceCount=2, minNodes=2, job="", trainingConfig="training/configs/tiny.yaml")
    assert (config.multi_node, config.min_nodes) == (True, 2)
    assert agent_config(config, bucket="b", topic_arn="t", log_group="l").min_nodes == 2
    with pytest.raises(StackConfigError, match="a user's job runs on one instance"):
        _config(instanceCount=2, job="examples/charlm/job.yaml")


def test_efa_needs_several_nodes_a_cluster_and_every_type_to_take_one() -> None:
    efa_cluster = _config(instanceTypes=CLUSTER_TYPES, placementStrategy="cluster")
    assert not efa_cluster.multi_node and not efa_cluster.efa
    assert dataclasses.replace(efa_cluster, instance_count=2).efa
    assert not dataclasses.replace(efa_cluster, instance_count=2, placement_strategy="").efa
    mixed = dataclasses.replace(efa_cluster, instance_count=2, instance_types=("p5.48xlarge", "g6.xlarge"))
    assert not mixed.efa


def test_agent_config_carries_efa() -> None:
    config = dataclasses.replace(
        _config(instanceTypes=CLUSTER_TYPES, placementStrategy="cluster"), instance_count=2
    )
    filled = agent_config(config, bucket="trainstack-dev-bucket", topic_arn="arn:t", log_group="/t")
    assert filled.efa is True
    assert AgentConfig.from_mapping(yaml.safe_load(filled.to_yaml())).efa is True


def test_agent_config_refuses_a_non_boolean_efa() -> None:
    raw = {"region": REGION, "bucket": "trainstack-dev", "group_name": "g", "topic_arn": "t"}
    raw["log_group"] = "/l"
    with pytest.raises(ValueError, match="'efa' must be true or false"):
        AgentConfig.from_mapping({**raw, "efa": "yes"})


def test_efa_table_covers_the_types_aws_lists() -> None:
    for instance_type in ("p4d.24xlarge", "p5.48xlarge", "p5e.48xlarge", "g6e.8xlarge", "g5.8xlarge"):
        assert supports_efa(instance_type), instance_type
    for instance_type in ("g6.xlarge", "g5.xlarge", "g6e.4xlarge", "g4dn.xlarge"):
        assert not supports_efa(instance_type), instance_type
    assert EFA_INSTANCE_TYPES["p5.48xlarge"] == 32 and EFA_INSTANCE_TYPES["p4d.24xlarge"] == 4
    assert all_support_efa(CLUSTER_TYPES) and not all_support_efa([]) and not all_support_efa(["g6.xlarge"])


def test_efa_environment_selects_the_efa_provider_and_rdma_only_where_supported() -> None:
    assert efa_environment() == {"FI_PROVIDER": "efa", "FI_EFA_FORK_SAFE": "1"}
    assert efa_environment(device_rdma=True) == {
        "FI_PROVIDER": "efa",
        "FI_EFA_FORK_SAFE": "1",
        "FI_EFA_USE_DEVICE_RDMA": "1",
    }
    assert "NCCL_SOCKET_IFNAME" not in efa_environment(device_rdma=True)
    assert supports_device_rdma("p5.48xlarge") and supports_device_rdma("p4d.24xlarge")
    assert not supports_device_rdma("g6e.12xlarge")


def _anywhere(value: Any) -> bool:
    import ipaddress

    if isinstance(value, dict):
        return any(_anywhere(v) for v in value.values())
    if isinstance(value, list):
        return any(_anywhere(v) for v in value)
    if isinstance(value, str) and "/" in value:
        try:
            return ipaddress.ip_network(value, strict=False).prefixlen == 0
        except ValueError:
            return False
    return False


def test_no_resource_of_any_stack_shape_lets_traffic_in_from_anywhere(
    example_stack: StackRun, spread_multinode: StackRun, cluster_efa: StackRun
) -> None:
    """0.0.0.0/0 and ::/0 appear only in routes and egress rules, never in ingress, whatever the shape."""
    with_ssh = run_stack({**example_config(), "trainstack:sshIngressCidrs": ["203.0.113.7/32"]})
    for stack in (example_stack, spread_multinode, cluster_efa, with_ssh):
        for resource in stack.resources:
            inputs = resource.inputs
            assert not _anywhere(inputs.get("ingress", [])), f"{resource.name}: ingress from anywhere"
            standalone = "ingress" in resource.type.lower() or inputs.get("type") == "ingress"
            assert not (standalone and _anywhere(inputs)), f"{resource.name}: ingress from anywhere"

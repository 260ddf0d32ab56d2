"""Every stack-config mistake (infra/config/) is refused with one message that names the key, why, and a
valid example; so is every mistake in the agent's config on the instance (bootstrap/agent_config.py)."""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pulumi
import pytest
import yaml

from bootstrap.agent_config import AgentConfig, AgentConfigError, Prefixes
from infra import bundle, efa
from infra import wheels as vendored
from infra.config import (
    DEFAULT_AMI_PARAMETER,
    DEFAULTS,
    NAMESPACE,
    NVIDIA_FAMILIES,
    REPO_ROOT,
    StackConfig,
    StackConfigError,
    load_stack_config,
    parse_stack_config,
    read_stack_config,
)
from infra.jobdef import JobDefinition
from infra.placement import choose_zones
from tests.infra.program import example_config, run_stack


def _parse(**overrides: Any) -> StackConfig:
    base = {k.split(":", 1)[1]: v for k, v in example_config().items() if k.startswith("trainstack:")}
    return parse_stack_config({**base, **overrides}, region="us-east-1", project="trainstack", stack="dev")


def _refused(key: str, *fragments: str, **overrides: Any) -> str:
    with pytest.raises(StackConfigError) as error:
        _parse(**overrides)
    message = str(error.value)
    assert f"trainstack:{key}:" in message
    for fragment in fragments:
        assert fragment in message
    # Each problem is one line and ends with a valid example the user can paste.
    problem_lines = [line for line in message.splitlines() if line.startswith("  - ")]
    assert problem_lines and all("pulumi config" in line for line in problem_lines)
    return message


def test_config_error_is_a_clean_pulumi_error_without_traceback() -> None:
    assert issubclass(StackConfigError, pulumi.RunError)


def test_example_stack_config_is_valid() -> None:
    config = _parse()
    assert config.group_name == "trainstack-dev-gpu"
    assert config.max_cost_usd is None


def test_empty_instance_types_are_refused() -> None:
    _refused("instanceTypes", "is empty", instanceTypes="[]")


def test_malformed_instance_type_is_refused() -> None:
    _refused("instanceTypes", "'bigGPU' is not an EC2 instance type", instanceTypes='["bigGPU"]')


def test_instance_type_without_nvidia_gpu_is_refused() -> None:
    _refused("instanceTypes", "'t3.large' has no NVIDIA GPU", instanceTypes='["g6.xlarge","t3.large"]')


def test_arm64_gpu_type_is_refused_with_the_reason() -> None:
    _refused("instanceTypes", "'g5g.xlarge' is refused", "arm64", instanceTypes='["g5g.xlarge"]')


def test_amd_gpu_type_is_refused_with_the_reason() -> None:
    _refused("instanceTypes", "AMD", instanceTypes='["g4ad.xlarge"]')


def test_on_demand_base_above_instance_count_is_refused_min_above_max() -> None:
    _refused("onDemandBaseCapacity", "min > max", instanceCount="1", onDemandBaseCapacity="2")


def test_instance_count_that_is_not_an_integer_is_refused() -> None:
    _refused("instanceCount", "must be an integer", instanceCount="two")


def test_bad_vpc_cidr_is_refused() -> None:
    _refused("vpcCidr", "not an IPv4 network", vpcCidr="10.42.0.0/33")


def test_public_vpc_cidr_is_refused() -> None:
    _refused("vpcCidr", "not a private", vpcCidr="8.8.0.0/16")


def test_bad_ssh_cidr_is_refused() -> None:
    _refused("sshIngressCidrs", "'203.0.113.7/40' is not a CIDR", sshIngressCidrs='["203.0.113.7/40"]')


def test_ssh_from_anywhere_ipv4_is_refused() -> None:
    _refused(
        "sshIngressCidrs", "'0.0.0.0/0' opens SSH to the whole internet", sshIngressCidrs='["0.0.0.0/0"]'
    )


def test_ssh_from_anywhere_ipv6_is_refused() -> None:
    _refused("sshIngressCidrs", "'::/0' opens SSH to the whole internet", sshIngressCidrs='["::/0"]')


def test_root_volume_size_out_of_range_is_refused() -> None:
    _refused("rootVolumeSizeGb", "between 100 and 16384", rootVolumeSizeGb="20")


def test_unknown_spot_strategy_is_refused() -> None:
    _refused("spotAllocationStrategy", "unknown strategy 'cheapest'", spotAllocationStrategy="cheapest")


def test_malformed_alert_email_is_refused() -> None:
    _refused("alertEmail", "'ml-team.example.com' is not an e-mail address", alertEmail="ml-team.example.com")


def test_negative_budget_is_refused() -> None:
    _refused("monthlyBudgetUsd", "positive", monthlyBudgetUsd="-5")


def test_pinned_ami_together_with_custom_ami_parameter_is_refused() -> None:
    _refused(
        "amiId",
        "both a pinned amiId and a custom amiParameter",
        amiId="ami-0123456789abcdef0",
        amiParameter="/my/own/ami",
    )


def test_pinned_ami_with_the_default_parameter_is_accepted() -> None:
    assert _parse(amiId="ami-0123456789abcdef0", amiParameter=DEFAULT_AMI_PARAMETER).ami_id


def test_log_retention_that_cloudwatch_does_not_accept_is_refused() -> None:
    _refused("logRetentionDays", "not a CloudWatch Logs retention period", logRetentionDays="10")


def test_missing_training_config_file_is_refused() -> None:
    _refused("trainingConfig", "cannot read", trainingConfig="training/configs/nope.yaml")


def test_bad_max_cost_is_refused() -> None:
    _refused("maxCostUsd", "not a positive USD amount", maxCostUsd="lots")


def test_unknown_key_is_refused_with_a_suggestion() -> None:
    _refused("instanceType", "did you mean 'instanceTypes'?", instanceType="g5.xlarge")


def test_every_problem_is_reported_at_once() -> None:
    message = _refused("alertEmail", "3 problems", alertEmail="nope", monthlyBudgetUsd="-1", vpcCidr="banana")
    assert "trainstack:monthlyBudgetUsd:" in message
    assert "trainstack:vpcCidr:" in message


def test_missing_region_is_refused() -> None:
    with pytest.raises(StackConfigError, match="aws:region: required"):
        parse_stack_config({}, region="", project="trainstack", stack="dev")


def test_type_offered_in_no_zone_is_refused_by_name() -> None:
    with pytest.raises(StackConfigError, match=r"trainstack:instanceTypes: p5\.48xlarge not offered"):
        choose_zones(["g5.xlarge", "p5.48xlarge"], [("g5.xlarge", "a"), ("g5.xlarge", "b")], ["a", "b"], "r")


def test_types_offered_in_fewer_than_two_zones_are_refused() -> None:
    with pytest.raises(StackConfigError, match="at least 2 zones"):
        choose_zones(["g6e.xlarge"], [("g6e.xlarge", "a")], ["a", "b"], "r")


def test_zones_keep_only_those_offering_a_chosen_type() -> None:
    offerings = [("g6.xlarge", "a"), ("g5.xlarge", "b"), ("g5.xlarge", "local-zone")]
    assert choose_zones(["g6.xlarge", "g5.xlarge"], offerings, ["a", "b", "c"], "r") == ["a", "b"]


def test_program_stops_with_the_config_error_before_creating_anything() -> None:
    with pytest.raises(StackConfigError, match="trainstack:sshIngressCidrs"):
        run_stack({**example_config(), "trainstack:sshIngressCidrs": ["0.0.0.0/0"]})


def test_missing_ami_parameter_names_the_key() -> None:
    with pytest.raises(StackConfigError, match="trainstack:amiParameter: cannot read SSM parameter"):
        run_stack(ami_parameter_found=False)


def test_arm64_ami_is_refused() -> None:
    with pytest.raises(StackConfigError, match="is arm64"):
        run_stack(architecture="arm64")


# == every key's range, fix and type, the checks across keys, and the agent's config, in memory ==============
# Every bad stack value gets one line naming the key, why, and a `pulumi config set` command, and that
# command's value is itself accepted: the fix the error suggests works. Every agent setting out of range
# (bootstrap/agent_config.py) is one line naming the key and its range. Pure: no Pulumi engine, no AWS.


FIX = re.compile(rf"\(e\.g\. `pulumi config set {NAMESPACE}:(?P<key>\w+) (?P<example>.*)`\)$")
# A value of the wrong type, one below and one above any range a key has.
BAD = ("not-a-number", "-5", "99999")


def parse(raw: Mapping[str, object]) -> StackConfig:
    # networkIsolation (on by default) needs the instance wheels built (`make wheels`): off unless asked.
    return parse_stack_config(
        {"networkIsolation": "false", **raw}, region="us-east-1", project="trainstack", stack="dev"
    )


def problems(raw: Mapping[str, object]) -> list[str]:
    try:
        parse(raw)
    except StackConfigError as error:
        return list(error.problems)
    return []


def suggested(line: str, key: str) -> tuple[str, str]:
    """Why the line refuses the value, and the value of its `pulumi config set` command (as the shell
    hands it to Pulumi)."""
    fix = FIX.search(line)
    assert fix is not None and fix["key"] == key, f"no fix for {key} in: {line}"
    words = shlex.split(fix["example"])
    return line[: fix.start()], words[0] if words else ""


# The job file is a path: its line says to check the key (there is no one value to suggest).
CHECKED = [key for key in DEFAULTS if key != "job"]


@pytest.mark.parametrize("key", CHECKED)
def test_every_bad_value_names_its_key_and_a_fix_that_is_accepted(key: str) -> None:
    refused = 0
    for bad in BAD:
        if (key, bad) == ("instanceCount", "99999"):
            continue  # test_an_instance_count_far_above_the_maximum_is_one_line_too
        lines = [line for line in problems({key: bad}) if line.startswith(f"{NAMESPACE}:{key}: ")]
        for line in lines:
            refused += 1
            assert "\n" not in line
            why, fix = suggested(line, key)
            # (networkIsolation true, the suggested fix, may still want the wheels built: another reason.)
            assert not [p for p in problems({key: fix}) if p.startswith(why)], f"`{fix}` is refused too"
    assert refused or key == "resumeFrom", f"no bad value of {key} was refused"


def test_an_instance_count_far_above_the_maximum_is_one_line_too() -> None:
    lines = problems({"instanceCount": "99999"})
    assert any(line.startswith(f"{NAMESPACE}:instanceCount: ") for line in lines)
    assert all(len(line) < 500 for line in lines)


def test_an_unknown_key_is_named_with_the_closest_known_one_or_the_list_of_them() -> None:
    assert problems({"instanceCont": "2"}) == [
        f"{NAMESPACE}:instanceCont: unknown key, did you mean 'instanceCount'? "
        f"(remove it with `pulumi config rm {NAMESPACE}:instanceCont`)"
    ]
    assert problems({"zzz": "2"}) == [
        f"{NAMESPACE}:zzz: unknown key, known keys: {', '.join(DEFAULTS)} "
        f"(remove it with `pulumi config rm {NAMESPACE}:zzz`)"
    ]


@pytest.mark.parametrize(
    "isolation, private, expected",
    [("false", "false", False), ("false", "true", True)],
)
def test_private_subnets_without_network_isolation_is_the_users_choice(
    isolation: str, private: str, expected: bool
) -> None:
    config = parse({"networkIsolation": isolation, "privateSubnets": private})
    assert config.private_subnets is expected


# -- the agent's config on the instance (bootstrap/agent_config.py) -------------------------------------

AGENT = {
    "region": "us-east-1",
    "bucket": "trainstack-dev-data",
    "group_name": "trainstack-dev-gpu",
    "topic_arn": "arn:aws:sns:us-east-1:123456789012:trainstack-dev-alerts",
    "log_group": "/trainstack/dev",
}
# key, a value out of its range (or of the wrong kind), and the one line that refuses it.
AGENT_NUMBERS = [
    ("poll_seconds", 5.5, "'poll_seconds' must be a number between 0.1 and 5, got 5.5 (AWS asks for spot "
     "polling every ≤5 s)"),
    ("stop_deadline_seconds", 116, "'stop_deadline_seconds' must be a number between 1 and 115, got 116 "
     "(must fit the 120 s notice)"),
    ("stall_minutes", 1441, "'stall_minutes' must be a number between 0.05 and 1440, got 1441"),
    ("max_consecutive_failures", 2.0, "'max_consecutive_failures' must be an integer between 1 and 100, "
     "got 2.0"),
    ("instance_count", 1001, "'instance_count' must be an integer between 1 and 1000, got 1001"),
    ("instance_count", 1.0, "'instance_count' must be an integer between 1 and 1000, got 1.0"),
    ("root_volume_gb", 0, "'root_volume_gb' must be an integer between 1 and 65536, got 0"),
    ("max_cost_usd", 0.001, "'max_cost_usd' must be a number between 0.01 and 1e+07, got 0.001"),
]  # fmt: skip


@pytest.mark.parametrize("key, bad, line", AGENT_NUMBERS)
def test_an_agent_setting_out_of_its_range_is_one_line_naming_the_key_and_the_range(
    key: str, bad: object, line: str
) -> None:
    with pytest.raises(AgentConfigError) as refused:
        AgentConfig.from_mapping({**AGENT, key: bad}, "agent.yaml")
    assert str(refused.value) == f"agent.yaml: {line}"


def test_min_nodes_is_bounded_by_the_instance_count_and_prefixes_are_relative() -> None:
    with pytest.raises(AgentConfigError) as refused:
        AgentConfig.from_mapping({**AGENT, "instance_count": 2, "min_nodes": 3}, "agent.yaml")
    assert str(refused.value) == (
        "agent.yaml: 'min_nodes' must be an integer between 1 and 2, got 3 (a job needs at least one node "
        "and cannot wait for more than the group holds)"
    )
    assert AgentConfig.from_mapping({**AGENT, "instance_count": 2, "min_nodes": 2}).min_nodes == 2
    with pytest.raises(AgentConfigError, match=r"'prefixes\.data' must be a relative prefix ending in '/'"):
        AgentConfig.from_mapping({**AGENT, "prefixes": {"data": "/data/"}})
    with pytest.raises(AgentConfigError) as refused:
        AgentConfig.from_mapping({**AGENT, "prefixes": ["data/"]}, "agent.yaml")
    assert str(refused.value) == (
        "agent.yaml: 'prefixes' must be a mapping of data/code/checkpoints/results/state/jobs to 'name/'"
    )
    assert AgentConfig.from_mapping({**AGENT, "prefixes": {"data": "d/"}}).prefixes.data == "d/"


# -- every key's range at its edges (infra/config/) ---------------------------------------------------


def range_line(key: str, low: int, high: int, got: object, why: str, example: str) -> str:
    return (
        f"{NAMESPACE}:{key}: must be between {low} and {high}, got {got} ({why}) "
        f"(e.g. `pulumi config set {NAMESPACE}:{key} {example}`)"
    )


# key, its bounds, the suggested value, why the key is bounded.
RANGES = [
    ("instanceCount", 1, 64, "1",
     "instances training one job; above 1 they train it together (docs/multi-node.md)"),
    ("onDemandBaseCapacity", 0, 100, "0", "on-demand instances first"),
    ("onDemandPercentageAboveBase", 0, 100, "0", "0 = all spot"),
    ("rootVolumeSizeGb", 100, 16384, "150",
     "the Deep Learning AMI's image and the job's data and checkpoints need at least 100 GB"),
    ("noncurrentVersionDays", 1, 3650, "30", "old object versions kept"),
    ("maxConsecutiveFailures", 1, 100, "3", "crash-loop guard"),
    ("stallTimeoutMinutes", 1, 1440, "30", "stall watchdog"),
    ("spotFallbackMinutes", 0, 1440, "15",
     "minutes without a spot launch before launching on-demand; 0 = never"),
]  # fmt: skip
# Keys whose upper edge needs others set to hold: the global batch over 64 nodes, the base under the count.
ALONGSIDE = {
    "instanceCount": {"minNodes": "64"},
    "onDemandBaseCapacity": {"instanceCount": "64", "minNodes": "64"},
}


@pytest.mark.parametrize("key, low, high, example, why", RANGES)
def test_each_range_accepts_its_edges_and_refuses_one_beyond_in_one_line(
    key: str, low: int, high: int, example: str, why: str
) -> None:
    others = ALONGSIDE.get(key, {})
    assert problems({key: str(low)}) == [], f"{key}={low} refused"
    at_high = problems({key: str(high), **others})
    if key == "onDemandBaseCapacity":
        # Above MAX_NODES (64) the base always exceeds the group's maximum: that line, not the range's.
        assert at_high == [
            f"{NAMESPACE}:onDemandBaseCapacity: 100 on-demand instances exceed the group's maximum "
            "instanceCount=64 (min > max)" + fix("onDemandBaseCapacity", "64")
        ]
    else:
        assert at_high == [], f"{key}={high} refused"
    assert range_line(key, low, high, low - 1, why, example) in problems({key: str(low - 1)})
    assert range_line(key, low, high, high + 1, why, example) in problems({key: str(high + 1), **others})


def test_min_nodes_runs_from_one_to_the_instance_count() -> None:
    why = "nodes the job keeps training with while the others are replaced; at most instanceCount"
    assert problems({"instanceCount": "2", "minNodes": "2"}) == []
    assert problems({"instanceCount": "2", "minNodes": "3"}) == [range_line("minNodes", 1, 2, 3, why, "1")]
    assert problems({"instanceCount": "2", "minNodes": "0"}) == [range_line("minNodes", 1, 2, 0, why, "1")]
    # With an instance count out of range, minNodes is judged against one node, not a negative count.
    assert range_line("minNodes", 1, 1, 2, why, "1") in problems({"instanceCount": "0", "minNodes": "2"})


def test_on_demand_instances_cannot_exceed_the_groups_maximum() -> None:
    assert problems({"instanceCount": "2", "minNodes": "2", "onDemandBaseCapacity": "2"}) == []
    assert problems({"instanceCount": "2", "minNodes": "2", "onDemandBaseCapacity": "3"}) == [
        f"{NAMESPACE}:onDemandBaseCapacity: 3 on-demand instances exceed the group's maximum instanceCount=2 "
        f"(min > max) (e.g. `pulumi config set {NAMESPACE}:onDemandBaseCapacity 2`)"
    ]


def fix(key: str, example: str) -> str:
    return f" (e.g. `pulumi config set {NAMESPACE}:{key} {example}`)"


RETENTION = (
    "1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653"
)
TYPES = '\'["g6.xlarge","g5.xlarge","g6e.xlarge","g4dn.xlarge"]\''
TYPES_LIST = '\'["g6.xlarge","g5.xlarge"]\''
VPC_LIMITS = "must be an IPv4 network from /16 to /24 (a VPC's limits)"
# key, a value accepted at an edge, a value refused just beyond it, why it is refused, the fix's value.
EDGES = [
    ("monthlyBudgetUsd", "1", "0", "must be a positive number of USD, got 0", "100"),
    (
        "maxConcurrentJobs",
        "256",
        "257",
        "must be between 0 and 256, got 257 (jobs running at once across every pool; 0 = no limit beyond "
        "each pool's maxJobs)",
        "4",
    ),
    (
        "maxConcurrentJobs",
        "0",
        "-1",
        "must be between 0 and 256, got -1 (jobs running at once across every pool; 0 = no limit beyond "
        "each pool's maxJobs)",
        "4",
    ),
    ("maxConcurrentJobs", "3", "three", "must be an integer, got 'three'", "4"),
    (
        "logRetentionDays",
        "3653",
        "3654",
        f"3654 is not a CloudWatch Logs retention period ({RETENTION})",
        "30",
    ),
    ("flowLogRetentionDays", "1", "2", f"2 is not a CloudWatch Logs retention period ({RETENTION})", "365"),
    ("spotMaxPrice", "0.01", "0", "'0' is not a positive USD/hour price; empty = no cap", "0.50"),
    ("spotMaxPrice", "2", "2.", "'2.' is not a positive USD/hour price; empty = no cap", "0.50"),
    ("maxCostUsd", "0.01", "0.0", "'0.0' is not a positive USD amount; empty = no cap", "25"),
    ("maxCostUsd", "7", "$7", "'$7' is not a positive USD amount; empty = no cap", "25"),
    ("expectedHours", "0.5", "0", "'0' is not a positive number of hours; empty = unknown", "24"),
    ("amiId", "ami-0123abcd", "ami-0123abcd0", "'ami-0123abcd0' is not an AMI id", "ami-0123456789abcdef0"),
    (
        "amiId",
        "ami-0123456789abcdef0",
        "ami-0123456789ABCDEF0",
        "'ami-0123456789ABCDEF0' is not an AMI id",
        "ami-0123456789abcdef0",
    ),
    ("amiParameter", "/my/ami", "my/ami", "'my/ami' is not an SSM parameter path", DEFAULT_AMI_PARAMETER),
    ("vpcCidr", "10.0.0.0/16", "10.0.0.0/15", f"'10.0.0.0/15' {VPC_LIMITS}", "10.42.0.0/16"),
    ("vpcCidr", "192.168.7.0/24", "192.168.7.0/25", f"'192.168.7.0/25' {VPC_LIMITS}", "10.42.0.0/16"),
    ("vpcCidr", "172.16.0.0/16", "fd00::/16", f"'fd00::/16' {VPC_LIMITS}", "10.42.0.0/16"),
    (
        "vpcCidr",
        "10.0.0.0/16",
        "10.0.0.1/16",
        "'10.0.0.1/16' is not an IPv4 network (host bits must be zero)",
        "10.42.0.0/16",
    ),
    (
        "vpcCidr",
        "10.0.0.0/16",
        "11.0.0.0/16",
        "'11.0.0.0/16' is not a private (RFC 1918) range",
        "10.42.0.0/16",
    ),
    ("alertEmail", "a@b.io", "a@b.c", "'a@b.c' is not an e-mail address", "ml-team@example.com"),
    (
        "placementStrategy",
        "cluster",
        "spread",
        "unknown strategy 'spread'; use '' (none) or cluster (one AZ, multi-node jobs)",
        "cluster",
    ),
    (
        "spotAllocationStrategy",
        "lowest-price",
        "cheapest",
        "unknown strategy 'cheapest'; choose one of "
        "price-capacity-optimized, capacity-optimized, capacity-optimized-prioritized, lowest-price",
        "price-capacity-optimized",
    ),
    (
        "instanceTypes",
        '["p5.48xlarge"]',
        '["g6.xlarge","g6.xlarge"]',
        "lists a type twice: g6.xlarge, g6.xlarge",
        TYPES,
    ),
    (
        "instanceTypes",
        '["p6-b200.48xlarge"]',
        '["g5g.xlarge"]',
        "'g5g.xlarge' is refused: Graviton (arm64) with "
        "T4G; the x86_64 Deep Learning AMI does not boot on it",
        TYPES,
    ),
    (
        "instanceTypes",
        '["g6.xlarge"]',
        '["m5.xlarge"]',
        "'m5.xlarge' has no NVIDIA GPU (or is unknown); use one "
        f"of the families {', '.join(NVIDIA_FAMILIES)}",
        TYPES,
    ),
    ("instanceTypes", '["g6.xlarge"]', '["g6"]', "'g6' is not an EC2 instance type", TYPES),
    (
        "instanceTypes",
        '["g6.xlarge"]',
        "g6.xlarge",
        "must be a list of strings (JSON array), got 'g6.xlarge'",
        TYPES_LIST,
    ),
    ("instanceTypes", '["g6.xlarge"]', "[1]", "must be a list of strings, got [1]", TYPES_LIST),
    (
        "instanceTypes",
        '["g6.xlarge"]',
        '{"a": "g6.xlarge"}',
        "must be a list of strings, got {'a': 'g6.xlarge'}",
        TYPES_LIST,
    ),
    ("drill", " TRUE ", "yes", "must be true or false, got 'yes'", "true"),
    ("retainDataOnDestroy", "False", "1", "must be true or false, got '1'", "true"),
    ("instanceCount", " 2 ", "2.0", "must be an integer, got '2.0'", "1"),
    ("instanceCount", "1", "+1", "must be an integer, got '+1'", "1"),
    ("maxConsecutiveFailures", "5", "true", "must be an integer, got 'true'", "3"),
    ("minNodes", "1", "1.5", "must be an integer, got '1.5'", "1"),
    (
        "resumeFrom",
        "legacy",
        "Legacy",
        "'Legacy' is not a job id (lowercase letters, digits and dashes, e.g. default-1a2b3c4d, or legacy "
        "for the stack's checkpoints from before jobs); `trainstack jobs` lists them",
        "default-1a2b3c4d",
    ),
]


@pytest.mark.parametrize("key, accepted, refused, why, example", EDGES)
def test_a_value_at_the_edge_is_accepted_and_one_beyond_is_one_line_naming_the_key_and_a_fix(
    key: str, accepted: str, refused: str, why: str, example: str
) -> None:
    assert problems({key: accepted}) == [], f"{key}={accepted!r} refused"
    assert problems({key: refused}) == [f"{NAMESPACE}:{key}: {why}" + fix(key, example)]


def test_typed_values_as_pulumi_config_json_holds_them_are_read_like_strings() -> None:
    config = parse({"instanceCount": 2, "minNodes": 1, "drill": True, "sshIngressCidrs": ["203.0.113.7/32 "]})
    assert (config.instance_count, config.drill, config.ssh_ingress_cidrs) == (2, True, ("203.0.113.7/32",))
    assert problems({"instanceCount": True}) == [
        f"{NAMESPACE}:instanceCount: must be an integer, got True" + fix("instanceCount", "1")
    ]
    assert problems({"drill": 1}) == [
        f"{NAMESPACE}:drill: must be true or false, got 1" + fix("drill", "true")
    ]
    assert problems({"alertEmail": 5}) == [
        f"{NAMESPACE}:alertEmail: must be a string, got 5" + fix("alertEmail", "ml-team@example.com")
    ]


# -- what the program reads from a valid config -----------------------------------------------------------


def test_every_key_set_reaches_the_typed_config_trimmed() -> None:
    raw = {
        "instanceTypes": '[" g6e.xlarge ", "g5.xlarge"]',
        "instanceCount": "4",
        "minNodes": "4",
        "spotAllocationStrategy": "capacity-optimized",
        "onDemandBaseCapacity": "1",
        "onDemandPercentageAboveBase": "25",
        "spotMaxPrice": " 1.25 ",
        "amiParameter": DEFAULT_AMI_PARAMETER,
        "amiId": " ami-0123456789abcdef0 ",
        "rootVolumeSizeGb": "200",
        "vpcCidr": " 10.9.0.0/20 ",
        "privateSubnets": "true",
        "sshIngressCidrs": '["198.51.100.0/24"]',
        "alertEmail": " ops@example.com ",
        "monthlyBudgetUsd": "250",
        "retainDataOnDestroy": "false",
        "noncurrentVersionDays": "7",
        "logRetentionDays": "90",
        "flowLogRetentionDays": "400",
        "trainingConfig": " training/configs/tiny.yaml ",
        "maxCostUsd": " 12.5 ",
        "maxConsecutiveFailures": "5",
        "stallTimeoutMinutes": "45",
        "spotFallbackMinutes": "0",
        "expectedHours": " 3.5 ",
        "placementStrategy": " cluster ",
        "resumeFrom": " legacy ",
        "drill": "true",
        "devBox": "true",
        "maxConcurrentJobs": " 6 ",
    }
    config = parse_stack_config(raw, region="eu-west-1", project="proj", stack="prod")
    assert config == StackConfig(
        project="proj",
        stack="prod",
        region="eu-west-1",
        instance_types=("g6e.xlarge", "g5.xlarge"),
        instance_count=4,
        spot_allocation_strategy="capacity-optimized",
        on_demand_base_capacity=1,
        on_demand_percentage_above_base=25,
        spot_max_price="1.25",
        ami_parameter=DEFAULT_AMI_PARAMETER,
        ami_id="ami-0123456789abcdef0",
        root_volume_size_gb=200,
        vpc_cidr="10.9.0.0/20",
        private_subnets=True,
        ssh_ingress_cidrs=("198.51.100.0/24",),
        alert_email="ops@example.com",
        monthly_budget_usd=250,
        retain_data_on_destroy=False,
        noncurrent_version_days=7,
        log_retention_days=90,
        flow_log_retention_days=400,
        training_config=REPO_ROOT / "training/configs/tiny.yaml",
        job=yaml.safe_load((REPO_ROOT / "training/configs/tiny.yaml").read_text()),
        max_cost_usd=12.5,
        max_consecutive_failures=5,
        stall_timeout_minutes=45,
        spot_fallback_minutes=0,
        expected_hours=3.5,
        placement_strategy="cluster",
        min_nodes=4,
        resume_from="legacy",
        drill=True,
        network_isolation=False,
        dev_box=True,
        max_concurrent_jobs=6,
    )
    # The names every resource and the agent derive from it.
    assert (config.name, config.group_name, config.dev_box_name) == (
        "proj-prod",
        "proj-prod-gpu",
        "proj-prod-dev",
    )
    assert (config.log_group_name, config.flow_log_group_name) == ("/proj/prod", "/proj/prod/vpc-flow-logs")
    assert config.gpu_families == ("g5", "g6e")
    assert config.multi_node and config.cluster_placement and not config.efa


def test_a_config_left_at_its_defaults_is_the_documented_default() -> None:
    config = parse_stack_config({}, region="us-east-1", project="trainstack", stack="dev")
    assert config.instance_types == tuple(DEFAULTS["instanceTypes"])
    assert (config.instance_count, config.min_nodes, config.placement_strategy) == (1, 1, "")
    assert not (config.multi_node or config.cluster_placement or config.efa or config.private_subnets)
    assert (config.max_cost_usd, config.expected_hours, config.user_job, config.user_job_dir) == (None,) * 4
    assert (config.spot_fallback_minutes, config.flow_log_retention_days) == (15, 365)
    assert config.max_concurrent_jobs == 0, "no stack-wide limit unless set"
    assert config.job["train"]["batch_size"] == 256


def test_the_error_counts_its_problems_and_lists_each_on_its_own_line() -> None:
    with pytest.raises(StackConfigError) as one:
        parse({"drill": "maybe"})
    assert str(one.value) == (
        "stack 'dev' config has 1 problem:\n"
        f"  - {NAMESPACE}:drill: must be true or false, got 'maybe'" + fix("drill", "true")
    )
    with pytest.raises(StackConfigError) as two:
        parse({"drill": "maybe", "devBox": "maybe"})
    assert str(two.value).splitlines()[0] == "stack 'dev' config has 2 problems:"
    assert two.value.problems == [
        f"{NAMESPACE}:drill: must be true or false, got 'maybe'" + fix("drill", "true"),
        f"{NAMESPACE}:devBox: must be true or false, got 'maybe'" + fix("devBox", "true"),
    ]
    assert StackConfigError("plain").problems == ["plain"]


def test_the_cli_reads_a_stack_file_with_its_namespace_and_region() -> None:
    values = {
        "aws:region": "eu-central-1",
        f"{NAMESPACE}:instanceCount": "2",
        f"{NAMESPACE}:alertEmail": None,  # set to null: not set
        f"{NAMESPACE}:networkIsolation": "false",
        "other:instanceCount": "9",
    }
    config = read_stack_config(values, project="proj", stack="prod")
    assert (config.region, config.instance_count, config.alert_email) == ("eu-central-1", 2, "")
    assert (config.project, config.stack, config.group_name) == ("proj", "prod", "proj-prod-gpu")
    region_line = "aws:region: required (e.g. `pulumi config set aws:region us-east-1`)"
    with pytest.raises(StackConfigError) as missing:
        read_stack_config({}, project="trainstack", stack="dev")
    assert missing.value.problems == [region_line]
    assert read_stack_config({}, project="trainstack", stack="dev", require_region=False).region == ""
    with pytest.raises(StackConfigError) as typed:
        read_stack_config({"aws:region": 5}, project="trainstack", stack="dev")
    assert str(typed.value) == (
        "stack 'dev' config has 1 problem:\n"
        "  - aws:region: must be a string, got 5 (e.g. `pulumi config set aws:region us-east-1`)"
    )
    assert typed.value.problems == [
        "aws:region: must be a string, got 5 (e.g. `pulumi config set aws:region us-east-1`)"
    ]


def test_the_program_reads_the_running_stacks_config_set_values_over_the_environments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pulumi.runtime import config as engine_config
    from pulumi.runtime import settings

    environment = {"aws:region": "eu-west-1", "trainstack:instanceCount": "4", "trainstack:minNodes": "4"}
    monkeypatch.setenv("PULUMI_CONFIG", json.dumps({**environment, "trainstack:alertEmail": "a@b.io"}))
    monkeypatch.setattr(settings.SETTINGS, "project", "proj")
    monkeypatch.setattr(settings.SETTINGS, "stack", "prod")

    def load(values: dict[str, str]) -> StackConfig:
        engine_config.CONFIG.set(values)
        return load_stack_config()

    set_values = {"trainstack:instanceCount": "2", "trainstack:minNodes": "2", "other:instanceCount": "9"}
    config = contextvars.copy_context().run(load, set_values)
    assert (config.project, config.stack, config.region) == ("proj", "prod", "eu-west-1")
    assert (config.instance_count, config.min_nodes, config.alert_email) == (2, 2, "a@b.io")
    monkeypatch.setenv("PULUMI_CONFIG", json.dumps({"trainstack:drill": "maybe"}))
    with pytest.raises(StackConfigError) as refused:
        contextvars.copy_context().run(load, {})
    assert refused.value.problems == [
        "aws:region: required (e.g. `pulumi config set aws:region us-east-1`)",
        f"{NAMESPACE}:drill: must be true or false, got 'maybe'" + fix("drill", "true"),
    ]


# -- the checks across keys: the global batch, EFA, network isolation, resumeFrom ------------------------


def trainer_file(folder: Path, batch: object) -> str:
    """A valid built-in trainer config (tiny.yaml's) with its global batch set to `batch`."""
    tree = yaml.safe_load((REPO_ROOT / "training/configs/tiny.yaml").read_text())
    tree["train"]["batch_size"] = batch
    path = folder / f"batch-{batch}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def batch_line(batch: int, uneven: str, low: int, high: int, multiple: int) -> str:
    return (
        f"{NAMESPACE}:minNodes: train.batch_size {batch} of trainstack:trainingConfig does not split over "
        f"{uneven} node(s), and the job keeps its global batch whatever the number of nodes "
        f"(minNodes..instanceCount = {low}..{high}): use a multiple of {multiple}, or raise minNodes"
        + fix("minNodes", str(high))
    )


@pytest.mark.parametrize(
    "low, high, batch, uneven, multiple",
    [
        (2, 4, 6, "4", 12),
        (3, 4, 4, "3", 12),
        (1, 2, 3, "2", 2),
        (2, 2, 3, "2", 2),
        (1, 4, 2, "3, 4", 12),
        (64, 64, 96, "64", 64),
    ],
)
def test_a_global_batch_that_does_not_split_over_every_node_count_is_refused_naming_the_counts(
    tmp_path: Path, low: int, high: int, batch: int, uneven: str, multiple: int
) -> None:
    raw = {"instanceCount": str(high), "minNodes": str(low), "trainingConfig": trainer_file(tmp_path, batch)}
    assert problems(raw) == [batch_line(batch, uneven, low, high, multiple)]
    assert problems({**raw, "trainingConfig": trainer_file(tmp_path, batch * multiple)}) == []


def test_a_global_batch_the_trainer_chooses_or_one_node_is_never_refused(tmp_path: Path) -> None:
    assert problems({"instanceCount": "4", "trainingConfig": trainer_file(tmp_path, "auto")}) == []
    assert problems({"instanceCount": "1", "trainingConfig": trainer_file(tmp_path, 7)}) == []
    # A batch that is no number is the trainer's problem, named once, not also a split over the nodes.
    flagged = problems({"instanceCount": "2", "trainingConfig": trainer_file(tmp_path, True)})
    assert len(flagged) == 1 and "train.batch_size: expected int or 'auto', got True" in flagged[0]
    not_mapping = tmp_path / "list.yaml"
    not_mapping.write_text("- 1\n")
    assert problems({"instanceCount": "2", "trainingConfig": str(not_mapping)}) == [
        f"{NAMESPACE}:trainingConfig: {not_mapping} must hold a YAML mapping (the trainer's config)"
        + fix("trainingConfig", "training/configs/default.yaml")
    ]


def test_a_training_config_that_cannot_be_read_is_named_with_its_path(tmp_path: Path) -> None:
    example = fix("trainingConfig", "training/configs/default.yaml")
    missing = tmp_path / "absent.yaml"
    assert problems({"trainingConfig": str(missing)}) == [
        f"{NAMESPACE}:trainingConfig: cannot read {missing} (No such file or directory)" + example
    ]
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: [1\n")
    assert problems({"trainingConfig": str(broken)}) == [
        f"{NAMESPACE}:trainingConfig: {broken} is not valid YAML (while parsing a flow sequence)" + example
    ]
    # The trainer's own checks, named by the file as typed relative to the repository.
    tiny = "training/configs/tiny.yaml"
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {lr: 0}\n")
    assert problems({"trainingConfig": str(bad)}) == [
        f"{NAMESPACE}:trainingConfig: {bad}: train.lr: must be positive, got 0"
    ]
    assert parse({"trainingConfig": tiny}).training_config == REPO_ROOT / tiny
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("# réglages\ntrain: {lr: 1}\n".encode("latin-1"))
    assert problems({"trainingConfig": str(latin)}) == [
        f"{NAMESPACE}:trainingConfig: {latin}: not UTF-8 text (byte 3: invalid continuation byte); save it "
        "as UTF-8" + example
    ]


EFA_CLUSTER = {"instanceCount": "2", "minNodes": "2", "placementStrategy": "cluster"}
EFA_EXAMPLE = fix("instanceTypes", '\'["p5.48xlarge","p5e.48xlarge"]\'')


def test_a_relative_job_file_is_found_from_the_repository_not_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = Path(user_job(tmp_path / "job"))
    monkeypatch.chdir(tmp_path / "job")  # where a relative path would be read from otherwise
    config = parse({"job": os.path.relpath(job, REPO_ROOT)})
    assert config.user_job is not None and config.user_job.name == "probe"
    assert config.user_job_dir == job.parent.resolve()


def test_an_efa_type_of_two_network_cards_needs_private_subnets_too(monkeypatch: pytest.MonkeyPatch) -> None:
    # No listed type has two cards today; one added to the table must be judged like the bigger ones.
    monkeypatch.setitem(efa.EFA_TYPES, "g6e.24xlarge", efa.EfaCards(2))
    (line,) = problems({**EFA_CLUSTER, "instanceTypes": '["g6e.24xlarge"]'})
    assert line.startswith(
        f"{NAMESPACE}:privateSubnets: g6e.24xlarge gets 2 EFA interfaces (one per network card)"
    )


def test_an_efa_cluster_of_many_network_cards_needs_private_subnets() -> None:
    assert problems({**EFA_CLUSTER, "instanceTypes": '["p5.48xlarge"]'}) == [
        f"{NAMESPACE}:privateSubnets: p5.48xlarge gets 32 EFA interfaces (one per network card) and AWS "
        "gives no public address to an instance with several network interfaces, so in a public subnet it "
        "could not reach S3 or the AWS APIs; private subnets reach them through the NAT gateway"
        + fix("privateSubnets", "true")
    ]
    private = parse({**EFA_CLUSTER, "instanceTypes": '["p5.48xlarge"]', "privateSubnets": "true"})
    assert private.efa and private.private_subnets
    # One network card: one interface, a public subnet will do.
    assert parse({**EFA_CLUSTER, "instanceTypes": '["g6.8xlarge", "g5.8xlarge"]'}).efa


def test_efa_cards_that_are_unknown_or_differ_are_refused_in_one_line() -> None:
    assert problems({**EFA_CLUSTER, "instanceTypes": '["p5.4xlarge"]', "privateSubnets": "true"}) == [
        f"{NAMESPACE}:instanceTypes: p5.4xlarge has no entry in the EFA table (its network cards are "
        "unknown); add it to EFA_TYPES in infra/efa.py (MaximumNetworkCards from "
        "`aws ec2 describe-instance-types`) or choose a listed type" + EFA_EXAMPLE
    ]
    mixed = '["p5.48xlarge", "p4d.24xlarge"]'
    assert problems({**EFA_CLUSTER, "instanceTypes": mixed, "privateSubnets": "true"}) == [
        f"{NAMESPACE}:instanceTypes: p5.48xlarge (32 network cards), p4d.24xlarge (4 network cards) need "
        "different EFA interfaces and the group has one launch template; list types with the same number of "
        "network cards" + EFA_EXAMPLE
    ]


@pytest.mark.parametrize(
    "raw",
    [
        {"instanceCount": "1", "placementStrategy": "cluster"},  # one node: no cluster traffic
        {"instanceCount": "2", "minNodes": "2", "placementStrategy": ""},  # spread: no EFA
        {**EFA_CLUSTER, "instanceTypes": '["p5.48xlarge", "g6.xlarge"]'},  # not every type takes one
    ],
)
def test_no_efa_is_asked_for_without_several_nodes_in_a_cluster_of_efa_types(raw: dict[str, str]) -> None:
    types = raw.get("instanceTypes", '["p5.48xlarge"]')
    config = parse({**raw, "instanceTypes": types})
    assert not config.efa and not config.private_subnets


def fake_vendored(folder: Path) -> tuple[Path, Path]:
    """A lock of one package and its wheel, standing in for `make wheels` (which needs PyPI)."""
    wheels = folder / "wheels"
    wheels.mkdir(parents=True)
    wheel = wheels / "trainstack_probe-1.0-py3-none-any.whl"
    wheel.write_bytes(b"only its sha256 matters here")
    lock = folder / "requirements.txt"
    lock.write_text(
        f"trainstack-probe==1.0 \\\n    --hash=sha256:{hashlib.sha256(wheel.read_bytes()).hexdigest()}\n"
    )
    return lock, wheels


@pytest.fixture
def instance_wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    lock, wheels = fake_vendored(tmp_path / "instance")
    monkeypatch.setattr(vendored, "INSTANCE_LOCK", lock)
    monkeypatch.setattr(vendored, "INSTANCE_WHEELS_DIR", wheels)
    return wheels


def user_job(folder: Path, requirements: str | None = None) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.py").write_text("print('hi')\n")
    spec: dict[str, object] = {"name": "probe", "command": ["python", "train.py"]}
    if requirements is not None:
        (folder / "requirements.txt").write_text(requirements)
        spec["requirements"] = "requirements.txt"
    (folder / "job.yaml").write_text(yaml.safe_dump(spec))
    return str(folder / "job.yaml")


def test_network_isolation_puts_the_instances_in_private_subnets(instance_wheels: Path) -> None:
    config = parse({"networkIsolation": "true", "privateSubnets": "false"})
    assert config.network_isolation and config.private_subnets
    assert parse({"networkIsolation": "true", "instanceTypes": '["p5.48xlarge"]', **EFA_CLUSTER}).efa


def test_network_isolation_refuses_ssh_from_outside(instance_wheels: Path) -> None:
    assert problems({"networkIsolation": "true", "sshIngressCidrs": '["203.0.113.7/32"]'}) == [
        f"{NAMESPACE}:sshIngressCidrs: no SSH from outside reaches an instance under networkIsolation (the "
        "VPC has no internet gateway); use SSM Session Manager and remove the key"
        + fix("sshIngressCidrs", "'[]'")
    ]
    assert parse({"sshIngressCidrs": '["203.0.113.7/32"]'}).ssh_ingress_cidrs == ("203.0.113.7/32",)


def test_network_isolation_without_the_instance_wheels_says_make_wheels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock, _ = fake_vendored(tmp_path)
    monkeypatch.setattr(vendored, "INSTANCE_LOCK", lock)
    monkeypatch.setattr(vendored, "INSTANCE_WHEELS_DIR", tmp_path / "absent")
    assert problems({"networkIsolation": "true"}) == [
        f"{NAMESPACE}:networkIsolation: the instances cannot reach PyPI and {tmp_path / 'absent'} lacks a "
        "wheel matching requirements.txt's hashes for trainstack-probe==1.0; run `make wheels` (they go to "
        "the stack's bucket)" + fix("networkIsolation", "true")
    ]


def test_network_isolation_needs_a_users_job_requirements_vendored(
    tmp_path: Path, instance_wheels: Path
) -> None:
    plain = user_job(tmp_path / "plain", "requests>=2\n")
    (line,) = problems({"networkIsolation": "true", "job": plain})
    assert line.startswith(f"{NAMESPACE}:networkIsolation: the job's requirements cannot come from PyPI: ")
    assert line.endswith(
        "; lock them with hashes (pip-compile --generate-hashes) and vendor them next to it (pip download "
        "--require-hashes --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d "
        "wheels -r requirements.txt), or set false" + fix("networkIsolation", "false")
    )
    lock, _ = fake_vendored(tmp_path / "vendored")
    vendored_job = user_job(tmp_path / "vendored", lock.read_text())
    config = parse({"networkIsolation": "true", "job": vendored_job})
    assert config.user_job is not None and config.user_job_dir == (tmp_path / "vendored").resolve()
    # Without requirements there is nothing to fetch.
    assert parse({"networkIsolation": "true", "job": user_job(tmp_path / "bare")}).user_job is not None
    assert parse({"job": plain}).user_job is not None  # without isolation PyPI is reachable


def test_a_users_job_runs_on_one_instance(tmp_path: Path) -> None:
    job = user_job(tmp_path / "job")
    assert problems({"job": job, "instanceCount": "2"}) == [
        f"{NAMESPACE}:instanceCount: 2 nodes with trainstack:job: a user's job runs on one instance "
        "(multi-node runs the built-in trainer, trainstack:trainingConfig); set 1, or a multi-GPU type for "
        'more GPUs (e.g. instanceTypes ["g6.12xlarge"], 4 x L4)' + fix("instanceCount", "1")
    ]
    # Not also a global batch problem: the user's job has none.
    assert problems({"job": job, "instanceCount": "2", "trainingConfig": trainer_file(tmp_path, 3)}) == [
        problems({"job": job, "instanceCount": "2"})[0]
    ]


def test_a_bad_job_file_names_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "absent.yaml"
    (line,) = problems({"job": str(missing)})
    assert line.startswith(f"{NAMESPACE}:job: ") and str(missing) in line
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("# réglages\nname: x\n".encode("latin-1"))
    assert problems({"job": str(latin)}) == [
        f"{NAMESPACE}:job: {latin}: not UTF-8 text (byte 3: invalid continuation byte); save it as UTF-8"
    ]
    # Its requirements are read as UTF-8 on the instance: refused here, not at boot.
    job = user_job(tmp_path / "reqs", requirements="")
    (tmp_path / "reqs" / "requirements.txt").write_bytes("# paquets réglés\nrich\n".encode("latin-1"))
    assert problems({"job": job}) == [
        f"{NAMESPACE}:job: {job}: requirements: {tmp_path / 'reqs' / 'requirements.txt'}: not UTF-8 text "
        "(byte 11: invalid continuation byte); save it as UTF-8"
    ]
    # A workdir too big to bundle (data kept beside the code).
    monkeypatch.setattr(bundle, "MAX_JOB_BYTES", 4)
    job = user_job(tmp_path / "big")
    assert problems({"job": job}) == [
        f"{NAMESPACE}:job: the workdir {(tmp_path / 'big').resolve()} holds 0 MiB; keep data out of it "
        "(trainstack data push) so the code bundle stays small"
    ]


@pytest.mark.parametrize("job", [False, True])
def test_resume_from_another_job_is_accepted_for_the_trainer_and_a_users_job(
    tmp_path: Path, job: bool
) -> None:
    raw = {"resumeFrom": "default-1a2b3c4d", **({"job": user_job(tmp_path / "job")} if job else {})}
    config = parse(raw)
    assert config.resume_from == "default-1a2b3c4d" and (config.user_job is not None) is job


def test_resume_from_is_checked_even_when_other_keys_are_bad() -> None:
    assert problems({"resumeFrom": "Bad", "drill": "maybe"}) == [
        f"{NAMESPACE}:drill: must be true or false, got 'maybe'" + fix("drill", "true"),
        f"{NAMESPACE}:resumeFrom: 'Bad' is not a job id (lowercase letters, digits and dashes, e.g. "
        "default-1a2b3c4d, or legacy for the stack's checkpoints from before jobs); `trainstack jobs` lists "
        "them" + fix("resumeFrom", "default-1a2b3c4d"),
    ]
    # A valid id beside another problem: that problem alone (the job is not defined from a bad config).
    assert problems({"resumeFrom": "default-1a2b3c4d", "trainingConfig": "absent.yaml"}) == [
        f"{NAMESPACE}:trainingConfig: cannot read {REPO_ROOT / 'absent.yaml'} (No such file or directory)"
        + fix("trainingConfig", "training/configs/default.yaml")
    ]


def test_resume_from_the_stacks_own_job_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # The id includes resumeFrom, so only a digest collision makes them equal: stand one in.
    import infra.config.jobs

    monkeypatch.setattr(
        infra.config.jobs, "define_job", lambda **_: JobDefinition("own-1a2b3c4d", "own", "1a" * 32)
    )
    assert problems({"resumeFrom": "own-1a2b3c4d"}) == [
        f"{NAMESPACE}:resumeFrom: 'own-1a2b3c4d' is this stack's own job; name the earlier job to start from "
        "(`trainstack jobs` lists them), or empty to start from scratch" + fix("resumeFrom", "''")
    ]
    assert problems({"resumeFrom": "other-1a2b3c4d"}) == []


def test_resume_from_a_users_job_of_this_stack_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stand-in for a collision: the stack's job as defined without resumeFrom (the real digest includes it).
    import infra.config.jobs
    from infra import jobdef

    monkeypatch.setattr(
        infra.config.jobs, "define_job", lambda **kw: jobdef.define_job(**{**kw, "resume_from": ""})
    )
    job = user_job(tmp_path / "job")
    own = parse({"job": job})
    own_id = jobdef.define_stack_job(own).job_id
    assert own_id.startswith("probe-")
    (line,) = problems({"job": job, "resumeFrom": own_id})
    assert line.startswith(f"{NAMESPACE}:resumeFrom: '{own_id}' is this stack's own job")
    # The built-in trainer's job is another one.
    assert problems({"resumeFrom": own_id}) == []


# -- the agent's config file: every key, the file itself ------------------------------------------------


def agent_refusal(raw: object) -> str:
    with pytest.raises(AgentConfigError) as refused:
        AgentConfig.from_mapping(raw, "agent.yaml")
    return str(refused.value)


# key, a bad value, the one problem it is (after `agent.yaml: `).
NOT_A_JOB_ID = "is not a job id (lowercase letters, digits and dashes, e.g. 'default-1a2b3c4d'"
POLL_WHY = "(AWS asks for spot polling every ≤5 s)"
SHA_WHY = "must be the bundle's lowercase sha256 hex digest or empty"
AGENT_BAD = [
    ("region", "", "'region' is required and must be a non-empty string"),
    ("bucket", 5, "'bucket' is required and must be a non-empty string"),
    ("group_name", None, "'group_name' is required and must be a non-empty string"),
    ("topic_arn", "", "'topic_arn' is required and must be a non-empty string"),
    ("log_group", "", "'log_group' is required and must be a non-empty string"),
    ("bucket", "Trainstack_Data",
     "'bucket' 'Trainstack_Data' is not a valid S3 bucket name (e.g. 'trainstack-dev-data')"),
    ("bucket", "ab", "'bucket' 'ab' is not a valid S3 bucket name (e.g. 'trainstack-dev-data')"),
    ("region", "us-east", "'region' 'us-east' is not an AWS region (e.g. 'us-east-1')"),
    ("region", "US-EAST-1", "'region' 'US-EAST-1' is not an AWS region (e.g. 'us-east-1')"),
    ("gpu_required", "yes", "'gpu_required' must be true or false"),
    ("efa", 1, "'efa' must be true or false"),
    ("allow_data_change", "no", "'allow_data_change' must be true or false"),
    # Several jobs at once in one pool (`maxJobs`): a lane each, one to 256.
    ("lanes", 0, "'lanes' must be an integer between 1 and 256, got 0"),
    ("max_concurrent_jobs", -1, "'max_concurrent_jobs' must be an integer between 0 and 256, got -1"),
    ("max_concurrent_jobs", 257, "'max_concurrent_jobs' must be an integer between 0 and 256, got 257"),
    ("max_concurrent_jobs", True, "'max_concurrent_jobs' must be an integer between 0 and 256, got True"),
    ("lanes", 257, "'lanes' must be an integer between 1 and 256, got 257"),
    ("lanes", 2.0, "'lanes' must be an integer between 1 and 256, got 2.0"),
    ("pool", "Bad_Pool", "'pool' must be a pool name (a-z, 0-9 and '-') or empty, got 'Bad_Pool'"),
    ("pool", 7, "'pool' must be a pool name (a-z, 0-9 and '-') or empty, got 7"),
    ("job", ["train"], "'job' must be a mapping (the trainer's YAML config)"),
    ("scratch_dir", 5, "'scratch_dir' must be a path or null (null = instance-store NVMe, else root volume)"),
    ("lifecycle_hook", True, "'lifecycle_hook' must be the group's termination hook name or null"),
    ("job_role_arn", "arn:aws:iam::123456789012:user/x",
     "'job_role_arn' must be an IAM role ARN or null, got 'arn:aws:iam::123456789012:user/x'"),
    ("job_role_arn", 5, "'job_role_arn' must be an IAM role ARN or null, got 5"),
    ("job_name", 5, "'job_name' must be a string"),
    ("bundle_key", None, "'bundle_key' must be a string"),
    ("bundle_sha256", "AB" * 32, f"'bundle_sha256' {SHA_WHY}, got '{'AB' * 32}'"),
    ("bundle_sha256", None, f"'bundle_sha256' {SHA_WHY}, got None"),
    ("job_id", "Job_1", f"'job_id': 'Job_1' {NOT_A_JOB_ID}"),
    ("resume_from", "../x", f"'resume_from': '../x' {NOT_A_JOB_ID}"),
    ("dataset", "Big Set", "'dataset': 'Big Set' is not a dataset name"),
    ("dataset_version", "abc", "'dataset_version': 'abc' is not a dataset version"),
    ("data_wait_minutes", -1, "'data_wait_minutes' must be a number between 0 and 1440, got -1"),
    ("data_wait_minutes", "5", "'data_wait_minutes' must be a number between 0 and 1440, got '5'"),
    ("poll_seconds", True, f"'poll_seconds' must be a number between 0.1 and 5, got True {POLL_WHY}"),
    ("poll_seconds", 0.05, f"'poll_seconds' must be a number between 0.1 and 5, got 0.05 {POLL_WHY}"),
    ("max_consecutive_failures", 0, "'max_consecutive_failures' must be an integer between 1 and 100, got 0"),
    ("max_cost_usd", "25", "'max_cost_usd' must be a number between 0.01 and 1e+07, got '25'"),
    ("max_cost_usd", 1.1e7, "'max_cost_usd' must be a number between 0.01 and 1e+07, got 11000000.0"),
    ("max_cost_usd", 10000000.5, "'max_cost_usd' must be a number between 0.01 and 1e+07, got 10000000.5"),
    ("root_volume_gb", 65537, "'root_volume_gb' must be an integer between 1 and 65536, got 65537"),
    ("stop_deadline_seconds", 0.5,
     "'stop_deadline_seconds' must be a number between 1 and 115, got 0.5 (must fit the 120 s notice)"),
    ("stall_minutes", 0.04, "'stall_minutes' must be a number between 0.05 and 1440, got 0.04"),
    ("user_job", {"name": "x"}, "'user_job': command: required, a non-empty list of arguments"),
]  # fmt: skip


@pytest.mark.parametrize("key, bad, problem", AGENT_BAD)
def test_every_bad_agent_setting_is_one_line_naming_the_key(key: str, bad: object, problem: str) -> None:
    refused = agent_refusal({**AGENT, key: bad})
    assert refused.startswith(f"agent.yaml: {problem}"), refused
    assert "\n" not in refused


# key, the values at its edges, accepted.
ROLE = "arn:aws:iam::123456789012:role"
AGENT_EDGES = [
    ("poll_seconds", (0.1, 5, 5.0)),
    ("stop_deadline_seconds", (1, 115.0)),
    ("stall_minutes", (0.05, 1440)),
    ("data_wait_minutes", (0, 1440.0)),
    ("max_consecutive_failures", (1, 100)),
    ("instance_count", (1, 1000)),
    ("root_volume_gb", (1, 65536)),
    ("max_cost_usd", (0.01, 1e7, None)),
    ("job_role_arn", (f"{ROLE}/trainstack-dev-job", f"{ROLE.replace('aws', 'aws-cn', 1)}/a/b", None)),
    ("job_id", ("legacy", "", "resnet-1a2b3c4d")),
    ("resume_from", ("legacy", "default-1a2b3c4d", None)),
    ("bundle_sha256", ("", "0123456789abcdef" * 4)),
    ("dataset", ("", "imagenet-small")),
    ("dataset_version", ("", "0123456789ab")),
    ("scratch_dir", ("/opt/dlami/nvme", None)),
    ("lifecycle_hook", ("trainstack-drain", None)),
    ("bucket", ("abc", "a" * 63, "trainstack.dev-data")),
    ("region", ("eu-west-1", "us-gov-west-1")),
    ("gpu_required", (False,)),
    ("efa", (True,)),
    ("allow_data_change", (True,)),
    ("lanes", (1, 256)),
    ("max_concurrent_jobs", (0, 1, 256)),
    ("pool", ("", "gpu-a100")),
    ("user_job", (None, {"name": "probe", "command": ["python", "train.py"]})),
]  # fmt: skip


@pytest.mark.parametrize("key, values", AGENT_EDGES)
def test_an_agent_setting_at_its_edges_is_accepted_as_given(key: str, values: tuple[object, ...]) -> None:
    for value in values:
        assert getattr(AgentConfig.from_mapping({**AGENT, key: value}), key) == value


def test_a_bad_users_job_is_reported_beside_the_other_problems() -> None:
    assert agent_refusal({**AGENT, "efa": 0, "user_job": {"name": "x"}}) == (
        "agent.yaml: 'efa' must be true or false; 'user_job': command: required, a non-empty list of "
        "arguments, e.g. [python, train.py]"
    )


def test_the_agent_config_must_be_a_mapping_and_every_problem_is_reported_at_once() -> None:
    assert (
        agent_refusal(["region"])
        == "agent.yaml: expected a YAML mapping at the top level; see docs/internals.md"
    )
    assert agent_refusal({**AGENT, "colour": "red", "bucket": "A", "efa": "x"}) == (
        f"agent.yaml: unknown key 'colour' (known: {', '.join(sorted(AgentConfig.__dataclass_fields__))}); "
        "'bucket' 'A' is not a valid S3 bucket name (e.g. 'trainstack-dev-data'); 'efa' must be true or false"
    )
    with pytest.raises(AgentConfigError) as default_source:
        AgentConfig.from_mapping({})
    assert str(default_source.value).startswith("agent config: 'region' is required")


def test_prefixes_are_relative_and_known_and_default_to_the_contracts() -> None:
    assert agent_refusal({**AGENT, "prefixes": {"datta": "d/"}}) == "agent.yaml: unknown key 'prefixes.datta'"
    for bad in ("d", "/d/", 5):
        assert agent_refusal({**AGENT, "prefixes": {"code": bad}}) == (
            "agent.yaml: 'prefixes.code' must be a relative prefix ending in '/', e.g. 'code/'"
        )
    config = AgentConfig.from_mapping({**AGENT, "prefixes": {"code": "c/", "jobs": "j/"}})
    assert (config.prefixes.code, config.prefixes.jobs, config.prefixes.data) == ("c/", "j/", "data/")
    assert AgentConfig.from_mapping(AGENT).prefixes == Prefixes()
    # Every bad prefix is named, whichever comes first.
    assert agent_refusal({**AGENT, "prefixes": {"datta": "d/", "code": "/c/"}}) == (
        "agent.yaml: unknown key 'prefixes.datta'; 'prefixes.code' must be a relative prefix ending in '/', "
        "e.g. 'code/'"
    )
    # Another problem beside good prefixes: reported, and nothing built from them.
    assert (
        agent_refusal({**AGENT, "prefixes": {"code": "c/"}, "efa": 0})
        == "agent.yaml: 'efa' must be true or false"
    )


def test_min_nodes_with_an_unusable_instance_count_is_judged_against_the_largest_group() -> None:
    assert agent_refusal({**AGENT, "instance_count": 0, "min_nodes": 1000}) == (
        "agent.yaml: 'instance_count' must be an integer between 1 and 1000, got 0"
    )
    assert agent_refusal({**AGENT, "instance_count": "2", "min_nodes": 1001}).endswith(
        "'min_nodes' must be an integer between 1 and 1000, got 1001 (a job needs at least one node and "
        "cannot wait for more than the group holds)"
    )
    assert AgentConfig.from_mapping({**AGENT, "min_nodes": 1}).min_nodes == 1  # instance_count defaults to 1
    one_node = (
        "agent.yaml: 'min_nodes' must be an integer between 1 and 1, got 2 (a job needs at least one node "
        "and cannot wait for more than the group holds)"
    )
    assert agent_refusal({**AGENT, "min_nodes": 2}) == one_node
    assert agent_refusal({**AGENT, "instance_count": 1, "min_nodes": 2}) == one_node


def test_the_agent_config_written_by_infra_loads_back_equal(tmp_path: Path) -> None:
    config = AgentConfig.from_mapping(
        {
            **AGENT,
            "stack": "prod",
            "prefixes": {"data": "d/"},
            "instance_count": 3,
            "min_nodes": 2,
            "max_cost_usd": 25.0,
            "job": {"train": {"epochs": 2}},
            "user_job": {"name": "probe", "command": ["python", "train.py"]},
            "job_id": "probe-1a2b3c4d",
            "resume_from": "legacy",
            "bundle_sha256": "ab" * 32,
            "job_role_arn": "arn:aws:iam::123456789012:role/trainstack-prod-job",
            "dataset": "imagenet-small",
            "scratch_dir": None,
            "lifecycle_hook": None,
        }
    )
    path = tmp_path / "agent.yaml"
    path.write_text(config.to_yaml())
    assert AgentConfig.load(path) == config
    # In the order the dataclass declares its keys, for a person reading the file on the instance; `pool` and
    # `lanes` only when not the default pool's (its user data renders as before pools).
    declared = [
        k for k in AgentConfig.__dataclass_fields__ if k not in ("pool", "lanes", "max_concurrent_jobs")
    ]
    assert list(yaml.safe_load(config.to_yaml())) == declared
    pooled = AgentConfig.from_mapping({**AGENT, "pool": "big", "lanes": 3, "max_concurrent_jobs": 4})
    assert list(yaml.safe_load(pooled.to_yaml())) == list(AgentConfig.__dataclass_fields__)
    assert AgentConfig.from_mapping(yaml.safe_load(pooled.to_yaml())) == pooled


def test_an_agent_config_file_that_cannot_be_used_is_one_line_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "absent.yaml"
    with pytest.raises(AgentConfigError) as unreadable:
        AgentConfig.load(missing)
    assert str(unreadable.value) == (
        f"{missing}: cannot read the agent config (No such file or directory); pass --config FILE"
    )
    broken = tmp_path / "broken.yaml"
    broken.write_text("region: [us-east-1\n")
    with pytest.raises(AgentConfigError) as invalid:
        AgentConfig.load(broken)
    # YAML's own first line says what it was reading when it failed.
    assert str(invalid.value) == f"{broken}: not valid YAML (while parsing a flow sequence)"
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("# réglages\nregion: us-east-1\n".encode("latin-1"))
    with pytest.raises(AgentConfigError) as not_text:
        AgentConfig.load(latin)
    assert str(not_text.value) == (
        f"{latin}: cannot read the agent config (not UTF-8 text, byte 3: invalid continuation byte); pass "
        "--config FILE"
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**AGENT, "region": "nowhere"}))
    with pytest.raises(AgentConfigError) as refused:
        AgentConfig.load(bad)
    assert str(refused.value) == f"{bad}: 'region' 'nowhere' is not an AWS region (e.g. 'us-east-1')"


SSH_FIX = fix("sshIngressCidrs", "'[\"203.0.113.7/32\"]'")
SSH_REFUSED = "and is refused; use SSM Session Manager (no open port) or your own address"


def test_ssh_opened_wider_than_the_internets_share_is_named_as_written_in_one_line() -> None:
    four = '["1.0.0.0/8", "2.0.0.0/8", "3.0.0.0/8", "4.0.0.0/8"]'
    assert problems({"sshIngressCidrs": four}) == [
        f"{NAMESPACE}:sshIngressCidrs: '1.0.0.0/8', '2.0.0.0/8', '3.0.0.0/8', ... together open SSH to more "
        f"than an IPv4 /8, i.e. the internet {SSH_REFUSED}" + SSH_FIX
    ]
    three = '["1.0.0.0/8", "2.0.0.0/8", "3.0.0.0/8"]'
    assert problems({"sshIngressCidrs": three}) == [
        f"{NAMESPACE}:sshIngressCidrs: '1.0.0.0/8', '2.0.0.0/8', '3.0.0.0/8' together open SSH to more than "
        f"an IPv4 /8, i.e. the internet {SSH_REFUSED}" + SSH_FIX
    ]
    both = '["0.0.0.0/0", "2001:db8::/31"]'
    assert problems({"sshIngressCidrs": both}) == [
        f"{NAMESPACE}:sshIngressCidrs: '0.0.0.0/0' opens SSH to the whole internet {SSH_REFUSED}" + SSH_FIX,
        f"{NAMESPACE}:sshIngressCidrs: '2001:db8::/31' opens SSH to more than an IPv6 /32, i.e. the internet "
        f"{SSH_REFUSED}" + SSH_FIX,
    ]
    assert problems({"sshIngressCidrs": '["2001:db8::/32", "10.0.0.0/8"]'}) == []
    assert problems({"sshIngressCidrs": '["10.0.0.1/8"]'}) == [
        f"{NAMESPACE}:sshIngressCidrs: '10.0.0.1/8' is not a CIDR (host bits must be zero)" + SSH_FIX
    ]


# Every key given a value of the wrong type (as `pulumi config set --path` or a hand-edited stack file can):
# its one line, and the value its fix suggests.
WRONG_TYPE = {
    "vpcId": (5, "must be a string, got 5", "vpc-0123456789abcdef0"),
    "subnetIds": (
        5,
        "must be a list of strings, got 5",
        '\'["subnet-0123456789abcdef0","subnet-0fedcba9876543210"]\'',
    ),
    "createVpcEndpoints": ("x", "must be true or false, got 'x'", "false"),
    "instanceTypes": (5, "must be a list of strings, got 5", '\'["g6.xlarge","g5.xlarge"]\''),
    "instanceCount": ("x", "must be an integer, got 'x'", "1"),
    "minNodes": ("x", "must be an integer, got 'x'", "1"),
    "spotAllocationStrategy": (5, "must be a string, got 5", "price-capacity-optimized"),
    "onDemandBaseCapacity": ("x", "must be an integer, got 'x'", "0"),
    "onDemandPercentageAboveBase": ("x", "must be an integer, got 'x'", "0"),
    "spotMaxPrice": (5, "must be a string, got 5", "0.50"),
    "amiParameter": (5, "must be a string, got 5", DEFAULT_AMI_PARAMETER),
    "amiId": (5, "must be a string, got 5", "ami-0123456789abcdef0"),
    "rootVolumeSizeGb": ("x", "must be an integer, got 'x'", "150"),
    "vpcCidr": (5, "must be a string, got 5", "10.42.0.0/16"),
    "privateSubnets": ("x", "must be true or false, got 'x'", "false"),
    "sshIngressCidrs": (5, "must be a list of strings, got 5", "'[\"203.0.113.7/32\"]'"),
    "alertEmail": (5, "must be a string, got 5", "ml-team@example.com"),
    "monthlyBudgetUsd": ("x", "must be an integer, got 'x'", "100"),
    "retainDataOnDestroy": ("x", "must be true or false, got 'x'", "true"),
    "noncurrentVersionDays": ("x", "must be an integer, got 'x'", "30"),
    "logRetentionDays": ("x", "must be an integer, got 'x'", "30"),
    "flowLogRetentionDays": ("x", "must be an integer, got 'x'", "365"),
    "trainingConfig": (5, "must be a string, got 5", "training/configs/default.yaml"),
    "job": (5, "must be a string, got 5", "examples/charlm/job.yaml"),
    "maxCostUsd": (5, "must be a string, got 5", "25"),
    "maxConsecutiveFailures": ("x", "must be an integer, got 'x'", "3"),
    "stallTimeoutMinutes": ("x", "must be an integer, got 'x'", "30"),
    "spotFallbackMinutes": ("x", "must be an integer, got 'x'", "15"),
    "expectedHours": (5, "must be a string, got 5", "24"),
    "placementStrategy": (5, "must be a string, got 5", "cluster"),
    "resumeFrom": (5, "must be a string, got 5", "default-1a2b3c4d"),
    "drill": ("x", "must be true or false, got 'x'", "true"),
    "networkIsolation": ("x", "must be true or false, got 'x'", "true"),
    "devBox": ("x", "must be true or false, got 'x'", "true"),
    "maxConcurrentJobs": ("x", "must be an integer, got 'x'", "4"),
}


def test_every_key_is_in_the_wrong_type_table() -> None:
    assert sorted(WRONG_TYPE) == sorted(DEFAULTS)


@pytest.mark.parametrize("key", list(WRONG_TYPE))
def test_a_value_of_the_wrong_type_is_one_line_whose_suggested_value_is_accepted(
    key: str, instance_wheels: Path
) -> None:
    bad, why, example = WRONG_TYPE[key]
    assert problems({key: bad}) == [f"{NAMESPACE}:{key}: {why}" + fix(key, example)]
    # The fix as the shell hands it to Pulumi, with the isolated stack's wheels in place: accepted. (The
    # example job ships in examples/, which `make mutate`'s copy of the packages does not hold.)
    (value,) = shlex.split(example)
    if key != "job" or (REPO_ROOT / value).is_file():
        # vpcId and subnetIds are set together: each one's fix is accepted beside its partner.
        partner = {
            "vpcId": {"subnetIds": '["subnet-0123456789abcdef0"]'},
            "subnetIds": {"vpcId": "vpc-0123456789abcdef0"},
        }
        assert problems({key: value, **partner.get(key, {})}) == []


def test_a_pinned_ami_and_a_custom_ami_parameter_are_one_too_many() -> None:
    assert problems({"amiId": "ami-0123456789abcdef0", "amiParameter": "/my/ami"}) == [
        f"{NAMESPACE}:amiId: both a pinned amiId and a custom amiParameter are set; keep one "
        f"(or `pulumi config rm {NAMESPACE}:amiParameter`)" + fix("amiId", "''")
    ]


def test_no_instance_type_is_refused_with_the_default_list_to_paste() -> None:
    assert problems({"instanceTypes": "[]"}) == [
        f"{NAMESPACE}:instanceTypes: is empty; the group needs at least one NVIDIA GPU instance type"
        + fix("instanceTypes", TYPES)
    ]


def test_the_trainers_problems_name_a_config_in_the_repository_as_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import infra.config.jobs

    monkeypatch.setattr(infra.config.jobs, "REPO_ROOT", tmp_path)  # where the job files are read
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "bad.yaml").write_text("train: {lr: 0}\n")
    assert problems({"trainingConfig": "configs/bad.yaml"}) == [
        f"{NAMESPACE}:trainingConfig: configs/bad.yaml: train.lr: must be positive, got 0"
    ]


# -- trainstack:pools' own lines, word for word (the config mutation run found them unread) -----------------


def test_each_pool_refusal_is_its_exact_line() -> None:
    from tests.infra.test_pools import GOOD
    from tests.infra.test_pools import _problems as pool_problems

    fix = "(e.g. `pulumi config set --path 'trainstack:pools[0].name' "
    assert pool_problems([{**GOOD, "name": "big-gpu"}]) == [
        "trainstack:pools[0].name: 'big-gpu' has the word gpu in it: its group trainstack-dev-gpu-big-gpu "
        "could be another stack's group, which this stack's instances could then scale; name the pool "
        "without it " + fix + "big`)"
    ]
    assert pool_problems([{**GOOD, "name": "Big"}]) == [
        "trainstack:pools[0].name: 'Big' is not a pool name: 1 to 16 lowercase letters, digits and dashes, "
        "starting with a letter and not ending with a dash (it becomes part of the group's and its "
        "resources' names) " + fix + "big`)"
    ]
    # Cut to its room (4 characters: "abc-"), the fix drops the dash a name may not end with.
    assert pool_problems([{**GOOD, "name": "abc-defghijklmn"}], stack="a-very-long-stack-name-her") == [
        "trainstack:pools[0].name: 'abc-defghijklmn' makes the pool's AWS names too long "
        "('trainstack-a-very-long-stack-name-her-capacity-abc-defghijklmn-group-events' is 75 characters, "
        "AWS allows 64); use a name of at most 4 characters " + fix + "abc`)"
    ]
    assert pool_problems([{**GOOD, "maxJob": 2}]) == [
        "trainstack:pools[0].maxJob: unknown key, did you mean 'maxJobs'? (remove it with `pulumi config rm "
        "--path 'trainstack:pools[0].maxJob'`)"
    ]
    assert pool_problems([{**GOOD, "zzzz": 2}]) == [
        "trainstack:pools[0].zzzz: unknown key, a pool's keys: name, instanceTypes, maxInstances, minNodes, "
        "spotAllocationStrategy, onDemandBaseCapacity, onDemandPercentageAboveBase, spotMaxPrice, "
        "spotFallbackMinutes, placementGroup, maxJobs (remove it with `pulumi config rm --path "
        "'trainstack:pools[0].zzzz'`)"
    ]
    for key, value in (("minNodes", "2"), ("spotFallbackMinutes", "5")):
        assert pool_problems([GOOD], **{key: value}) == [
            f"trainstack:pools: replaces the single group's keys, and trainstack:{key} is set too; keep one: "
            f"the pools (set each pool's own value in trainstack:pools, then `pulumi config rm "
            f"trainstack:{key}`), or the single group (`pulumi config rm trainstack:pools`)"
        ]


def test_pools_set_to_nothing_are_the_single_group_and_a_pools_own_settings_are_kept() -> None:
    from tests.infra.test_pools import GOOD
    from tests.infra.test_pools import _parse as parse_pools

    for nothing in ("[]", " [] ", ""):
        assert parse_pools(nothing).declared_pools == (), nothing
        # No pools: the single group's keys are the stack's pool, set beside an empty trainstack:pools.
        single = parse_pools(nothing, instanceTypes='["g6e.xlarge"]')
        assert single.instance_types == ("g6e.xlarge",) and single.declared_pools == (), nothing
    multi = {"name": "multi", "instanceTypes": ["g6.12xlarge"], "maxInstances": 2, "minNodes": 2}
    config = parse_pools([GOOD, multi])
    assert [pool.min_nodes for pool in config.pools] == [1, 2]
    assert config.placement_strategy == "", "the first pool asks for no placement group"
    assert parse_pools([{**GOOD, "placementGroup": True}]).placement_strategy == "cluster"


# -- an existing VPC's ids (vpcId, subnetIds, createVpcEndpoints): their shapes, before any lookup ----------

_VPC = "vpc-0123456789abcdef0"
_SUBNETS = ("subnet-0123456789abcdef0", "subnet-0fedcba9876543210")
_SUBNETS_EXAMPLE = (
    '`pulumi config set trainstack:subnetIds \'["subnet-0123456789abcdef0","subnet-0fedcba9876543210"]\'`'
)


def _vpc_problems(vpc_id: str, subnet_ids: tuple[str, ...], create_endpoints: bool = False) -> list[str]:
    from infra.config.network import check_existing_vpc
    from infra.config.values import Problems

    problems = Problems()
    check_existing_vpc(vpc_id, subnet_ids, create_endpoints, problems)
    return problems.lines


@pytest.mark.parametrize(
    "vpc_id, subnet_ids, create_endpoints",
    [
        (_VPC, _SUBNETS, True),
        (_VPC, _SUBNETS, False),
        ("vpc-01234567", ("subnet-01234567",), False),  # the older 8-digit ids
        ("", (), False),
    ],
)
def test_an_existing_vpcs_well_formed_ids_pass(
    vpc_id: str, subnet_ids: tuple[str, ...], create_endpoints: bool
) -> None:
    assert _vpc_problems(vpc_id, subnet_ids, create_endpoints) == []


def test_each_malformed_or_missing_vpc_id_is_its_own_line_with_an_example() -> None:
    assert _vpc_problems("vpc-xyz", ("subnet-1", "subnet-0123456789abcdef")) == [
        "trainstack:vpcId: 'vpc-xyz' is not a VPC id (e.g. `pulumi config set trainstack:vpcId "
        "vpc-0123456789abcdef0`)",
        f"trainstack:subnetIds: 'subnet-1' is not a subnet id (e.g. {_SUBNETS_EXAMPLE})",
        f"trainstack:subnetIds: 'subnet-0123456789abcdef' is not a subnet id (e.g. {_SUBNETS_EXAMPLE})",
    ]
    assert _vpc_problems(_VPC, (_SUBNETS[1], _SUBNETS[0], _SUBNETS[1], _SUBNETS[0])) == [
        f"trainstack:subnetIds: {_SUBNETS[0]}, {_SUBNETS[1]} listed more than once (e.g. {_SUBNETS_EXAMPLE})"
    ]
    assert _vpc_problems(_VPC, ()) == [
        f"trainstack:subnetIds: vpcId {_VPC} is set: list the private subnets of it to use "
        f"(e.g. {_SUBNETS_EXAMPLE})"
    ]
    assert _vpc_problems("", _SUBNETS) == [
        "trainstack:vpcId: subnetIds is set: name the VPC they belong to (or remove subnetIds) (e.g. "
        "`pulumi config set trainstack:vpcId vpc-0123456789abcdef0`)"
    ]
    assert _vpc_problems("", (), True) == [
        "trainstack:createVpcEndpoints: only applies to an existing VPC (vpcId); the stack's own VPC always "
        "has its endpoints (e.g. `pulumi config set trainstack:createVpcEndpoints false`)"
    ]


def test_an_existing_vpcs_keys_reach_the_stack_config_and_are_checked_there() -> None:
    config = _parse(vpcId=_VPC, subnetIds=json.dumps(list(_SUBNETS)), createVpcEndpoints="true")
    assert (config.vpc_id, config.subnet_ids, config.create_vpc_endpoints) == (_VPC, _SUBNETS, True)
    _refused("createVpcEndpoints", "only applies to an existing VPC", createVpcEndpoints="true")


# -- trainstack:measuredThroughput: the stack's and each pool's measured figures ---------------------------


def test_measured_throughput_reaches_the_stack_and_each_pool_gets_its_own_types() -> None:
    measured = {"g6.xlarge": 410, "g4dn.xlarge": "100.5"}
    single = _parse(measuredThroughput=json.dumps(measured))
    assert dict(single.measured_throughput) == {"g6.xlarge": 410.0, "g4dn.xlarge": 100.5}
    assert [dict(pool.measured_throughput) for pool in single.pools] == [
        {"g6.xlarge": 410.0, "g4dn.xlarge": 100.5}
    ]
    pools = [
        {"name": "default", "instanceTypes": ["g6.xlarge", "g5.xlarge"], "maxInstances": 1},
        {"name": "old", "instanceTypes": ["g4dn.xlarge"], "maxInstances": 1, "spotFallbackMinutes": 7},
    ]
    declared = _parse(pools=json.dumps(pools), measuredThroughput=json.dumps(measured))
    assert [dict(pool.measured_throughput) for pool in declared.pools] == [
        {"g6.xlarge": 410.0},
        {"g4dn.xlarge": 100.5},
    ]
    assert _parse().measured_throughput == () and _parse().pools[0].measured_throughput == ()


def test_a_measured_type_no_pool_offers_is_refused_unless_the_pools_themselves_are() -> None:
    message = _refused(
        'measuredThroughput["p5.48xlarge"]',
        "not an instance type of any pool",
        measuredThroughput='{"p5.48xlarge": 9}',
    )
    assert "the pools offer g4dn.xlarge, g5.xlarge, g6.xlarge, g6e.xlarge" in message
    pools = [{"name": "default", "instanceTypes": ["g5.xlarge"], "maxInstances": 1}]
    message = _refused(
        'measuredThroughput["p4d.24xlarge"]',
        "not an instance type",
        pools=json.dumps(pools),
        measuredThroughput='{"p4d.24xlarge": 9}',
    )
    assert "the pools offer g5.xlarge" in message
    # Pools refused for their own reasons: the types they would offer are unknown, so no type is judged.
    with pytest.raises(StackConfigError) as refused:
        _parse(pools='[{"name": "default"}]', measuredThroughput='{"p5.48xlarge": 9}')
    assert "measuredThroughput" not in str(refused.value)
    _refused(
        'measuredThroughput["g6.xlarge"]', "must be a positive number", measuredThroughput='{"g6.xlarge": -1}'
    )


def test_with_pools_the_stacks_spot_fallback_is_the_first_pools() -> None:
    pools = [
        {"name": "default", "instanceTypes": ["g6.xlarge"], "maxInstances": 1, "spotFallbackMinutes": 7},
        {"name": "big", "instanceTypes": ["g6e.12xlarge"], "maxInstances": 2, "spotFallbackMinutes": 3},
    ]
    assert _parse(pools=json.dumps(pools)).spot_fallback_minutes == 7


def test_the_default_job_is_checked_against_every_pool_it_may_start_on(tmp_path: Path) -> None:
    """Until jobs are placed on pools, any pool's agent may take the stack's default job: a user's job (one
    instance) is refused beside a multi-node pool, and the built-in trainer's global batch must split over
    each pool's node counts, each named by the pool's own key."""
    pools = json.dumps(
        [
            {"name": "default", "instanceTypes": ["g6.xlarge"], "maxInstances": 1},
            {"name": "big", "instanceTypes": ["g6e.12xlarge"], "maxInstances": 2},
        ]
    )
    (tmp_path / "job.yaml").write_text("name: mine\ncommand: [python, train.py]\n")
    (tmp_path / "train.py").write_text("")
    (tmp_path / "train.yaml").write_text("train:\n  batch_size: 7\n")
    with pytest.raises(StackConfigError) as user_job:
        _parse(pools=pools, job=str(tmp_path / "job.yaml"))
    assert str(user_job.value).splitlines()[1:] == [
        "  - trainstack:pools[1].maxInstances: 2 nodes with trainstack:job: a user's job runs on one "
        "instance (multi-node runs the built-in trainer, trainstack:trainingConfig); set 1, or a multi-GPU "
        'type for more GPUs (e.g. instanceTypes ["g6.12xlarge"], 4 x L4); until jobs are placed on pools, '
        "any pool may run the stack's default job (e.g. `pulumi config set --path "
        "'trainstack:pools[1].maxInstances' 1`)"
    ]
    with pytest.raises(StackConfigError) as trainer:
        _parse(pools=pools, job="", trainingConfig=str(tmp_path / "train.yaml"))
    assert str(trainer.value).splitlines()[1:] == [
        "  - trainstack:pools[1].minNodes: train.batch_size 7 of trainstack:trainingConfig does not split "
        "over 2 node(s), and the job keeps its global batch whatever the number of nodes "
        "(minNodes..maxInstances = 1..2): use a multiple of 2, or raise minNodes (e.g. `pulumi config set "
        "--path 'trainstack:pools[1].minNodes' 2`)"
    ]

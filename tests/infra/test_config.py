"""Every stack-config mistake is refused with one message that names the key, why, and a valid example."""

from __future__ import annotations

from typing import Any

import pulumi
import pytest

from infra.config import DEFAULT_AMI_PARAMETER, StackConfig, StackConfigError, parse_stack_config
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

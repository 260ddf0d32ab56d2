"""The stack config refuses SSH from the internet however it is written, and keeps flow logs a year."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.config import MAX_INGRESS_ADDRESSES, StackConfig, StackConfigError, parse_stack_config
from policypack.network import MAX_INGRESS_ADDRESSES as PACK_MAX_INGRESS_ADDRESSES
from tests.infra.program import FALLBACK_JOB


def _parse(tmp_path: Path, **raw: Any) -> StackConfig:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(FALLBACK_JOB))
    return parse_stack_config(
        {"trainingConfig": str(job), **raw}, region="us-east-1", project="trainstack", stack="dev"
    )


def _problems(tmp_path: Path, **raw: Any) -> list[str]:
    with pytest.raises(StackConfigError) as error:
        _parse(tmp_path, **raw)
    return str(error.value).splitlines()[1:]


@pytest.mark.parametrize(
    ("cidrs", "said"),
    [
        (["0.0.0.0/0"], "'0.0.0.0/0' opens SSH to the whole internet"),
        (["0.0.0.0/1", "128.0.0.0/1"], "'0.0.0.0/1', '128.0.0.0/1' together open SSH to the whole internet"),
        (["::0/0"], "'::/0' opens SSH to the whole internet"),
        (["2000::/3"], "'2000::/3' opens SSH to more than an IPv6 /32"),
        (["10.0.0.0/8", "11.0.0.0/8"], "together open SSH to more than an IPv4 /8"),
        (["64.0.0.0/2", "203.0.113.7/32"], "together open SSH to more than an IPv4 /8"),
    ],
    ids=["zero", "two-halves", "ipv6-zero-spelled-out", "ipv6-global-unicast", "two-slash-8s", "a-quarter"],
)
def test_ssh_from_more_than_a_slash_8_or_ipv6_slash_32_is_refused_in_one_line(
    tmp_path: Path, cidrs: list[str], said: str
) -> None:
    (problem,) = _problems(tmp_path, sshIngressCidrs=cidrs)
    assert problem.startswith("  - trainstack:sshIngressCidrs: ")
    assert said in problem
    assert "SSM Session Manager" in problem and "pulumi config set trainstack:sshIngressCidrs" in problem


@pytest.mark.parametrize(
    "cidrs",
    [
        [],
        ["203.0.113.7/32"],
        ["10.0.0.0/8"],
        ["198.51.100.0/24", "2001:db8::/32"],
        ["10.0.0.0/9", "10.128.0.0/9"],
    ],
    ids=["none", "one-address", "one-slash-8", "office-and-ipv6-site", "a-slash-8-in-halves"],
)
def test_ssh_from_at_most_a_slash_8_and_an_ipv6_slash_32_is_accepted(
    tmp_path: Path, cidrs: list[str]
) -> None:
    assert _parse(tmp_path, sshIngressCidrs=cidrs).ssh_ingress_cidrs == tuple(cidrs)


def test_config_and_policy_pack_draw_the_internet_at_the_same_size() -> None:
    assert MAX_INGRESS_ADDRESSES == PACK_MAX_INGRESS_ADDRESSES == {4: 2**24, 6: 2**96}


def test_flow_logs_are_kept_a_year_by_default_and_training_logs_a_month(tmp_path: Path) -> None:
    config = _parse(tmp_path)
    assert (config.flow_log_retention_days, config.log_retention_days) == (365, 30)
    assert _parse(tmp_path, flowLogRetentionDays="731").flow_log_retention_days == 731


def test_flow_log_retention_must_be_a_cloudwatch_retention_period(tmp_path: Path) -> None:
    (problem,) = _problems(tmp_path, flowLogRetentionDays=100)
    assert problem.startswith(
        "  - trainstack:flowLogRetentionDays: 100 is not a CloudWatch Logs retention period"
    )
    assert "pulumi config set trainstack:flowLogRetentionDays 365" in problem

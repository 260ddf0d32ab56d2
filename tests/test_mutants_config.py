"""Config validation (infra/config.py, bootstrap/agent_config.py): the promises `make mutate` found
untested. Every bad stack value gets one line naming the key, why, and a `pulumi config set` command, and
that command's value is itself accepted: the fix the error suggests works. Every agent setting out of range
is one line naming the key and its range. Pure: no Pulumi engine, no AWS."""

from __future__ import annotations

import re
import shlex

import pytest

from bootstrap.agent_config import AgentConfig, AgentConfigError
from infra.config import DEFAULTS, NAMESPACE, StackConfig, StackConfigError, parse_stack_config

FIX = re.compile(rf"\(e\.g\. `pulumi config set {NAMESPACE}:(?P<key>\w+) (?P<example>.*)`\)$")
# A value of the wrong type, one below and one above any range a key has.
BAD = ("not-a-number", "-5", "99999")


def parse(raw: dict[str, object]) -> StackConfig:
    # networkIsolation (on by default) needs the instance wheels built (`make wheels`): off unless asked.
    return parse_stack_config(
        {"networkIsolation": "false", **raw}, region="us-east-1", project="trainstack", stack="dev"
    )


def problems(raw: dict[str, object]) -> list[str]:
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

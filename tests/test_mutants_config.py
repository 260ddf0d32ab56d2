"""Stack config validation (infra/config.py): the promises `make mutate` found untested. Every bad value
gets one line naming the key, why, and a `pulumi config set` command, and that command's value is itself
accepted: the fix the error suggests works. Pure: no Pulumi engine, no AWS."""

from __future__ import annotations

import re
import shlex

import pytest

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


@pytest.mark.xfail(
    strict=True,
    raises=ValueError,
    reason="infra/config.py runs the global-batch check on an instanceCount already refused as out of "
    "range: math.lcm(1..99999) cannot even be printed (a traceback, not the problem list; reported)",
)
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

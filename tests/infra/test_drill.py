"""trainstack:drill: off, nothing is declared; on, the FIS experiment template and a role that can interrupt
this stack's instances only, passing the policy pack."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest

from infra import drill
from infra.config import StackConfigError, parse_stack_config
from infra.iam.common import RESOURCE_STAR_REQUIRED
from tests.infra.program import ACCOUNT_ID, REGION, StackRun, example_config, run_stack
from tests.policy.harness import Resource, check

TEMPLATE = "aws:fis/experimentTemplate:ExperimentTemplate"
ROLE = "aws:iam/role:Role"
ROLE_POLICY = "aws:iam/rolePolicy:RolePolicy"
GROUP = "trainstack-dev-gpu"


@pytest.fixture(scope="module")
def drill_stack() -> StackRun:
    return run_stack({**example_config(), "trainstack:drill": True})


def _drill_resources(stack: StackRun) -> list[Any]:
    return [r for r in stack.resources if r.name.startswith("drill") or r.type == TEMPLATE]


def test_drill_off_declares_nothing_and_exports_no_template(example_stack: StackRun) -> None:
    assert _drill_resources(example_stack) == []
    assert "drill_template_id" not in example_stack.outputs


def test_drill_on_declares_the_spot_interruption_template(drill_stack: StackRun) -> None:
    template = drill_stack.one(TEMPLATE)
    assert template.parent == "drill"
    (action,) = template.inputs["actions"]
    assert action["actionId"] == "aws:ec2:send-spot-instance-interruptions"
    assert action["parameters"] == [{"key": "durationBeforeInterruption", "value": "PT2M"}]
    (target,) = template.inputs["targets"]
    assert action["target"] == {"key": "SpotInstances", "value": target["name"]}
    assert target["resourceType"] == "aws:ec2:spot-instance"
    assert target["selectionMode"] == "COUNT(1)"
    assert target["resourceTags"] == [{"key": "Name", "value": GROUP}]
    assert target["filters"] == [{"path": "State.Name", "values": ["running"]}]
    assert template.inputs["stopConditions"] == [{"source": "none"}]
    assert template.inputs["experimentOptions"]["emptyTargetResolutionMode"] == "fail"
    role = next(r for r in drill_stack.of_type(ROLE) if r.parent == "drill")
    assert template.inputs["roleArn"] == f"arn:aws:iam:{REGION}:{ACCOUNT_ID}:{role.name}"
    assert drill_stack.outputs["drill_template_id"] == f"{template.name}-id"


def _instance_tags(stack: StackRun) -> dict[str, str]:
    """The tags every instance of the group carries: the launch template's and the group's propagated ones."""
    (spec,) = [
        s
        for s in stack.one("aws:ec2/launchTemplate:LaunchTemplate").inputs["tagSpecifications"]
        if s["resourceType"] == "instance"
    ]
    group = stack.one("aws:autoscaling/group:Group").inputs["tags"]
    propagated = {t["key"]: t["value"] for t in group if t["propagateAtLaunch"]}
    assert propagated == spec["tags"], "the group and its launch template tag instances alike"
    return dict(spec["tags"])


def test_the_template_selects_and_the_role_interrupts_only_instances_tagged_as_this_stacks(
    drill_stack: StackRun,
) -> None:
    tags = _instance_tags(drill_stack)
    (target,) = drill_stack.one(TEMPLATE).inputs["targets"]
    assert {t["key"]: t["value"] for t in target["resourceTags"]}.items() <= tags.items()
    policy = json.loads(
        next(r for r in drill_stack.of_type(ROLE_POLICY) if r.parent == "drill").inputs["policy"]
    )
    by_sid = {s["Sid"]: s for s in policy["Statement"]}
    interrupt = by_sid["InterruptThisStacksSpotInstances"]
    assert interrupt["Action"] == "ec2:SendSpotInstanceInterruptions"
    assert interrupt["Resource"] == f"arn:aws:ec2:{REGION}:{ACCOUNT_ID}:instance/*"
    required = {
        key.removeprefix("aws:ResourceTag/"): v for key, v in interrupt["Condition"]["StringEquals"].items()
    }
    assert required == {"trainstack:project": "trainstack", "trainstack:stack": "dev", "Name": GROUP}
    assert required.items() <= tags.items(), "the stack's own instances must pass the condition"
    assert by_sid["FindTheTargetInstances"] == {
        "Sid": "FindTheTargetInstances",
        "Effect": "Allow",
        "Action": ["ec2:DescribeInstances"],
        "Resource": "*",
    }
    assert len(by_sid) == 2


def test_only_fis_assumes_the_role_and_only_for_this_accounts_experiments(drill_stack: StackRun) -> None:
    role = next(r for r in drill_stack.of_type(ROLE) if r.parent == "drill")
    (statement,) = json.loads(role.inputs["assumeRolePolicy"])["Statement"]
    assert statement["Principal"] == {"Service": "fis.amazonaws.com"}
    assert statement["Action"] == "sts:AssumeRole"
    assert statement["Condition"] == {
        "StringEquals": {"aws:SourceAccount": ACCOUNT_ID},
        "ArnLike": {"aws:SourceArn": f"arn:aws:fis:{REGION}:{ACCOUNT_ID}:experiment/*"},
    }


def test_star_only_where_aws_takes_no_resource_and_parliament_finds_nothing(drill_stack: StackRun) -> None:
    policy = next(r for r in drill_stack.of_type(ROLE_POLICY) if r.parent == "drill").inputs["policy"]
    for statement in json.loads(policy)["Statement"]:
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        assert not any("*" in action for action in actions)
        if statement["Resource"] == "*":
            assert set(actions) <= RESOURCE_STAR_REQUIRED | drill.RESOURCE_STAR_REQUIRED
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from parliament import analyze_policy_string

    findings = [f.issue for f in analyze_policy_string(policy, include_community_auditors=True).findings]
    assert findings == []


def test_the_stack_with_the_drill_passes_the_policy_pack(drill_stack: StackRun) -> None:
    resources = [Resource(r.type, r.name, {**r.inputs, "id": f"{r.name}-id"}) for r in drill_stack.resources]
    violations = check(resources)
    assert violations == [], "\n".join(f"{v.policy}: {v.message}" for v in violations)


def test_drill_is_a_boolean_key() -> None:
    base = {key.split(":", 1)[1]: v for key, v in example_config().items() if key.startswith("trainstack:")}
    parse = lambda raw: parse_stack_config(raw, region="us-east-1", project="trainstack", stack="dev")  # noqa: E731
    assert parse(base).drill is False
    assert parse({**base, "drill": "true"}).drill is True
    with pytest.raises(StackConfigError, match=r"trainstack:drill: must be true or false"):
        parse({**base, "drill": "yes"})

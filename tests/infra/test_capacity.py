"""Capacity fallback: the declared function, role, log group and rules; its handler against moto."""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import boto3
import pytest
from moto.autoscaling.models import FakeAutoScalingGroup, autoscaling_backends
from moto.core import DEFAULT_ACCOUNT_ID

from demo.stack import STAND_IN_AMI
from infra.capacity import HANDLER, function_code, function_policy, group_arn_pattern
from lambdas.capacity_fallback import handler
from lambdas.capacity_fallback.handler import FALL_BACK, RETURN_TO_SPOT, STAY, Settings
from tests.iam import principals
from tests.iam.plugin import record_as
from tests.iam.principals import CAPACITY_FALLBACK
from tests.iam.requests import Stack
from tests.infra.program import ACCOUNT_ID, RecordedResource, StackRun, example_config, run_stack

FUNCTION = "aws:lambda/function:Function"


def _capacity_functions(stack: StackRun) -> list[RecordedResource]:
    """The capacity functions (the scheduler, infra/scheduler.py, is another function of every stack)."""
    return [f for f in stack.of_type(FUNCTION) if str(f.parent).startswith("capacity")]


RULE = "aws:cloudwatch/eventRule:EventRule"
REGION = "us-east-1"
GROUP = "trainstack-test-gpu"
OTHER_GROUP = "someone-elses-gpu"
T0 = datetime(2026, 12, 1, 8, 0, tzinfo=timezone.utc)


# --- the program --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fallback_off() -> StackRun:
    return run_stack({**example_config(), "trainstack:spotFallbackMinutes": 0})


def test_default_stack_declares_one_fallback_wired_to_its_group(example_stack: StackRun) -> None:
    component = example_stack.one("trainstack:capacity:CapacityFallback")
    (function,) = _capacity_functions(example_stack)
    assert function.parent == component.name
    assert function.inputs["environment"]["variables"] == {
        "GROUP_NAME": "trainstack-dev-gpu",
        "FALLBACK_MINUTES": "15",
        "SPOT_ON_DEMAND_PERCENTAGE": "0",
    }
    assert function.inputs["handler"] == "handler.handler"
    assert function.inputs["runtime"].startswith("python3.")


def test_function_is_invoked_by_its_groups_launch_failures_and_every_five_minutes(
    example_stack: StackRun,
) -> None:
    rules = {r.name: r.inputs for r in example_stack.of_type(RULE) if r.parent == "capacity"}
    assert rules["capacity-schedule"]["scheduleExpression"] == "rate(5 minutes)"
    pattern = json.loads(rules["capacity-group-events"]["eventPattern"])
    assert "EC2 Instance Launch Unsuccessful" in pattern["detail-type"]
    assert pattern["detail"] == {"AutoScalingGroupName": ["trainstack-dev-gpu"]}
    permissions = [
        r for r in example_stack.of_type("aws:lambda/permission:Permission") if r.parent == "capacity"
    ]
    assert {p.inputs["principal"] for p in permissions} == {"events.amazonaws.com"}
    assert len(permissions) == len(rules) == 2
    targets = [
        r for r in example_stack.of_type("aws:cloudwatch/eventTarget:EventTarget") if r.parent == "capacity"
    ]
    assert len(targets) == 2


def test_function_logs_to_its_own_group_encrypted_with_the_stacks_key(example_stack: StackRun) -> None:
    log_groups = {r.parent: r.inputs for r in example_stack.of_type("aws:cloudwatch/logGroup:LogGroup")}
    logs = log_groups["capacity"]
    assert logs["name"] == "/trainstack/dev/capacity-fallback"
    # The stack's key, whose policy lets CloudWatch Logs encrypt log groups under /trainstack/dev.
    assert logs["kmsKeyId"] == log_groups["observability"]["kmsKeyId"]
    assert logs["kmsKeyId"].startswith(f"arn:aws:kms:{REGION}:{ACCOUNT_ID}:key/")
    assert logs["retentionInDays"] == 30
    assert (
        _capacity_functions(example_stack)[0].inputs["loggingConfig"]["logGroup"]
        == "/trainstack/dev/capacity-fallback"
    )


def test_role_may_switch_only_this_group_and_write_only_its_logs(example_stack: StackRun) -> None:
    (policy,) = [r for r in example_stack.of_type("aws:iam/rolePolicy:RolePolicy") if r.parent == "capacity"]
    statements = json.loads(policy.inputs["policy"])["Statement"]
    update = next(s for s in statements if "autoscaling:UpdateAutoScalingGroup" in s["Action"])
    assert update["Resource"].endswith(":autoScalingGroupName/trainstack-dev-gpu")
    for statement in statements:
        actions = [statement["Action"]] if isinstance(statement["Action"], str) else statement["Action"]
        assert not any(a == "*" or a.endswith(":*") for a in actions)
        if statement["Resource"] == "*":
            assert set(actions) <= {
                "autoscaling:DescribeAutoScalingGroups",
                "autoscaling:DescribeScalingActivities",
            }
    logs = next(s for s in statements if "logs:PutLogEvents" in s["Action"])
    assert logs["Resource"].endswith(":log-group:/trainstack/dev/capacity-fallback:*")


def test_fallback_minutes_zero_declares_nothing(fallback_off: StackRun) -> None:
    assert not fallback_off.of_type("trainstack:capacity:CapacityFallback")
    assert not _capacity_functions(fallback_off)


def test_lambda_package_is_its_handler_and_trainstack_job_of_stdlib_and_boto3() -> None:
    # The runtime has the standard library and boto3; trainstack_job (stdlib only) travels in the package,
    # so the handler reads the agent's records through their one definition.
    tree = ast.parse(HANDLER.read_text())
    modules = {
        ((node.module or "") if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
        if not (isinstance(node, ast.ImportFrom) and node.level)
    }
    assert modules - set(sys.stdlib_module_names) == {"boto3", "trainstack_job"}
    packaged = set(function_code(HANDLER).assets)
    assert {
        "handler.py",
        "trainstack_job/records.py",
        "trainstack_job/jobs.py",
        "trainstack_job/contract.py",
    } <= packaged
    assert not any(name.endswith(("lightning.py", "hf.py")) or "__pycache__" in name for name in packaged)


def test_group_arn_pattern_names_the_group() -> None:
    arn = group_arn_pattern(partition="aws", region=REGION, account_id=ACCOUNT_ID, group_name=GROUP)
    document = function_policy(group_arn=arn, log_group_arn="arn:aws:logs:us-east-1:1:log-group:/x")
    assert document["Statement"][1]["Resource"] == (
        f"arn:aws:autoscaling:{REGION}:{ACCOUNT_ID}:autoScalingGroup:*:autoScalingGroupName/{GROUP}"
    )


# --- the handler against moto ---------------------------------------------------------------------------


@dataclass
class Fleet:
    """A moto group with a spot mixed instances policy; its launches are played by the test, as AWS logs them.

    moto has capacity for everything and records no scaling activities, so the test takes instances away
    (no spot capacity) and supplies the activities DescribeScalingActivities would return.
    """

    client: Any
    # The handler's own client: its calls are recorded as the function's role's, for the IAM check.
    function_client: Any
    activities: list[dict[str, Any]] = field(default_factory=list)

    def settings(self, minutes: int = 15, group: str = GROUP) -> Settings:
        return Settings(group_name=group, fallback_minutes=minutes, spot_on_demand_percentage=0)

    def group(self, name: str = GROUP) -> dict[str, Any]:
        return dict(
            self.client.describe_auto_scaling_groups(AutoScalingGroupNames=[name])["AutoScalingGroups"][0]
        )

    def on_demand_percentage(self, name: str = GROUP) -> int:
        distribution = self.group(name)["MixedInstancesPolicy"]["InstancesDistribution"]
        return int(distribution["OnDemandPercentageAboveBaseCapacity"])

    def lose_instances(self, name: str = GROUP) -> None:
        """The spot instance is gone and none replaces it (no spot capacity)."""
        autoscaling_backends[DEFAULT_ACCOUNT_ID][REGION].autoscaling_groups[name].instance_states = []

    def launch(self) -> None:
        """The group gets its instance (moto fills the desired capacity)."""
        self.client.set_desired_capacity(AutoScalingGroupName=GROUP, DesiredCapacity=1)

    def scale_to_zero(self) -> None:
        self.client.set_desired_capacity(AutoScalingGroupName=GROUP, DesiredCapacity=0)

    def launch_attempt(self, at: datetime, *, ok: bool) -> None:
        self.activities.insert(
            0,
            {
                "ActivityId": f"a-{len(self.activities)}",
                "AutoScalingGroupName": GROUP,
                "Description": "Launching a new EC2 instance"
                + (": i-0123" if ok else ".  Status Reason: ..."),
                "Cause": "an instance was started in response to a difference between desired and actual",
                "StartTime": at,
                "StatusCode": "Successful" if ok else "Failed",
                "StatusMessage": ""
                if ok
                else "Could not launch Spot Instances. InsufficientInstanceCapacity",
                "Progress": 100,
            },
        )

    def failures(self, start: datetime, until: datetime, every: timedelta = timedelta(minutes=2)) -> None:
        at = start
        while at <= until:
            self.launch_attempt(at, ok=False)
            at += every

    def tick(
        self, now: datetime, *, settings: Settings | None = None, event: dict[str, Any] | None = None
    ) -> str:
        return handler.run(event or {}, self.function_client, settings or self.settings(), now)["action"]


def _update_as_aws_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """moto replaces a group's whole mixed instances policy on UpdateAutoScalingGroup (and fails on one
    without a launch template); AWS changes only what the request names ("Any parameters that you don't
    specify are not changed"; the launch template "is not required when updating the group")."""
    update = FakeAutoScalingGroup.update

    def merged(self: FakeAutoScalingGroup, *args: Any, **kwargs: Any) -> None:
        policy = kwargs.get("mixed_instances_policy")
        if policy and "LaunchTemplate" not in policy and self.mixed_instances_policy:
            template = dict(self.mixed_instances_policy["LaunchTemplate"])
            # moto keeps the template's id and name, and takes only one of them back.
            spec = template["LaunchTemplateSpecification"]
            template["LaunchTemplateSpecification"] = {
                k: v for k, v in spec.items() if k != "LaunchTemplateName"
            }
            kwargs["mixed_instances_policy"] = {
                **self.mixed_instances_policy,
                **policy,
                "LaunchTemplate": template,
            }
        update(self, *args, **kwargs)

    monkeypatch.setattr(FakeAutoScalingGroup, "update", merged)


@pytest.fixture()
def fleet(aws: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fleet]:
    _update_as_aws_does(monkeypatch)
    ec2 = boto3.client("ec2", region_name=REGION)
    client = boto3.client("autoscaling", region_name=REGION)
    image = STAND_IN_AMI
    subnets = ",".join(s["SubnetId"] for s in ec2.describe_subnets()["Subnets"][:2])
    for name in (GROUP, OTHER_GROUP):
        template = ec2.create_launch_template(LaunchTemplateName=name, LaunchTemplateData={"ImageId": image})
        client.create_auto_scaling_group(
            AutoScalingGroupName=name,
            MinSize=0,
            MaxSize=1,
            DesiredCapacity=1,
            VPCZoneIdentifier=subnets,
            MixedInstancesPolicy={
                "LaunchTemplate": {
                    "LaunchTemplateSpecification": {
                        "LaunchTemplateId": template["LaunchTemplate"]["LaunchTemplateId"],
                        "Version": "1",
                    },
                    "Overrides": [{"InstanceType": "g6.xlarge"}, {"InstanceType": "g5.xlarge"}],
                },
                "InstancesDistribution": {
                    "OnDemandBaseCapacity": 0,
                    "OnDemandPercentageAboveBaseCapacity": 0,
                    "SpotAllocationStrategy": "price-capacity-optimized",
                },
            },
        )
    function_client = record_as(boto3.client("autoscaling", region_name=REGION), CAPACITY_FALLBACK)
    state = Fleet(client, function_client)

    def scaling_activities(params: dict[str, Any], **_: Any) -> Any:
        assert params["body"]["AutoScalingGroupName"] == GROUP, "the handler read another group's activities"
        return _Ok(), {"Activities": list(state.activities)}

    for made in (client, function_client):
        made.meta.events.register("before-call.auto-scaling.DescribeScalingActivities", scaling_activities)
    yield state


class _Ok:
    """The HTTP half of a response botocore takes from a before-call hook."""

    status_code = 200


def test_no_launch_for_fifteen_minutes_while_wanted_switches_to_on_demand(fleet: Fleet) -> None:
    fleet.lose_instances()
    fleet.failures(T0, T0 + timedelta(minutes=14))
    assert fleet.tick(T0 + timedelta(minutes=14, seconds=30)) == STAY
    assert fleet.on_demand_percentage() == 0
    fleet.failures(T0 + timedelta(minutes=15), T0 + timedelta(minutes=15))
    assert fleet.tick(T0 + timedelta(minutes=15, seconds=10)) == FALL_BACK
    assert fleet.on_demand_percentage() == 100
    policy = fleet.group()["MixedInstancesPolicy"]
    assert [o["InstanceType"] for o in policy["LaunchTemplate"]["Overrides"]] == ["g6.xlarge", "g5.xlarge"]
    assert policy["InstancesDistribution"]["SpotAllocationStrategy"] == "price-capacity-optimized"


def test_on_demand_instance_runs_its_life_then_spot_is_tried_first(fleet: Fleet) -> None:
    fleet.lose_instances()
    fleet.failures(T0, T0 + timedelta(minutes=16))
    assert fleet.tick(T0 + timedelta(minutes=16)) == FALL_BACK
    # The on-demand launch is pending: still falling back.
    assert fleet.tick(T0 + timedelta(minutes=17)) == STAY
    fleet.launch()
    fleet.launch_attempt(T0 + timedelta(minutes=18), ok=True)
    for minutes in (20, 60, 600):
        assert fleet.tick(T0 + timedelta(minutes=minutes)) == STAY
        assert fleet.on_demand_percentage() == 100
    # The on-demand life ends (instance gone) while the group still wants one: spot first again.
    fleet.lose_instances()
    assert fleet.tick(T0 + timedelta(minutes=601)) == RETURN_TO_SPOT
    assert fleet.on_demand_percentage() == 0


def test_group_scaled_to_zero_returns_to_spot(fleet: Fleet) -> None:
    fleet.lose_instances()
    fleet.failures(T0, T0 + timedelta(minutes=20))
    assert fleet.tick(T0 + timedelta(minutes=20)) == FALL_BACK
    fleet.launch()
    fleet.launch_attempt(T0 + timedelta(minutes=21), ok=True)
    fleet.scale_to_zero()
    assert fleet.tick(T0 + timedelta(hours=30)) == RETURN_TO_SPOT
    assert fleet.on_demand_percentage() == 0


def test_zero_minutes_never_falls_back(fleet: Fleet) -> None:
    fleet.lose_instances()
    fleet.failures(T0, T0 + timedelta(hours=3))
    assert fleet.tick(T0 + timedelta(hours=3), settings=fleet.settings(minutes=0)) == STAY
    assert fleet.on_demand_percentage() == 0


def test_an_old_drought_does_not_count_after_a_pause(fleet: Fleet) -> None:
    # Failed for 20 min yesterday, then stopped wanting; resumed two minutes ago: the clock starts again.
    fleet.lose_instances()
    fleet.failures(T0 - timedelta(days=1), T0 - timedelta(days=1) + timedelta(minutes=20))
    fleet.failures(T0, T0 + timedelta(minutes=2))
    assert fleet.tick(T0 + timedelta(minutes=2)) == STAY
    assert fleet.on_demand_percentage() == 0


def test_a_group_with_its_instance_is_left_alone(fleet: Fleet) -> None:
    fleet.failures(T0, T0 + timedelta(minutes=30))
    assert fleet.tick(T0 + timedelta(minutes=30)) == STAY
    assert fleet.on_demand_percentage() == 0


def test_never_touches_another_group(fleet: Fleet) -> None:
    fleet.lose_instances(OTHER_GROUP)
    fleet.lose_instances()
    fleet.failures(T0, T0 + timedelta(minutes=30))
    event: dict[str, Any] = {
        "detail-type": "EC2 Instance Launch Unsuccessful",
        "detail": {"AutoScalingGroupName": OTHER_GROUP},
    }
    assert fleet.tick(T0 + timedelta(minutes=30), event=event) == STAY
    assert fleet.on_demand_percentage(OTHER_GROUP) == 0
    assert fleet.on_demand_percentage() == 0
    # Its own group's event acts on its own group only.
    event["detail"]["AutoScalingGroupName"] = GROUP
    assert fleet.tick(T0 + timedelta(minutes=30), event=event) == FALL_BACK
    assert fleet.on_demand_percentage(OTHER_GROUP) == 0


def test_handler_reads_its_settings_from_the_environment(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GROUP_NAME", GROUP)
    monkeypatch.setenv("FALLBACK_MINUTES", "15")
    monkeypatch.setenv("SPOT_ON_DEMAND_PERCENTAGE", "0")
    monkeypatch.setattr(handler.boto3, "client", lambda service: fleet.function_client)
    assert handler.handler({"source": "aws.events", "detail-type": "Scheduled Event"}, None)["action"] == STAY


def test_the_update_names_no_launch_template_so_aws_checks_no_launch_permissions(fleet: Fleet) -> None:
    # AWS checks ec2:RunInstances, iam:PassRole and ec2:CreateTags only when an update names a launch
    # template; the function's role has none of them (tests/iam checks the recorded call against it).
    update = handler.distribution_update(fleet.group(), 100)
    assert update == {
        "InstancesDistribution": {
            **fleet.group()["MixedInstancesPolicy"]["InstancesDistribution"],
            "OnDemandPercentageAboveBaseCapacity": 100,
        }
    }


# --- the IAM check evaluates what the program attaches -----------------------------------------------------


def test_the_iam_check_evaluates_the_documents_the_program_attaches_to_each_role(
    example_stack: StackRun,
) -> None:
    """tests/iam builds each role's policy from infra/iam/ for a stack's ARNs: for the example stack's
    ARNs it must be, statement for statement, what the program attaches to the instance and function roles."""

    class ExampleStack(Stack):
        bucket_arn = "arn:aws:s3:::trainstack-dev-0123456789"
        key_arn = f"arn:aws:kms:{REGION}:{ACCOUNT_ID}:key/1234abcd-12ab-34cd-56ef-1234567890ab"
        topic_arn = f"arn:aws:sns:{REGION}:{ACCOUNT_ID}:trainstack-dev-alerts"
        log_group_arn = f"arn:aws:logs:{REGION}:{ACCOUNT_ID}:log-group:/trainstack/dev"

    stack = ExampleStack("trainstack-dev", REGION, ACCOUNT_ID)
    attached = {
        r.name: json.loads(r.inputs["policy"]) for r in example_stack.of_type("aws:iam/rolePolicy:RolePolicy")
    }
    assert attached["identity-instance-policy"] == principals.instance_policy(stack)
    # The example stack sets no maxCostUsd: its function reads no ledger (tests/infra/test_least_privilege.py
    # checks a capped stack's against the check's default model, which has the cost cap).
    assert attached["capacity-policy"] == principals.capacity_fallback_policy(stack, cost_cap=False)
    # ... and the roles the check names as the callers are the program's roles.
    roles = {r.inputs.get("name") for r in example_stack.of_type("aws:iam/role:Role")}
    for principal in (principals.INSTANCE, principals.CAPACITY_FALLBACK):
        assert principals.caller(principal, stack).arn.rsplit("/", 1)[-1] in roles

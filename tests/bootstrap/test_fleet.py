"""bootstrap/fleet.py against the embedded group: an instance scale-in chose reads as leaving, and one that
leaves for good after a scale-in took it (AWS then refuses the terminate) is not an error."""

from __future__ import annotations

from typing import Any

import pytest
from botocore.exceptions import ClientError

from bootstrap.fleet import Fleet
from demo.stack import LocalStack


class Listing:
    """An autoscaling client that lists one instance in the given lifecycle states (AWS lists an instance
    while it drains; moto drops it at once)."""

    def __init__(self, *states: str) -> None:
        self.states = states

    def describe_auto_scaling_instances(self, InstanceIds: list[str]) -> dict[str, Any]:  # noqa: N803
        return {
            "AutoScalingInstances": [{"InstanceId": InstanceIds[0], "LifecycleState": s} for s in self.states]
        }


@pytest.mark.parametrize(
    ("states", "leaving", "gone"),
    [
        (("InService",), False, False),
        (("Pending",), False, False),
        (("Terminating",), True, False),
        (("Terminating:Wait",), True, False),  # draining: leaving, but it may still confirm and release
        (("Terminating:Proceed",), True, True),
        (("Terminated",), True, True),
        ((), True, True),  # no longer listed
    ],
)
def test_leaving_is_any_terminating_state_and_gone_only_past_the_drain(
    states: tuple[str, ...], leaving: bool, gone: bool
) -> None:
    fleet = Fleet(Listing(*states), "g")
    assert fleet.leaving("i-1") is leaving
    assert fleet.instance_gone("i-1") is gone


def test_an_instance_scaled_in_before_it_leaves_for_good_is_no_error(stack: LocalStack) -> None:
    autoscaling = stack.client("autoscaling")
    autoscaling.update_auto_scaling_group(AutoScalingGroupName=stack.group_name, MaxSize=4, DesiredCapacity=2)
    first, second = stack.instance_ids()[:2]
    fleet = Fleet(autoscaling, stack.group_name)
    assert not fleet.leaving(first) and not fleet.leaving(second)
    fleet.protect(first, True)
    autoscaling.set_desired_capacity(AutoScalingGroupName=stack.group_name, DesiredCapacity=1)
    assert stack.instance_ids() == [first]
    assert fleet.leaving(second)
    # AWS (and the embedded server, taught so) refuses to terminate what the group no longer has.
    with pytest.raises(ClientError, match="No managed instance found for instance ID"):
        autoscaling.terminate_instance_in_auto_scaling_group(
            InstanceId=second, ShouldDecrementDesiredCapacity=True
        )
    fleet.leave_for_good(second)  # it is going already: nothing to do, nothing raised
    assert stack.group()["DesiredCapacity"] == 1, "the capacity came down once, with the scale-in"
    fleet.leave_for_good(first)  # still the group's: it goes, and the group wants one fewer
    assert stack.group()["DesiredCapacity"] == 0 and stack.instance_ids() == []


def test_leaving_for_good_still_fails_when_the_instance_stays() -> None:
    class Refusing(Listing):
        def set_instance_protection(self, **_: Any) -> None:
            raise ClientError({"Error": {"Code": "AccessDenied"}}, "SetInstanceProtection")

    with pytest.raises(ClientError, match="AccessDenied"):
        Fleet(Refusing("InService"), "g").leave_for_good("i-1")


class Recording(Listing):
    """An autoscaling client that records each call with its arguments, as AWS's API names them."""

    def __init__(self, desired: int | None = 1) -> None:
        super().__init__("InService")
        self.desired = desired
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        def call(**kwargs: Any) -> dict[str, Any]:
            self.calls.append((name, kwargs))
            return {}

        return call

    def describe_auto_scaling_groups(self, AutoScalingGroupNames: list[str]) -> dict[str, Any]:  # noqa: N803
        self.calls.append(("describe_auto_scaling_groups", {"AutoScalingGroupNames": AutoScalingGroupNames}))
        found = [] if self.desired is None else [{"DesiredCapacity": str(self.desired)}]
        return {"AutoScalingGroups": found}


def test_each_call_names_this_stacks_group_and_asks_aws_for_exactly_what_it_means() -> None:
    """Billing stops at once (no cooldown), a replacement is asked for without the grace period, a drained
    instance goes on (CONTINUE), protection is set on this instance in this group only."""
    client = Recording(desired=3)
    fleet = Fleet(client, "trainstack-g")
    assert fleet.desired_capacity() == 3
    fleet.scale_to_zero()
    fleet.replace_instance("i-1")
    fleet.complete_lifecycle_action("drain", "i-1")
    fleet.protect("i-1", True)
    fleet.protect("i-1", False)
    assert client.calls == [
        ("describe_auto_scaling_groups", {"AutoScalingGroupNames": ["trainstack-g"]}),
        (
            "set_desired_capacity",
            {"AutoScalingGroupName": "trainstack-g", "DesiredCapacity": 0, "HonorCooldown": False},
        ),
        (
            "set_instance_health",
            {"InstanceId": "i-1", "HealthStatus": "Unhealthy", "ShouldRespectGracePeriod": False},
        ),
        (
            "complete_lifecycle_action",
            {
                "LifecycleHookName": "drain",
                "AutoScalingGroupName": "trainstack-g",
                "InstanceId": "i-1",
                "LifecycleActionResult": "CONTINUE",
            },
        ),
        (
            "set_instance_protection",
            {"InstanceIds": ["i-1"], "AutoScalingGroupName": "trainstack-g", "ProtectedFromScaleIn": True},
        ),
        (
            "set_instance_protection",
            {"InstanceIds": ["i-1"], "AutoScalingGroupName": "trainstack-g", "ProtectedFromScaleIn": False},
        ),
    ]
    assert Fleet(Recording(desired=None), "gone").desired_capacity() is None


@pytest.mark.parametrize(
    ("desired", "instance_count", "decrement"),
    [
        (2, 1, True),  # a second instance of a single-writer job: the group wants one fewer
        (1, 1, False),  # the group's own count: a replacement it launched first must stay
        (0, 1, False),  # scaled to zero already: the terminate alone
        (3, 2, True),
        (2, 2, False),
        (None, 1, False),  # the group is not found: never lower what cannot be read
    ],
)
def test_leaving_lowers_the_capacity_only_above_the_jobs_own_instance_count(
    desired: int | None, instance_count: int, decrement: bool
) -> None:
    client = Recording(desired=desired)
    assert Fleet(client, "g").leave("i-9", instance_count=instance_count) is decrement
    assert client.calls[-1] == (
        "terminate_instance_in_auto_scaling_group",
        {"InstanceId": "i-9", "ShouldDecrementDesiredCapacity": decrement},
    )


def test_an_instance_leaving_while_its_replacement_runs_takes_only_itself(stack: LocalStack) -> None:
    """Capacity rebalancing launches the replacement before it terminates the old instance: at the group's
    own count the old one leaves and the replacement keeps running."""
    autoscaling = stack.client("autoscaling")
    autoscaling.update_auto_scaling_group(AutoScalingGroupName=stack.group_name, MaxSize=2, DesiredCapacity=2)
    old, replacement = stack.instance_ids()[:2]
    fleet = Fleet(autoscaling, stack.group_name)
    assert fleet.leave(old, instance_count=2) is False
    assert stack.group()["DesiredCapacity"] == 2
    assert old not in stack.instance_ids() and replacement in stack.instance_ids()
    assert fleet.leave(replacement, instance_count=1) is True
    assert stack.group()["DesiredCapacity"] == 1


def test_leaving_for_good_takes_the_protection_off_before_the_terminate_and_lowers_the_capacity() -> None:
    """Protection is against scale-in only: off first, so that if the terminate fails the group may still
    take the instance when it scales in."""
    client = Recording(desired=2)
    Fleet(client, "g").leave_for_good("i-1")
    assert client.calls == [
        (
            "set_instance_protection",
            {"InstanceIds": ["i-1"], "AutoScalingGroupName": "g", "ProtectedFromScaleIn": False},
        ),
        (
            "terminate_instance_in_auto_scaling_group",
            {"InstanceId": "i-1", "ShouldDecrementDesiredCapacity": True},
        ),
    ]

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

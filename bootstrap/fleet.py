"""The Auto Scaling group as the agent sees it: scale to zero, report an unhealthy instance."""

from __future__ import annotations

from typing import Any

from trainstack_job.throughput import capacity_units


class Fleet:
    """Calls on this stack's group only (the instance role allows nothing else)."""

    def __init__(self, autoscaling: Any, group_name: str) -> None:
        self._autoscaling = autoscaling
        self.group_name = group_name

    def desired_capacity(self) -> int | None:
        groups = self._autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[self.group_name])
        found = groups.get("AutoScalingGroups", [])
        return int(found[0]["DesiredCapacity"]) if found else None

    def scale_to_zero(self) -> None:
        """Desired capacity 0: the group terminates its instances and launches none; billing stops."""
        self._autoscaling.set_desired_capacity(
            AutoScalingGroupName=self.group_name, DesiredCapacity=0, HonorCooldown=False
        )

    def replace_instance(self, instance_id: str) -> None:
        """Mark this instance unhealthy so that the group replaces it (desired capacity unchanged)."""
        self._autoscaling.set_instance_health(
            InstanceId=instance_id, HealthStatus="Unhealthy", ShouldRespectGracePeriod=False
        )

    def complete_lifecycle_action(self, hook_name: str, instance_id: str) -> None:
        """Let a terminating instance go as soon as its work is saved, not at the hook's heartbeat timeout."""
        self._autoscaling.complete_lifecycle_action(
            LifecycleHookName=hook_name,
            AutoScalingGroupName=self.group_name,
            InstanceId=instance_id,
            LifecycleActionResult="CONTINUE",
        )

    def leave(self, instance_id: str, *, instance_count: int) -> bool:
        """Terminate this instance through its group, which stops its bill; returns whether the desired
        capacity was lowered.

        The group's count decides: above `instance_count` (a manual scale-up, a second instance for a
        single-writer job) the capacity goes down with it; at `instance_count` it stays, because the group
        already holds one more instance than it wants (capacity rebalancing launched the replacement before
        terminating this one) and lowering it would take the replacement too.
        """
        desired = self.desired_capacity()
        # Desired capacity counts the group's units; a weighted pool's unit is one instance (infra/fleet.py).
        decrement = desired is not None and desired > capacity_units(instance_count)
        self._autoscaling.terminate_instance_in_auto_scaling_group(
            InstanceId=instance_id, ShouldDecrementDesiredCapacity=decrement
        )
        return decrement

    def protect(self, instance_id: str, protected: bool) -> None:
        """Scale-in protection of this instance (a pool running several jobs at once): while it serves a job,
        a lower desired capacity takes an idle instance, never this one (AWS's own scale-in protection)."""
        self._autoscaling.set_instance_protection(
            InstanceIds=[instance_id], AutoScalingGroupName=self.group_name, ProtectedFromScaleIn=protected
        )

    def leave_for_good(self, instance_id: str) -> None:
        """This instance goes, and the group wants one instance fewer (a pool running several jobs at once:
        the others' instances run on). Its protection comes off first: it protects it from scale-in only.
        Unprotected, a scale-in may take it before the terminate call, which AWS then refuses ("No managed
        instance found"): it is going already, and the capacity came down with it."""
        try:
            self.protect(instance_id, False)
            self._autoscaling.terminate_instance_in_auto_scaling_group(
                InstanceId=instance_id, ShouldDecrementDesiredCapacity=True
            )
        except Exception:
            if not self.leaving(instance_id):
                raise

    def leaving(self, instance_id: str) -> bool:
        """Whether the group is taking this instance away: a `Terminating` state (AWS lists it so while it
        drains), or no longer listed (gone already). Chosen by a scale-in, it must claim no job."""
        found = self._autoscaling.describe_auto_scaling_instances(InstanceIds=[instance_id])
        states = [i.get("LifecycleState", "") for i in found.get("AutoScalingInstances", [])]
        return not states or all(s.startswith("Terminat") for s in states)

    def instance_gone(self, instance_id: str) -> bool:
        """Whether the group no longer has this instance (terminated, or past its drain hook): a lease it
        holds is a dead instance's. Draining (`Terminating:Wait`) is not gone: it may still confirm and
        release. Unknown is not gone either: only a definite answer shortens the wait."""
        found = self._autoscaling.describe_auto_scaling_instances(InstanceIds=[instance_id])
        states = [i.get("LifecycleState", "") for i in found.get("AutoScalingInstances", [])]
        return not states or all(s in ("Terminated", "Terminating:Proceed") for s in states)

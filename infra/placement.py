"""Placement: which Availability Zones offer the chosen GPU types (AZs that offer none would only fail)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pulumi_aws as aws

from infra.config import NAMESPACE, StackConfigError

MIN_ZONES = 2
# Enough spot pools to ride out an interruption wave; more subnets would only spread the VPC's space thin.
MAX_ZONES = 6


def choose_zones(
    instance_types: Sequence[str],
    offerings: Iterable[tuple[str, str]],
    available_zones: Iterable[str],
    region: str,
) -> list[str]:
    """Zones (sorted) that are available and offer at least one chosen type; refuse types offered nowhere."""
    available = set(available_zones)
    zones_by_type: dict[str, set[str]] = {t: set() for t in instance_types}
    for instance_type, zone in offerings:
        if instance_type in zones_by_type and zone in available:
            zones_by_type[instance_type].add(zone)
    nowhere = [t for t, zones in zones_by_type.items() if not zones]
    if nowhere:
        raise StackConfigError(
            f"{NAMESPACE}:instanceTypes: {', '.join(nowhere)} not offered in any Availability Zone of "
            f"{region}; remove {'it' if len(nowhere) == 1 else 'them'} or pick another region "
            "(`trainstack doctor` lists what each zone offers)"
        )
    zones = sorted(set().union(*zones_by_type.values()))
    if len(zones) < MIN_ZONES:
        raise StackConfigError(
            f"{NAMESPACE}:instanceTypes: only {', '.join(zones)} in {region} offers "
            f"{', '.join(instance_types)}; the group needs at least {MIN_ZONES} zones to survive a spot "
            "capacity shortage: add types (e.g. g5.xlarge, g4dn.xlarge) or pick another region"
        )
    return zones[:MAX_ZONES]


def lookup_zones(instance_types: Sequence[str], region: str) -> list[str]:
    """Ask EC2 (at preview and update alike) which of the region's standard zones offer the types."""
    offerings = aws.ec2.get_instance_type_offerings(
        location_type="availability-zone",
        filters=[
            aws.ec2.GetInstanceTypeOfferingsFilterArgs(name="instance-type", values=list(instance_types))
        ],
    )
    # Local and Wavelength zones are opt-in and lack most GPU types and services; keep the standard ones.
    zones = aws.get_availability_zones(
        state="available",
        filters=[aws.GetAvailabilityZonesFilterArgs(name="opt-in-status", values=["opt-in-not-required"])],
    )
    return choose_zones(
        instance_types,
        zip(offerings.instance_types, offerings.locations, strict=True),
        zones.names,
        region,
    )

"""Placement: which Availability Zones offer the chosen GPU types (AZs that offer none would only fail)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pulumi_aws as aws

from infra.config import NAMESPACE, POOLS_KEY, Pool, StackConfigError

MIN_ZONES = 2
# Enough spot pools to ride out an interruption wave; more subnets would only spread the VPC's space thin.
MAX_ZONES = 6


def choose_zones(
    instance_types: Sequence[str],
    offerings: Iterable[tuple[str, str]],
    available_zones: Iterable[str],
    region: str,
    key: str = "instanceTypes",
) -> list[str]:
    """Zones (sorted) that are available and offer at least one chosen type; refuse types offered nowhere.
    `key` names the setting in the error (a pool's is `pools[<index>].instanceTypes`)."""
    available = set(available_zones)
    zones_by_type: dict[str, set[str]] = {t: set() for t in instance_types}
    for instance_type, zone in offerings:
        if instance_type in zones_by_type and zone in available:
            zones_by_type[instance_type].add(zone)
    nowhere = [t for t, zones in zones_by_type.items() if not zones]
    if nowhere:
        raise StackConfigError(
            f"{NAMESPACE}:{key}: {', '.join(nowhere)} not offered in any Availability Zone of "
            f"{region}; remove {'it' if len(nowhere) == 1 else 'them'} or pick another region "
            "(`trainstack doctor` lists what each zone offers)"
        )
    zones = sorted(set().union(*zones_by_type.values()))
    if len(zones) < MIN_ZONES:
        raise StackConfigError(
            f"{NAMESPACE}:{key}: only {', '.join(zones)} in {region} offers "
            f"{', '.join(instance_types)}; the group needs at least {MIN_ZONES} zones to survive a spot "
            "capacity shortage: add types (e.g. g5.xlarge, g4dn.xlarge) or pick another region"
        )
    return zones[:MAX_ZONES]


def lookup_pool_zones(
    pools: Sequence[Pool], region: str, *, declared: bool
) -> tuple[list[str], dict[str, list[str]]]:
    """The stack's zones (the subnets it makes) and each pool's: the zones that offer one of its types.

    The single group's pool (`declared` False) gets exactly `lookup_zones`'s zones. For trainstack:pools the
    stack's zones are the union of the pools' (at most MAX_ZONES, the first in order), and each pool's group
    launches only into its own zones among them."""
    types = list(dict.fromkeys(t for pool in pools for t in pool.instance_types))
    if not declared:
        zones = lookup_zones(types, region)
        return zones, {pool.name: zones for pool in pools}
    offerings, available = _offerings(types)
    by_pool = {
        pool.name: choose_zones(
            pool.instance_types, offerings, available, region, f"{POOLS_KEY}[{index}].instanceTypes"
        )
        for index, pool in enumerate(pools)
    }
    zones = sorted(set().union(*by_pool.values()))[:MAX_ZONES]
    for index, pool in enumerate(pools):
        kept = [zone for zone in by_pool[pool.name] if zone in zones]
        if len(kept) < MIN_ZONES:
            raise StackConfigError(
                f"{NAMESPACE}:{POOLS_KEY}[{index}].instanceTypes: the stack's subnets are in "
                f"{', '.join(zones)} (at most {MAX_ZONES} zones), and only {', '.join(kept) or 'none'} of "
                f"them offer{'s' if len(kept) == 1 else ''} pool {pool.name!r}'s types; give the pools "
                "types offered in the same zones, or pick another region"
            )
        by_pool[pool.name] = kept
    return zones, by_pool


def _offerings(instance_types: Sequence[str]) -> tuple[list[tuple[str, str]], list[str]]:
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
    return list(zip(offerings.instance_types, offerings.locations, strict=True)), list(zones.names)


def lookup_zones(instance_types: Sequence[str], region: str) -> list[str]:
    """Ask EC2 (at preview and update alike) which of the region's standard zones offer the types."""
    offerings, available = _offerings(instance_types)
    return choose_zones(instance_types, offerings, available, region)

"""Which GPU instance types take an Elastic Fabric Adapter (EFA), on how many network cards, and the network
interfaces the launch template gives them: one EFA per network card. Plain data, shared by preview
(infra/config/) and the launch template (infra/fleet.py).

Sources: AWS, "Elastic Fabric Adapter", Supported instance types
(https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa.html#efa-instance-types); "Maximize network bandwidth
on Amazon EC2 instances with multiple network cards" (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/
efa-acc-inst-types.html: P5 and P5e up to 32 network cards and 3,200 Gbps, G6e up to 4 and 400 Gbps); the
archived awsdocs/amazon-ec2-user-guide doc_source/efa.md for the older types; p4d.24xlarge 4 x 100 Gbps:
AWS Compute Blog, "Amazon EC2 P4d instances deep dive". Only the families infra/config/ allows are listed.
Check a type with `aws ec2 describe-instance-types --instance-types TYPE
--query 'InstanceTypes[].NetworkInfo.[MaximumNetworkCards,EfaInfo.MaximumEfaInterfaces]'`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class EfaCards:
    """An EFA type's network cards, whether its extra cards take EFA-only interfaces, a card's line rate."""

    network_cards: int
    # EFA-only (no IP, no ENA: RDMA traffic only, so it needs no address from the subnet): documented for the
    # P5 family, G6e and P6. Elsewhere the extra cards get a full EFA (with ENA and a private IP), which every
    # EFA type takes.
    efa_only: bool = False
    # A card's line rate where the sources above give it (the instance's rate over its cards); None = not
    # recorded here (bench/RESULTS.md's estimate uses only the recorded ones).
    card_gbps: int | None = None


EFA_TYPES: dict[str, EfaCards] = {
    "g4dn.8xlarge": EfaCards(1),
    "g4dn.12xlarge": EfaCards(1),
    "g4dn.16xlarge": EfaCards(1),
    "g4dn.metal": EfaCards(1),
    "g5.8xlarge": EfaCards(1),
    "g5.12xlarge": EfaCards(1),
    "g5.16xlarge": EfaCards(1),
    "g5.24xlarge": EfaCards(1),
    "g5.48xlarge": EfaCards(1, card_gbps=100),
    "g6.8xlarge": EfaCards(1),
    "g6.12xlarge": EfaCards(1),
    "g6.16xlarge": EfaCards(1),
    "g6.24xlarge": EfaCards(1),
    "g6.48xlarge": EfaCards(1),
    "g6e.8xlarge": EfaCards(1),
    "g6e.12xlarge": EfaCards(1),
    "g6e.16xlarge": EfaCards(1),
    # Its second card (if any) is unchecked: one EFA, as before.
    "g6e.24xlarge": EfaCards(1),
    "g6e.48xlarge": EfaCards(4, efa_only=True, card_gbps=100),
    "gr6.8xlarge": EfaCards(1),
    "p3dn.24xlarge": EfaCards(1),
    # EFA-only on p4d is not in the pages above (their p4d examples use full EFAs): full EFAs on all 4.
    "p4d.24xlarge": EfaCards(4, card_gbps=100),
    "p4de.24xlarge": EfaCards(4, card_gbps=100),
    "p5.48xlarge": EfaCards(32, efa_only=True, card_gbps=100),
    "p5e.48xlarge": EfaCards(32, efa_only=True, card_gbps=100),
    # EFAv3: 16 cards of 200 Gbps, the same 3,200 Gbps.
    "p5en.48xlarge": EfaCards(16, efa_only=True, card_gbps=200),
    "p6-b200.48xlarge": EfaCards(8, efa_only=True, card_gbps=400),
}
# Instance type -> the most EFA interfaces it takes (one per network card); what the tables above say.
EFA_INSTANCE_TYPES: dict[str, int] = {name: cards.network_cards for name, cards in EFA_TYPES.items()}
# Families whose every size a multi-node user means to run over EFA: one missing from the table is a gap in
# it (a new size), refused at preview rather than silently run over TCP on one card.
EFA_FAMILIES = frozenset({"p3dn", "p4d", "p4de", "p5", "p5e", "p5en", "p6-b200", "p6-b300"})
TABLE_FIX = (
    "add it to EFA_TYPES in infra/efa.py (network cards: `aws ec2 describe-instance-types --instance-types "
    "{type} --query 'InstanceTypes[].NetworkInfo.MaximumNetworkCards'`) or choose a listed type"
)


@dataclass(frozen=True)
class EfaInterface:
    """One network interface of the launch template."""

    network_card_index: int
    device_index: int
    interface_type: str  # "efa" (EFA with ENA: an IP address) or "efa-only"


class EfaTableError(ValueError):
    """instanceTypes that the table cannot give one set of interfaces; the message is one line."""


def supports_efa(instance_type: str) -> bool:
    return instance_type in EFA_TYPES


def all_support_efa(instance_types: Iterable[str]) -> bool:
    """True when every type takes an EFA: the group has one launch template, shared by all its types."""
    types = list(instance_types)
    return bool(types) and all(supports_efa(t) for t in types)


def unknown_efa_types(instance_types: Iterable[str]) -> list[str]:
    """Types of an EFA family that the table does not list: their network cards are unknown."""
    return [t for t in instance_types if t.split(".", 1)[0] in EFA_FAMILIES and t not in EFA_TYPES]


def efa_interfaces(instance_types: Iterable[str]) -> tuple[EfaInterface, ...]:
    """One EFA per network card, for a group whose types all take EFA.

    As AWS documents for these types: the primary interface (network card 0, device index 0) is an EFA with
    ENA, the instance's IP address; every other card gets one interface at device index 1, EFA-only where the
    type supports it. (AWS's newer page also allows an ENA primary with an EFA-only on card 0 and device
    index 0 on the others; the shape here is the one its P5 and P4d examples use.) The group's one launch
    template serves every type, so they must have the same cards.
    """
    types = list(instance_types)
    unknown = [t for t in types if t not in EFA_TYPES]
    if unknown:
        raise EfaTableError(
            f"{unknown[0]} has no entry in the EFA table (its network cards are unknown); "
            + TABLE_FIX.format(type=unknown[0])
        )
    shapes = {(EFA_TYPES[t].network_cards, EFA_TYPES[t].efa_only) for t in types}
    if len(shapes) > 1:
        listed = ", ".join(f"{t} ({EFA_TYPES[t].network_cards} network cards)" for t in types)
        raise EfaTableError(
            f"{listed} need different EFA interfaces and the group has one launch template; "
            "list types with the same number of network cards"
        )
    ((cards, efa_only),) = shapes
    extra = "efa-only" if efa_only else "efa"
    return (EfaInterface(0, 0, "efa"), *(EfaInterface(card, 1, extra) for card in range(1, cards)))


def efa_bandwidth_gbps(instance_type: str, cards_attached: int | None = None) -> int | None:
    """The EFA line rate of `cards_attached` cards (default: all), None where the rate is unrecorded."""
    entry = EFA_TYPES[instance_type]
    if entry.card_gbps is None:
        return None
    return (cards_attached or entry.network_cards) * entry.card_gbps

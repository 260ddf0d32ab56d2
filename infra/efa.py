"""Which GPU instance types take an Elastic Fabric Adapter (EFA), and how many, as plain data.

Source: AWS, "Elastic Fabric Adapter", Supported instance types
(https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa.html#efa-instance-types) and the "Maximum EFA
interfaces" of each type in the EC2 instance-type specifications; the archived awsdocs/amazon-ec2-user-guide
doc_source/efa.md lists the older ones (g4dn.8xlarge, g4dn.12xlarge, g4dn.metal, g5.48xlarge, p3dn.24xlarge,
p4d.24xlarge). Only the families infra/config.py allows are listed. A region may lack a type; check with
`aws ec2 describe-instance-types --filters Name=network-info.efa-supported,Values=true`.
"""

from __future__ import annotations

from collections.abc import Iterable

# Instance type -> the most EFA interfaces it takes (one per network card).
EFA_INSTANCE_TYPES: dict[str, int] = {
    "g4dn.8xlarge": 1,
    "g4dn.12xlarge": 1,
    "g4dn.16xlarge": 1,
    "g4dn.metal": 1,
    "g5.8xlarge": 1,
    "g5.12xlarge": 1,
    "g5.16xlarge": 1,
    "g5.24xlarge": 1,
    "g5.48xlarge": 1,
    "g6.8xlarge": 1,
    "g6.12xlarge": 1,
    "g6.16xlarge": 1,
    "g6.24xlarge": 1,
    "g6.48xlarge": 1,
    "g6e.8xlarge": 1,
    "g6e.12xlarge": 1,
    "g6e.16xlarge": 1,
    "g6e.24xlarge": 1,
    "g6e.48xlarge": 1,
    "gr6.8xlarge": 1,
    "p3dn.24xlarge": 1,
    "p4d.24xlarge": 4,
    "p4de.24xlarge": 4,
    "p5.48xlarge": 32,
    "p5e.48xlarge": 32,
    "p5en.48xlarge": 16,
    "p6-b200.48xlarge": 8,
}

# The stack attaches one EFA (network card 0, the primary interface). Using every card of a p5 (32) needs one
# interface per NetworkCardIndex, each with device index 1, no public address (AWS assigns none to an instance
# with several interfaces, so public subnets would lose egress: privateSubnets then) and a launch template per
# type, since the group's one template serves every type in instanceTypes.
EFA_INTERFACES_ATTACHED = 1


def supports_efa(instance_type: str) -> bool:
    return instance_type in EFA_INSTANCE_TYPES


def all_support_efa(instance_types: Iterable[str]) -> bool:
    """True when every type takes an EFA: the group has one launch template, shared by all its types."""
    types = list(instance_types)
    return bool(types) and all(supports_efa(t) for t in types)

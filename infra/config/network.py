"""The stack's network keys: the VPC range, SSH ingress, what network isolation needs, and an existing VPC."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from infra import wheels as vendored
from infra.config.values import SUBNET_ID, VPC_ID, Problems
from trainstack_job.jobfile import JobSpec


def check_network_isolation(
    ssh_cidrs: tuple[str, ...],
    user_job: JobSpec | None,
    user_job_dir: Path | None,
    problems: Problems,
) -> None:
    """What cannot work without any route out of the VPC: refused at preview, one line each."""
    if ssh_cidrs:
        problems.add(
            "sshIngressCidrs",
            "no SSH from outside reaches an instance under networkIsolation (the VPC has no internet "
            "gateway); use SSM Session Manager and remove the key",
            "'[]'",
        )
    try:
        vendored.vendored_wheels(vendored.INSTANCE_LOCK, vendored.INSTANCE_WHEELS_DIR)
    except vendored.WheelsError as exc:
        problems.add(
            "networkIsolation",
            f"the instances cannot reach PyPI and {exc}; run `make wheels` (they go to the stack's bucket)",
            "true",
        )
    if user_job is not None and user_job.requirements and user_job_dir is not None:
        requirements = user_job_dir / user_job.requirements
        try:
            vendored.vendored_wheels(requirements, requirements.parent / vendored.JOB_WHEELS_DIR_NAME)
        except vendored.WheelsError as exc:
            problems.add(
                "networkIsolation",
                f"the job's requirements cannot come from PyPI: {exc}; lock them with hashes (pip-compile "
                "--generate-hashes) and vendor them next to it (pip download --require-hashes "
                "--only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d wheels -r "
                f"{user_job.requirements}), or set false",
                "false",
            )


def check_vpc_cidr(cidr: str, problems: Problems) -> None:
    try:
        network = ipaddress.ip_network(cidr)
    except ValueError:
        problems.add("vpcCidr", f"{cidr!r} is not an IPv4 network (host bits must be zero)", "10.42.0.0/16")
        return
    if not isinstance(network, ipaddress.IPv4Network) or not 16 <= network.prefixlen <= 24:
        problems.add(
            "vpcCidr", f"{cidr!r} must be an IPv4 network from /16 to /24 (a VPC's limits)", "10.42.0.0/16"
        )
    elif not network.is_private:
        problems.add("vpcCidr", f"{cidr!r} is not a private (RFC 1918) range", "10.42.0.0/16")


# The most address space SSH may be opened to, all sshIngressCidrs together: one IPv4 /8, one IPv6 /32.
# The policy pack's no-unrestricted-ingress judges every security group by the same numbers (SECURITY.md).
MAX_INGRESS_ADDRESSES = {4: 2**24, 6: 2**96}


def check_ssh_cidrs(cidrs: tuple[str, ...], problems: Problems) -> None:
    example = "'[\"203.0.113.7/32\"]'"
    networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for cidr in cidrs:
        try:
            networks.append(ipaddress.ip_network(cidr))
        except ValueError:
            problems.add("sshIngressCidrs", f"{cidr!r} is not a CIDR (host bits must be zero)", example)
    # Judged by the address space they open together, not by how they are written: ["0.0.0.0/1",
    # "128.0.0.0/1"] is the whole internet, and so is "::0/0".
    unions: dict[int, list[ipaddress.IPv4Network | ipaddress.IPv6Network]] = {
        4: list(ipaddress.collapse_addresses(n for n in networks if isinstance(n, ipaddress.IPv4Network))),
        6: list(ipaddress.collapse_addresses(n for n in networks if isinstance(n, ipaddress.IPv6Network))),
    }
    for (version, union), widest in zip(unions.items(), ("/8", "/32"), strict=True):
        size = sum(network.num_addresses for network in union)
        if size <= MAX_INGRESS_ADDRESSES[version]:
            continue
        written = [str(n) for n in networks if n.version == version]
        subject = ", ".join(repr(cidr) for cidr in written[:3]) + (", ..." if len(written) > 3 else "")
        verb = "opens" if len(written) == 1 else "together open"
        whole = size == 2 ** (32 if version == 4 else 128)
        reach = "the whole internet" if whole else f"more than an IPv{version} {widest}, i.e. the internet"
        problems.add(
            "sshIngressCidrs",
            f"{subject} {verb} SSH to {reach} and is refused; use SSM Session Manager (no open port) "
            "or your own address",
            example,
        )


SUBNET_IDS_EXAMPLE = '\'["subnet-0123456789abcdef0","subnet-0fedcba9876543210"]\''
VPC_ID_EXAMPLE = "vpc-0123456789abcdef0"


def check_existing_vpc(
    vpc_id: str, subnet_ids: tuple[str, ...], create_endpoints: bool, problems: Problems
) -> None:
    """The ids' shapes only; what the VPC and subnets hold is checked against AWS at preview
    (infra/network.py, lookup_existing_network)."""
    if vpc_id and not VPC_ID.match(vpc_id):
        problems.add("vpcId", f"{vpc_id!r} is not a VPC id", VPC_ID_EXAMPLE)
    for subnet in subnet_ids:
        if not SUBNET_ID.match(subnet):
            problems.add("subnetIds", f"{subnet!r} is not a subnet id", SUBNET_IDS_EXAMPLE)
    repeated = sorted({subnet for subnet in subnet_ids if subnet_ids.count(subnet) > 1})
    if repeated:
        problems.add("subnetIds", f"{', '.join(repeated)} listed more than once", SUBNET_IDS_EXAMPLE)
    # Both or neither: subnets alone would land in a VPC the stack did not check; a VPC alone leaves the
    # stack to guess which of its subnets are private.
    if vpc_id and not subnet_ids:
        problems.add(
            "subnetIds", f"vpcId {vpc_id} is set: list the private subnets of it to use", SUBNET_IDS_EXAMPLE
        )
    if subnet_ids and not vpc_id:
        problems.add(
            "vpcId", "subnetIds is set: name the VPC they belong to (or remove subnetIds)", VPC_ID_EXAMPLE
        )
    if create_endpoints and not vpc_id:
        problems.add(
            "createVpcEndpoints",
            "only applies to an existing VPC (vpcId); the stack's own VPC always has its endpoints",
            "false",
        )

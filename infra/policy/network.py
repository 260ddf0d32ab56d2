"""Checks on the network: security groups, the default security group, flow logs, public IPs."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pulumi_policy import PolicyResource, ReportViolation

from . import resource_types as t
from .properties import Unknown, as_bool, as_int, get, is_unknown, items
from .stack import describe, of_type, require_configurer

_ANYWHERE = ("0.0.0.0/0", "::/0")  # sources an ingress rule is refused for
_ALL_PROTOCOLS = ("-1", "all")


def no_unrestricted_ingress(
    resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any]
) -> Iterator[str]:
    """EC2.18 / EC2.19 / CIS 5.2-5.3: ingress from 0.0.0.0/0 or ::/0 is refused.

    Policy config `authorizedPublicPorts` (default none) lists TCP/UDP ports that may stay open to the
    world, the way Security Hub's EC2.18 parameter does, for stacks that do serve the Internet.
    """
    authorized = {int(port) for port in config.get("authorizedPublicPorts", [])}
    if resource_type == t.SECURITY_GROUP:
        rules = items(props, "ingress")
        for index, rule in enumerate([] if isinstance(rules, Unknown) else rules):
            if not is_unknown(rule):
                yield from _open_rule_problems(f"ingress[{index}]", rule, authorized, "protocol")
    elif resource_type == t.SECURITY_GROUP_RULE:
        if get(props, "type") == "ingress":
            yield from _open_rule_problems("the rule", props, authorized, "protocol")
    elif resource_type == t.SECURITY_GROUP_INGRESS_RULE:
        sources = [get(props, "cidrIpv4"), get(props, "cidrIpv6")]
        if any(source in _ANYWHERE for source in sources) and not _ports_authorized(
            props, authorized, "ipProtocol"
        ):
            yield _open_message("the rule", props, "ipProtocol")


def _open_rule_problems(where: str, rule: Any, authorized: set[int], protocol_key: str) -> Iterator[str]:
    sources: list[Any] = []
    for key in ("cidrBlocks", "ipv6CidrBlocks"):
        values = items(rule, key)
        if not isinstance(values, Unknown):
            sources.extend(values)
    if any(source in _ANYWHERE for source in sources) and not _ports_authorized(
        rule, authorized, protocol_key
    ):
        yield _open_message(where, rule, protocol_key)


def _ports_authorized(rule: Any, authorized: set[int], protocol_key: str) -> bool:
    protocol = str(get(rule, protocol_key) or "-1")
    low, high = as_int(get(rule, "fromPort")), as_int(get(rule, "toPort"))
    if is_unknown(get(rule, "fromPort")) or is_unknown(get(rule, "toPort")) or is_unknown(protocol):
        return True
    if protocol in _ALL_PROTOCOLS or low is None or high is None or high - low > 1024:
        return False
    return all(port in authorized for port in range(low, high + 1))


def _open_message(where: str, rule: Any, protocol_key: str) -> str:
    low, high = get(rule, "fromPort"), get(rule, "toPort")
    ports = "all ports" if str(get(rule, protocol_key) or "-1") in _ALL_PROTOCOLS else f"ports {low}-{high}"
    return (
        f"{where} opens {ports} to 0.0.0.0/0 or ::/0, which is refused: use SSM Session Manager, or allow "
        "explicit CIDRs "
        "(or list the port in the policy's authorizedPublicPorts config)"
    )


def default_security_group_closed(
    resources: Sequence[PolicyResource], config: Mapping[str, Any], report: ReportViolation
) -> None:
    """EC2.2: each VPC's default security group is adopted and allows nothing in or out."""
    for group in of_type(resources, [t.DEFAULT_SECURITY_GROUP]):
        for direction in ("ingress", "egress"):
            rules = items(group.props, direction)
            if not isinstance(rules, Unknown) and rules:
                report(
                    f"{describe(group)}: remove every {direction} rule (a default group allows nothing)",
                    group.urn,
                )
    for vpc in of_type(resources, [t.VPC]):
        require_configurer(
            resources,
            vpc,
            [t.DEFAULT_SECURITY_GROUP],
            "vpcId",
            problem=lambda _group: None,
            missing=(
                "adopt its default security group with aws.ec2.DefaultSecurityGroup(vpc_id=...) and no "
                "ingress or egress rules (left alone it allows all traffic between its members and out)"
            ),
            report=report,
        )


def vpc_flow_logs_enabled(
    resources: Sequence[PolicyResource], config: Mapping[str, Any], report: ReportViolation
) -> None:
    """EC2.6: every VPC has a flow log that records at least rejected traffic."""

    def problem(flow_log: PolicyResource) -> str | None:
        traffic = get(flow_log.props, "trafficType")
        if is_unknown(traffic) or traffic in ("ALL", "REJECT"):
            return None
        return f'set trafficType = "ALL" or "REJECT" on {describe(flow_log)} (it is {traffic})'

    for vpc in of_type(resources, [t.VPC]):
        require_configurer(
            resources,
            vpc,
            [t.FLOW_LOG],
            "vpcId",
            problem=problem,
            missing='add an aws.ec2.FlowLog with vpc_id=<this VPC> and traffic_type="ALL"',
            report=report,
        )


def no_public_ip_with_private_networking(
    resources: Sequence[PolicyResource], config: Mapping[str, Any], report: ReportViolation
) -> None:
    """EC2.9 / EC2.25: once egress goes through a NAT gateway, instances get no public IPv4 address.

    A stack without a NAT gateway has chosen public subnets (the cheap default), where instances need a
    public address for egress; it still has no inbound path, which no_unrestricted_ingress enforces.
    """
    if not of_type(resources, [t.NAT_GATEWAY]):
        return
    for template in of_type(resources, [t.LAUNCH_TEMPLATE]):
        interfaces = items(template.props, "networkInterfaces")
        for index, interface in enumerate([] if isinstance(interfaces, Unknown) else interfaces):
            if as_bool(get(interface, "associatePublicIpAddress")) is True:
                report(
                    f"{describe(template)}: set networkInterfaces[{index}].associatePublicIpAddress = "
                    '"false" '
                    "(the stack routes egress through a NAT gateway)",
                    template.urn,
                )
    for resource in of_type(resources, [t.INSTANCE, t.LAUNCH_CONFIGURATION]):
        if as_bool(get(resource.props, "associatePublicIpAddress")) is True:
            report(
                f"{describe(resource)}: set associatePublicIpAddress = false "
                "(the stack routes egress through a NAT gateway)",
                resource.urn,
            )

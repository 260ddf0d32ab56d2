"""Checks on the network: security groups, the default security group, flow logs, public IPs."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from pulumi_policy import PolicyResource, ReportViolation

from . import resource_types as t
from .documents import UnreadableDocumentError, statements
from .patterns import has_wildcard, literal_prefix
from .properties import Unknown, as_bool, as_int, get, is_unknown, items
from .stack import Reference, describe, of_type, refers_to, require_configurer

_ALL_PROTOCOLS = ("-1", "all")

# How much address space an ingress rule may open before it counts as "the internet" (EC2.18/EC2.19).
# Judged on the union of a resource's ingress sources, so 0.0.0.0/1 + 128.0.0.0/1 is the internet too.
# IPv4: at most one /8 (16.7 M addresses), the largest block any single organisation was ever assigned;
# an office, VPN or CI egress range is /16 or smaller. IPv6: at most one /32, a regional registry's
# minimum allocation to a whole ISP; a site gets a /48. infra/config/ refuses sshIngressCidrs the same way.
MAX_INGRESS_ADDRESSES = {4: 2**24, 6: 2**96}
_WIDEST = {4: "/8", 6: "/32"}
_IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# CloudWatch.16's default: flow logs are the record of who tried to reach what, kept a year.
FLOW_LOG_MINIMUM_RETENTION_DAYS = 365


def no_unrestricted_ingress(
    resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any]
) -> Iterator[str]:
    """EC2.18 / EC2.19 / CIS 5.2-5.3: ingress from the internet (more than a /8 or an IPv6 /32) is refused,
    and so is ingress from another security group; a self-referencing rule (members of the same group, e.g.
    the nodes of one multi-node job) passes.

    Policy config `authorizedPublicPorts` (default none) lists TCP/UDP ports that may stay open to the
    world, the way Security Hub's EC2.18 parameter does, for stacks that do serve the Internet.
    """
    authorized = {int(port) for port in config.get("authorizedPublicPorts", [])}
    lists = {str(pl) for pl in config.get("authorizedPrefixListIds", [])}
    if resource_type == t.SECURITY_GROUP:
        rules = items(props, "ingress")
        known = [] if isinstance(rules, Unknown) else rules
        for index, rule in enumerate(known):
            if not is_unknown(rule):
                yield from _other_group_problems(f"ingress[{index}]", _inline_source_groups(rule))
                if not _ports_authorized(rule, authorized, "protocol"):
                    yield from _prefix_list_problems(
                        f"ingress[{index}]", rule, "prefixListIds", "protocol", lists
                    )
        open_rules = [
            (f"ingress[{index}]", rule)
            for index, rule in enumerate(known)
            if not is_unknown(rule) and not _ports_authorized(rule, authorized, "protocol")
        ]
        yield from _wide_ingress_problems(open_rules, "protocol", _rule_sources)
    elif resource_type == t.SECURITY_GROUP_RULE:
        if get(props, "type") != "ingress":
            return
        yield from _other_group_problems("the rule", _rule_source_groups(props, "sourceSecurityGroupId"))
        if not _ports_authorized(props, authorized, "protocol"):
            yield from _wide_ingress_problems([("the rule", props)], "protocol", _rule_sources)
            yield from _prefix_list_problems("the rule", props, "prefixListIds", "protocol", lists)
    elif resource_type == t.SECURITY_GROUP_INGRESS_RULE:
        yield from _other_group_problems("the rule", _rule_source_groups(props, "referencedSecurityGroupId"))
        if not _ports_authorized(props, authorized, "ipProtocol"):
            yield from _wide_ingress_problems([("the rule", props)], "ipProtocol", _ingress_rule_sources)
            yield from _prefix_list_problems("the rule", props, "prefixListId", "ipProtocol", lists)


def _prefix_list_problems(
    where: str, rule: Any, key: str, protocol_key: str, authorized: set[str]
) -> Iterator[str]:
    """A prefix list's addresses are not in the rule (an AWS-managed list, CloudFront's say, spans much of
    the internet): ingress from one passes only when the pack config lists it as reviewed."""
    values = items(rule, key)
    for prefix_list in [] if isinstance(values, Unknown) else values:
        if isinstance(prefix_list, str) and not is_unknown(prefix_list) and prefix_list not in authorized:
            yield (
                f"{where} admits prefix list {prefix_list} on {_ports(rule, protocol_key)}, whose addresses "
                "this pack cannot judge: allow narrow CIDRs or use SSM Session Manager (or list the prefix "
                "list in the policy's authorizedPrefixListIds once reviewed)"
            )


def _inline_source_groups(rule: Any) -> list[str]:
    """Groups an inline rule admits besides its own (`self: true` names the group itself, not listed here)."""
    groups = items(rule, "securityGroups")
    if isinstance(groups, Unknown):
        return []
    return [group for group in groups if isinstance(group, str) and not is_unknown(group)]


def _rule_source_groups(props: Any, source_key: str) -> list[str]:
    """The source group of a separate rule resource, unless it is the rule's own group (or not known yet)."""
    source = get(props, source_key)
    if not isinstance(source, str) or not source or is_unknown(source):
        return []
    own = get(props, "securityGroupId")
    return [] if is_unknown(own) or source == own else [source]


def _other_group_problems(where: str, groups: list[str]) -> Iterator[str]:
    """Only members of the group itself may come in: another group's members are other workloads."""
    for group in groups:
        yield (
            f"{where} admits security group {group}, not only this group's own members: allow peers with a "
            "self-referencing rule (self = true) and reach instances with SSM Session Manager"
        )


def _rule_sources(rule: Any) -> list[Any]:
    sources: list[Any] = []
    for key in ("cidrBlocks", "ipv6CidrBlocks"):
        values = items(rule, key)
        if not isinstance(values, Unknown):
            sources.extend(values)
    return sources


def _ingress_rule_sources(rule: Any) -> list[Any]:
    return [get(rule, "cidrIpv4"), get(rule, "cidrIpv6")]


def _networks(sources: list[Any]) -> list[_IpNetwork]:
    """The known, well-formed CIDRs among `sources` (AWS itself rejects malformed ones)."""
    networks: list[_IpNetwork] = []
    for source in sources:
        if isinstance(source, str) and not is_unknown(source):
            try:
                networks.append(ipaddress.ip_network(source.strip(), strict=False))
            except ValueError:
                continue
    return networks


def wide_address_space(networks: list[_IpNetwork]) -> str | None:
    """What `networks` together open, when that is more than MAX_INGRESS_ADDRESSES; None when narrower."""
    unions: dict[int, list[_IpNetwork]] = {
        4: list(ipaddress.collapse_addresses(n for n in networks if isinstance(n, ipaddress.IPv4Network))),
        6: list(ipaddress.collapse_addresses(n for n in networks if isinstance(n, ipaddress.IPv6Network))),
    }
    for version, union in unions.items():
        size = sum(network.num_addresses for network in union)
        if size > MAX_INGRESS_ADDRESSES[version]:
            shown = ", ".join(str(network) for network in union[:3]) + (", ..." if len(union) > 3 else "")
            share = size / 2 ** (32 if version == 4 else 128)
            return shown if share == 1 else f"{shown} ({share:.0%} of all IPv{version} addresses)"
    return None


def _wide_ingress_problems(
    open_rules: list[tuple[str, Any]], protocol_key: str, sources: Callable[[Any], list[Any]]
) -> Iterator[str]:
    """One line per rule that alone opens too much; one line for rules that do so only together."""
    narrow: list[tuple[str, Any]] = []
    for where, rule in open_rules:
        wide = wide_address_space(_networks(sources(rule)))
        if wide:
            yield _open_message(where, _ports(rule, protocol_key), wide)
        else:
            narrow.append((where, rule))
    together = wide_address_space([n for _, rule in narrow for n in _networks(sources(rule))])
    if together and len(narrow) > 1:
        wheres = " and ".join(where for where, _ in narrow)
        yield _open_message(f"{wheres} together", "their ports", together, verb="open")


def _ports_authorized(rule: Any, authorized: set[int], protocol_key: str) -> bool:
    protocol = str(get(rule, protocol_key) or "-1")
    low, high = as_int(get(rule, "fromPort")), as_int(get(rule, "toPort"))
    if is_unknown(get(rule, "fromPort")) or is_unknown(get(rule, "toPort")) or is_unknown(protocol):
        return True
    if protocol in _ALL_PROTOCOLS or low is None or high is None or high - low > 1024:
        return False
    return all(port in authorized for port in range(low, high + 1))


def _ports(rule: Any, protocol_key: str) -> str:
    if str(get(rule, protocol_key) or "-1") in _ALL_PROTOCOLS:
        return "all ports"
    return f"ports {get(rule, 'fromPort')}-{get(rule, 'toPort')}"


def _open_message(where: str, ports: str, wide: str, verb: str = "opens") -> str:
    return (
        f"{where} {verb} {ports} to {wide}, more than an IPv4 /8 or IPv6 /32, which counts as the internet "
        "and is refused: use SSM Session Manager, or allow narrower CIDRs "
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


def vpc_flow_logs_retained(
    resources: Sequence[PolicyResource], config: Mapping[str, Any], report: ReportViolation
) -> None:
    """CloudWatch.16: a log group receiving VPC flow logs keeps them a year (the control's default).

    Policy config `minimumRetentionDays` (default 365) sets the floor. Training logs are judged by
    log-group-retained-and-encrypted's own, lower floor; flow logs delivered to S3 are not judged here.
    """
    minimum = int(config.get("minimumRetentionDays", FLOW_LOG_MINIMUM_RETENTION_DAYS))
    log_groups = of_type(resources, [t.LOG_GROUP])
    for flow_log in of_type(resources, [t.FLOW_LOG]):
        destination_type = get(flow_log.props, "logDestinationType")
        if destination_type not in (None, "cloud-watch-logs"):
            continue
        receivers = [group for group in log_groups if _delivers_to(flow_log, group)]
        destination = get(flow_log.props, "logDestination") or get(flow_log.props, "logGroupName")
        if not receivers and isinstance(destination, str) and not is_unknown(destination):
            report(
                f"{describe(flow_log)}: delivers to {destination}, a log group this stack does not declare "
                "(deleted, or kept elsewhere with no known retention): declare it as an "
                f"aws.cloudwatch.LogGroup with retention_in_days >= {minimum} and kms_key_id",
                flow_log.urn,
            )
        for group in receivers:
            raw = get(group.props, "retentionInDays")
            days = as_int(raw)
            if not is_unknown(raw) and (days is None or days < minimum):
                report(
                    f"{describe(group)}: set retentionInDays to at least {minimum} for the VPC flow logs of "
                    f"{describe(flow_log)} (it is {raw if raw is not None else 'unset'})",
                    group.urn,
                )


def _delivers_to(flow_log: PolicyResource, group: PolicyResource) -> bool:
    """Does the flow log write to this log group (by engine dependency, ARN, or an ARN ending in its name)?"""
    for prop in ("logDestination", "logGroupName"):
        if any(dependency.urn == group.urn for dependency in flow_log.property_dependencies.get(prop, [])):
            return True
        value = get(flow_log.props, prop)
        if not isinstance(value, str) or is_unknown(value):
            continue
        identities = [get(group.props, key) for key in ("arn", "id", "name")]
        if value in [i for i in identities if isinstance(i, str) and not is_unknown(i)]:
            return True
        name = get(group.props, "name")
        by_name = isinstance(name, str) and not is_unknown(name)
        if by_name and value.removesuffix(":*").endswith(f":log-group:{name}"):
            return True
    return False


def no_all_protocol_egress_to_the_internet(
    resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any]
) -> Iterator[str]:
    """CKV_AWS_382: no security group sends every protocol and port to the internet (more than a /8 or an
    IPv6 /32): a compromised process then reaches any service anywhere. Egress names its ports (443)."""
    if resource_type == t.SECURITY_GROUP:
        rules = items(props, "egress")
        known = [] if isinstance(rules, Unknown) else rules
        for index, rule in enumerate(known):
            if not is_unknown(rule) and _all_traffic(rule, "protocol"):
                yield from _egress_problem(f"egress[{index}]", _rule_sources(rule))
    elif resource_type == t.SECURITY_GROUP_RULE:
        if get(props, "type") == "egress" and _all_traffic(props, "protocol"):
            yield from _egress_problem("the rule", _rule_sources(props))
    elif resource_type == t.SECURITY_GROUP_EGRESS_RULE and _all_traffic(props, "ipProtocol"):
        yield from _egress_problem("the rule", _ingress_rule_sources(props))


def _all_traffic(rule: Any, protocol_key: str) -> bool:
    protocol = get(rule, protocol_key)
    if is_unknown(protocol):
        return False
    if str(protocol if protocol is not None else "-1").lower() in _ALL_PROTOCOLS:
        return True
    low, high = as_int(get(rule, "fromPort")), as_int(get(rule, "toPort"))
    return low is not None and high is not None and low <= 1 and high >= 65535


def _egress_problem(where: str, destinations: list[Any]) -> Iterator[str]:
    wide = wide_address_space(_networks(destinations))
    if wide:
        yield (
            f"{where} allows all protocols and ports to {wide}: allow only the ports the instances need "
            "(tcp 443 for AWS APIs and package indexes)"
        )


def s3_endpoint_policy_scoped(
    resources: Sequence[PolicyResource], config: Mapping[str, Any], report: ReportViolation
) -> None:
    """Data perimeter: an S3 VPC endpoint carries a policy that reaches named buckets only.

    Without a policy (AWS's default allows everything) or with `s3:*` on `*`, a compromised process sends
    data through the endpoint to any bucket of any account, out of sight of the security group.
    """
    policies = of_type(resources, [t.VPC_ENDPOINT_POLICY])
    for endpoint in of_type(resources, [t.VPC_ENDPOINT]):
        service = get(endpoint.props, "serviceName")
        if not isinstance(service, str) or is_unknown(service) or not service.endswith(".s3"):
            continue
        documents = [("policy", get(endpoint.props, "policy"))]
        documents += [
            (f"the policy of {describe(p)}", get(p.props, "policy"))
            for p in policies
            if refers_to(p, "vpcEndpointId", endpoint) is not Reference.NO
        ]
        known = [(where, document) for where, document in documents if document is not None]
        if not known:
            report(
                f"{describe(endpoint)}: set a policy allowing the stack's bucket only (without one the "
                "endpoint reaches every bucket of every account)",
                endpoint.urn,
            )
            continue
        for where, document in known:
            for problem in _endpoint_document_problems(document):
                report(f"{describe(endpoint)}: {where} {problem}", endpoint.urn)


def _endpoint_document_problems(document: Any) -> Iterator[str]:
    try:
        parsed = statements(document)
    except UnreadableDocumentError as error:
        yield f"{error}: fix the JSON"
        return
    for index, statement in enumerate(parsed or []):
        if not statement.allows():
            continue
        s3_actions = [a for a in _ENDPOINT_S3_ACTIONS if statement.covers_action(a)]
        if not s3_actions:
            continue
        if statement.not_resources:
            yield f"Statement[{index}] allows S3 with NotResource: name the stack's bucket in Resource"
            continue
        broad = [r for r in statement.resources if not is_unknown(r) and not _names_a_bucket(r)]
        if broad:
            yield (
                f"Statement[{index}] allows {', '.join(s3_actions)} on {broad[0].strip()}, every bucket: "
                "name the stack's bucket (arn:aws:s3:::<bucket> and arn:aws:s3:::<bucket>/*)"
            )


def _names_a_bucket(resource: str) -> bool:
    """A wildcard only after the bucket's name (`arn:aws:s3:::bucket/*`), or none at all."""
    return _NAMED_BUCKET.match(literal_prefix(resource)) is not None or (
        not has_wildcard(resource) and resource.strip().lower().startswith("arn:")
    )


_ENDPOINT_S3_ACTIONS = ("s3:GetObject", "s3:PutObject", "s3:ListBucket")
_NAMED_BUCKET = re.compile(r"^arn:[^:*?]+:s3:::[^/*?]+/", re.IGNORECASE)

"""Checks on what launches instances: launch templates, instances, volumes and Auto Scaling groups."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pulumi_policy import PolicyResource, ReportViolation

from . import resource_types as t
from .keys import is_aws_managed_key
from .properties import Unknown, as_bool, as_int, count, get, is_set, is_unknown, items
from .stack import describe, of_type
from .user_data import decode, find_piped_downloads, sandbox_problems, scan_user_data


def imdsv2_required(resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any]) -> Iterator[str]:
    """EC2.8 / EC2.170 / AutoScaling.3: a token-less IMDSv1 call lets any SSRF read the role's credentials."""
    if _inherits_from_launch_template(resource_type, props):
        return
    endpoint = get(props, "metadataOptions", "httpEndpoint")
    tokens = get(props, "metadataOptions", "httpTokens")
    if is_unknown(tokens) or is_unknown(endpoint) or tokens == "required":
        return
    if endpoint == "disabled":
        # Off today; whoever turns the endpoint on (ModifyInstanceMetadataOptions, a later template version)
        # turns IMDSv1 on with it.
        yield (
            'set metadataOptions.httpTokens = "required" with httpEndpoint "disabled" too: enabling the '
            "endpoint "
            "later would bring IMDSv1 back with it"
        )
    else:
        yield 'set metadataOptions.httpTokens = "required" (IMDSv2 only)'


def imds_hop_limit_one(
    resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any]
) -> Iterator[str]:
    """AutoScaling.4: with a hop limit above 1, containers on the instance can reach IMDS too."""
    if _inherits_from_launch_template(resource_type, props):
        return
    if get(props, "metadataOptions", "httpEndpoint") == "disabled":
        return
    raw = get(props, "metadataOptions", "httpPutResponseHopLimit")
    if is_unknown(raw):
        return
    hops = as_int(raw)
    if hops is None or hops > 1:
        yield f"set metadataOptions.httpPutResponseHopLimit = 1 (it is {raw if raw is not None else 'unset'})"


def ebs_encrypted_with_cmk(
    resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any]
) -> Iterator[str]:
    """EC2.181 / EC2.3: every EBS volume encrypted, with a customer managed KMS key."""
    if resource_type == t.EBS_VOLUME:
        yield from _volume_problems("the volume", props)
    elif resource_type == t.INSTANCE:
        yield from _instance_volume_problems(props)
    elif resource_type == t.LAUNCH_TEMPLATE:
        yield from _launch_template_volume_problems(props)
    elif resource_type == t.LAUNCH_CONFIGURATION:
        for where in ("rootBlockDevice", "ebsBlockDevices"):
            for index, device in enumerate(_known(items(props, where))):
                if as_bool(get(device, "encrypted")) is False or get(device, "encrypted") is None:
                    yield f"set {where}[{index}].encrypted = true (better: a launch template with a KMS key)"


def _launch_template_volume_problems(props: Mapping[str, Any]) -> Iterator[str]:
    mappings = items(props, "blockDeviceMappings")
    if isinstance(mappings, Unknown):
        return
    ebs_mappings = [m for m in _known(mappings) if get(m, "ebs") is not None]
    if not ebs_mappings:
        yield (
            'add blockDeviceMappings for the root volume with ebs.encrypted = "true" and ebs.kmsKeyId '
            "(without one the AMI's unencrypted default applies)"
        )
    for mapping in ebs_mappings:
        device = get(mapping, "deviceName") or "?"
        # pulumi-aws types launch-template ebs.encrypted as a string: "true"/"false".
        yield from _volume_problems(f"blockDeviceMappings[{device}].ebs", get(mapping, "ebs"))


def _instance_volume_problems(props: Mapping[str, Any]) -> Iterator[str]:
    root = get(props, "rootBlockDevice")
    if root is None and get(props, "launchTemplate") is None:
        yield "set rootBlockDevice with encrypted = true and kmsKeyId (the AMI's default may be unencrypted)"
    elif root is not None:
        yield from _volume_problems("rootBlockDevice", root)
    for index, device in enumerate(_known(items(props, "ebsBlockDevices"))):
        yield from _volume_problems(f"ebsBlockDevices[{index}]", device)


def _volume_problems(where: str, volume: Any) -> Iterator[str]:
    if is_unknown(volume):
        return
    encrypted = get(volume, "encrypted")
    if not is_unknown(encrypted) and as_bool(encrypted) is not True:
        yield f"set {where}.encrypted = true"
    elif not is_set(get(volume, "kmsKeyId")) or is_aws_managed_key(get(volume, "kmsKeyId")):
        yield f"set {where}.kmsKeyId to a customer managed KMS key (not the AWS managed aws/ebs key)"


def group_spans_zones_and_types(
    resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any]
) -> Iterator[str]:
    """AutoScaling.2 / AutoScaling.6: spot capacity comes back fastest from several AZs and types.

    A group in a placement group may keep to one zone: a cluster placement group (a multi-node job's nodes
    close together) exists in a single AZ, and its several instance types still spread the spot risk.
    """
    zones = count(props, "availabilityZones")
    subnets = count(props, "vpcZoneIdentifiers")
    one_zone = not isinstance(zones, Unknown) and not isinstance(subnets, Unknown) and max(zones, subnets) < 2
    if one_zone and not is_set(get(props, "placementGroup")):
        yield "give vpcZoneIdentifiers subnets in two or more Availability Zones"
    overrides = items(props, "mixedInstancesPolicy", "launchTemplate", "overrides")
    if isinstance(overrides, Unknown) or any(is_unknown(o) for o in overrides):
        return
    if any(get(o, "instanceRequirements") is not None for o in overrides):
        return  # attribute-based selection always spans several instance types
    types = {get(o, "instanceType") for o in overrides if get(o, "instanceType") is not None}
    if any(is_unknown(value) for value in types):
        return
    if len(types) < 2:
        yield "use mixedInstancesPolicy.launchTemplate.overrides with two or more instance types"


def group_uses_launch_template(
    resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any]
) -> Iterator[str]:
    """AutoScaling.9: launch configurations are deprecated and lack IMDSv2 and mixed-instance features."""
    if resource_type == t.LAUNCH_CONFIGURATION:
        yield "replace the launch configuration with an aws.ec2.LaunchTemplate"
        return
    if is_set(get(props, "launchConfiguration")):
        yield "replace launchConfiguration with launchTemplate or mixedInstancesPolicy.launchTemplate"
        return
    direct = get(props, "launchTemplate")
    mixed = get(props, "mixedInstancesPolicy", "launchTemplate", "launchTemplateSpecification")
    if not is_set(direct) and not is_set(mixed):
        yield "set launchTemplate or mixedInstancesPolicy.launchTemplate.launchTemplateSpecification"


def no_secrets_in_user_data(
    resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any]
) -> Iterator[str]:
    """CKV_AWS_46: user data is readable by every process on the instance and via the EC2 API."""
    # Launch templates take user data base64-encoded; instances and launch configurations take either.
    sources = [("userData", resource_type == t.LAUNCH_TEMPLATE), ("userDataBase64", True)]
    for prop, encoded in sources:
        value = get(props, prop)
        if not isinstance(value, str) or is_unknown(value):
            continue
        # Scanned as written and decoded, so a wrongly (un)encoded value is still read; YAML as parsed values.
        for kind in scan_user_data(value, decode(value, base64_encoded=encoded)):
            yield (
                f"{prop} contains {kind}: read it at boot from SSM Parameter Store or Secrets Manager "
                "(a trainstack job: `secrets:` in job.yaml, `trainstack secrets set NAME`)"
            )


def _inherits_from_launch_template(resource_type: str, props: Mapping[str, Any]) -> bool:
    """An instance launched from a template without its own metadata options gets the template's,
    which this same policy checks on the template."""
    return (
        resource_type == t.INSTANCE
        and get(props, "launchTemplate") is not None
        and get(props, "metadataOptions") is None
    )


def _known(values: list[Any] | Unknown) -> list[Any]:
    if isinstance(values, Unknown):
        return []
    return [value for value in values if not is_unknown(value)]


def groups_launch_declared_templates(
    resources: Sequence[PolicyResource], config: Mapping[str, Any], report: ReportViolation
) -> None:
    """AutoScaling.3 / AutoScaling.4: what a group (or an instance) launches is a launch template of this
    stack, so the IMDS, EBS and user-data rules have judged it. A template made elsewhere (the console,
    another stack, an older version) bypasses all of them; so does a per-type override naming one."""
    templates = of_type(resources, [t.LAUNCH_TEMPLATE])
    declared: set[str] = set()
    for template in templates:
        for key in ("id", "name", "arn"):
            value = get(template.props, key)
            if isinstance(value, str) and not is_unknown(value):
                declared.add(value)
    for launcher in of_type(resources, [t.AUTOSCALING_GROUP, t.INSTANCE]):
        for where, reference in template_references(launcher.props):
            if reference not in declared:
                report(
                    f"{describe(launcher)}: {where} names launch template {reference}, which this stack does "
                    "not declare (so no IMDS, EBS or user-data rule judged it): launch from this stack's "
                    "aws.ec2.LaunchTemplate (launch_template_id=template.id)",
                    launcher.urn,
                )


def template_references(props: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, id or name) of each launch template a group or instance names with a value known now."""
    specifications: list[tuple[str, Any, tuple[str, str]]] = [
        ("launchTemplate", get(props, "launchTemplate"), ("id", "name")),
        (
            "mixedInstancesPolicy.launchTemplate.launchTemplateSpecification",
            get(props, "mixedInstancesPolicy", "launchTemplate", "launchTemplateSpecification"),
            ("launchTemplateId", "launchTemplateName"),
        ),
    ]
    overrides = items(props, "mixedInstancesPolicy", "launchTemplate", "overrides")
    for index, override in enumerate(_known(overrides)):
        specifications.append(
            (
                f"mixedInstancesPolicy.launchTemplate.overrides[{index}].launchTemplateSpecification",
                get(override, "launchTemplateSpecification"),
                ("launchTemplateId", "launchTemplateName"),
            )
        )
    for where, specification, keys in specifications:
        if specification is None or is_unknown(specification):
            continue
        for key in keys:
            value = get(specification, key)
            if isinstance(value, str) and value and not is_unknown(value):
                yield f"{where}.{key}", value


def no_piped_downloads_in_user_data(
    resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any]
) -> Iterator[str]:
    """Boot supply chain: user data never runs what it downloads unseen (`curl | bash`, `wget -O- | sh`,
    `bash <(curl ...)`, `sh -c "$(curl ...)"`): whoever controls that URL, its DNS or its TLS path owns the
    instance, role included, and nothing pins what ran."""
    sources = [("userData", resource_type == t.LAUNCH_TEMPLATE), ("userDataBase64", True)]
    for prop, encoded in sources:
        value = get(props, prop)
        if not isinstance(value, str) or is_unknown(value):
            continue
        text = f"{value}\n{decode(value, base64_encoded=encoded)}"
        for command in find_piped_downloads(text):
            yield (
                f"{prop} runs a download unseen ({command}): download to a file, check its SHA-256, then run "
                "it (or ship it in the hashed bundle)"
            )


def job_sandbox_in_user_data(
    resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any]
) -> Iterator[str]:
    """T10: user data that starts trainstack's agent writes the job sandbox (the job's own user, and the
    owner-matched firewall rule that keeps it from IMDS) and the agent's unit runs it before every start."""
    sources = [("userData", resource_type == t.LAUNCH_TEMPLATE), ("userDataBase64", True)]
    for prop, encoded in sources:
        value = get(props, prop)
        if not isinstance(value, str) or is_unknown(value):
            continue
        for problem in sandbox_problems(decode(value, base64_encoded=encoded)):
            yield f"{prop}: {problem}"

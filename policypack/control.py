"""Building a Pulumi policy from one security control: its IDs, what it checks, and the check itself."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    PolicyComplianceFramework,
    PolicyResource,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    Severity,
    StackValidationArgs,
    StackValidationPolicy,
)
from pulumi_policy.proxy import UNKNOWN_STRING_VALUE, UnknownValueError

from .properties import recording_unknowns
from .stack import short_type

FSBP = PolicyComplianceFramework(
    name="AWS Foundational Security Best Practices",
    version="1.0.0",
    reference="https://docs.aws.amazon.com/securityhub/latest/userguide/fsbp-standard.html",
)

# A resource check gets (resource type, properties, policy config) and yields one line per violation.
ResourceCheck = Callable[[str, Mapping[str, Any], Mapping[str, Any]], Iterator[str]]
# A stack check sees every resource and reports (message, urn) itself: its violations span resources.
StackCheck = Callable[[Sequence[PolicyResource], Mapping[str, Any], ReportViolation], None]


def describe_control(controls: Sequence[str], summary: str) -> str:
    return f"[{', '.join(controls)}] {summary}"


def resource_policy(
    name: str,
    controls: Sequence[str],
    summary: str,
    types: Sequence[str],
    check: ResourceCheck,
    severity: Severity,
    remediation: str,
) -> ResourceValidationPolicy:
    """A mandatory policy that runs `check` on every resource of `types`."""

    def validate(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
        if args.resource_type not in types:
            return
        with recording_unknowns() as unknown_paths:
            messages = list(check(args.resource_type, args.props, args.get_config()))
        for message in messages:
            report_violation(f"{short_type(args.resource_type)} '{args.name}': {message}", None)
        if unknown_paths and not messages:
            # Unknown values pass, and we say so: pulumi-policy turns this into an advisory line
            # "can't run policy ... during preview: ... value at .<path> can't be known during preview".
            # The policy runs again, with every value known, during `pulumi up`.
            raise UnknownValueError(UNKNOWN_STRING_VALUE, unknown_paths[0].split("."))

    return ResourceValidationPolicy(
        name=name,
        description=describe_control(controls, summary),
        validate=validate,
        enforcement_level=EnforcementLevel.MANDATORY,
        severity=severity,
        framework=FSBP,
        tags=list(controls),
        remediation_steps=remediation,
    )


def stack_policy(
    name: str,
    controls: Sequence[str],
    summary: str,
    check: StackCheck,
    severity: Severity,
    remediation: str,
) -> StackValidationPolicy:
    """A mandatory policy that sees the whole stack, for controls that span resources."""

    def validate(args: StackValidationArgs, report_violation: ReportViolation) -> None:
        check(args.resources, args.get_config(), report_violation)

    return StackValidationPolicy(
        name=name,
        description=describe_control(controls, summary),
        validate=validate,
        enforcement_level=EnforcementLevel.MANDATORY,
        severity=severity,
        framework=FSBP,
        tags=list(controls),
        remediation_steps=remediation,
    )

"""Finding which resources in a stack configure which others (a bucket's policy, a VPC's flow log)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pulumi_policy import PolicyResource

from .properties import get, is_unknown

# Properties that identify a resource to the resources that configure it (a bucket is referred to by its
# name, which is also its id; a VPC by its id). Stack validation sees outputs, so `id` is there after `up`.
_IDENTITY_PROPERTIES = ("id", "arn", "bucket", "name")


class Reference(enum.Enum):
    """Whether a property of one resource points at another."""

    YES = "yes"
    NO = "no"
    UNKNOWN = "unknown"


def of_type(resources: Iterable[PolicyResource], types: Sequence[str]) -> list[PolicyResource]:
    return [resource for resource in resources if resource.resource_type in types]


def refers_to(resource: PolicyResource, prop: str, target: PolicyResource) -> Reference:
    """Does `resource.<prop>` point at `target`?

    At preview the IDs are unknown, but the engine records which resources each property depends on;
    after `up` (and under mocks) the values themselves are compared.
    """
    if any(dependency.urn == target.urn for dependency in resource.property_dependencies.get(prop, [])):
        return Reference.YES
    value = get(resource.props, prop)
    if value is None:
        return Reference.NO
    if is_unknown(value):
        return Reference.UNKNOWN
    identities = [get(target.props, key) for key in _IDENTITY_PROPERTIES]
    known = {str(identity) for identity in identities if identity is not None and not is_unknown(identity)}
    # A value known at preview cannot come from a target whose identity is still unknown: that identity
    # only exists after `up`, so a literal here names some other resource.
    return Reference.YES if str(value) in known else Reference.NO


@dataclass(frozen=True)
class Configurers:
    """The resources of some types that configure a target, and whether others might once IDs are known."""

    found: list[PolicyResource]
    maybe: bool


def configurers(
    resources: Iterable[PolicyResource], target: PolicyResource, types: Sequence[str], prop: str
) -> Configurers:
    found: list[PolicyResource] = []
    maybe = False
    for candidate in of_type(resources, types):
        reference = refers_to(candidate, prop, target)
        if reference is Reference.YES:
            found.append(candidate)
        elif reference is Reference.UNKNOWN:
            maybe = True
    return Configurers(found=found, maybe=maybe)


def short_type(resource_type: str) -> str:
    """`aws:s3/bucketPolicy:BucketPolicy` -> `aws.s3.BucketPolicy`, the name a Python user writes."""
    module_and_type = resource_type.split(":")
    if len(module_and_type) != 3:
        return resource_type
    package, module, type_name = module_and_type
    return f"{package}.{module.split('/')[0]}.{type_name}"


def require_configurer(
    resources: Sequence[PolicyResource],
    target: PolicyResource,
    types: Sequence[str],
    prop: str,
    problem: Callable[[PolicyResource], str | None],
    missing: str,
    report: Callable[[str, str | None], None],
) -> None:
    """Report `missing` unless some resource of `types` configures `target` without a `problem`.

    A configurer whose reference is unknown at preview counts as a pass; the check runs again on `up`.
    """
    found = configurers(resources, target, types, prop)
    problems = [problem(candidate) for candidate in found.found]
    if any(message is None for message in problems):
        return
    if problems:
        report(f"{describe(target)}: {problems[0]}", target.urn)
    elif not found.maybe:
        report(f"{describe(target)}: {missing}", target.urn)


def describe(resource: PolicyResource) -> str:
    return f"{short_type(resource.resource_type)} '{resource.name}'"

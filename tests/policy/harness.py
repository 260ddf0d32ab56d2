"""Drives the policy pack's rules the way the Pulumi engine does, and collects what they report."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pulumi_policy import (
    Policy,
    PolicyResource,
    PolicyResourceOptions,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)
from pulumi_policy.policy import PolicyCustomTimeouts
from pulumi_policy.proxy import UnknownValueError, _DictProxy, unknown_checking_proxy

from policypack.rules import POLICIES


@dataclass
class Resource:
    """One resource as the engine hands it to a policy: type token, name and camelCase properties."""

    type: str
    name: str
    props: dict[str, Any]
    # property name -> names of the resources that property's value came from (what preview knows).
    depends_on: dict[str, list[str]] = field(default_factory=dict)

    @property
    def urn(self) -> str:
        return f"urn:pulumi:test::trainstack::{self.type}::{self.name}"


@dataclass(frozen=True)
class Violation:
    policy: str
    message: str
    urn: str | None


def _options() -> PolicyResourceOptions:
    return PolicyResourceOptions(False, [], None, [], PolicyCustomTimeouts(0, 0, 0), [], None)


@dataclass(frozen=True)
class Deferred:
    """A policy that could not fully run at preview: the engine shows it as an advisory line."""

    policy: str
    resource: str
    message: str


@dataclass
class Verdict:
    violations: list[Violation] = field(default_factory=list)
    deferred: list[Deferred] = field(default_factory=list)


def check(
    resources: Sequence[Resource],
    config: Mapping[str, Mapping[str, Any]] | None = None,
    policies: Sequence[Policy] = POLICIES,
) -> list[Violation]:
    """Every violation every policy reports on these resources (resource policies, then stack policies)."""
    return evaluate(resources, config, policies).violations


def evaluate(
    resources: Sequence[Resource],
    config: Mapping[str, Mapping[str, Any]] | None = None,
    policies: Sequence[Policy] = POLICIES,
) -> Verdict:
    """Violations, plus the policies deferred to `up` by an unknown value, as the engine records them.

    `policies` defaults to the whole pack; a test passes a smaller pack to show what a missing policy misses.
    """
    config = config or {}
    verdict = Verdict()
    plain = [_plain(resource.props) for resource in resources]
    for policy in policies:

        def report(message: str, urn: str | None = None, policy_name: str = policy.name) -> None:
            verdict.violations.append(Violation(policy_name, message, urn))

        if isinstance(policy, ResourceValidationPolicy):
            for resource, resource_plain in zip(resources, plain, strict=True):
                args = ResourceValidationArgs(
                    resource.type,
                    _PolicysOwn(resource.props, resource_plain),
                    resource.urn,
                    resource.name,
                    _options(),
                    None,
                    config.get(policy.name),
                )
                try:
                    policy.validate(args, report)
                except UnknownValueError as error:
                    verdict.deferred.append(Deferred(policy.name, resource.name, error.message))
        elif isinstance(policy, StackValidationPolicy):
            resources_as_engine = _policy_resources(resources, plain)
            policy.validate(StackValidationArgs(resources_as_engine, config.get(policy.name)), report)
    return verdict


# Values a policy cannot change in place.
_IMMUTABLE = (str, int, float, bool, type(None))


def _plain(value: Any) -> bool:
    """Whether `value` is made only of dicts, lists and immutable values (JSON data, as the engine sends)."""
    if isinstance(value, dict):
        return all(_plain(item) for item in value.values())
    if isinstance(value, list):
        return all(_plain(item) for item in value)
    return isinstance(value, _IMMUTABLE)


class _PolicysOwn(_DictProxy):
    """The properties as one policy gets them: pulumi-policy's unknown-checking proxy of its own copy, built
    when the policy first reads them.

    The proxy builds every dict and list anew, so for plain data it is the copy: whatever one policy writes
    reaches neither the test's resource nor the next policy. Anything else (a tuple holding a dict, an
    object) is deep-copied first. Most policies look at a resource's type and return: building each
    policy's copy of every resource up front (and deep-copying plain data as well) was most of these tests'
    CPU. The resources do not change while the pack runs, so the copy is the same whenever it is made."""

    def __init__(self, props: dict[str, Any], plain: bool) -> None:  # the proxy's own state comes later
        self._props = props
        self._plain = plain
        self._made: Any = None

    def _own(self) -> Any:
        if self._made is None:
            self._made = unknown_checking_proxy(self._props if self._plain else copy.deepcopy(self._props))
        return self._made

    def __getitem__(self, key: Any) -> Any:
        return self._own()[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._own()[key] = value

    def __len__(self) -> int:
        return len(self._own())

    def __iter__(self) -> Iterator[Any]:
        return iter(self._own())


def _policy_resources(resources: Sequence[Resource], plain: Sequence[bool]) -> list[PolicyResource]:
    by_name: dict[str, PolicyResource] = {}
    for resource, resource_plain in zip(resources, plain, strict=True):
        by_name[resource.name] = PolicyResource(
            resource.type,
            _PolicysOwn(resource.props, resource_plain),
            resource.urn,
            resource.name,
            _options(),
            None,
            None,
            [],
            {},
        )
    for resource in resources:
        policy_resource = by_name[resource.name]
        for prop, names in resource.depends_on.items():
            targets = [by_name[name] for name in names]
            policy_resource.property_dependencies[prop] = targets
            policy_resource.dependencies.extend(targets)
    return list(by_name.values())

"""Drives the policy pack's rules the way the Pulumi engine does, and collects what they report."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
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
from pulumi_policy.proxy import UnknownValueError, unknown_checking_proxy

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
    for policy in policies:

        def report(message: str, urn: str | None = None, policy_name: str = policy.name) -> None:
            verdict.violations.append(Violation(policy_name, message, urn))

        if isinstance(policy, ResourceValidationPolicy):
            for resource in resources:
                args = ResourceValidationArgs(
                    resource.type,
                    unknown_checking_proxy(copy.deepcopy(resource.props)),
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
            resources_as_engine = _policy_resources(resources)
            policy.validate(StackValidationArgs(resources_as_engine, config.get(policy.name)), report)
    return verdict


def _policy_resources(resources: Iterable[Resource]) -> list[PolicyResource]:
    by_name: dict[str, PolicyResource] = {}
    for resource in resources:
        by_name[resource.name] = PolicyResource(
            resource.type,
            unknown_checking_proxy(copy.deepcopy(resource.props)),
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

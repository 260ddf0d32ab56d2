"""The harness gives every policy its own copy of each resource's properties, as the engine does: what one
policy writes reaches neither the test's resources nor the policies after it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pulumi_policy import (
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)
from pulumi_policy.proxy import UNKNOWN_STRING_VALUE

from tests.policy import harness
from tests.policy.harness import Deferred, Resource, evaluate


def _plain() -> dict[str, Any]:
    """JSON data: the proxy's own copy is enough."""
    return {"tags": {"team": "ml"}, "rules": ["tls-only"]}


def _with_a_tuple() -> dict[str, Any]:
    """A tuple holding a dict: the proxy passes the tuple through as it is, so it is deep-copied first."""
    return {**_plain(), "pair": ({"kms": "aws:kms"},)}


def _read_and_scribble(props: Any, seen: list[tuple[str, list[str], str | None]]) -> None:
    pair = props.get("pair")
    seen.append((props["tags"]["team"], list(props["rules"]), pair[0]["kms"] if pair else None))
    props["tags"]["team"] = "changed"
    props["rules"]["__target"].append("added")  # the list behind pulumi-policy's list proxy
    if pair:
        pair[0]["kms"] = "changed"


def test_what_a_policy_writes_reaches_no_other_policy_nor_the_tests_resource() -> None:
    seen: list[tuple[str, list[str], str | None]] = []

    def resource_check(args: ResourceValidationArgs, report: ReportViolation) -> None:
        _read_and_scribble(args.props, seen)

    def stack_check(args: StackValidationArgs, report: ReportViolation) -> None:
        for resource in args.resources:
            _read_and_scribble(resource.props, seen)

    policies = [
        ResourceValidationPolicy("first", "writes to its props", resource_check),
        StackValidationPolicy("whole-stack", "writes to every resource's props", stack_check),
        ResourceValidationPolicy("second", "writes to its props", resource_check),
    ]
    resources = [
        Resource("aws:s3/bucket:Bucket", "data", _plain()),
        Resource("aws:sns/topic:Topic", "alerts", _with_a_tuple()),
    ]
    assert [harness._plain(r.props) for r in resources] == [True, False]  # one of each way to a copy
    verdict = evaluate(resources, policies=policies)
    assert verdict.violations == [] and verdict.deferred == []
    # Each policy, for each resource, read the properties as the test gave them.
    assert seen == [("ml", ["tls-only"], None), ("ml", ["tls-only"], "aws:kms")] * 3
    assert [r.props for r in resources] == [_plain(), _with_a_tuple()]


def test_a_policy_reads_its_properties_as_pulumi_policys_proxy_gives_them() -> None:
    read: list[tuple[Any, ...]] = []

    def reader(args: ResourceValidationArgs, report: ReportViolation) -> None:
        props = args.props
        read.append(
            (isinstance(props, Mapping), len(props), sorted(props), "tags" in props, props.get("none"))
        )
        if props["arn"] == "unused":  # unknown at preview: pulumi-policy raises, the engine defers the policy
            report("never", None)

    resource = Resource("aws:s3/bucket:Bucket", "data", {**_with_a_tuple(), "arn": UNKNOWN_STRING_VALUE})
    verdict = evaluate([resource], policies=[ResourceValidationPolicy("reader", "reads", reader)])
    assert read == [(True, 4, ["arn", "pair", "rules", "tags"], True, None)]
    assert verdict.violations == []
    assert verdict.deferred == [
        Deferred("reader", "data", "string value at .arn can't be known during preview")
    ]

"""The policy pack judges every pool (trainstack:pools): a compliant stack of several pools passes with no
violation, and a second pool weakened in any way the pack checks the single group for is caught, naming that
pool's own template or group."""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.infra.program import example_config, run_stack
from tests.infra.test_pools import POOLS
from tests.policy.harness import Resource, Violation, check
from tests.policy.test_program_passes_pack import _as_engine_sees_it, _explain

SECOND_TEMPLATE = "fleet-big-launch-template"
SECOND_GROUP = "fleet-big-group"


def _pools_stack(**overrides: Any) -> list[Resource]:
    config = {**example_config(), "trainstack:pools": POOLS, **overrides}
    return _as_engine_sees_it(run_stack(config).resources)


@pytest.fixture(scope="module")
def public_pools() -> list[Resource]:
    return _pools_stack()


@pytest.fixture(scope="module")
def private_pools() -> list[Resource]:
    return _pools_stack(**{"trainstack:privateSubnets": True})


def _copy(resources: list[Resource]) -> list[Resource]:
    return copy.deepcopy(resources)


def _named(resources: list[Resource], name: str) -> Resource:
    (found,) = [r for r in resources if r.name == name]
    return found


@pytest.mark.parametrize("stack", ["public_pools", "private_pools"])
def test_a_stack_of_pools_has_zero_violations(stack: str, request: pytest.FixtureRequest) -> None:
    resources: list[Resource] = request.getfixturevalue(stack)
    templates = [r for r in resources if r.type == "aws:ec2/launchTemplate:LaunchTemplate"]
    groups = [r for r in resources if r.type == "aws:autoscaling/group:Group"]
    assert len(templates) == len(groups) == len(POOLS), "every pool reaches the pack"
    violations = check(resources)
    assert violations == [], _explain(violations)


def _user_data(template: Resource, extra: str) -> None:
    text = base64.b64decode(template.props["userData"]).decode()
    template.props["userData"] = base64.b64encode((text + extra).encode()).decode()


def _imdsv1(resources: list[Resource]) -> None:
    template = _named(resources, SECOND_TEMPLATE)
    template.props["metadataOptions"] = {**template.props["metadataOptions"], "httpTokens": "optional"}


def _hop_limit(resources: list[Resource]) -> None:
    template = _named(resources, SECOND_TEMPLATE)
    template.props["metadataOptions"] = {**template.props["metadataOptions"], "httpPutResponseHopLimit": 2}


def _unencrypted_root(resources: list[Resource]) -> None:
    (mapping,) = _named(resources, SECOND_TEMPLATE).props["blockDeviceMappings"]
    mapping["ebs"]["encrypted"] = "false"


def _aws_managed_key(resources: list[Resource]) -> None:
    (mapping,) = _named(resources, SECOND_TEMPLATE).props["blockDeviceMappings"]
    mapping["ebs"]["kmsKeyId"] = "alias/aws/ebs"


def _secret_in_user_data(resources: list[Resource]) -> None:
    _user_data(
        _named(resources, SECOND_TEMPLATE), "\nruncmd:\n- export AWS_ACCESS_KEY_ID=AKIAIOSFODNN7EXAMPLE\n"
    )


def _piped_download(resources: list[Resource]) -> None:
    _user_data(
        _named(resources, SECOND_TEMPLATE), "\nruncmd:\n- curl -fsSL https://example.com/x.sh | bash\n"
    )


def _public_ip(resources: list[Resource]) -> None:
    (interface,) = _named(resources, SECOND_TEMPLATE).props["networkInterfaces"]
    interface["associatePublicIpAddress"] = "true"


def _template_from_elsewhere(resources: list[Resource]) -> None:
    spec = _named(resources, SECOND_GROUP).props["mixedInstancesPolicy"]["launchTemplate"]
    spec["launchTemplateSpecification"]["launchTemplateId"] = "lt-0123456789abcdef0"


def _one_type_one_zone(resources: list[Resource]) -> None:
    group = _named(resources, "fleet-l4-group")
    group.props["mixedInstancesPolicy"]["launchTemplate"]["overrides"] = [{"instanceType": "g6.xlarge"}]
    group.props["vpcZoneIdentifiers"] = group.props["vpcZoneIdentifiers"][:1]


def _every_group_scaled(resources: list[Resource]) -> None:
    """The instance role's group statement by prefix: it would reach any stack's `...-gpu-*` group."""
    policy = _named(resources, "identity-instance-policy")
    document = json.loads(policy.props["policy"])
    for statement in document["Statement"]:
        if statement.get("Sid") == "ScaleOwnGroup":
            statement["Resource"] = (
                "arn:aws:autoscaling:us-east-1:123456789012:autoScalingGroup:*:autoScalingGroupName/trainstack-dev-gpu*"
            )
    policy.props["policy"] = json.dumps(document)


# (how the second pool is weakened, the stack, the policy that catches it, the resource it names)
MUTATIONS: list[tuple[Callable[[list[Resource]], None], str, str, str]] = [
    (_imdsv1, "public_pools", "imdsv2-required", SECOND_TEMPLATE),
    (_hop_limit, "public_pools", "imds-hop-limit-one", SECOND_TEMPLATE),
    (_unencrypted_root, "public_pools", "ebs-encrypted-with-cmk", SECOND_TEMPLATE),
    (_aws_managed_key, "public_pools", "ebs-encrypted-with-cmk", SECOND_TEMPLATE),
    (_secret_in_user_data, "public_pools", "no-secrets-in-user-data", SECOND_TEMPLATE),
    (_piped_download, "public_pools", "no-piped-downloads-in-user-data", SECOND_TEMPLATE),
    (_public_ip, "private_pools", "no-public-ip-with-private-networking", SECOND_TEMPLATE),
    (_template_from_elsewhere, "public_pools", "launch-templates-declared", SECOND_GROUP),
    (_one_type_one_zone, "public_pools", "group-spans-zones-and-types", "fleet-l4-group"),
    (_every_group_scaled, "public_pools", "autoscaling-changes-scoped", "identity-instance-policy"),
]


@pytest.mark.parametrize(
    ("weaken", "stack", "policy", "resource"), MUTATIONS, ids=[m[0].__name__.strip("_") for m in MUTATIONS]
)
def test_a_weakened_pool_other_than_the_first_is_caught(
    weaken: Callable[[list[Resource]], None],
    stack: str,
    policy: str,
    resource: str,
    request: pytest.FixtureRequest,
) -> None:
    resources = _copy(request.getfixturevalue(stack))
    weaken(resources)
    violations: list[Violation] = check(resources)
    assert {v.policy for v in violations} == {policy}, _explain(violations)
    # A resource policy's line names its resource (the engine adds the URN); a stack policy's gives the URN.
    assert all(f" '{resource}': " in v.message for v in violations), _explain(violations)

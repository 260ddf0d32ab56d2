"""The network perimeter (issue 24, part 3): HTTPS-only egress, an S3 endpoint that admits the stack's bucket
only, a bucket that refuses the instances' roles outside that endpoint, and trainstack:networkIsolation."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra import wheels as vendored
from infra.config import StackConfigError, parse_stack_config
from infra.network import INTERFACE_ENDPOINTS, S3_ENDPOINT_BUCKET_ACTIONS
from infra.storage import data_bucket_policy
from tests.infra.program import ACCOUNT_ID, REGION, RecordedResource, StackRun, example_config, run_stack
from tests.policy.harness import Resource, check

SG = "aws:ec2/securityGroup:SecurityGroup"
ENDPOINT = "aws:ec2/vpcEndpoint:VpcEndpoint"
ISOLATED = {"trainstack:networkIsolation": True}


def _fake_vendored(folder: Path) -> tuple[Path, Path]:
    """A lock of one package and its wheel, standing in for `make wheels` (which needs PyPI)."""
    wheels = folder / "wheels"
    wheels.mkdir(parents=True)
    wheel = wheels / "trainstack_probe-1.0-py3-none-any.whl"
    wheel.write_bytes(b"not really a zip: only its sha256 matters here")
    lock = folder / "requirements-instance.lock.txt"
    lock.write_text(
        f"trainstack-probe==1.0 \\\n    --hash=sha256:{hashlib.sha256(wheel.read_bytes()).hexdigest()}\n"
    )
    return lock, wheels


@pytest.fixture(scope="module")
def vendored_wheels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    lock, wheels = _fake_vendored(tmp_path_factory.mktemp("vendored"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vendored, "INSTANCE_LOCK", lock)
        patch.setattr(vendored, "INSTANCE_WHEELS_DIR", wheels)
        yield wheels


@pytest.fixture(scope="module")
def isolated_stack(vendored_wheels: Path) -> StackRun:
    return run_stack({**example_config(), **ISOLATED})


def _named(stack: StackRun, type_token: str, name: str) -> RecordedResource:
    (found,) = [r for r in stack.of_type(type_token) if r.name == name]
    return found


def _as_engine_sees_it(stack: StackRun) -> list[Resource]:
    return [Resource(r.type, r.name, {**r.inputs, "id": f"{r.name}-id"}) for r in stack.resources]


# --- both modes -----------------------------------------------------------------------------------------


def test_egress_is_https_only_port_80_is_gone(example_stack: StackRun, private_stack: StackRun) -> None:
    for stack in (example_stack, private_stack):
        egress = _named(stack, SG, "network-instance-sg").inputs["egress"]
        assert [(rule["protocol"], rule["fromPort"], rule["toPort"]) for rule in egress] == [
            ("tcp", 443, 443)
        ]
        assert egress[0]["cidrBlocks"] == ["0.0.0.0/0"]


def test_the_s3_endpoint_admits_this_stacks_bucket_and_aws_owned_read_only_buckets(
    example_stack: StackRun,
) -> None:
    endpoint = _named(example_stack, ENDPOINT, "network-s3-endpoint").inputs
    policy = json.loads(endpoint["policy"])
    bucket = f"arn:aws:s3:::{example_stack.outputs['bucket_name']}"
    own, aws_owned = policy["Statement"]
    assert own["Resource"] == [bucket, f"{bucket}/*"]
    assert own["Condition"] == {"StringEquals": {"aws:ResourceAccount": ACCOUNT_ID}}
    assert all("*" not in action for action in own["Action"])
    assert aws_owned["Action"] == "s3:GetObject"  # nothing can be written anywhere but the stack's bucket
    assert all(
        r.startswith("arn:aws:s3:::") and r.endswith("/*") and "*" not in r[:-2]
        for r in aws_owned["Resource"]
    )
    assert "arn:aws:s3:::amazon-ssm-us-east-1/*" in aws_owned["Resource"]
    for statement in policy["Statement"]:
        assert statement["Effect"] == "Allow" and "*" not in statement["Resource"]


def test_the_endpoint_allows_every_s3_action_the_program_grants_any_role(example_stack: StackRun) -> None:
    granted: set[str] = set()
    for policy in example_stack.of_type("aws:iam/rolePolicy:RolePolicy"):
        for statement in json.loads(policy.inputs["policy"])["Statement"]:
            actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
            granted |= {a for a in actions if a.startswith("s3:") and statement["Effect"] == "Allow"}
    assert granted, "no role is granted any S3 action: the check would pass vacuously"
    assert granted <= set(S3_ENDPOINT_BUCKET_ACTIONS), sorted(granted - set(S3_ENDPOINT_BUCKET_ACTIONS))


def test_the_bucket_refuses_the_instances_roles_outside_their_endpoint_and_nobody_else(
    example_stack: StackRun,
) -> None:
    policy = json.loads(
        _named(example_stack, "aws:s3/bucketPolicy:BucketPolicy", "storage-policy").inputs["policy"]
    )
    (deny,) = [s for s in policy["Statement"] if s["Sid"] == "DenyInstanceRoleOutsideTheVpcEndpoint"]
    assert deny["Effect"] == "Deny" and deny["Action"] == "s3:*"
    assert deny["Condition"]["StringNotEquals"] == {"aws:SourceVpce": "network-s3-endpoint-id"}
    roles = {r.name: r.inputs for r in example_stack.of_type("aws:iam/role:Role")}
    principals = deny["Condition"]["ArnEquals"]["aws:PrincipalArn"]
    arn = f"arn:aws:iam:{REGION}:{ACCOUNT_ID}"  # what the mocks make of a role's ARN
    assert principals == [f"{arn}:identity-instance-role", f"{arn}:identity-job-role"], principals
    assert {"identity-instance-role", "identity-job-role"} <= set(roles)
    # The TLS and key statements stay as they were.
    assert {s["Sid"] for s in policy["Statement"]} >= {"DenyInsecureTransport", "DenyOtherKmsKeys"}


def test_the_deny_leaves_the_users_cli_and_pulumi_alone() -> None:
    document = data_bucket_policy(
        bucket_arn="arn:aws:s3:::b",
        key_arn="arn:aws:kms:us-east-1:1:key/k",
        instance_endpoint_id="vpce-1",
        instance_principal_arns=["arn:aws:iam::1:role/x-instance"],
    )
    (deny,) = [s for s in document["Statement"] if s["Sid"] == "DenyInstanceRoleOutsideTheVpcEndpoint"]
    # Scoped by principal ARN: a user's or a Lambda's request, from anywhere, is never matched.
    assert set(deny["Condition"]) == {"ArnEquals", "StringNotEquals"}
    assert deny["Condition"]["ArnEquals"]["aws:PrincipalArn"] == ["arn:aws:iam::1:role/x-instance"]


def test_the_default_stack_declares_no_interface_endpoint_and_uploads_no_wheels(
    example_stack: StackRun,
) -> None:
    assert [r.inputs["vpcEndpointType"] for r in example_stack.of_type(ENDPOINT)] == ["Gateway"]
    assert not [
        r for r in example_stack.of_type("aws:s3/bucketObjectv2:BucketObjectv2") if "wheels" in r.name
    ]


# --- networkIsolation -----------------------------------------------------------------------------------


def test_isolation_has_no_route_out_of_the_vpc(isolated_stack: StackRun) -> None:
    for kind in (
        "aws:ec2/internetGateway:InternetGateway",
        "aws:ec2/natGateway:NatGateway",
        "aws:ec2/eip:Eip",
    ):
        assert not isolated_stack.of_type(kind), kind
    (table,) = isolated_stack.of_type("aws:ec2/routeTable:RouteTable")
    assert table.inputs.get("routes", []) == []
    subnets = isolated_stack.of_type("aws:ec2/subnet:Subnet")
    assert subnets and all("private" in s.name and not s.inputs["mapPublicIpOnLaunch"] for s in subnets)
    s3 = _named(isolated_stack, ENDPOINT, "network-s3-endpoint").inputs
    assert s3["routeTableIds"] == [f"{table.name}-id"]
    template = isolated_stack.one("aws:ec2/launchTemplate:LaunchTemplate").inputs
    assert [i.get("associatePublicIpAddress") for i in template["networkInterfaces"]] == ["false"]


def test_isolation_reaches_every_aws_service_through_a_private_dns_interface_endpoint(
    isolated_stack: StackRun,
) -> None:
    interfaces = [r for r in isolated_stack.of_type(ENDPOINT) if r.inputs["vpcEndpointType"] == "Interface"]
    services = {r.inputs["serviceName"].rsplit(".", 1)[1] for r in interfaces}
    assert services == set(INTERFACE_ENDPOINTS)
    assert {"ssm", "ssmmessages", "ec2messages", "logs", "monitoring", "sns", "autoscaling", "ec2", "sts",
            "kms", "secretsmanager"} <= services  # fmt: skip
    for endpoint in interfaces:
        assert endpoint.inputs["privateDnsEnabled"] is True
        assert endpoint.inputs["securityGroupIds"] == ["network-endpoints-sg-id"]
        assert endpoint.inputs["serviceName"].startswith(f"com.amazonaws.{REGION}.")


def test_isolation_lets_only_the_instances_subnets_reach_the_endpoints_and_the_instances_nothing_else(
    isolated_stack: StackRun,
) -> None:
    group = _named(isolated_stack, SG, "network-endpoints-sg").inputs
    cidrs = sorted(s.inputs["cidrBlock"] for s in isolated_stack.of_type("aws:ec2/subnet:Subnet"))
    (ingress,) = group["ingress"]
    assert (ingress["protocol"], ingress["fromPort"], ingress["toPort"]) == ("tcp", 443, 443)
    assert sorted(ingress["cidrBlocks"]) == cidrs
    assert group.get("egress", []) == []
    egress = _named(isolated_stack, SG, "network-instance-sg").inputs["egress"]
    assert all((r["protocol"], r["fromPort"], r["toPort"]) == ("tcp", 443, 443) for r in egress)
    assert not any(r.get("cidrBlocks") or r.get("ipv6CidrBlocks") for r in egress), "no internet egress"
    assert egress[0]["securityGroups"] == ["network-endpoints-sg-id"]
    assert egress[1]["prefixListIds"]  # S3, through its gateway endpoint


def test_isolation_uploads_the_locked_wheels_under_code_wheels(
    isolated_stack: StackRun, vendored_wheels: Path
) -> None:
    objects = [
        r for r in isolated_stack.of_type("aws:s3/bucketObjectv2:BucketObjectv2") if r.parent == "wheels"
    ]
    assert [o.inputs["key"] for o in objects] == [
        f"{vendored.WHEELS_PREFIX}{p.name}" for p in sorted(vendored_wheels.glob("*.whl"))
    ]
    assert vendored.WHEELS_PREFIX == "code/wheels/"


@pytest.mark.parametrize("overrides", [{}, {"trainstack:instanceCount": 2}], ids=["one-node", "multi-node"])
def test_isolated_stacks_pass_the_policy_pack_with_zero_violations(
    vendored_wheels: Path, overrides: dict[str, Any]
) -> None:
    violations = check(_as_engine_sees_it(run_stack({**example_config(), **ISOLATED, **overrides})))
    assert violations == [], "\n".join(f"{v.policy}: {v.message}" for v in violations)


# --- preview refuses what cannot work -------------------------------------------------------------------


def _parse(**overrides: Any) -> Any:
    base = {k.split(":", 1)[1]: v for k, v in example_config().items() if k.startswith("trainstack:")}
    return parse_stack_config({**base, **overrides}, region=REGION, project="trainstack", stack="dev")


def _refusal(**overrides: Any) -> list[str]:
    with pytest.raises(StackConfigError) as error:
        _parse(**overrides)
    return str(error.value).splitlines()[1:]


def test_isolation_implies_private_subnets(vendored_wheels: Path) -> None:
    config = _parse(networkIsolation="true", privateSubnets="false")
    assert config.network_isolation and config.private_subnets
    assert not _parse().network_isolation


def test_isolation_without_vendored_wheels_is_refused_naming_make_wheels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock, _ = _fake_vendored(tmp_path)
    monkeypatch.setattr(vendored, "INSTANCE_LOCK", lock)
    monkeypatch.setattr(vendored, "INSTANCE_WHEELS_DIR", tmp_path / "absent")
    (line,) = _refusal(networkIsolation="true")
    assert (
        "trainstack:networkIsolation:" in line and "make wheels" in line and "trainstack-probe==1.0" in line
    )
    # A wheel that is not the locked one (changed since `make wheels`) counts as missing.
    (tmp_path / "wheels" / "trainstack_probe-1.0-py3-none-any.whl").write_bytes(b"other bytes")
    monkeypatch.setattr(vendored, "INSTANCE_WHEELS_DIR", tmp_path / "wheels")
    (line,) = _refusal(networkIsolation="true")
    assert "make wheels" in line


def test_isolation_refuses_ssh_from_outside_in_one_line(vendored_wheels: Path) -> None:
    (line,) = _refusal(networkIsolation="true", sshIngressCidrs='["203.0.113.7/32"]')
    assert "trainstack:sshIngressCidrs:" in line and "networkIsolation" in line and "Session Manager" in line


def _job(folder: Path, requirements: str | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.py").write_text("print('hi')\n")
    spec: dict[str, Any] = {"name": "probe", "command": ["python", "train.py"]}
    if requirements is not None:
        (folder / "requirements.txt").write_text(requirements)
        spec["requirements"] = "requirements.txt"
    (folder / "job.yaml").write_text(json.dumps(spec))
    return folder / "job.yaml"


def test_isolation_refuses_a_job_whose_requirements_are_not_vendored(
    tmp_path: Path, vendored_wheels: Path
) -> None:
    (line,) = _refusal(networkIsolation="true", job=str(_job(tmp_path / "plain", "requests>=2\n")))
    assert "- trainstack:networkIsolation:" in line and "--generate-hashes" in line and "wheels" in line
    hashed = "trainstack-probe==1.0 --hash=sha256:" + "0" * 64 + "\n"
    (line,) = _refusal(networkIsolation="true", job=str(_job(tmp_path / "hashed", hashed)))
    assert "lacks a wheel" in line


def test_isolation_accepts_a_job_with_hashed_vendored_requirements(
    tmp_path: Path, vendored_wheels: Path
) -> None:
    lock, wheels = _fake_vendored(tmp_path / "job")
    job = _job(tmp_path / "job", lock.read_text())
    assert (job.parent / "wheels") == wheels
    config = _parse(networkIsolation="true", job=str(job))
    assert config.user_job is not None and config.user_job.requirements == "requirements.txt"
    assert (
        _parse(job=str(_job(tmp_path / "plain", "requests>=2\n"))).user_job is not None
    )  # without isolation

"""Bring your own network (issue 36, part 6): trainstack:vpcId and subnetIds.

The program is run under Pulumi mocks whose EC2 lookups (getVpc, getSubnet, getRouteTable, getVpcEndpoint)
answer from a small fake account: a complete VPC is used as given (no VPC, subnet or NAT declared); what the
baseline needs and the VPC lacks refuses the preview in one line each, naming the resource and the fix,
before any resource is declared.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import pytest

from infra import wheels as vendored
from infra.config import StackConfigError, parse_stack_config
from infra.network import INTERFACE_ENDPOINTS
from tests.infra import program
from tests.infra.program import REGION, example_config, run_stack
from tests.policy.harness import Resource, check

VPC = "vpc-0a1b2c3d4e5f60718"
OTHER_VPC = "vpc-0ffffffffffffffff"
SUBNET_A = "subnet-0aaaaaaaaaaaaaaa1"
SUBNET_B = "subnet-0bbbbbbbbbbbbbbb2"
FOREIGN_SUBNET = "subnet-0ccccccccccccccc3"
PRIVATE_TABLE = "rtb-0a0a0a0a0a0a0a0a0"
MAIN_TABLE = "rtb-0b0b0b0b0b0b0b0b0"
S3_ENDPOINT = "vpce-0123456789abcdef0"
S3_PREFIX_LIST = "pl-63a5400a"
S3_SERVICE = f"com.amazonaws.{REGION}.s3"
NAT = "nat-0123456789abcdef0"
FULL_ACCESS = json.dumps(
    {"Statement": [{"Effect": "Allow", "Principal": "*", "Action": "*", "Resource": "*"}]}
)

VPC_TYPE = "aws:ec2/vpc:Vpc"
SUBNET_TYPE = "aws:ec2/subnet:Subnet"
ENDPOINT_TYPE = "aws:ec2/vpcEndpoint:VpcEndpoint"
FLOW_LOG_TYPE = "aws:ec2/flowLog:FlowLog"
SG_TYPE = "aws:ec2/securityGroup:SecurityGroup"
GROUP_TYPE = "aws:autoscaling/group:Group"
BUCKET_POLICY_TYPE = "aws:s3/bucketPolicy:BucketPolicy"
LOG_GROUP_TYPE = "aws:cloudwatch/logGroup:LogGroup"
CREATED_ONLY_BY_THE_STACKS_OWN_VPC = (
    VPC_TYPE,
    SUBNET_TYPE,
    "aws:ec2/natGateway:NatGateway",
    "aws:ec2/internetGateway:InternetGateway",
    "aws:ec2/eip:Eip",
    "aws:ec2/routeTable:RouteTable",
    "aws:ec2/routeTableAssociation:RouteTableAssociation",
    "aws:ec2/defaultSecurityGroup:DefaultSecurityGroup",
)


@dataclass
class Account:
    """What the fake account holds: VPCs, subnets, route tables and endpoints, as the lookups return them."""

    vpcs: dict[str, dict[str, Any]] = field(default_factory=dict)
    subnets: dict[str, dict[str, Any]] = field(default_factory=dict)
    # subnet id -> route table id (explicit associations); others use their VPC's main table.
    associations: dict[str, str] = field(default_factory=dict)
    route_tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    endpoints: list[dict[str, Any]] = field(default_factory=list)


def complete_account() -> Account:
    """A company VPC that meets the baseline: private subnets in two zones behind a NAT, an S3 gateway
    endpoint on their route table."""
    return Account(
        vpcs={
            VPC: {
                "id": VPC,
                "cidrBlock": "10.50.0.0/16",
                "enableDnsSupport": True,
                "enableDnsHostnames": True,
                "mainRouteTableId": MAIN_TABLE,
            },
            OTHER_VPC: {
                "id": OTHER_VPC,
                "cidrBlock": "10.60.0.0/16",
                "enableDnsSupport": True,
                "enableDnsHostnames": True,
                "mainRouteTableId": "rtb-0c0c0c0c0c0c0c0c0",
            },
        },
        subnets={
            SUBNET_A: _subnet(SUBNET_A, VPC, "us-east-1a", "10.50.1.0/24"),
            SUBNET_B: _subnet(SUBNET_B, VPC, "us-east-1b", "10.50.2.0/24"),
            FOREIGN_SUBNET: _subnet(FOREIGN_SUBNET, OTHER_VPC, "us-east-1a", "10.60.1.0/24"),
        },
        associations={SUBNET_A: PRIVATE_TABLE, SUBNET_B: PRIVATE_TABLE},
        route_tables={
            PRIVATE_TABLE: [{"cidrBlock": "0.0.0.0/0", "natGatewayId": NAT}],
            MAIN_TABLE: [],
        },
        endpoints=[
            {
                "id": S3_ENDPOINT,
                "vpcId": VPC,
                "serviceName": S3_SERVICE,
                "vpcEndpointType": "Gateway",
                "routeTableIds": [PRIVATE_TABLE],
                "prefixListId": S3_PREFIX_LIST,
                "policy": FULL_ACCESS,
                "privateDnsEnabled": False,
            }
        ],
    )


def _subnet(subnet_id: str, vpc_id: str, zone: str, cidr: str) -> dict[str, Any]:
    return {
        "id": subnet_id,
        "vpcId": vpc_id,
        "availabilityZone": zone,
        "cidrBlock": cidr,
        "mapPublicIpOnLaunch": False,
    }


def _interface_endpoint(service: str, private_dns: bool = True) -> dict[str, Any]:
    return {
        "id": f"vpce-1{list(INTERFACE_ENDPOINTS).index(service):016x}",
        "vpcId": VPC,
        "serviceName": f"com.amazonaws.{REGION}.{service}",
        "vpcEndpointType": "Interface",
        "routeTableIds": [],
        "prefixListId": "",
        "policy": FULL_ACCESS,
        "privateDnsEnabled": private_dns,
    }


def _not_found(key: str, what: str) -> Any:
    """A failed lookup as the engine reports it: a check failure, not a crash of the mock."""
    return ({}, [(key, f"no matching {what} found")])


class AccountMocks(program._Mocks):
    """The infra tests' mocks, plus the EC2 lookups of an existing network, answered from `account`; and
    every resource the program declares counted (a refused preview declares none)."""

    account: ClassVar[Account] = Account()
    declared: ClassVar[list[str]] = []

    def call(self, args: Any) -> Any:
        token, given = args.token, args.args
        if token == "aws:ec2/getVpc:getVpc":
            found = self.account.vpcs.get(given["id"])
            return found or _not_found("id", f"EC2 VPC {given['id']}")
        if token == "aws:ec2/getSubnet:getSubnet":
            found = self.account.subnets.get(given["id"])
            return found or _not_found("id", f"EC2 Subnet {given['id']}")
        if token == "aws:ec2/getRouteTable:getRouteTable":
            table = given.get("routeTableId") or self.account.associations.get(given.get("subnetId", ""))
            if table is None:
                return _not_found("subnetId", "Route Table")
            return {"id": table, "routeTableId": table, "routes": self.account.route_tables[table]}
        if token == "aws:ec2/getVpcEndpoint:getVpcEndpoint":
            matches = [
                endpoint
                for endpoint in self.account.endpoints
                if endpoint["vpcId"] == given["vpcId"]
                and endpoint["serviceName"] == given["serviceName"]
                and endpoint["vpcEndpointType"] == given["vpcEndpointType"]
            ]
            if len(matches) > 1:
                return ({}, [("vpcId", "multiple EC2 VPC Endpoints matched; use additional constraints")])
            return matches[0] if matches else _not_found("vpcId", "EC2 VPC Endpoint")
        return super().call(args)

    def new_resource(self, args: Any) -> Any:
        self.declared.append(args.typ)
        return super().new_resource(args)


@pytest.fixture
def account(monkeypatch: pytest.MonkeyPatch) -> Iterator[Account]:
    """The fake account the program's lookups read; edit it before `run_stack`."""
    state = complete_account()
    mocks = type("Mocks", (AccountMocks,), {"account": state, "declared": []})
    monkeypatch.setattr(program, "_Mocks", mocks)
    yield state


def _declared() -> list[str]:
    return list(program._Mocks.declared)  # type: ignore[attr-defined]  # AccountMocks while patched


def byo(**overrides: Any) -> dict[str, Any]:
    return {
        **example_config(),
        "trainstack:vpcId": VPC,
        "trainstack:subnetIds": [SUBNET_A, SUBNET_B],
        **{f"trainstack:{key}": value for key, value in overrides.items()},
    }


def _refused(config: dict[str, Any]) -> list[str]:
    """The preview's problem lines (`trainstack:<key>: why (e.g. fix)`); and that nothing was declared."""
    with pytest.raises(StackConfigError) as error:
        run_stack(config)
    assert _declared() == [], "a refused preview declares nothing"
    return error.value.problems


# --- a complete VPC is used as given ------------------------------------------------------------------


def test_a_complete_vpc_is_used_as_given(account: Account) -> None:
    stack = run_stack(byo())
    for type_token in CREATED_ONLY_BY_THE_STACKS_OWN_VPC:
        assert stack.of_type(type_token) == [], type_token
    # Its own S3 endpoint is used, not a second one; no interface endpoint without networkIsolation.
    assert stack.of_type(ENDPOINT_TYPE) == []
    (group,) = stack.of_type(GROUP_TYPE)
    assert group.inputs["vpcZoneIdentifiers"] == [SUBNET_A, SUBNET_B]
    (instance_sg,) = [g for g in stack.of_type(SG_TYPE) if g.name == "network-instance-sg"]
    assert instance_sg.inputs["vpcId"] == VPC
    assert instance_sg.inputs.get("ingress", []) == [], "the stack's own group stays closed to inbound"
    # The bucket admits the instances through the VPC's S3 endpoint, by its id.
    policies = [json.dumps(policy.inputs["policy"]) for policy in stack.of_type(BUCKET_POLICY_TYPE)]
    assert any(f'"aws:SourceVpce": "{S3_ENDPOINT}"' in policy.replace("\\", "") for policy in policies)
    assert stack.outputs["region"] == REGION


def test_launch_template_has_no_public_address_in_a_given_vpc(account: Account) -> None:
    stack = run_stack(byo(privateSubnets=False))
    templates = stack.of_type("aws:ec2/launchTemplate:LaunchTemplate")
    assert templates
    for template in templates:
        for interface in template.inputs.get("networkInterfaces", []):
            assert interface.get("associatePublicIpAddress") in (None, "false"), interface


def test_a_given_vpc_gets_the_stacks_own_flow_log_kept_a_year(account: Account) -> None:
    """pulumi-aws has no flow-log lookup: the stack adds its own (a VPC takes several) to its own log group,
    so EC2.6 holds whether or not the owner logs the VPC."""
    stack = run_stack(byo())
    (flow_log,) = stack.of_type(FLOW_LOG_TYPE)
    assert flow_log.inputs["vpcId"] == VPC
    assert flow_log.inputs["trafficType"] == "ALL"
    (log_group,) = [g for g in stack.of_type(LOG_GROUP_TYPE) if g.inputs["name"].endswith("vpc-flow-logs")]
    assert log_group.inputs["retentionInDays"] == 365


def test_a_given_vpc_passes_the_policy_pack_with_zero_violations(account: Account) -> None:
    stack = run_stack(byo())
    resources = [Resource(r.type, r.name, {**r.inputs, "id": f"{r.name}-id"}) for r in stack.resources]
    violations = check(resources)
    assert violations == [], "\n".join(f"{v.policy}: {v.message}" for v in violations)


def test_subnets_in_one_zone_only_use_that_zone(account: Account) -> None:
    stack = run_stack(byo(subnetIds=[SUBNET_A]))
    (group,) = stack.of_type(GROUP_TYPE)
    assert group.inputs["vpcZoneIdentifiers"] == [SUBNET_A]


# --- what is missing refuses the preview, one line each -----------------------------------------------


def test_a_vpc_without_an_s3_endpoint_is_refused_naming_it_and_the_fix(account: Account) -> None:
    account.endpoints.clear()
    (line,) = _refused(byo())
    assert line.startswith(f"trainstack:vpcId: {VPC} has no S3 gateway endpoint ({S3_SERVICE})")
    assert f"aws ec2 create-vpc-endpoint --vpc-id {VPC} --service-name {S3_SERVICE}" in line
    assert f"--route-table-ids {PRIVATE_TABLE}" in line
    assert line.endswith("(e.g. `pulumi config set trainstack:createVpcEndpoints true`)")


def test_create_vpc_endpoints_adds_the_missing_s3_endpoint_scoped_to_the_bucket(account: Account) -> None:
    account.endpoints.clear()
    stack = run_stack(byo(createVpcEndpoints=True))
    (endpoint,) = stack.of_type(ENDPOINT_TYPE)
    assert endpoint.inputs["vpcId"] == VPC
    assert endpoint.inputs["vpcEndpointType"] == "Gateway"
    assert endpoint.inputs["routeTableIds"] == [PRIVATE_TABLE]
    policy = json.loads(endpoint.inputs["policy"])
    for statement in policy["Statement"]:
        assert statement["Resource"] != "*" and "*" not in statement["Resource"], statement


def test_an_s3_endpoint_off_the_subnets_route_table_is_refused(account: Account) -> None:
    account.endpoints[0]["routeTableIds"] = [MAIN_TABLE]
    (line,) = _refused(byo())
    assert f"the S3 gateway endpoint {S3_ENDPOINT} is not on {PRIVATE_TABLE}" in line
    assert f"--vpc-endpoint-id {S3_ENDPOINT} --add-route-table-ids {PRIVATE_TABLE}" in line


def test_subnets_of_another_vpc_are_refused(account: Account) -> None:
    (line,) = _refused(byo(subnetIds=[SUBNET_A, FOREIGN_SUBNET]))
    assert line.startswith(
        f"trainstack:subnetIds: {FOREIGN_SUBNET} belongs to {OTHER_VPC}, not to vpcId {VPC}"
    )


def test_an_unknown_vpc_or_subnet_is_refused(account: Account) -> None:
    (line,) = _refused(byo(vpcId="vpc-0dddddddddddddddd"))
    assert line.startswith("trainstack:vpcId: vpc-0dddddddddddddddd not found in us-east-1")
    (line,) = _refused(byo(subnetIds=[SUBNET_A, "subnet-0eeeeeeeeeeeeeeee"]))
    assert line.startswith("trainstack:subnetIds: subnet-0eeeeeeeeeeeeeeee not found in us-east-1")


def test_public_subnets_are_refused(account: Account) -> None:
    account.subnets[SUBNET_A]["mapPublicIpOnLaunch"] = True
    account.route_tables[PRIVATE_TABLE] = [{"cidrBlock": "0.0.0.0/0", "gatewayId": "igw-0123456789abcdef0"}]
    lines = _refused(byo())
    assert any(
        f"{SUBNET_A} gives every instance a public IPv4 address" in line
        and f"--subnet-id {SUBNET_A} --no-map-public-ip-on-launch" in line
        for line in lines
    ), lines
    assert sum("is a public subnet" in line and "igw-0123456789abcdef0" in line for line in lines) == 2


def test_subnets_on_the_main_route_table_are_checked_there(account: Account) -> None:
    """A subnet without its own association uses the VPC's main table: the S3 endpoint must be on it."""
    del account.associations[SUBNET_B]
    (line,) = _refused(byo())
    assert f"is not on {MAIN_TABLE}, the route table of {SUBNET_B}" in line


def test_a_vpc_without_dns_is_refused(account: Account) -> None:
    account.vpcs[VPC]["enableDnsSupport"] = False
    (line,) = _refused(byo())
    assert f"--vpc-id {VPC} --enable-dns-support" in line


# --- networkIsolation in a given VPC ------------------------------------------------------------------


@pytest.fixture
def vendored_wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lock and its wheel, standing in for `make wheels` (networkIsolation's preview check)."""
    import hashlib

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = wheels / "trainstack_probe-1.0-py3-none-any.whl"
    wheel.write_bytes(b"only its sha256 matters here")
    lock = tmp_path / "requirements-instance.lock.txt"
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    lock.write_text(f"trainstack-probe==1.0 \\\n    --hash=sha256:{digest}\n")
    monkeypatch.setattr(vendored, "INSTANCE_LOCK", lock)
    monkeypatch.setattr(vendored, "INSTANCE_WHEELS_DIR", wheels)


def _isolated(account: Account) -> None:
    account.route_tables[PRIVATE_TABLE] = []


def test_isolation_refuses_each_missing_interface_endpoint(account: Account, vendored_wheels: None) -> None:
    _isolated(account)
    account.endpoints.append(_interface_endpoint("ssm"))
    lines = _refused(byo(networkIsolation=True))
    missing = [service for service in INTERFACE_ENDPOINTS if service != "ssm"]
    assert len(lines) == len(missing)
    for line, service in zip(lines, missing, strict=True):
        assert f"has no interface endpoint com.amazonaws.{REGION}.{service}," in line
        assert line.endswith("(e.g. `pulumi config set trainstack:createVpcEndpoints true`)")


def test_isolation_creates_only_the_missing_interface_endpoints(
    account: Account, vendored_wheels: None
) -> None:
    _isolated(account)
    account.endpoints.append(_interface_endpoint("ssm"))
    stack = run_stack(byo(networkIsolation=True, createVpcEndpoints=True))
    created = {e.inputs["serviceName"].rsplit(".", 1)[-1]: e for e in stack.of_type(ENDPOINT_TYPE)}
    assert set(created) == set(INTERFACE_ENDPOINTS) - {"ssm"}
    for endpoint in created.values():
        assert endpoint.inputs["vpcId"] == VPC and endpoint.inputs["privateDnsEnabled"] is True
        assert endpoint.inputs["subnetIds"] == [SUBNET_A]
    (endpoint_sg,) = [g for g in stack.of_type(SG_TYPE) if g.name == "network-endpoints-sg"]
    assert endpoint_sg.inputs["ingress"][0]["cidrBlocks"] == ["10.50.1.0/24", "10.50.2.0/24"]
    (instance_sg,) = [g for g in stack.of_type(SG_TYPE) if g.name == "network-instance-sg"]
    egress = instance_sg.inputs["egress"]
    assert [rule.get("cidrBlocks") for rule in egress if rule.get("cidrBlocks")] == [["10.50.0.0/16"]]
    assert [rule["prefixListIds"] for rule in egress if rule.get("prefixListIds")] == [[S3_PREFIX_LIST]]


def test_isolation_refuses_a_route_out_of_the_vpc(account: Account, vendored_wheels: None) -> None:
    account.endpoints.extend(_interface_endpoint(service) for service in INTERFACE_ENDPOINTS)
    lines = _refused(byo(networkIsolation=True))
    assert [line.split("'s route table")[0] for line in lines] == [
        f"trainstack:networkIsolation: {subnet}" for subnet in (SUBNET_A, SUBNET_B)
    ]
    assert all(f"{PRIVATE_TABLE} sends 0.0.0.0/0 to {NAT}" in line for line in lines)


# --- the keys' shapes, refused before any lookup ------------------------------------------------------


def _parse_problems(**overrides: Any) -> list[str]:
    base = {k.split(":", 1)[1]: v for k, v in example_config().items() if k.startswith("trainstack:")}
    with pytest.raises(StackConfigError) as error:
        parse_stack_config({**base, **overrides}, region=REGION, project="trainstack", stack="dev")
    return error.value.problems


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            {"vpcId": "vpc-XYZ", "subnetIds": [SUBNET_A]},
            "trainstack:vpcId: 'vpc-XYZ' is not a VPC id (e.g. `pulumi config set trainstack:vpcId "
            "vpc-0123456789abcdef0`)",
        ),
        (
            {"vpcId": VPC, "subnetIds": ["sn-123"]},
            "trainstack:subnetIds: 'sn-123' is not a subnet id",
        ),
        ({"vpcId": VPC}, f"trainstack:subnetIds: vpcId {VPC} is set: list the private subnets of it"),
        ({"subnetIds": [SUBNET_A]}, "trainstack:vpcId: subnetIds is set: name the VPC they belong to"),
        ({"vpcId": VPC, "subnetIds": [SUBNET_A, SUBNET_A]}, f"trainstack:subnetIds: {SUBNET_A} listed more"),
        ({"createVpcEndpoints": True}, "trainstack:createVpcEndpoints: only applies to an existing VPC"),
        ({"vpcId": VPC, "subnetIds": "not json"}, "trainstack:subnetIds: must be a list of strings"),
    ],
    ids=["bad-vpc", "bad-subnet", "vpc-alone", "subnets-alone", "repeated", "endpoints-alone", "not-a-list"],
)
def test_bad_ids_are_refused_in_one_line(overrides: dict[str, Any], expected: str) -> None:
    lines = _parse_problems(**overrides)
    assert lines[0].startswith(expected), lines
    # A list that cannot be read also leaves vpcId without subnets: said too, but the first line is the why.
    assert len(lines) == (2 if overrides.get("subnetIds") == "not json" else 1), lines


def test_a_given_vpc_implies_private_subnets() -> None:
    base = {k.split(":", 1)[1]: v for k, v in example_config().items() if k.startswith("trainstack:")}
    config = parse_stack_config(
        {**base, "vpcId": VPC, "subnetIds": json.dumps([SUBNET_A, SUBNET_B]), "privateSubnets": "false"},
        region=REGION,
        project="trainstack",
        stack="dev",
    )
    assert config.existing_vpc and config.private_subnets
    assert config.subnet_ids == (SUBNET_A, SUBNET_B)
    assert replace(config, vpc_id="").existing_vpc is False

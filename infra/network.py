"""Network: a VPC over the zones that offer the GPU types, with no inbound path and logged traffic.

S3 traffic from the instances takes the VPC's gateway endpoint, whose policy admits this stack's bucket and
a few AWS-owned, read-only buckets (S3_ENDPOINT_AWS_BUCKETS); the bucket's own policy refuses the instance
role anywhere else (infra/storage.py). Egress is HTTPS only. With trainstack:networkIsolation the
instances sit in private subnets with no route out of the VPC at all: AWS APIs through interface
endpoints (INTERFACE_ENDPOINTS), S3 through the gateway endpoint, packages from the stack's own bucket.

With trainstack:vpcId and subnetIds the stack uses an existing VPC instead (lookup_existing_network): it
creates no VPC, subnet, gateway or route there, checks what it is given against the same baseline at
preview (one line per missing thing, before anything is created), and adds only what is safe to add to a
VPC it does not own: its own security group, its own flow log, and, with trainstack:createVpcEndpoints,
the endpoints the VPC lacks.
"""

from __future__ import annotations

import ipaddress
import json
import typing
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_aws as aws

from infra.config import NAMESPACE, StackConfig, StackConfigError
from infra.config.values import Problems
from infra.iam import common, service_roles
from infra.placement import MIN_ZONES

# Each subnet is the VPC cut in 16: room for MAX_ZONES public and MAX_ZONES private subnets.
_SUBNET_BITS = 4

ANYWHERE_IPV4 = "0.0.0.0/0"  # default route and egress only: ingress from anywhere is refused
HTTPS = 443

# What an instance does in the stack's bucket (the instance role's S3 actions; multipart uploads are
# s3:PutObject). The endpoint allows no other action on it, and nothing at all on other buckets of the
# account or anyone else's: a compromised process cannot copy data to a bucket it controls through it.
S3_ENDPOINT_BUCKET_ACTIONS = (
    "s3:AbortMultipartUpload",
    "s3:DeleteObject",
    "s3:GetBucketLocation",
    "s3:GetObject",
    "s3:ListBucket",
    "s3:ListBucketMultipartUploads",
    "s3:ListMultipartUploadParts",
    "s3:PutObject",
)
# AWS-owned buckets an instance reads through the endpoint (GetObject only, so nothing leaves by them),
# "{region}" filled in. SSM Agent: its updates and the AWS-owned documents and plugins it fetches
# ("SSM Agent communications with AWS managed S3 buckets"). Amazon Linux's package repositories, which
# are S3 buckets: prepare-os.sh installs dnf's versionlock plugin on an Amazon Linux AMI (amiParameter).
# The default Ubuntu DLAMI's apt mirrors and PyPI are not on S3, and no boot step uses apt (prepare-os.sh
# only holds packages; cloud-init's package_update is off).
S3_ENDPOINT_AWS_BUCKETS = (
    "amazon-ssm-{region}",
    "aws-ssm-{region}",
    "al2023-repos-{region}-de612dc2",
    "amazonlinux-2-repos-{region}",
)
# trainstack:networkIsolation: one interface endpoint (private DNS) per AWS service an instance calls,
# with why. Pricing has no endpoint in most regions: the agent falls back to its built-in on-demand table
# (bootstrap/pricing.py), after one connect timeout per instance type and life.
INTERFACE_ENDPOINTS: dict[str, str] = {
    "ssm": "Session Manager, and the stack's secrets under /trainstack/<stack>/ (SSM parameters)",
    "ssmmessages": "Session Manager's data channel",
    "ec2messages": "SSM Agent's command channel (agents before 3.3 need it for Session Manager)",
    "logs": "the agent's and the job's CloudWatch log streams",
    "monitoring": "GPU metrics (cloudwatch:PutMetricData)",
    "sns": "alerts to the stack's topic",
    "autoscaling": "lifecycle hooks, instance health, scaling the group to zero",
    "ec2": "spot price history for the cost meter",
    "sts": "the job's own narrower credentials (sts:AssumeRole)",
    "kms": "the stack's key (Session Manager encryption, data keys)",
    "secretsmanager": "the stack's secrets under /trainstack/<stack>/ (Secrets Manager)",
}


@dataclass
class NetworkArgs:
    name: str
    region: str
    account_id: str
    vpc_cidr: str
    zones: list[str]
    private_subnets: bool
    ssh_ingress_cidrs: list[str]
    kms_key_arn: pulumi.Input[str]
    flow_log_group_name: str
    flow_log_retention_days: int
    # The stack's bucket: the only bucket of anyone's the instances may use through the S3 endpoint.
    bucket_arn: pulumi.Input[str]
    # Multi-node jobs: the instances reach each other (NCCL, c10d, gloo, EFA) and nothing else does.
    peer_traffic: bool = False
    # trainstack:networkIsolation: private subnets with no route out of the VPC, AWS APIs through interface
    # endpoints, no internet egress at all.
    network_isolation: bool = False
    tags: dict[str, str] = field(default_factory=dict)
    # trainstack:vpcId/subnetIds, looked up and checked (lookup_existing_network); None: the stack's own VPC.
    existing: ExistingNetwork | None = None


@dataclass(frozen=True)
class ExistingNetwork:
    """An existing VPC and private subnets of it, as found in the account and checked against the baseline."""

    vpc_id: str
    vpc_cidr: str
    subnet_ids: tuple[str, ...]
    # Each subnet's Availability Zone and CIDR, in subnet_ids' order (the pools pair subnets and zones).
    zones: tuple[str, ...]
    subnet_cidrs: tuple[str, ...]
    # The subnets' route tables, each once: where an S3 gateway endpoint the stack creates is attached.
    route_table_ids: tuple[str, ...]
    # The VPC's S3 gateway endpoint and its prefix list; "" when the stack creates its own
    # (createVpcEndpoints).
    s3_endpoint_id: str = ""
    s3_prefix_list_id: str = ""
    # networkIsolation: the interface endpoints the VPC lacks and the stack creates (createVpcEndpoints).
    missing_interface_services: tuple[str, ...] = ()


class Network(pulumi.ComponentResource):
    """VPC, subnets (public, private behind one NAT, or isolated), S3 gateway endpoint, flow logs, instance
    SG; under networkIsolation, interface endpoints instead of any route out."""

    # None with an existing VPC (trainstack:vpcId): vpc_id is then the given one.
    vpc: aws.ec2.Vpc | None
    vpc_id: pulumi.Output[str]
    subnet_ids: list[pulumi.Output[str]]
    security_group: aws.ec2.SecurityGroup
    # None when an existing VPC's own S3 gateway endpoint is used: s3_endpoint_id is then that one.
    s3_endpoint: aws.ec2.VpcEndpoint | None
    s3_endpoint_id: pulumi.Output[str]
    interface_endpoints: list[aws.ec2.VpcEndpoint]
    _private_cidrs: list[str]
    _endpoint_subnet_id: pulumi.Input[str]

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("trainstack:network:Network", name, None, opts)
        self._name = name
        self._args = args
        self._child = pulumi.ResourceOptions(parent=self)
        existing = args.existing
        route_table_ids = self._create_vpc() if existing is None else self._use_existing_vpc(existing)
        s3_prefix_list_id: pulumi.Input[str]
        if existing is not None and existing.s3_endpoint_id:
            self.s3_endpoint = None
            self.s3_endpoint_id = pulumi.Output.from_input(existing.s3_endpoint_id)
            s3_prefix_list_id = existing.s3_prefix_list_id
        else:
            self.s3_endpoint = self._create_s3_endpoint(route_table_ids)
            self.s3_endpoint_id = self.s3_endpoint.id
            s3_prefix_list_id = self.s3_endpoint.prefix_list_id
        # An existing VPC gets the stack's own flow log too: pulumi-aws has no flow-log lookup to check the
        # owner's, and a VPC takes several flow logs; this one writes only to the stack's own log group (a
        # year, the stack's key) and goes with the stack, so EC2.6 holds whatever the owner logs.
        self._create_flow_logs()
        self.interface_endpoints = []
        services: list[str] = []
        if args.network_isolation:
            services = list(INTERFACE_ENDPOINTS if existing is None else existing.missing_interface_services)
        endpoint_group = self._create_endpoint_security_group() if services else None
        self.security_group = self._create_instance_security_group(endpoint_group, s3_prefix_list_id)
        if endpoint_group is not None:
            self._create_interface_endpoints(endpoint_group, services)
        self.register_outputs(
            {
                "vpc_id": self.vpc_id,
                "subnet_ids": self.subnet_ids,
                "security_group_id": self.security_group.id,
                "s3_endpoint_id": self.s3_endpoint_id,
            }
        )

    def _use_existing_vpc(self, existing: ExistingNetwork) -> list[pulumi.Input[str]]:
        """Nothing is created in the given VPC's structure: no subnet, gateway, route or route table. Its
        default security group is left alone too (adopting it would rewrite the rules of a group that the
        owner's other workloads may use); the stack's instances never join it."""
        self.vpc = None
        self.vpc_id = pulumi.Output.from_input(existing.vpc_id)
        self.subnet_ids = [pulumi.Output.from_input(subnet) for subnet in existing.subnet_ids]
        self._private_cidrs = list(existing.subnet_cidrs)
        self._endpoint_subnet_id = existing.subnet_ids[0]
        return list(existing.route_table_ids)

    def _create_vpc(self) -> list[pulumi.Input[str]]:
        args, name = self._args, self._name
        self.vpc = aws.ec2.Vpc(
            f"{name}-vpc",
            cidr_block=args.vpc_cidr,
            # SSM Session Manager and the S3 endpoint need VPC DNS.
            enable_dns_support=True,
            enable_dns_hostnames=True,
            tags={**args.tags, "Name": args.name},
            opts=self._child,
        )
        self.vpc_id = self.vpc.id
        # EC2.2: adopting the default security group with no rules removes AWS's allow-all defaults.
        aws.ec2.DefaultSecurityGroup(
            f"{name}-default-sg",
            vpc_id=self.vpc_id,
            ingress=[],
            egress=[],
            tags={**args.tags, "Name": f"{args.name}-default-unused"},
            opts=self._child,
        )
        route_tables = self._create_isolated_subnets() if args.network_isolation else self._create_subnets()
        return [table.id for table in route_tables]

    def _create_s3_endpoint(self, route_table_ids: list[pulumi.Input[str]]) -> aws.ec2.VpcEndpoint:
        args, name = self._args, self._name
        return aws.ec2.VpcEndpoint(
            f"{name}-s3-endpoint",
            vpc_id=self.vpc_id,
            service_name=f"com.amazonaws.{args.region}.s3",
            vpc_endpoint_type="Gateway",
            route_table_ids=route_table_ids,
            policy=pulumi.Output.from_input(args.bucket_arn).apply(
                lambda arn: json.dumps(
                    s3_endpoint_policy(bucket_arn=arn, account_id=args.account_id, region=args.region)
                )
            ),
            tags={**args.tags, "Name": f"{args.name}-s3"},
            opts=self._child,
        )

    def _create_subnets(self) -> list[aws.ec2.RouteTable]:
        args, name = self._args, self._name
        blocks = list(ipaddress.ip_network(args.vpc_cidr).subnets(prefixlen_diff=_SUBNET_BITS))
        gateway = aws.ec2.InternetGateway(
            f"{name}-igw", vpc_id=self.vpc_id, tags={**args.tags, "Name": args.name}, opts=self._child
        )
        public_table = aws.ec2.RouteTable(
            f"{name}-public-rt",
            vpc_id=self.vpc_id,
            routes=[aws.ec2.RouteTableRouteArgs(cidr_block=ANYWHERE_IPV4, gateway_id=gateway.id)],
            tags={**args.tags, "Name": f"{args.name}-public"},
            opts=self._child,
        )
        public_subnets: list[aws.ec2.Subnet] = []
        for index, zone in enumerate(args.zones):
            subnet = aws.ec2.Subnet(
                f"{name}-public-{zone}",
                vpc_id=self.vpc_id,
                availability_zone=zone,
                cidr_block=str(blocks[index]),
                # EC2.15: nothing gets a public address by default; the launch template decides.
                map_public_ip_on_launch=False,
                tags={**args.tags, "Name": f"{args.name}-public-{zone}"},
                opts=self._child,
            )
            aws.ec2.RouteTableAssociation(
                f"{name}-public-{zone}-rta",
                subnet_id=subnet.id,
                route_table_id=public_table.id,
                opts=self._child,
            )
            public_subnets.append(subnet)
        if not args.private_subnets:
            self.subnet_ids = [subnet.id for subnet in public_subnets]
            return [public_table]

        # One NAT gateway, not one per zone: a zone outage only pauses a spot job, and each NAT bills hourly.
        address = aws.ec2.Eip(f"{name}-nat-ip", domain="vpc", tags=args.tags, opts=self._child)
        nat = aws.ec2.NatGateway(
            f"{name}-nat",
            allocation_id=address.id,
            subnet_id=public_subnets[0].id,
            tags={**args.tags, "Name": args.name},
            opts=pulumi.ResourceOptions(parent=self, depends_on=[gateway]),
        )
        private_table = aws.ec2.RouteTable(
            f"{name}-private-rt",
            vpc_id=self.vpc_id,
            routes=[aws.ec2.RouteTableRouteArgs(cidr_block=ANYWHERE_IPV4, nat_gateway_id=nat.id)],
            tags={**args.tags, "Name": f"{args.name}-private"},
            opts=self._child,
        )
        private_ids: list[pulumi.Output[str]] = []
        for index, zone in enumerate(args.zones):
            subnet = aws.ec2.Subnet(
                f"{name}-private-{zone}",
                vpc_id=self.vpc_id,
                availability_zone=zone,
                cidr_block=str(blocks[len(blocks) // 2 + index]),
                map_public_ip_on_launch=False,
                tags={**args.tags, "Name": f"{args.name}-private-{zone}"},
                opts=self._child,
            )
            aws.ec2.RouteTableAssociation(
                f"{name}-private-{zone}-rta",
                subnet_id=subnet.id,
                route_table_id=private_table.id,
                opts=self._child,
            )
            private_ids.append(subnet.id)
        self.subnet_ids = private_ids
        return [public_table, private_table]

    def _create_isolated_subnets(self) -> list[aws.ec2.RouteTable]:
        """Private subnets whose only routes are the VPC itself and the S3 gateway endpoint: no internet
        gateway, no NAT, so no instance can reach anything outside the VPC, whatever its security group."""
        args, name = self._args, self._name
        blocks = list(ipaddress.ip_network(args.vpc_cidr).subnets(prefixlen_diff=_SUBNET_BITS))
        table = aws.ec2.RouteTable(
            f"{name}-isolated-rt",
            vpc_id=self.vpc_id,
            routes=[],
            tags={**args.tags, "Name": f"{args.name}-isolated"},
            opts=self._child,
        )
        self._private_cidrs = []
        subnets: list[aws.ec2.Subnet] = []
        for index, zone in enumerate(args.zones):
            cidr = str(blocks[len(blocks) // 2 + index])
            subnet = aws.ec2.Subnet(
                f"{name}-private-{zone}",
                vpc_id=self.vpc_id,
                availability_zone=zone,
                cidr_block=cidr,
                map_public_ip_on_launch=False,
                tags={**args.tags, "Name": f"{args.name}-private-{zone}"},
                opts=self._child,
            )
            aws.ec2.RouteTableAssociation(
                f"{name}-private-{zone}-rta", subnet_id=subnet.id, route_table_id=table.id, opts=self._child
            )
            subnets.append(subnet)
            self._private_cidrs.append(cidr)
        self._endpoint_subnet_id = subnets[0].id
        self.subnet_ids = [subnet.id for subnet in subnets]
        return [table]

    def _create_endpoint_security_group(self) -> aws.ec2.SecurityGroup:
        """The interface endpoints' group: HTTPS in from the instances' subnets (which hold nothing else but
        the endpoints themselves), nothing out (a group is stateful: replies need no rule)."""
        args = self._args
        return aws.ec2.SecurityGroup(
            f"{self._name}-endpoints-sg",
            vpc_id=self.vpc_id,
            description=f"{args.name} interface endpoints: HTTPS from the instances' subnets only",
            ingress=[
                aws.ec2.SecurityGroupIngressArgs(
                    description="HTTPS from the instances' subnets to the AWS API endpoints",
                    protocol="tcp",
                    from_port=HTTPS,
                    to_port=HTTPS,
                    cidr_blocks=list(self._private_cidrs),
                )
            ],
            egress=[],
            tags={**args.tags, "Name": f"{args.name}-endpoints"},
            opts=self._child,
        )

    def _create_interface_endpoints(self, group: aws.ec2.SecurityGroup, services: list[str]) -> None:
        """One endpoint per service, private DNS on, so the SDKs' usual regional names resolve inside the VPC.

        In the first zone's subnet only: each endpoint bills per zone and hour (about 7 USD a month), and like
        the single NAT gateway, a zone outage only pauses a spot job.
        """
        args = self._args
        for service in services:
            self.interface_endpoints.append(
                aws.ec2.VpcEndpoint(
                    f"{self._name}-{service}-endpoint",
                    vpc_id=self.vpc_id,
                    service_name=f"com.amazonaws.{args.region}.{service}",
                    vpc_endpoint_type="Interface",
                    private_dns_enabled=True,
                    subnet_ids=[self._endpoint_subnet_id],
                    security_group_ids=[group.id],
                    tags={**args.tags, "Name": f"{args.name}-{service}"},
                    opts=self._child,
                )
            )

    def _create_flow_logs(self) -> None:
        args, name = self._args, self._name
        log_group = aws.cloudwatch.LogGroup(
            f"{name}-flow-logs",
            name=args.flow_log_group_name,
            # A year by default (CloudWatch.16): who tried to reach what, long after the training logs go.
            retention_in_days=args.flow_log_retention_days,
            kms_key_id=args.kms_key_arn,
            tags=args.tags,
            opts=self._child,
        )
        role = aws.iam.Role(
            f"{name}-flow-logs-role",
            # Only on behalf of this account's flow logs (the confused-deputy guard AWS recommends).
            assume_role_policy=json.dumps(
                common.assume_role_policy("vpc-flow-logs.amazonaws.com", account_id=args.account_id)
            ),
            tags=args.tags,
            opts=self._child,
        )
        aws.iam.RolePolicy(
            f"{name}-flow-logs-policy",
            role=role.id,
            policy=log_group.arn.apply(
                lambda arn: json.dumps(service_roles.flow_logs_policy(log_group_arn=arn))
            ),
            opts=self._child,
        )
        aws.ec2.FlowLog(
            f"{name}-flow-log",
            vpc_id=self.vpc_id,
            traffic_type="ALL",
            log_destination_type="cloud-watch-logs",
            log_destination=log_group.arn,
            iam_role_arn=role.arn,
            max_aggregation_interval=600,
            tags=args.tags,
            opts=self._child,
        )

    def _create_instance_security_group(
        self, endpoint_group: aws.ec2.SecurityGroup | None, s3_prefix_list_id: pulumi.Input[str]
    ) -> aws.ec2.SecurityGroup:
        args = self._args
        # No inbound rule at all by default: operators reach instances through SSM Session Manager.
        ingress = [
            aws.ec2.SecurityGroupIngressArgs(
                description=f"SSH from {cidr} (trainstack:sshIngressCidrs)",
                protocol="tcp",
                from_port=22,
                to_port=22,
                cidr_blocks=[] if ":" in cidr else [cidr],
                ipv6_cidr_blocks=[cidr] if ":" in cidr else [],
            )
            for cidr in args.ssh_ingress_cidrs
        ]
        # Outbound: HTTPS only. It reaches every AWS API, the S3 endpoint and the package index (pip: HTTPS).
        # No port 80: nothing at boot uses plain HTTP (no apt run: cloud-init's package_update is off and
        # prepare-os.sh only holds packages; the NVIDIA and Ubuntu repos are never fetched). DNS, NTP and
        # instance metadata are link-local and not filtered by groups.
        if args.network_isolation and args.existing is not None:
            # An existing VPC's interface endpoints are its owner's, in security groups the stack does not
            # know: HTTPS to the VPC's own range reaches them (and those the stack added), nothing beyond it.
            egress = [
                aws.ec2.SecurityGroupEgressArgs(
                    description="HTTPS to the AWS API interface endpoints in the VPC",
                    protocol="tcp",
                    from_port=HTTPS,
                    to_port=HTTPS,
                    cidr_blocks=[args.existing.vpc_cidr],
                ),
                aws.ec2.SecurityGroupEgressArgs(
                    description="HTTPS to S3 through the gateway endpoint",
                    protocol="tcp",
                    from_port=HTTPS,
                    to_port=HTTPS,
                    prefix_list_ids=[s3_prefix_list_id],
                ),
            ]
        elif endpoint_group is None:
            egress = [
                aws.ec2.SecurityGroupEgressArgs(
                    description="HTTPS to AWS APIs, S3 and the package index",
                    protocol="tcp",
                    from_port=HTTPS,
                    to_port=HTTPS,
                    cidr_blocks=[ANYWHERE_IPV4],
                )
            ]
        else:
            # networkIsolation: HTTPS to the interface endpoints and to S3 through its gateway endpoint only.
            egress = [
                aws.ec2.SecurityGroupEgressArgs(
                    description="HTTPS to the AWS API interface endpoints",
                    protocol="tcp",
                    from_port=HTTPS,
                    to_port=HTTPS,
                    security_groups=[endpoint_group.id],
                ),
                aws.ec2.SecurityGroupEgressArgs(
                    description="HTTPS to S3 through the gateway endpoint",
                    protocol="tcp",
                    from_port=HTTPS,
                    to_port=HTTPS,
                    prefix_list_ids=[s3_prefix_list_id],
                ),
            ]
        if args.peer_traffic:
            # All protocols and ports, but only between members of this group, i.e. this job's instances:
            # NCCL and gloo pick ephemeral ports, and an EFA needs all traffic to and from its own group.
            ingress.append(
                aws.ec2.SecurityGroupIngressArgs(
                    description="Multi-node training: all traffic from this job's other instances",
                    protocol="-1",
                    from_port=0,
                    to_port=0,
                    self=True,
                )
            )
            egress.append(
                aws.ec2.SecurityGroupEgressArgs(
                    description="Multi-node training: all traffic to this job's other instances",
                    protocol="-1",
                    from_port=0,
                    to_port=0,
                    self=True,
                )
            )
        return aws.ec2.SecurityGroup(
            f"{self._name}-instance-sg",
            vpc_id=self.vpc_id,
            description=f"{args.name} GPU instances: no inbound unless sshIngressCidrs",
            ingress=ingress,
            egress=egress,
            tags={**args.tags, "Name": f"{args.name}-instances"},
            opts=self._child,
        )


def s3_endpoint_policy(*, bucket_arn: str, account_id: str, region: str) -> dict[str, Any]:
    """The S3 gateway endpoint's policy: the stack's bucket (in this account) for what instances do there,
    and read-only access to the few AWS-owned buckets the AMI's agents read (S3_ENDPOINT_AWS_BUCKETS)."""
    partition = bucket_arn.split(":")[1]
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "ThisStacksBucketOnly",
                "Effect": "Allow",
                "Principal": "*",
                "Action": list(S3_ENDPOINT_BUCKET_ACTIONS),
                "Resource": [bucket_arn, f"{bucket_arn}/*"],
                # Bucket names are global: were this one deleted and claimed by another account, refused.
                "Condition": {"StringEquals": {"aws:ResourceAccount": account_id}},
            },
            {
                "Sid": "ReadAwsOwnedAgentAndRepositoryBuckets",
                "Effect": "Allow",
                "Principal": "*",
                "Action": "s3:GetObject",
                "Resource": [
                    f"arn:{partition}:s3:::{name.format(region=region)}/*" for name in S3_ENDPOINT_AWS_BUCKETS
                ],
            },
        ],
    }


def lookup_existing_network(config: StackConfig) -> ExistingNetwork:
    """trainstack:vpcId and subnetIds, looked up and checked against the network baseline.

    Run by the program before it declares anything, so `pulumi preview` (and `up`) refuses with one line per
    missing thing, naming the resource and the fix, before anything is created. Refused: subnets of another
    VPC or unknown; subnets that give instances public addresses or route to an internet gateway (the
    instances must have no inbound path); no S3 gateway endpoint on the subnets' route tables (the stack's
    bucket admits its instances only through one, infra/storage.py); under networkIsolation, a route out of
    the VPC or a missing interface endpoint. Missing endpoints are added instead with createVpcEndpoints.
    """
    problems = Problems()
    vpc_id, region = config.vpc_id, config.region
    try:
        vpc = aws.ec2.get_vpc(id=vpc_id)
    # Pulumi reports a failed lookup as a plain Exception ("invoke of ... failed: ..."), nothing narrower.
    except Exception as exc:
        problems.add(
            "vpcId",
            f"{vpc_id} not found in {region} ({_first_line(exc)}); check the id and the account",
            "vpc-0123456789abcdef0",
        )
        _refuse(config, problems)
    if not vpc.enable_dns_support:
        problems.add(
            "vpcId",
            f"{vpc_id} has DNS resolution off, which SSM and the VPC endpoints need; turn it on "
            f"(aws ec2 modify-vpc-attribute --vpc-id {vpc_id} --enable-dns-support) or use another VPC",
            vpc_id,
        )
    if config.network_isolation and not vpc.enable_dns_hostnames:
        problems.add(
            "vpcId",
            f"{vpc_id} has DNS hostnames off, which the interface endpoints' private DNS needs; turn it on "
            f"(aws ec2 modify-vpc-attribute --vpc-id {vpc_id} --enable-dns-hostnames) or use another VPC",
            vpc_id,
        )
    zones: list[str] = []
    cidrs: list[str] = []
    tables: dict[str, list[str]] = {}
    no_default_route: list[str] = []
    for subnet_id in config.subnet_ids:
        try:
            subnet = aws.ec2.get_subnet(id=subnet_id)
        except Exception as exc:
            problems.add(
                "subnetIds",
                f"{subnet_id} not found in {region} ({_first_line(exc)}); list subnets of {vpc_id}",
                "'[\"subnet-0123456789abcdef0\"]'",
            )
            continue
        if subnet.vpc_id != vpc_id:
            problems.add(
                "subnetIds",
                f"{subnet_id} belongs to {subnet.vpc_id}, not to vpcId {vpc_id}; list private subnets of "
                f"{vpc_id} only",
                "'[\"subnet-0123456789abcdef0\"]'",
            )
            continue
        zones.append(subnet.availability_zone)
        cidrs.append(subnet.cidr_block)
        if subnet.map_public_ip_on_launch:
            problems.add(
                "subnetIds",
                f"{subnet_id} gives every instance a public IPv4 address (auto-assign public IP is on); turn "
                f"it off (aws ec2 modify-subnet-attribute --subnet-id {subnet_id} "
                "--no-map-public-ip-on-launch) or list a private subnet",
                "'[\"subnet-0123456789abcdef0\"]'",
            )
        table = _route_table(subnet_id, vpc)
        tables.setdefault(table.route_table_id, []).append(subnet_id)
        defaults = [route for route in table.routes if route.cidr_block == ANYWHERE_IPV4]
        to_internet = [r.gateway_id for r in defaults if (r.gateway_id or "").startswith("igw-")]
        if to_internet:
            problems.add(
                "subnetIds",
                f"{subnet_id} is a public subnet (its route table {table.route_table_id} sends "
                f"{ANYWHERE_IPV4} to {to_internet[0]}); list private subnets, whose way out is a NAT "
                "gateway or none",
                "'[\"subnet-0123456789abcdef0\"]'",
            )
        elif defaults and config.network_isolation:
            target = _route_target(defaults[0])
            problems.add(
                "networkIsolation",
                f"{subnet_id}'s route table {table.route_table_id} sends {ANYWHERE_IPV4} to {target}, a "
                "route out of the VPC; list subnets without one, or set false",
                "false",
            )
        elif not defaults:
            no_default_route.append(subnet_id)
    if no_default_route and not config.network_isolation:
        # Not refused: a proxy or the owner's own endpoints may serve them; but PyPI and the AWS APIs the
        # instances call must be reachable somehow, or each boot fails.
        pulumi.log.warn(
            f"{NAMESPACE}:subnetIds: {', '.join(no_default_route)} have no route to {ANYWHERE_IPV4}: the "
            "instances reach AWS APIs and PyPI only if the VPC provides another way (interface endpoints, "
            f"a proxy); otherwise add a NAT route, or set {NAMESPACE}:networkIsolation true"
        )
    route_table_ids = tuple(tables)
    s3_endpoint_id, s3_prefix_list_id = _check_s3_endpoint(config, route_table_ids, tables, problems)
    missing = _check_interface_endpoints(config, problems) if config.network_isolation else ()
    if problems.lines:
        _refuse(config, problems)
    if len(set(zones)) < MIN_ZONES:
        pulumi.log.warn(
            f"{NAMESPACE}:subnetIds: every subnet is in {zones[0]}: a spot shortage there pauses the job "
            "until capacity returns; add a private subnet in another zone to ride it out"
        )
    return ExistingNetwork(
        vpc_id=vpc_id,
        vpc_cidr=vpc.cidr_block,
        subnet_ids=config.subnet_ids,
        zones=tuple(zones),
        subnet_cidrs=tuple(cidrs),
        route_table_ids=route_table_ids,
        s3_endpoint_id=s3_endpoint_id,
        s3_prefix_list_id=s3_prefix_list_id,
        missing_interface_services=missing,
    )


def existing_network_zones(
    existing: ExistingNetwork, pool_zones: dict[str, list[str]]
) -> tuple[list[str], dict[str, list[str]]]:
    """The given subnets' zones (one per subnet, in order) and each pool's: those among them that offer its
    types (`pool_zones`, from infra/placement.py). A pool none of the subnets can serve is refused."""
    kept_by_pool: dict[str, list[str]] = {}
    for pool, offered in pool_zones.items():
        kept = [zone for zone in offered if zone in existing.zones]
        if not kept:
            what = "the instance types" if len(pool_zones) == 1 else f"pool {pool!r}'s instance types"
            raise StackConfigError(
                f"{NAMESPACE}:subnetIds: the subnets are in {', '.join(sorted(set(existing.zones)))}, and "
                f"none of those zones offers {what} (offered in {', '.join(offered)}); add a private subnet "
                "in one of them, or choose other instance types"
            )
        kept_by_pool[pool] = kept
    return list(existing.zones), kept_by_pool


def _check_s3_endpoint(
    config: StackConfig, route_table_ids: tuple[str, ...], tables: dict[str, list[str]], problems: Problems
) -> tuple[str, str]:
    """The VPC's S3 gateway endpoint (its id and prefix list), which must serve every subnet's route table;
    ("", "") when the stack is to create its own (createVpcEndpoints)."""
    vpc_id, service = config.vpc_id, f"com.amazonaws.{config.region}.s3"
    create = (
        f"create one (aws ec2 create-vpc-endpoint --vpc-id {vpc_id} --service-name {service} "
        f"--route-table-ids {' '.join(route_table_ids)}) or let the stack add it"
    )
    try:
        endpoint = aws.ec2.get_vpc_endpoint(
            vpc_id=vpc_id, service_name=service, vpc_endpoint_type="Gateway", state="available"
        )
    except Exception as exc:
        if "multiple" in str(exc).lower():
            # The bucket admits the instances through one endpoint id (infra/storage.py).
            problems.add(
                "subnetIds",
                f"{vpc_id} has several S3 gateway endpoints; the stack's bucket admits its instances through "
                "one: list subnets whose route tables one endpoint serves",
                "'[\"subnet-0123456789abcdef0\"]'",
            )
        elif config.create_vpc_endpoints:
            return "", ""
        else:
            problems.add(
                "vpcId",
                f"{vpc_id} has no S3 gateway endpoint ({service}), through which alone the stack's bucket "
                f"admits its instances; {create}",
                "true",
                fix_key="createVpcEndpoints",
            )
        return "", ""
    for table in route_table_ids:
        if table not in (endpoint.route_table_ids or []):
            subnets = ", ".join(tables[table])
            problems.add(
                "subnetIds",
                f"the S3 gateway endpoint {endpoint.id} is not on {table}, the route table of {subnets}; add "
                f"it (aws ec2 modify-vpc-endpoint --vpc-endpoint-id {endpoint.id} --add-route-table-ids "
                f"{table}) or list other subnets",
                "'[\"subnet-0123456789abcdef0\"]'",
            )
    if _allows_any_bucket(endpoint.policy):
        # Not refused: the endpoint is the VPC owner's to scope; the bucket still refuses other roles.
        pulumi.log.warn(
            f"{NAMESPACE}:vpcId: the S3 gateway endpoint {endpoint.id} of {vpc_id} admits any bucket; the "
            "stack's own endpoint admits only its bucket and a few AWS-owned ones (s3_endpoint_policy in "
            "infra/network.py): ask the VPC's owner to scope it if the data must not leave"
        )
    return endpoint.id, endpoint.prefix_list_id


def _check_interface_endpoints(config: StackConfig, problems: Problems) -> tuple[str, ...]:
    """networkIsolation: each INTERFACE_ENDPOINTS service has an available endpoint with private DNS in the
    VPC; the missing ones, which the stack creates with createVpcEndpoints (else one problem each)."""
    missing: list[str] = []
    for service, why in INTERFACE_ENDPOINTS.items():
        name = f"com.amazonaws.{config.region}.{service}"
        try:
            endpoint = aws.ec2.get_vpc_endpoint(
                vpc_id=config.vpc_id, service_name=name, vpc_endpoint_type="Interface", state="available"
            )
        except Exception:
            if config.create_vpc_endpoints:
                missing.append(service)
            else:
                problems.add(
                    "vpcId",
                    f"{config.vpc_id} has no interface endpoint {name}, which networkIsolation needs for "
                    f"{why}; create it with private DNS (aws ec2 create-vpc-endpoint --vpc-endpoint-type "
                    f"Interface --vpc-id {config.vpc_id} --service-name {name} --private-dns-enabled ...) or "
                    "let the stack add it",
                    "true",
                    fix_key="createVpcEndpoints",
                )
            continue
        if not endpoint.private_dns_enabled:
            problems.add(
                "vpcId",
                f"the interface endpoint {endpoint.id} ({name}) has private DNS off, so the instances' SDKs "
                f"do not reach it; turn it on (aws ec2 modify-vpc-endpoint --vpc-endpoint-id {endpoint.id} "
                "--private-dns-enabled)",
                config.vpc_id,
            )
    return tuple(missing)


def _route_table(subnet_id: str, vpc: aws.ec2.GetVpcResult) -> aws.ec2.GetRouteTableResult:
    """The subnet's route table: its own association, else the VPC's main table (a subnet without an
    explicit association uses it, and the lookup by subnet finds none)."""
    try:
        return aws.ec2.get_route_table(subnet_id=subnet_id)
    except Exception:
        return aws.ec2.get_route_table(route_table_id=vpc.main_route_table_id)


def _route_target(route: aws.ec2.outputs.GetRouteTableRouteResult) -> str:
    for target in (
        route.nat_gateway_id,
        route.transit_gateway_id,
        route.gateway_id,
        route.network_interface_id,
        route.vpc_peering_connection_id,
        route.vpc_endpoint_id,
    ):
        if target:
            return target
    return "a gateway"


def _allows_any_bucket(policy: str | None) -> bool:
    """Whether an endpoint policy allows some action on every resource (AWS's default full-access policy)."""
    if not policy:
        return True
    try:
        document = json.loads(policy)
    except json.JSONDecodeError:
        return False
    statements = document.get("Statement", [])
    for statement in statements if isinstance(statements, list) else [statements]:
        resources = statement.get("Resource", [])
        resources = resources if isinstance(resources, list) else [resources]
        if statement.get("Effect") == "Allow" and "*" in resources:
            return True
    return False


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__


def _refuse(config: StackConfig, problems: Problems) -> typing.NoReturn:
    count = len(problems.lines)
    header = (
        f"stack '{config.stack}': the existing network {config.vpc_id} has {count} "
        f"problem{'s' if count > 1 else ''}:"
    )
    raise StackConfigError("\n".join([header, *(f"  - {line}" for line in problems.lines)]), problems.lines)

"""Network: a VPC over the zones that offer the GPU types, with no inbound path and logged traffic.

S3 traffic from the instances takes the VPC's gateway endpoint, whose policy admits this stack's bucket and
a few AWS-owned, read-only buckets (S3_ENDPOINT_AWS_BUCKETS); the bucket's own policy refuses the instance
role anywhere else (infra/storage.py). Egress is HTTPS only. With trainstack:networkIsolation the
instances sit in private subnets with no route out of the VPC at all: AWS APIs through interface
endpoints (INTERFACE_ENDPOINTS), S3 through the gateway endpoint, packages from the stack's own bucket.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_aws as aws

from infra.iam import common, service_roles

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


class Network(pulumi.ComponentResource):
    """VPC, subnets (public, private behind one NAT, or isolated), S3 gateway endpoint, flow logs, instance
    SG; under networkIsolation, interface endpoints instead of any route out."""

    vpc: aws.ec2.Vpc
    subnet_ids: list[pulumi.Output[str]]
    security_group: aws.ec2.SecurityGroup
    s3_endpoint: aws.ec2.VpcEndpoint
    interface_endpoints: list[aws.ec2.VpcEndpoint]
    _private_cidrs: list[str]
    _isolated_subnets: list[aws.ec2.Subnet]

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("trainstack:network:Network", name, None, opts)
        self._name = name
        self._args = args
        self._child = pulumi.ResourceOptions(parent=self)
        self.vpc = aws.ec2.Vpc(
            f"{name}-vpc",
            cidr_block=args.vpc_cidr,
            # SSM Session Manager and the S3 endpoint need VPC DNS.
            enable_dns_support=True,
            enable_dns_hostnames=True,
            tags={**args.tags, "Name": args.name},
            opts=self._child,
        )
        # EC2.2: adopting the default security group with no rules removes AWS's allow-all defaults.
        aws.ec2.DefaultSecurityGroup(
            f"{name}-default-sg",
            vpc_id=self.vpc.id,
            ingress=[],
            egress=[],
            tags={**args.tags, "Name": f"{args.name}-default-unused"},
            opts=self._child,
        )
        route_tables = self._create_isolated_subnets() if args.network_isolation else self._create_subnets()
        self.s3_endpoint = aws.ec2.VpcEndpoint(
            f"{name}-s3-endpoint",
            vpc_id=self.vpc.id,
            service_name=f"com.amazonaws.{args.region}.s3",
            vpc_endpoint_type="Gateway",
            route_table_ids=[table.id for table in route_tables],
            policy=pulumi.Output.from_input(args.bucket_arn).apply(
                lambda arn: json.dumps(
                    s3_endpoint_policy(bucket_arn=arn, account_id=args.account_id, region=args.region)
                )
            ),
            tags={**args.tags, "Name": f"{args.name}-s3"},
            opts=self._child,
        )
        self._create_flow_logs()
        self.interface_endpoints = []
        endpoint_group = self._create_endpoint_security_group() if args.network_isolation else None
        self.security_group = self._create_instance_security_group(endpoint_group)
        if endpoint_group is not None:
            self._create_interface_endpoints(endpoint_group)
        self.register_outputs(
            {
                "vpc_id": self.vpc.id,
                "subnet_ids": self.subnet_ids,
                "security_group_id": self.security_group.id,
                "s3_endpoint_id": self.s3_endpoint.id,
            }
        )

    def _create_subnets(self) -> list[aws.ec2.RouteTable]:
        args, name = self._args, self._name
        blocks = list(ipaddress.ip_network(args.vpc_cidr).subnets(prefixlen_diff=_SUBNET_BITS))
        gateway = aws.ec2.InternetGateway(
            f"{name}-igw", vpc_id=self.vpc.id, tags={**args.tags, "Name": args.name}, opts=self._child
        )
        public_table = aws.ec2.RouteTable(
            f"{name}-public-rt",
            vpc_id=self.vpc.id,
            routes=[aws.ec2.RouteTableRouteArgs(cidr_block=ANYWHERE_IPV4, gateway_id=gateway.id)],
            tags={**args.tags, "Name": f"{args.name}-public"},
            opts=self._child,
        )
        public_subnets: list[aws.ec2.Subnet] = []
        for index, zone in enumerate(args.zones):
            subnet = aws.ec2.Subnet(
                f"{name}-public-{zone}",
                vpc_id=self.vpc.id,
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
            vpc_id=self.vpc.id,
            routes=[aws.ec2.RouteTableRouteArgs(cidr_block=ANYWHERE_IPV4, nat_gateway_id=nat.id)],
            tags={**args.tags, "Name": f"{args.name}-private"},
            opts=self._child,
        )
        private_ids: list[pulumi.Output[str]] = []
        for index, zone in enumerate(args.zones):
            subnet = aws.ec2.Subnet(
                f"{name}-private-{zone}",
                vpc_id=self.vpc.id,
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
            vpc_id=self.vpc.id,
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
                vpc_id=self.vpc.id,
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
        self._isolated_subnets = subnets
        self.subnet_ids = [subnet.id for subnet in subnets]
        return [table]

    def _create_endpoint_security_group(self) -> aws.ec2.SecurityGroup:
        """The interface endpoints' group: HTTPS in from the instances' subnets (which hold nothing else but
        the endpoints themselves), nothing out (a group is stateful: replies need no rule)."""
        args = self._args
        return aws.ec2.SecurityGroup(
            f"{self._name}-endpoints-sg",
            vpc_id=self.vpc.id,
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

    def _create_interface_endpoints(self, group: aws.ec2.SecurityGroup) -> None:
        """One endpoint per service, private DNS on, so the SDKs' usual regional names resolve inside the VPC.

        In the first zone's subnet only: each endpoint bills per zone and hour (about 7 USD a month), and like
        the single NAT gateway, a zone outage only pauses a spot job.
        """
        args = self._args
        for service in INTERFACE_ENDPOINTS:
            self.interface_endpoints.append(
                aws.ec2.VpcEndpoint(
                    f"{self._name}-{service}-endpoint",
                    vpc_id=self.vpc.id,
                    service_name=f"com.amazonaws.{args.region}.{service}",
                    vpc_endpoint_type="Interface",
                    private_dns_enabled=True,
                    subnet_ids=[self._isolated_subnets[0].id],
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
            vpc_id=self.vpc.id,
            traffic_type="ALL",
            log_destination_type="cloud-watch-logs",
            log_destination=log_group.arn,
            iam_role_arn=role.arn,
            max_aggregation_interval=600,
            tags=args.tags,
            opts=self._child,
        )

    def _create_instance_security_group(
        self, endpoint_group: aws.ec2.SecurityGroup | None
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
        if endpoint_group is None:
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
                    prefix_list_ids=[self.s3_endpoint.prefix_list_id],
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
            vpc_id=self.vpc.id,
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

"""Network: a VPC over the zones that offer the GPU types, with no inbound path and logged traffic."""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

from infra import policies

# Each subnet is the VPC cut in 16: room for MAX_ZONES public and MAX_ZONES private subnets.
_SUBNET_BITS = 4

ANYWHERE_IPV4 = "0.0.0.0/0"  # default route and egress only: ingress from anywhere is refused


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
    # Multi-node jobs: the instances reach each other (NCCL, c10d, gloo, EFA) and nothing else does.
    peer_traffic: bool = False
    tags: dict[str, str] = field(default_factory=dict)


class Network(pulumi.ComponentResource):
    """VPC, subnets (public, or private behind one NAT), S3 gateway endpoint, flow logs, instance SG."""

    vpc: aws.ec2.Vpc
    subnet_ids: list[pulumi.Output[str]]
    security_group: aws.ec2.SecurityGroup

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
        route_tables = self._create_subnets()
        aws.ec2.VpcEndpoint(
            f"{name}-s3-endpoint",
            vpc_id=self.vpc.id,
            service_name=f"com.amazonaws.{args.region}.s3",
            vpc_endpoint_type="Gateway",
            route_table_ids=[table.id for table in route_tables],
            tags={**args.tags, "Name": f"{args.name}-s3"},
            opts=self._child,
        )
        self._create_flow_logs()
        self.security_group = self._create_instance_security_group()
        self.register_outputs(
            {
                "vpc_id": self.vpc.id,
                "subnet_ids": self.subnet_ids,
                "security_group_id": self.security_group.id,
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
                policies.assume_role_policy("vpc-flow-logs.amazonaws.com", account_id=args.account_id)
            ),
            tags=args.tags,
            opts=self._child,
        )
        aws.iam.RolePolicy(
            f"{name}-flow-logs-policy",
            role=role.id,
            policy=log_group.arn.apply(lambda arn: json.dumps(policies.flow_logs_policy(log_group_arn=arn))),
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

    def _create_instance_security_group(self) -> aws.ec2.SecurityGroup:
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
        # Outbound: HTTPS reaches every AWS API, the S3 endpoint and package indexes; HTTP only serves the
        # Ubuntu mirrors. DNS, NTP and instance metadata are link-local and not filtered by groups.
        egress = [
            aws.ec2.SecurityGroupEgressArgs(
                description=description,
                protocol="tcp",
                from_port=port,
                to_port=port,
                cidr_blocks=[ANYWHERE_IPV4],
            )
            for port, description in (
                (443, "HTTPS to AWS APIs, S3 and package indexes"),
                (80, "Ubuntu apt mirrors"),
            )
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

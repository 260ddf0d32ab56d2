"""trainstack:pools (issue 32, "Pools"): one or more Auto Scaling groups over one shared baseline.

Three parts. An existing stack (no trainstack:pools) diffs to nothing: its URNs and its group's, launch
template's, IAM's and capacity function's inputs are the program's from before pools, written out below as
literals (captured from that program under these same mocks). Preview refuses every bad pool in one line
naming `pools[<index>].<key>` and the fix. A stack of three pools gets three groups and templates over one
VPC, bucket, key, role, topic and log group, each pool's instances scaling only the stack's groups and each
capacity function only its own pool's.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import yaml

from bootstrap.agent_config import AgentConfig
from bootstrap.cloud_init import render_user_data
from infra.config import (
    DEFAULTS,
    MAX_NODES,
    MAX_POOLS,
    POOLS_EXAMPLE,
    StackConfig,
    StackConfigError,
    parse_stack_config,
)
from infra.fleet import pool_weights
from lambdas.capacity_fallback.handler import CostCap
from tests.iam.evaluate import Caller, Request, decide
from tests.iam.requests import Stack
from tests.infra.program import ACCOUNT_ID, RecordedResource, StackRun, example_config, run_stack

ASG = "aws:autoscaling/group:Group"
TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
URN_PREFIX = "urn:pulumi:dev::trainstack::"
DEFAULT_TYPES = ["g6.xlarge", "g5.xlarge", "g6e.xlarge", "g4dn.xlarge"]

# -- an existing stack diffs to nothing ---------------------------------------------------------------------

# Every URN of the example stack (Pulumi.dev.yaml) before pools, as the mock monitor makes them; {job} is the
# stack's default job's id (derived from its definition, not from anything pools change).
BEFORE_URNS = frozenset({
    "pulumi:pulumi:Stack$trainstack:capacity:CapacityFallback::capacity",
    "pulumi:pulumi:Stack$trainstack:fleet:Fleet::fleet",
    "pulumi:pulumi:Stack$trainstack:identity:Identity::identity",
    "pulumi:pulumi:Stack$trainstack:network:Network::network",
    "pulumi:pulumi:Stack$trainstack:observability:Observability::observability",
    "pulumi:pulumi:Stack$trainstack:queue:DefaultJob::default-job",
    "pulumi:pulumi:Stack$trainstack:storage:Storage::storage",
    "trainstack:capacity:CapacityFallback$aws:cloudwatch/eventRule:EventRule::capacity-group-events",
    "trainstack:capacity:CapacityFallback$aws:cloudwatch/eventRule:EventRule::capacity-schedule",
    "trainstack:capacity:CapacityFallback$aws:cloudwatch/eventTarget:EventTarget::capacity-group-events-target",
    "trainstack:capacity:CapacityFallback$aws:cloudwatch/eventTarget:EventTarget::capacity-schedule-target",
    "trainstack:capacity:CapacityFallback$aws:cloudwatch/logGroup:LogGroup::capacity-logs",
    "trainstack:capacity:CapacityFallback$aws:iam/role:Role::capacity-role",
    "trainstack:capacity:CapacityFallback$aws:iam/rolePolicy:RolePolicy::capacity-policy",
    "trainstack:capacity:CapacityFallback$aws:lambda/function:Function::capacity-function",
    "trainstack:capacity:CapacityFallback$aws:lambda/permission:Permission::capacity-group-events-invoke",
    "trainstack:capacity:CapacityFallback$aws:lambda/permission:Permission::capacity-schedule-invoke",
    "trainstack:fleet:Fleet$aws:autoscaling/group:Group::fleet-group",
    "trainstack:fleet:Fleet$aws:ec2/launchTemplate:LaunchTemplate::fleet-launch-template",
    "trainstack:fleet:Fleet$aws:s3/bucketObjectv2:BucketObjectv2::fleet-bundle",
    "trainstack:identity:Identity$aws:iam/instanceProfile:InstanceProfile::identity-instance-profile",
    "trainstack:identity:Identity$aws:iam/role:Role::identity-instance-role",
    "trainstack:identity:Identity$aws:iam/role:Role::identity-job-role",
    "trainstack:identity:Identity$aws:iam/rolePolicy:RolePolicy::identity-instance-policy",
    "trainstack:identity:Identity$aws:iam/rolePolicy:RolePolicy::identity-job-policy",
    "trainstack:identity:Identity$aws:iam/rolePolicy:RolePolicy::identity-session-manager",
    "trainstack:network:Network$aws:cloudwatch/logGroup:LogGroup::network-flow-logs",
    "trainstack:network:Network$aws:ec2/defaultSecurityGroup:DefaultSecurityGroup::network-default-sg",
    "trainstack:network:Network$aws:ec2/flowLog:FlowLog::network-flow-log",
    "trainstack:network:Network$aws:ec2/internetGateway:InternetGateway::network-igw",
    "trainstack:network:Network$aws:ec2/routeTable:RouteTable::network-public-rt",
    "trainstack:network:Network$aws:ec2/routeTableAssociation:RouteTableAssociation::network-public-us-east-1a-rta",
    "trainstack:network:Network$aws:ec2/routeTableAssociation:RouteTableAssociation::network-public-us-east-1b-rta",
    "trainstack:network:Network$aws:ec2/routeTableAssociation:RouteTableAssociation::network-public-us-east-1d-rta",
    "trainstack:network:Network$aws:ec2/securityGroup:SecurityGroup::network-instance-sg",
    "trainstack:network:Network$aws:ec2/subnet:Subnet::network-public-us-east-1a",
    "trainstack:network:Network$aws:ec2/subnet:Subnet::network-public-us-east-1b",
    "trainstack:network:Network$aws:ec2/subnet:Subnet::network-public-us-east-1d",
    "trainstack:network:Network$aws:ec2/vpc:Vpc::network-vpc",
    "trainstack:network:Network$aws:ec2/vpcEndpoint:VpcEndpoint::network-s3-endpoint",
    "trainstack:network:Network$aws:iam/role:Role::network-flow-logs-role",
    "trainstack:network:Network$aws:iam/rolePolicy:RolePolicy::network-flow-logs-policy",
    "trainstack:observability:Observability$aws:budgets/budget:Budget::observability-budget",
    "trainstack:observability:Observability$aws:cloudwatch/dashboard:Dashboard::observability-dashboard",
    "trainstack:observability:Observability$aws:cloudwatch/eventRule:EventRule::observability-group-activity",
    "trainstack:observability:Observability$aws:cloudwatch/eventRule:EventRule::observability-rebalance",
    "trainstack:observability:Observability$aws:cloudwatch/eventRule:EventRule::observability-spot-warning",
    "trainstack:observability:Observability$aws:cloudwatch/eventTarget:EventTarget::observability-group-activity-to-sns",
    "trainstack:observability:Observability$aws:cloudwatch/eventTarget:EventTarget::observability-rebalance-to-sns",
    "trainstack:observability:Observability$aws:cloudwatch/eventTarget:EventTarget::observability-spot-warning-to-sns",
    "trainstack:observability:Observability$aws:cloudwatch/logGroup:LogGroup::observability-logs",
    "trainstack:observability:Observability$aws:cloudwatch/metricAlarm:MetricAlarm::observability-gpu-idle",
    "trainstack:observability:Observability$aws:sns/topic:Topic::observability-alerts",
    "trainstack:observability:Observability$aws:sns/topicPolicy:TopicPolicy::observability-alerts-policy",
    "trainstack:queue:DefaultJob$aws:s3/bucketObjectv2:BucketObjectv2::default-job-{job}-entry",
    "trainstack:queue:DefaultJob$aws:s3/bucketObjectv2:BucketObjectv2::default-job-{job}-record",
    "trainstack:storage:Storage$aws:kms/alias:Alias::storage-key-alias",
    "trainstack:storage:Storage$aws:kms/key:Key::storage-key",
    "trainstack:storage:Storage$aws:s3/bucket:Bucket::storage-access-logs",
    "trainstack:storage:Storage$aws:s3/bucket:Bucket::storage-bucket",
    "trainstack:storage:Storage$aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration::storage-access-logs-lifecycle",
    "trainstack:storage:Storage$aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration::storage-lifecycle",
    "trainstack:storage:Storage$aws:s3/bucketLogging:BucketLogging::storage-access-logging",
    "trainstack:storage:Storage$aws:s3/bucketOwnershipControls:BucketOwnershipControls::storage-access-logs-ownership",
    "trainstack:storage:Storage$aws:s3/bucketOwnershipControls:BucketOwnershipControls::storage-ownership",
    "trainstack:storage:Storage$aws:s3/bucketPolicy:BucketPolicy::storage-access-logs-policy",
    "trainstack:storage:Storage$aws:s3/bucketPolicy:BucketPolicy::storage-policy",
    "trainstack:storage:Storage$aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock::storage-access-logs-public-access-block",
    "trainstack:storage:Storage$aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock::storage-public-access-block",
    "trainstack:storage:Storage$aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration::storage-access-logs-encryption",
    "trainstack:storage:Storage$aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration::storage-encryption",
    "trainstack:storage:Storage$aws:s3/bucketVersioning:BucketVersioning::storage-access-logs-versioning",
    "trainstack:storage:Storage$aws:s3/bucketVersioning:BucketVersioning::storage-versioning",
})  # fmt: skip
# The group's and the launch template's inputs before pools (the template's user-data: BEFORE_AGENT_CONFIG).
BEFORE_GROUP: dict[str, Any] = {
    "capacityRebalance": True,
    "desiredCapacity": 1,
    "enabledMetrics": ["GroupDesiredCapacity", "GroupInServiceInstances", "GroupTotalInstances"],
    "forceDelete": True,
    "healthCheckGracePeriod": 300,
    "healthCheckType": "EC2",
    "initialLifecycleHooks": [
        {
            "defaultResult": "CONTINUE",
            "heartbeatTimeout": 600,
            "lifecycleTransition": "autoscaling:EC2_INSTANCE_TERMINATING",
            "name": "trainstack-drain",
        }
    ],
    "maxSize": 2,
    "metricsGranularity": "1Minute",
    "minSize": 0,
    "mixedInstancesPolicy": {
        "instancesDistribution": {
            "onDemandBaseCapacity": 0,
            "onDemandPercentageAboveBaseCapacity": 0,
            "spotAllocationStrategy": "price-capacity-optimized",
            "spotMaxPrice": "",
        },
        "launchTemplate": {
            "launchTemplateSpecification": {"launchTemplateId": "fleet-launch-template-id", "version": "1"},
            "overrides": [{"instanceType": t} for t in DEFAULT_TYPES],
        },
    },
    "name": "trainstack-dev-gpu",
    "tags": [
        {"key": "trainstack:project", "propagateAtLaunch": True, "value": "trainstack"},
        {"key": "trainstack:stack", "propagateAtLaunch": True, "value": "dev"},
        {"key": "Name", "propagateAtLaunch": True, "value": "trainstack-dev-gpu"},
    ],
    "vpcZoneIdentifiers": [
        "network-public-us-east-1a-id",
        "network-public-us-east-1b-id",
        "network-public-us-east-1d-id",
    ],
    "waitForCapacityTimeout": "0",
}
# Issue 36 weights a single-instance pool's types by expected throughput (trainstack_job/throughput.py's
# shipped estimate: T4 1, A10G 2, L4 2, L40S 6): the group's one change since pools, its sizes now in units.
WEIGHTS = {"g6.xlarge": "2", "g5.xlarge": "2", "g6e.xlarge": "6", "g4dn.xlarge": "1"}
WEIGHTED_GROUP: dict[str, Any] = {
    **BEFORE_GROUP,
    "maxSize": 2 * 6,
    "mixedInstancesPolicy": {
        **BEFORE_GROUP["mixedInstancesPolicy"],
        "launchTemplate": {
            **BEFORE_GROUP["mixedInstancesPolicy"]["launchTemplate"],
            "overrides": [{"instanceType": t, "weightedCapacity": WEIGHTS[t]} for t in DEFAULT_TYPES],
        },
    },
}
BEFORE_GROUP_OPTIONS = {
    "ignore_changes": ("desiredCapacity",),
    "depends_on": {
        "default-job-{job}-entry",
        "fleet-launch-template",
        "network-public-us-east-1a",
        "network-public-us-east-1b",
        "network-public-us-east-1d",
    },
}
_TAGS = {"trainstack:project": "trainstack", "trainstack:stack": "dev"}
BEFORE_TEMPLATE: dict[str, Any] = {
    "blockDeviceMappings": [
        {
            "deviceName": "/dev/sda1",
            "ebs": {
                "deleteOnTermination": "true",
                "encrypted": "true",
                "kmsKeyId": "arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab",
                "volumeSize": 150,
                "volumeType": "gp3",
            },
        }
    ],
    "description": "trainstack-dev: GPU training instances",
    "iamInstanceProfile": {"arn": "arn:aws:iam:us-east-1:123456789012:identity-instance-profile"},
    "imageId": "ami-0123456789abcdef0",
    "metadataOptions": {
        "httpEndpoint": "enabled",
        "httpPutResponseHopLimit": 1,
        "httpTokens": "required",
        "instanceMetadataTags": "enabled",
    },
    "name": "trainstack-dev-gpu",
    "networkInterfaces": [
        {
            "associatePublicIpAddress": "true",
            "deleteOnTermination": "true",
            "deviceIndex": 0,
            "securityGroups": ["network-instance-sg-id"],
        }
    ],
    "tagSpecifications": [
        {"resourceType": kind, "tags": {"Name": "trainstack-dev-gpu", **_TAGS}}
        for kind in ("instance", "volume", "network-interface")
    ],
    "tags": _TAGS,
    "updateDefaultVersion": True,
}
# What infra sets in the agent config its user-data carries (every other field is AgentConfig's default);
# the bundle's key and digest are the run's own (they change with the agent's code, not with pools).
BEFORE_AGENT_CONFIG: dict[str, Any] = {
    "region": "us-east-1",
    "bucket": "trainstack-dev-0123456789",
    "group_name": "trainstack-dev-gpu",
    "topic_arn": "arn:aws:sns:us-east-1:123456789012:trainstack-dev-alerts",
    "log_group": "/trainstack/dev",
    "stack": "dev",
    "gpu_required": True,
    "stall_minutes": 30.0,
    "max_consecutive_failures": 3,
    "max_cost_usd": None,
    "instance_count": 1,
    "min_nodes": 1,
    "root_volume_gb": 150,
    "efa": False,
    "lifecycle_hook": "trainstack-drain",
    "job": {},
    "user_job": None,
    "job_id": "",
    "job_name": "",
    "resume_from": None,
    "job_role_arn": "arn:aws:iam::123456789012:role/trainstack-dev-job",
}
_GROUP_ARN = (
    "arn:aws:autoscaling:us-east-1:123456789012:autoScalingGroup:*:autoScalingGroupName/trainstack-dev-gpu"
)
# The other inputs that name the group (IAM, the capacity function, the alerts), before pools.
BEFORE_GROUP_REFERENCES: dict[str, dict[str, Any]] = {
    "identity-instance-policy": {"ScaleOwnGroup": _GROUP_ARN},
    "capacity-policy": {"SwitchThisGroupsPurchaseOption": _GROUP_ARN},
    "capacity-role": {
        "name": "trainstack-dev-capacity-fallback",
        "description": "trainstack-dev capacity fallback: reads and switches trainstack-dev-gpu only",
    },
    "capacity-function": {
        "name": "trainstack-dev-capacity-fallback",
        "environment": {
            "variables": {
                "FALLBACK_MINUTES": "15",
                "GROUP_NAME": "trainstack-dev-gpu",
                "SPOT_ON_DEMAND_PERCENTAGE": "0",
            }
        },
    },
    "capacity-logs": {"name": "/trainstack/dev/capacity-fallback"},
    "capacity-group-events": {
        "name": "trainstack-dev-capacity-group-events",
        "description": "trainstack dev: launch failures and terminations -> capacity fallback",
        "eventPattern": '{"source": ["aws.autoscaling"], "detail-type": ["EC2 Instance Launch Unsuccessful", '
        '"EC2 Instance Terminate Successful"], "detail": {"AutoScalingGroupName": ["trainstack-dev-gpu"]}}',
    },
    "capacity-schedule": {"name": "trainstack-dev-capacity-schedule"},
    "observability-group-activity": {
        "name": "trainstack-dev-group-activity",
        "description": "trainstack dev: Launches and terminations in trainstack-dev-gpu",
        "eventPattern": '{"source": ["aws.autoscaling"], "detail-type": ["EC2 Instance Launch Successful", '
        '"EC2 Instance Terminate Successful", "EC2 Instance Launch Unsuccessful", "EC2 Instance Terminate '
        'Unsuccessful"], "detail": {"AutoScalingGroupName": ["trainstack-dev-gpu"]}}',
    },
    "observability-gpu-idle": {
        "name": "trainstack-dev-gpu-idle",
        "dimensions": {"AutoScalingGroupName": "trainstack-dev-gpu"},
        "alarmDescription": "trainstack dev: average GPU utilisation below 10% for 30 minutes: the job is "
        "stuck or starved of data while instances bill. Check `trainstack logs` (data_wait_fraction) or "
        "`trainstack stop`.",
    },
}


def _job(stack: StackRun) -> str:
    return str(stack.outputs["job_id"])


def _named(stack: StackRun) -> dict[str, RecordedResource]:
    return {resource.name: resource for resource in stack.resources}


def _agent_mapping(template: RecordedResource) -> dict[str, Any]:
    """The agent config a launch template's user-data writes to /etc/trainstack/agent.yaml."""
    document = yaml.safe_load(base64.b64decode(template.inputs["userData"]).decode())
    (entry,) = [f for f in document["write_files"] if f["path"] == "/etc/trainstack/agent.yaml"]
    mapping: dict[str, Any] = yaml.safe_load(entry["content"])
    return mapping


def _statements(resource: RecordedResource) -> dict[str, Any]:
    return {s["Sid"]: s for s in json.loads(resource.inputs["policy"])["Statement"]}


# What the scheduler (infra/scheduler.py) adds to every stack: new resources beside the old, none replaced.
SCHEDULER_URNS = frozenset(
    {"pulumi:pulumi:Stack$trainstack:scheduler:Scheduler::scheduler"}
    | {
        f"trainstack:scheduler:Scheduler${kind}::scheduler-{name}"
        for kind, name in (
            ("aws:cloudwatch/logGroup:LogGroup", "logs"),
            ("aws:iam/role:Role", "role"),
            ("aws:iam/rolePolicy:RolePolicy", "policy"),
            ("aws:lambda/function:Function", "function"),
            ("aws:s3/bucketNotification:BucketNotification", "bucket-events"),
            *(
                (kind, f"{rule}{suffix}")
                for rule in ("queue-entries", "pool-events", "schedule")
                for kind, suffix in (
                    ("aws:cloudwatch/eventRule:EventRule", ""),
                    ("aws:lambda/permission:Permission", "-invoke"),
                    ("aws:cloudwatch/eventTarget:EventTarget", "-target"),
                )
            ),
        )
    }
)


def test_an_existing_stack_keeps_every_urn(example_stack: StackRun) -> None:
    urns = {
        r.urn.removeprefix(URN_PREFIX).replace(_job(example_stack), "{job}") for r in example_stack.resources
    }
    assert urns == BEFORE_URNS | SCHEDULER_URNS


def test_an_existing_stacks_group_keeps_its_inputs_and_options(example_stack: StackRun) -> None:
    group = example_stack.one(ASG)
    assert group.inputs == WEIGHTED_GROUP
    assert group.ignore_changes == BEFORE_GROUP_OPTIONS["ignore_changes"]
    waits = {name.replace(_job(example_stack), "{job}") for name in group.depends_on}
    assert waits == BEFORE_GROUP_OPTIONS["depends_on"]


def test_an_existing_stacks_launch_template_keeps_its_inputs_and_user_data(example_stack: StackRun) -> None:
    template = example_stack.one(TEMPLATE)
    inputs = {key: value for key, value in template.inputs.items() if key != "userData"}
    assert inputs == BEFORE_TEMPLATE
    # The user-data is byte for byte what the program rendered before pools for the same agent code: the
    # agent config it set, on the bundle this run uploads.
    bundle_key = _named(example_stack)["fleet-bundle"].inputs["key"]
    sha256 = bundle_key.split("/")[1]
    before = AgentConfig(**BEFORE_AGENT_CONFIG, bundle_key=bundle_key, bundle_sha256=sha256)
    rendered = render_user_data(before, bundle_key=bundle_key, bundle_sha256=sha256)
    assert template.inputs["userData"] == base64.b64encode(rendered.encode()).decode()


def test_an_existing_stacks_iam_capacity_function_and_alerts_name_its_group_as_before(
    example_stack: StackRun,
) -> None:
    named = _named(example_stack)
    for name, expected in BEFORE_GROUP_REFERENCES.items():
        resource = named[name]
        if resource.type == "aws:iam/rolePolicy:RolePolicy":
            statements = _statements(resource)
            assert {sid: statements[sid]["Resource"] for sid in expected} == expected, name
        else:
            assert {key: resource.inputs.get(key) for key in expected} == expected, name


def _without_times(resource: RecordedResource) -> tuple[str, dict[str, Any], tuple[str, ...]]:
    """A resource as `pulumi up` diffs it, less the default job's submission time (ignore_changes)."""
    inputs = dict(resource.inputs)
    if "code" in inputs and hasattr(inputs["code"], "assets"):  # the capacity function's archive: its files
        inputs["code"] = {name: str(asset.path) for name, asset in inputs["code"].assets.items()}
    if resource.parent == "default-job" and "content" in inputs and not resource.name.endswith("-bundle"):
        content = json.loads(inputs["content"])
        for key in ("submitted_at", "created_at"):
            content.pop(key, None)
        inputs["content"] = content
    return resource.urn, inputs, tuple(sorted(resource.depends_on))


def test_the_single_group_moved_into_pools_as_default_diffs_to_nothing(example_stack: StackRun) -> None:
    """`pools: [{name: default, ...}]` with the single group's settings is the same stack: a pool is the one
    code path, and the pool named default keeps the single group's names."""
    moved = run_stack(
        {
            **example_config(),
            "trainstack:pools": [{"name": "default", "instanceTypes": DEFAULT_TYPES, "maxInstances": 1}],
        }
    )
    assert sorted(map(_without_times, moved.resources)) == sorted(
        map(_without_times, example_stack.resources)
    )
    assert moved.outputs == example_stack.outputs


# -- preview refuses every bad pool, one line each ---------------------------------------------------------

GOOD = {"name": "default", "instanceTypes": ["g6.xlarge", "g5.xlarge"], "maxInstances": 1}
BIG = {"name": "big", "instanceTypes": ["g6e.12xlarge", "g6.12xlarge"], "maxInstances": 2}


def _parse(pools: Any, stack: str = "dev", **overrides: Any) -> StackConfig:
    base = {k.split(":", 1)[1]: v for k, v in example_config().items() if k.startswith("trainstack:")}
    raw = {**base, "pools": pools if isinstance(pools, str) else json.dumps(pools), **overrides}
    return parse_stack_config(raw, region="us-east-1", project="trainstack", stack=stack)


def _problems(pools: Any, stack: str = "dev", **overrides: Any) -> list[str]:
    try:
        _parse(pools, stack, **overrides)
    except StackConfigError as error:
        return list(error.problems)
    return []


def _fix(pools: list[Any], line: str) -> list[Any]:
    """The pools with the line's own fix applied as `pulumi config set --path 'trainstack:pools[i].key' v`
    stores it: true and false as booleans, integers as numbers, anything else as a string."""
    import re
    import shlex

    found = re.search(r"`pulumi config set --path 'trainstack:pools\[(\d+)\]\.(\w+)' (.*)`\)$", line)
    assert found, f"no --path fix in: {line}"
    (text,) = shlex.split(found[3])
    value: Any = text
    if text in ("true", "false"):
        value = text == "true"
    elif re.fullmatch(r"-?\d+", text):
        value = int(text)
    fixed = [dict(pool) if isinstance(pool, dict) else pool for pool in pools]
    fixed[int(found[1])][found[2]] = value
    return fixed


REFUSALS = [
    # (pools, the line's key, a fragment of why); each also passes once its line's own fix is applied.
    ([GOOD, {**BIG, "name": "default"}], "pools[1].name", "is pools[0]'s name too"),
    ([{**GOOD, "name": "Big_GPU"}], "pools[0].name", "is not a pool name"),
    ([{**GOOD, "name": "-big"}], "pools[0].name", "is not a pool name"),
    ([{**GOOD, "name": "a-name-far-too-long"}], "pools[0].name", "is not a pool name"),
    # Stack dev's pool gpu would be stack dev-gpu's group, pool x-gpu-y stack dev-gpu-x's pool y.
    ([{**GOOD, "name": "gpu"}], "pools[0].name", "could be another stack's group"),
    ([{**GOOD, "name": "gpu-big"}], "pools[0].name", "has the word gpu in it"),
    ([{**GOOD, "name": "x-gpu-y"}], "pools[0].name", "has the word gpu in it"),
    ([{k: v for k, v in GOOD.items() if k != "name"}], "pools[0].name", "is required"),
    ([{**GOOD, "instanceTypes": []}], "pools[0].instanceTypes", "is empty"),
    ([{k: v for k, v in GOOD.items() if k != "instanceTypes"}], "pools[0].instanceTypes", "is required"),
    ([GOOD, {**BIG, "instanceTypes": ["g6.xlarge", "t3.large"]}], "pools[1].instanceTypes", "no NVIDIA GPU"),
    (
        [{**GOOD, "instanceTypes": ["g5g.xlarge", "g5.xlarge"]}],
        "pools[0].instanceTypes",
        "is refused: Graviton",
    ),
    ([{**GOOD, "instanceTypes": ["g5.xlarge", "g5.xlarge"]}], "pools[0].instanceTypes", "lists a type twice"),
    ([{**GOOD, "instanceTypes": "g5.xlarge"}], "pools[0].instanceTypes", "must be a list of strings"),
    (
        [GOOD, {**BIG, "maxInstances": 0}],
        "pools[1].maxInstances",
        f"must be between 1 and {MAX_NODES}, got 0",
    ),
    ([GOOD, {**BIG, "maxInstances": MAX_NODES + 1}], "pools[1].maxInstances", f"between 1 and {MAX_NODES}"),
    ([{k: v for k, v in GOOD.items() if k != "maxInstances"}], "pools[0].maxInstances", "is required"),
    ([{**GOOD, "maxInstances": "two"}], "pools[0].maxInstances", "must be an integer"),
    ([GOOD, {**BIG, "minNodes": 3}], "pools[1].minNodes", "must be between 1 and 2, got 3"),
    ([GOOD, {**BIG, "onDemandBaseCapacity": 3}], "pools[1].onDemandBaseCapacity", "maximum maxInstances=2"),
    (
        [{**GOOD, "onDemandPercentageAboveBase": 101}],
        "pools[0].onDemandPercentageAboveBase",
        "between 0 and 100",
    ),
    ([{**GOOD, "spotAllocationStrategy": "cheapest"}], "pools[0].spotAllocationStrategy", "unknown strategy"),
    ([{**GOOD, "spotMaxPrice": "-1"}], "pools[0].spotMaxPrice", "is not a positive USD/hour price"),
    ([{**GOOD, "spotFallbackMinutes": -1}], "pools[0].spotFallbackMinutes", "between 0 and 1440"),
    ([{**GOOD, "placementGroup": "maybe"}], "pools[0].placementGroup", "must be true or false"),
    ([{**GOOD, "minNodes": "two"}], "pools[0].minNodes", "must be an integer"),
    ([{**GOOD, "onDemandBaseCapacity": "none"}], "pools[0].onDemandBaseCapacity", "must be an integer"),
    ([{**GOOD, "spotMaxPrice": 5}], "pools[0].spotMaxPrice", "must be a string"),
    ([{**GOOD, "spotFallbackMinutes": "soon"}], "pools[0].spotFallbackMinutes", "must be an integer"),
    ([{**GOOD, "maxJobs": 0}], "pools[0].maxJobs", "between 1 and"),
    ([{**GOOD, "instanceType": ["g5.xlarge"]}], "pools[0].instanceType", "did you mean 'instanceTypes'?"),
]


@pytest.mark.parametrize(("pools", "key", "why"), REFUSALS, ids=[f"{r[1]}: {r[2]}" for r in REFUSALS])
def test_a_bad_pool_is_one_line_naming_its_key_and_a_fix_that_is_accepted(
    pools: list[Any], key: str, why: str
) -> None:
    (line,) = _problems(pools)
    assert line.startswith(f"trainstack:{key}: ") and why in line, line
    if "unknown key" in line:
        assert line.endswith(f"(remove it with `pulumi config rm --path 'trainstack:{key}'`)")
        return
    # The fix the line gives is accepted: no line about that key at all (not merely another reason).
    fixed = _problems(_fix(pools, line))
    assert not [p for p in fixed if p.startswith(f"trainstack:{key}: ")], f"the fix is refused too: {fixed}"


def test_a_pool_that_is_not_a_mapping_is_one_line() -> None:
    assert _problems([GOOD, "big"]) == [
        "trainstack:pools[1]: must be a mapping with name, instanceTypes and maxInstances, got 'big' "
        "(e.g. `pulumi config set --path 'trainstack:pools[1].name' big`)"
    ]


@pytest.mark.parametrize("pools", ["not-a-number", "-5", '{"name": "big"}', [GOOD] * (MAX_POOLS + 1)])
def test_pools_that_are_not_a_short_list_are_one_line_with_an_example_that_is_accepted(pools: Any) -> None:
    (line,) = _problems(pools)
    assert line.startswith("trainstack:pools: ") and line.endswith(
        f"(e.g. `pulumi config set trainstack:pools {POOLS_EXAMPLE}`)"
    )
    import shlex

    (example,) = shlex.split(POOLS_EXAMPLE)
    config = _parse(example)
    assert [pool.name for pool in config.pools] == ["default", "big"]


def test_a_pool_name_too_long_for_its_aws_names_is_refused_with_one_that_fits() -> None:
    stack = "a-long-stack-name-team"
    (line,) = _problems([{**GOOD, "name": "research-gpus"}], stack=stack)
    assert line.startswith(
        "trainstack:pools[0].name: 'research-gpus' makes the pool's AWS names too long "
        "('trainstack-a-long-stack-name-team-capacity-research-gpus-group-events' is 69 characters, AWS "
        "allows 64); use a name of at most 8 characters (e.g. `pulumi config set --path "
        "'trainstack:pools[0].name' research`)"
    )
    assert _problems(_fix([{**GOOD, "name": "research-gpus"}], line), stack=stack) == []
    # A stack name that leaves no room: the pool named default carries none in its AWS names.
    (line,) = _problems([{**GOOD, "name": "big"}], stack="x" * 30)
    assert "only the pool named default" in line
    assert _problems(_fix([{**GOOD, "name": "big"}], line), stack="x" * 30) == []


def test_pools_together_with_the_single_groups_keys_is_one_line_saying_which_to_keep() -> None:
    assert _problems([GOOD], instanceCount="2", spotMaxPrice="0.5") == [
        "trainstack:pools: replaces the single group's keys, and trainstack:instanceCount, "
        "trainstack:spotMaxPrice are set too; keep one: the pools (set each pool's own values in "
        "trainstack:pools, then `pulumi config rm trainstack:instanceCount && pulumi config rm "
        "trainstack:spotMaxPrice`), or the single group (`pulumi config rm trainstack:pools`)"
    ]
    # At their defaults they are not set: the engine hands the program Pulumi.yaml's defaults as values.
    defaults = {key: DEFAULTS[key] for key in ("instanceCount", "spotMaxPrice", "placementStrategy")}
    assert (
        _problems(
            [GOOD], **{k: json.dumps(v) if isinstance(v, list) else str(v) for k, v in defaults.items()}
        )
        == []
    )


def test_an_efa_pool_in_public_subnets_is_refused_as_the_single_group_is() -> None:
    efa = {"name": "efa", "instanceTypes": ["p5.48xlarge", "p5e.48xlarge"], "maxInstances": 2}
    assert _problems([GOOD, {**efa, "placementGroup": True}]) == [
        "trainstack:privateSubnets: p5.48xlarge gets 32 EFA interfaces (one per network card) and AWS gives "
        "no public address to an instance with several network interfaces, so in a public subnet it could "
        "not reach S3 or the AWS APIs; private subnets reach them through the NAT gateway "
        "(e.g. `pulumi config set trainstack:privateSubnets true`)"
    ]
    assert _problems([GOOD, efa]) == [], "without a placement group: no EFA"
    assert _parse([GOOD, {**efa, "placementGroup": True}], privateSubnets="true").pools[1].efa
    # One instance trains alone: no placement group, no EFA, so a public subnet serves it.
    assert _problems([GOOD, {**efa, "maxInstances": 1, "placementGroup": True}]) == []
    # Types whose network cards differ cannot share the pool's one template: named at the pool's own key.
    mixed = {**efa, "instanceTypes": ["p5.48xlarge", "p4d.24xlarge"], "placementGroup": True}
    (line,) = _problems([GOOD, mixed], privateSubnets="true")
    assert line.startswith("trainstack:pools[1].instanceTypes: p5.48xlarge (32 network cards), p4d.24xlarge")


def test_the_default_job_must_fit_every_pool_any_of_whose_agents_may_take_it() -> None:
    (line,) = _problems([GOOD, {**BIG, "maxInstances": 3}])
    assert line.startswith("trainstack:pools[1].minNodes: train.batch_size 256 of trainstack:trainingConfig ")
    assert "(minNodes..maxInstances = 1..3)" in line
    (line,) = _problems([GOOD, BIG], job="examples/charlm/job.yaml")
    assert line.startswith("trainstack:pools[1].maxInstances: 2 nodes with trainstack:job: a user's job runs")
    assert "any pool may run the stack's default job" in line


def test_a_pool_without_types_still_has_its_size_checked() -> None:
    problems = _problems([{"name": "big", "maxInstances": 0}])
    assert "trainstack:pools[0].instanceTypes: is required" in "\n".join(problems), problems
    (size,) = [p for p in problems if p.startswith("trainstack:pools[0].maxInstances: ")]
    assert "(instances training one job; above 1 they train it together (docs/multi-node.md))" in size, size


def test_a_pool_keeps_every_setting_it_was_given() -> None:
    given = {
        **GOOD,
        "spotMaxPrice": "0.75",
        "spotAllocationStrategy": "capacity-optimized",
        "onDemandBaseCapacity": 1,
        "onDemandPercentageAboveBase": 50,
        "spotFallbackMinutes": 30,
        "placementGroup": False,
    }
    pool = _parse([given]).pools[0]
    assert (pool.spot_max_price, pool.spot_allocation_strategy, pool.spot_fallback_minutes) == (
        "0.75",
        "capacity-optimized",
        30,
    )
    assert (pool.on_demand_base_capacity, pool.on_demand_percentage_above_base, pool.placement_group) == (
        1,
        50,
        False,
    )


def test_an_empty_pools_list_is_the_single_group() -> None:
    empty: Any
    for empty in ("[]", "", []):
        config = _parse(empty)
        assert (config.declared_pools, [p.name for p in config.pools]) == ((), ["default"])


def test_the_single_groups_fields_describe_the_first_pool() -> None:
    """The CLI (doctor, estimate, prices) reads the single group's fields: with pools, the default pool's."""
    config = _parse([{**BIG, "onDemandBaseCapacity": 1, "placementGroup": True}, GOOD])
    assert (config.group_name, config.instance_types, config.instance_count) == (
        "trainstack-dev-gpu-big",
        ("g6e.12xlarge", "g6.12xlarge"),
        2,
    )
    assert (config.on_demand_base_capacity, config.placement_strategy) == (1, "cluster")
    assert config.group_names == ("trainstack-dev-gpu-big", "trainstack-dev-gpu")
    assert [pool.default for pool in config.pools] == [True, False]


# -- a stack of pools: one group and template each, over one baseline --------------------------------------

FUNCTION = "aws:lambda/function:Function"
POOLS: list[dict[str, Any]] = [
    {"name": "default", "instanceTypes": DEFAULT_TYPES, "maxInstances": 1},
    # Two nodes in a cluster placement group, one instance on-demand first, back to on-demand after 5 min.
    {
        "name": "big",
        "instanceTypes": ["g5.xlarge", "g4dn.xlarge"],
        "maxInstances": 2,
        "onDemandBaseCapacity": 1,
        "spotFallbackMinutes": 5,
        "placementGroup": True,
    },
    # L4/L40S only (offered in us-east-1a and 1d of the mocked region), never on-demand: no function.
    {
        "name": "l4",
        "instanceTypes": ["g6.xlarge", "g6e.xlarge"],
        "maxInstances": 1,
        "spotAllocationStrategy": "capacity-optimized",
        "spotFallbackMinutes": 0,
    },
]
# The single-instance pools' weights: the l4 pool's slowest type is its L4 (an L40S is three of it).
POOL_WEIGHTS = {"default": [WEIGHTS[t] for t in DEFAULT_TYPES], "l4": ["1", "3"]}
GROUPS = {"default": "trainstack-dev-gpu", "big": "trainstack-dev-gpu-big", "l4": "trainstack-dev-gpu-l4"}
# What one pool adds to the stack (its capacity function's resources only when that is on).
FLEET_TYPES = ["trainstack:fleet:Fleet", TEMPLATE, ASG, "aws:cloudwatch/metricAlarm:MetricAlarm"]
CAPACITY_TYPES = [
    "trainstack:capacity:CapacityFallback",
    "aws:cloudwatch/logGroup:LogGroup",
    "aws:iam/role:Role",
    "aws:iam/rolePolicy:RolePolicy",
    "aws:lambda/function:Function",
    *["aws:cloudwatch/eventRule:EventRule", "aws:lambda/permission:Permission"] * 2,
    *["aws:cloudwatch/eventTarget:EventTarget"] * 2,
]


@pytest.fixture(scope="module")
def pools_stack() -> StackRun:
    # With a stack-wide limit: every pool's agents and the scheduler know it; nothing else changes.
    return run_stack({**example_config(), "trainstack:pools": POOLS, "trainstack:maxConcurrentJobs": "3"})


def _groups(stack: StackRun) -> dict[str, RecordedResource]:
    return {group.inputs["name"]: group for group in stack.of_type(ASG)}


def _template_of(stack: StackRun, group: RecordedResource) -> RecordedResource:
    spec = group.inputs["mixedInstancesPolicy"]["launchTemplate"]["launchTemplateSpecification"]
    return _named(stack)[spec["launchTemplateId"].removesuffix("-id")]


def test_a_pool_adds_its_own_group_and_template_and_nothing_the_baseline_has(
    example_stack: StackRun, pools_stack: StackRun
) -> None:
    from collections import Counter

    added = Counter(r.type for r in pools_stack.resources) - Counter(r.type for r in example_stack.resources)
    # big: its fleet, a placement group and its capacity function; l4: its fleet only (fallback 0).
    expected = Counter([*FLEET_TYPES, *FLEET_TYPES, "aws:ec2/placementGroup:PlacementGroup", *CAPACITY_TYPES])
    assert added == expected
    assert not Counter(r.type for r in example_stack.resources) - Counter(
        r.type for r in pools_stack.resources
    )


def test_each_pool_is_a_group_launching_its_own_template_and_types(pools_stack: StackRun) -> None:
    groups = _groups(pools_stack)
    assert set(groups) == set(GROUPS.values())
    for pool in POOLS:
        group = groups[GROUPS[pool["name"]]]
        template = _template_of(pools_stack, group)
        assert template.inputs["name"] == group.inputs["name"] == GROUPS[pool["name"]]
        assert (
            template.parent
            == group.parent
            == ("fleet" if pool["name"] == "default" else f"fleet-{pool['name']}")
        )
        policy = group.inputs["mixedInstancesPolicy"]
        assert [o["instanceType"] for o in policy["launchTemplate"]["overrides"]] == pool["instanceTypes"]
        weights = [o.get("weightedCapacity") for o in policy["launchTemplate"]["overrides"]]
        if pool["maxInstances"] == 1:
            # One instance of one job: weighted relative to its own slowest type, sizes in those units.
            assert weights == POOL_WEIGHTS[pool["name"]]
            heaviest = max(int(w) for w in weights)
            assert group.inputs["maxSize"] == (pool["maxInstances"] + 1) * heaviest
        else:
            # Several instances per job: AWS could meet N units with fewer, heavier instances; unweighted.
            assert weights == [None] * len(pool["instanceTypes"])
            assert group.inputs["maxSize"] == pool["maxInstances"] + 1
        distribution = policy["instancesDistribution"]
        assert distribution["onDemandBaseCapacity"] == pool.get("onDemandBaseCapacity", 0)
        assert distribution["spotAllocationStrategy"] == pool.get(
            "spotAllocationStrategy", "price-capacity-optimized"
        )
        assert group.ignore_changes == ("desiredCapacity",)
    # The default pool starts with the stack's default job; the others wait at zero for work.
    assert [groups[GROUPS[p["name"]]].inputs["desiredCapacity"] for p in POOLS] == [1, 0, 0]
    assert groups[GROUPS["default"]].inputs == WEIGHTED_GROUP, "the default pool is the single group"


def test_every_pool_shares_the_stacks_role_network_key_and_bundle(pools_stack: StackRun) -> None:
    templates = pools_stack.of_type(TEMPLATE)
    assert len(templates) == 3
    for key in (
        "iamInstanceProfile",
        "imageId",
        "metadataOptions",
        "blockDeviceMappings",
        "networkInterfaces",
    ):
        assert all(t.inputs[key] == templates[0].inputs[key] for t in templates), key
    (bundle,) = [
        r for r in pools_stack.of_type("aws:s3/bucketObjectv2:BucketObjectv2") if r.name.endswith("-bundle")
    ]
    assert bundle.name == "fleet-bundle"
    configs = {t.inputs["name"]: _agent_mapping(t) for t in templates}
    assert {c["bundle_key"] for c in configs.values()} == {bundle.inputs["key"]}
    groups = _groups(pools_stack)
    # The default pool's group waits for the stack's default job; the others for the bundle they boot.
    assert f"default-job-{_job(pools_stack)}-entry" in groups[GROUPS["default"]].depends_on
    for pool in ("big", "l4"):
        assert "fleet-bundle" in groups[GROUPS[pool]].depends_on


def test_each_pools_user_data_carries_its_group_and_size(pools_stack: StackRun) -> None:
    configs = {t.inputs["name"]: _agent_mapping(t) for t in pools_stack.of_type(TEMPLATE)}
    for pool in POOLS:
        loaded = AgentConfig.from_mapping(configs[GROUPS[pool["name"]]])
        assert (loaded.group_name, loaded.instance_count, loaded.min_nodes, loaded.efa) == (
            GROUPS[pool["name"]],
            pool["maxInstances"],
            1,
            False,
        )
        # A pool other than the default names itself: its instances take only its jobs.
        assert loaded.pool == ("" if pool is POOLS[0] else pool["name"])
        assert loaded.max_concurrent_jobs == 3, "the stack's run slots, shared by every pool"
    # Nothing else differs between pools.
    shared = [
        {k: v for k, v in c.items() if k not in ("group_name", "instance_count", "pool")}
        for c in configs.values()
    ]
    assert all(c == shared[0] for c in shared)


def test_a_pool_launches_only_into_the_zones_that_offer_its_types(pools_stack: StackRun) -> None:
    groups = _groups(pools_stack)
    subnets = {name: group.inputs["vpcZoneIdentifiers"] for name, group in groups.items()}
    assert subnets[GROUPS["default"]] == [f"network-public-us-east-1{z}-id" for z in "abd"]
    assert subnets[GROUPS["l4"]] == ["network-public-us-east-1a-id", "network-public-us-east-1d-id"]
    # A cluster placement group lives in one zone: the pool's first.
    (placement,) = pools_stack.of_type("aws:ec2/placementGroup:PlacementGroup")
    assert (placement.name, placement.parent, placement.inputs["strategy"]) == (
        "fleet-big-placement",
        "fleet-big",
        "cluster",
    )
    assert groups[GROUPS["big"]].inputs["placementGroup"] == "fleet-big-placement"
    assert subnets[GROUPS["big"]] == ["network-public-us-east-1a-id"]
    assert "placementGroup" not in groups[GROUPS["default"]].inputs


def _allowed(document: dict[str, Any], action: str, group: str) -> bool:
    stack = Stack("trainstack-dev", "us-east-1", ACCOUNT_ID)
    caller = Caller("role", f"arn:aws:iam::{ACCOUNT_ID}:role/r", ACCOUNT_ID, [document])
    return decide(Request(action, stack.group_arn(group)), caller, None, key_policy=False).allowed


def test_the_instance_role_scales_and_drains_every_pool_and_no_other_group(pools_stack: StackRun) -> None:
    document = json.loads(_named(pools_stack)["identity-instance-policy"].inputs["policy"])
    for action in ("autoscaling:SetDesiredCapacity", "autoscaling:CompleteLifecycleAction"):
        assert all(_allowed(document, action, group) for group in GROUPS.values()), action
        # Named one by one, never by a prefix another stack's (or a later pool's) group could share.
        for other in ("trainstack-dev-gpu-big2", "trainstack-dev-gpu-l", "trainstack-dev2-gpu", "x-gpu"):
            assert not _allowed(document, action, other), other


def test_each_pools_capacity_function_switches_its_own_group_only(pools_stack: StackRun) -> None:
    named = _named(pools_stack)
    functions = {
        f.parent: f for f in pools_stack.of_type("aws:lambda/function:Function") if f.parent != "scheduler"
    }
    assert set(functions) == {"capacity", "capacity-big"}, "l4 never falls back (spotFallbackMinutes 0)"
    big = functions["capacity-big"]
    assert big.inputs["name"] == "trainstack-dev-capacity-fallback-big"
    assert big.inputs["environment"]["variables"] == {
        "GROUP_NAME": "trainstack-dev-gpu-big",
        "FALLBACK_MINUTES": "5",
        "SPOT_ON_DEMAND_PERCENTAGE": "0",
    }
    assert named["capacity-big-logs"].inputs["name"] == "/trainstack/dev/capacity-fallback/big"
    assert named["capacity-big-role"].inputs["name"] == "trainstack-dev-capacity-fallback-big"
    events = named["capacity-big-group-events"]
    assert events.inputs["name"] == "trainstack-dev-capacity-big-group-events"
    assert json.loads(events.inputs["eventPattern"])["detail"] == {"AutoScalingGroupName": [GROUPS["big"]]}
    assert "fleet-big-group" in events.depends_on
    for policy, own in (("capacity-policy", "default"), ("capacity-big-policy", "big")):
        document = json.loads(named[policy].inputs["policy"])
        for pool, group in GROUPS.items():
            assert _allowed(document, "autoscaling:UpdateAutoScalingGroup", group) == (pool == own), policy


def test_outputs_describe_the_default_pool_as_before_and_list_every_pool(
    example_stack: StackRun, pools_stack: StackRun
) -> None:
    outputs = pools_stack.outputs
    for key in ("group_name", "instance_count", "instance_types", "ssm_session_command"):
        assert outputs[key] == example_stack.outputs[key], key
    assert outputs["pools"] == {
        pool["name"]: {
            "group_name": GROUPS[pool["name"]],
            "instance_types": pool["instanceTypes"],
            "max_instances": pool["maxInstances"],
            "default": pool["name"] == "default",
            "max_jobs": 1,
        }
        for pool in POOLS
    }
    assert example_stack.outputs["pools"] == {
        "default": {
            "group_name": "trainstack-dev-gpu",
            "instance_types": DEFAULT_TYPES,
            "max_instances": 1,
            "default": True,
            "max_jobs": 1,
        }
    }


def test_every_pools_launches_and_idle_gpus_reach_the_topic(pools_stack: StackRun) -> None:
    named = _named(pools_stack)
    pattern = json.loads(named["observability-group-activity"].inputs["eventPattern"])
    assert pattern["detail"] == {"AutoScalingGroupName": list(GROUPS.values())}
    alarms = {a.name: a.inputs for a in pools_stack.of_type("aws:cloudwatch/metricAlarm:MetricAlarm")}
    assert {name: a["dimensions"]["AutoScalingGroupName"] for name, a in alarms.items()} == {
        "observability-gpu-idle": GROUPS["default"],
        "observability-gpu-idle-big": GROUPS["big"],
        "observability-gpu-idle-l4": GROUPS["l4"],
    }
    assert alarms["observability-gpu-idle-big"]["name"] == "trainstack-dev-gpu-idle-big"


def test_a_default_pool_of_another_name_is_the_stacks_default_group() -> None:
    """The first pool is the default pool whatever its name: it runs the default job and `group_name` names
    it; only a pool named default keeps the single group's resources."""
    run = run_stack({**example_config(), "trainstack:pools": [{**POOLS[2], "name": "main"}, POOLS[0]]})
    groups = _groups(run)
    main, default = groups["trainstack-dev-gpu-main"], groups["trainstack-dev-gpu"]
    assert (main.parent, main.inputs["desiredCapacity"], default.inputs["desiredCapacity"]) == (
        "fleet-main",
        1,
        0,
    )
    assert f"default-job-{_job(run)}-entry" in main.depends_on
    assert run.outputs["group_name"] == "trainstack-dev-gpu-main"
    assert run.outputs["instance_types"] == POOLS[2]["instanceTypes"]
    (bundle,) = [r for r in run.of_type("aws:s3/bucketObjectv2:BucketObjectv2") if r.name.endswith("-bundle")]
    assert bundle.parent == "fleet-main"


def test_a_pool_whose_types_no_zone_offers_is_refused_naming_the_pool() -> None:
    with pytest.raises(StackConfigError) as error:
        run_stack(
            {
                **example_config(),
                "trainstack:pools": [
                    POOLS[0],
                    {**POOLS[2], "instanceTypes": ["p4d.24xlarge", "p5.48xlarge"]},
                ],
            }
        )
    assert str(error.value).startswith(
        "trainstack:pools[1].instanceTypes: p4d.24xlarge not offered in any Availability Zone of us-east-1"
    )


def test_the_readme_and_example_stack_pools_are_accepted() -> None:
    """The pools the README shows (and Pulumi.dev.yaml's commented example) pass preview as written."""
    import re

    from tests.infra.program import EXAMPLE_STACK, REPO_ROOT

    readme = (REPO_ROOT / "README.md").read_text()
    (block,) = re.findall(
        r"```yaml\n(# Pulumi.<stack>.yaml\nconfig:\n  trainstack:pools:\n.*?)```", readme, re.S
    )
    pools = yaml.safe_load(block)["config"]["trainstack:pools"]
    assert [(p.name, p.placement_group, p.efa) for p in _parse(pools).pools] == [
        ("default", False, False),
        ("big", True, True),
    ]
    example = EXAMPLE_STACK.read_text()
    commented = re.search(r"^  # trainstack:pools:\n((?:  #   .*\n)+)", example, re.M)
    assert commented, "Pulumi.dev.yaml shows trainstack:pools commented out"
    lines = "".join(line.replace("  #", "", 1) for line in commented.group(1).splitlines(keepends=True))
    assert [p.name for p in _parse(yaml.safe_load(lines)).pools] == ["default", "big"]


def test_the_cli_reads_pools_from_the_stack_file_as_preview_does() -> None:
    """The CLI hands the stack file's parsed YAML (a list, not JSON text) to the same schema."""
    from infra.config import read_stack_config

    config = read_stack_config(
        {"aws:region": "eu-west-1", "trainstack:pools": [GOOD, BIG]}, project="trainstack", stack="prod"
    )
    assert config.group_names == ("trainstack-prod-gpu", "trainstack-prod-gpu-big")
    with pytest.raises(StackConfigError) as error:
        read_stack_config(
            {"trainstack:pools": [GOOD, {**BIG, "maxInstances": 0}]},
            project="t",
            stack="s",
            require_region=False,
        )
    assert [p.split(":")[1].split(" ")[0] for p in error.value.problems] == ["pools[1].maxInstances"]


def test_a_pools_cost_cap_reads_its_own_pools_current_job() -> None:
    # Each pool keeps its own pointer; its capacity function's cost cap follows that pool's job. The default
    # pool's function has no variable for it (its environment is as before pools).
    stack = run_stack({**example_config(), "trainstack:pools": POOLS, "trainstack:maxCostUsd": "50"})
    functions = {
        f.parent: f for f in stack.of_type("aws:lambda/function:Function") if f.parent != "scheduler"
    }
    variables = {name: f.inputs["environment"]["variables"] for name, f in functions.items()}
    assert variables["capacity-big"]["CURRENT_JOB"] == "current-job-big.json"
    assert "CURRENT_JOB" not in variables["capacity"]
    named = _named(stack)
    document = json.loads(named["capacity-big-policy"].inputs["policy"])
    reads = [
        r
        for s in document["Statement"]
        if s["Sid"] == "ReadTheCurrentJobsLedger"
        for r in ([s["Resource"]] if isinstance(s["Resource"], str) else s["Resource"])
    ]
    assert any(r.endswith("/state/current-job-big.json") for r in reads), reads
    cap = CostCap.from_env({**variables["capacity-big"], "BUCKET": "b", "TOPIC_ARN": "t"})
    assert cap is not None and cap.current_job_key == "state/current-job-big.json"


def test_a_pool_running_several_jobs_at_once_has_a_lane_each_and_room_for_their_standbys() -> None:
    pools = [
        {"name": "default", "instanceTypes": DEFAULT_TYPES, "maxInstances": 1},
        {"name": "many", "instanceTypes": DEFAULT_TYPES, "maxInstances": 1, "maxJobs": 4},
    ]
    stack = run_stack({**example_config(), "trainstack:pools": pools})
    groups = _groups(stack)
    # Each job's instance and its standby (or capacity rebalancing's replacement), for each job at once.
    # A pool of lanes stays unweighted (AWS could meet 4 units with one heavy instance): its sizes count
    # instances. A pool of one lane counts units: room for two instances of its heaviest type (L40S, 6).
    assert groups["trainstack-dev-gpu-many"].inputs["maxSize"] == 8
    many = groups["trainstack-dev-gpu-many"].inputs["mixedInstancesPolicy"]["launchTemplate"]["overrides"]
    assert all("weightedCapacity" not in o for o in many)
    assert groups["trainstack-dev-gpu"].inputs["maxSize"] == 2 * 6, "a pool of one lane: units"
    configs = {t.inputs["name"]: _agent_mapping(t) for t in stack.of_type(TEMPLATE)}
    assert configs["trainstack-dev-gpu-many"]["lanes"] == 4
    assert "lanes" not in configs["trainstack-dev-gpu"], "the default pool's user data is unchanged"
    assert stack.outputs["pools"]["many"]["max_jobs"] == 4


def test_several_jobs_at_once_are_refused_on_a_multi_node_pool_and_out_of_range() -> None:
    problems = _problems(
        [
            {"name": "default", "instanceTypes": DEFAULT_TYPES, "maxInstances": 2, "maxJobs": 2},
            {"name": "zero", "instanceTypes": DEFAULT_TYPES, "maxInstances": 1, "maxJobs": 0},
        ]
    )
    assert any(
        "trainstack:pools[0].maxJobs: several jobs at once run one-instance jobs" in p
        and "maxInstances is 2" in p
        and "`pulumi config set --path 'trainstack:pools[0].maxJobs' 1`" in p
        for p in problems
    ), problems
    assert any(p.startswith("trainstack:pools[1].maxJobs") for p in problems), problems


def test_max_concurrent_jobs_reaches_the_scheduler_and_the_outputs_only_when_set(
    example_stack: StackRun, pools_stack: StackRun
) -> None:
    def scheduler_env(stack: StackRun) -> dict[str, Any]:
        (function,) = [f for f in stack.of_type(FUNCTION) if f.parent == "scheduler"]
        variables: dict[str, Any] = function.inputs["environment"]["variables"]
        return variables

    assert scheduler_env(pools_stack)["MAX_CONCURRENT_JOBS"] == "3"
    assert pools_stack.outputs["max_concurrent_jobs"] == 3
    # A stack without a limit: the function's environment and every agent's config as before (no diff).
    assert set(scheduler_env(example_stack)) == {"BUCKET", "POOLS"}
    assert example_stack.outputs["max_concurrent_jobs"] == 0
    for template in example_stack.of_type(TEMPLATE):
        assert "max_concurrent_jobs" not in _agent_mapping(template)


def test_only_a_pool_of_one_instance_and_one_job_weighs_its_types_by_throughput() -> None:
    """AWS fulfils units with whatever mix is cheapest per unit: a pool that needs N instances (a multi-node
    job, several lanes) could get fewer, heavier ones, so only a pool that asks for one instance is weighted.
    A pool of one GPU model has nothing to weigh."""
    one = {"name": "default", "instanceTypes": ["g4dn.xlarge", "g6e.xlarge"], "maxInstances": 1}
    pools = [
        one,
        {**one, "name": "lanes", "maxJobs": 2},
        {**one, "name": "nodes", "maxInstances": 2},
        {**one, "name": "same", "instanceTypes": ["g6.xlarge", "g6.2xlarge"]},
    ]
    weights = {pool.name: pool_weights(pool) for pool in _parse(pools).pools}
    assert weights == {
        "default": {"g4dn.xlarge": 1, "g6e.xlarge": 6},
        "lanes": None,
        "nodes": None,
        "same": None,
    }


# -- weights from measured throughput (trainstack:measuredThroughput) ----------------------------------------

MEASURED = "trainstack:measuredThroughput"
# resnet50 measured 100 samples/s on a T4 and 310 on an L4 (its datasheet says 1.86 T4s): the geometric mean
# of measured/shipped (100 and 166.5) is 129, which scales the A10G's estimate (1.92) to 248 and the L40S's
# (5.57) to 719. Relative to the T4: L4 3.1 -> 3, A10G 2.5 -> 2, L40S 7.2 -> 7.
MEASURED_FIGURES = {"g4dn.xlarge": 100, "g6.xlarge": "310"}
MEASURED_WEIGHTS = {"g6.xlarge": "3", "g5.xlarge": "2", "g6e.xlarge": "7", "g4dn.xlarge": "1"}


def test_measured_throughput_sets_the_groups_weights_and_up_says_which_are_measured(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("INFO"):
        stack = run_stack({**example_config(), MEASURED: MEASURED_FIGURES})
    (group,) = stack.of_type(ASG)
    overrides = group.inputs["mixedInstancesPolicy"]["launchTemplate"]["overrides"]
    assert {o["instanceType"]: o["weightedCapacity"] for o in overrides} == MEASURED_WEIGHTS
    # Sizes in units: room for the same instances, each the heaviest; a unit is still one instance.
    assert group.inputs["maxSize"] == 2 * 7
    assert group.inputs["desiredCapacity"] == 1
    (line,) = [r.getMessage() for r in caplog.records if "WeightedCapacity" in r.getMessage()]
    assert line.startswith(
        "pool default: WeightedCapacity g6.xlarge 3 (measured), g5.xlarge 2 (estimated), g6e.xlarge 7 "
        "(estimated), g4dn.xlarge 1 (measured); from trainstack:measuredThroughput"
    )


def test_measured_throughput_as_pulumi_passes_it_and_as_the_stack_file_holds_it_weigh_alike() -> None:
    pools = [{**GOOD, "instanceTypes": ["g4dn.xlarge", "g6.xlarge", "g6e.xlarge"]}]
    as_json = _parse(pools, measuredThroughput=json.dumps(MEASURED_FIGURES))
    as_yaml = _parse(pools, measuredThroughput=MEASURED_FIGURES)
    assert (
        as_json.measured_throughput
        == as_yaml.measured_throughput
        == (
            ("g4dn.xlarge", 100.0),
            ("g6.xlarge", 310.0),
        )
    )
    assert (
        pool_weights(as_json.pools[0])
        == pool_weights(as_yaml.pools[0])
        == {
            "g4dn.xlarge": 1,
            "g6.xlarge": 3,
            "g6e.xlarge": 7,
        }
    )
    # Unset or empty: the shipped estimate, as before the key.
    assert pool_weights(_parse(pools, measuredThroughput="").pools[0]) == pool_weights(_parse(pools).pools[0])


def test_a_pool_whose_slowest_type_is_unmeasured_weighs_it_1() -> None:
    """The L4 is measured by nobody: its estimate (1.86 T4s) scaled by the measured types' ratio (geometric
    mean of the L40S's 1200/5.57 and the A10G's 500/1.92: 237) is 441 samples/s, below the A10G's measured
    500: the slowest, so exactly 1, and a unit stays one instance."""
    from trainstack_job.throughput import capacity_units

    pool = {**GOOD, "instanceTypes": ["g6.xlarge", "g5.xlarge", "g6e.xlarge"]}
    config = _parse([pool], measuredThroughput={"g6e.xlarge": 1200, "g5.xlarge": 500})
    weights = pool_weights(config.pools[0])
    assert weights == {"g6.xlarge": 1, "g5.xlarge": 1, "g6e.xlarge": 3}
    assert capacity_units(1, weights) == 1


def test_measured_figures_weigh_only_the_pools_of_one_instance_and_one_job_that_offer_their_types() -> None:
    one = {"name": "default", "instanceTypes": ["g4dn.xlarge", "g6.xlarge"], "maxInstances": 1}
    pools = [
        one,
        {**one, "name": "lanes", "maxJobs": 2},
        {**one, "name": "l40s", "instanceTypes": ["g6e.xlarge", "g6e.2xlarge"]},
    ]
    config = _parse(pools, measuredThroughput={"g4dn.xlarge": 100, "g6.xlarge": 500})
    assert {p.name: p.measured for p in config.pools} == {
        "default": {"g4dn.xlarge": 100.0, "g6.xlarge": 500.0},
        "lanes": {"g4dn.xlarge": 100.0, "g6.xlarge": 500.0},
        "l40s": {},
    }
    assert {p.name: pool_weights(p) for p in config.pools} == {
        "default": {"g4dn.xlarge": 1, "g6.xlarge": 5},
        "lanes": None,
        "l40s": None,
    }


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("[100]", "must be a mapping of instance type to the samples per second measured on it"),
        ("not json", "must be a mapping of instance type"),
        ({"g6.xlarge": -3}, "must be a positive number of samples per second, got -3"),
        ({"g6.xlarge": 0}, "must be a positive number of samples per second, got 0"),
        ({"g6.xlarge": "fast"}, "must be a number of samples per second, got 'fast'"),
        ({"g6.xlarge": True}, "must be a number of samples per second, got True"),
        ({"g6.xlarge": "nan"}, "must be a positive number of samples per second, got 'nan'"),
        ({"g6.xlarge": 5e12}, "is more than any training job measures"),
        (
            {"g6.xlarg": 410},
            "not an instance type of any pool, so it would weigh nothing (did you mean 'g6.xlarge'?)",
        ),
        (
            {"p5.48xlarge": 410},
            "not an instance type of any pool, so it would weigh nothing (the pools offer",
        ),
    ],
)
def test_a_bad_measured_throughput_is_one_line_naming_the_key_and_the_fix(value: Any, says: str) -> None:
    problems = _problems([GOOD], measuredThroughput=value)
    assert len(problems) == 1, problems
    (line,) = problems
    assert line.startswith(f"{MEASURED}"), line
    assert says in line, line
    assert "pulumi config set --path 'trainstack:measuredThroughput[\"" in line or (
        "pulumi config rm --path 'trainstack:measuredThroughput[\"" in line
    ), line
    assert "\n" not in line

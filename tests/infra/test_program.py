"""The program as a whole: zones, the spot group, alerts, outputs, and what `pulumi destroy` keeps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from infra.fleet import LIFECYCLE_HOOK_NAME
from infra.observability import event_alerts
from tests.infra.program import (
    AMI_ID,
    REPO_ROOT,
    ROOT_DEVICE,
    StackRun,
    example_config,
    run_stack,
    shared_run,
)

ASG = "aws:autoscaling/group:Group"
INTERNALS_OUTPUTS = {
    "region", "bucket_name", "data_prefix", "code_prefix", "checkpoints_prefix", "results_prefix",
    "state_prefix", "jobs_prefix", "job_id", "data_upload_command", "group_name", "instance_count",
    "instance_types", "log_group_name",
    "topic_arn", "kms_key_arn", "dashboard_url", "ssm_session_command",
    # infra/pools.py POOLS_OUTPUT (trainstack_job/contract.py's StackOutput does not name it yet).
    "pools", "max_concurrent_jobs",
}  # fmt: skip
BILLING_TYPES_DELETED_ON_DESTROY = (
    "aws:autoscaling/group:Group",
    "aws:ec2/natGateway:NatGateway",
    "aws:ec2/eip:Eip",
    "aws:ec2/vpcEndpoint:VpcEndpoint",
    "aws:cloudwatch/logGroup:LogGroup",
    "aws:cloudwatch/metricAlarm:MetricAlarm",
    "aws:cloudwatch/dashboard:Dashboard",
    "aws:ec2/flowLog:FlowLog",
    "aws:sns/topic:Topic",
)


def test_exports_exactly_the_outputs_the_cli_reads(example_stack: StackRun) -> None:
    outputs = example_stack.outputs
    assert set(outputs) == INTERNALS_OUTPUTS
    assert outputs["group_name"] == "trainstack-dev-gpu"
    assert outputs["data_prefix"] == "data/"
    assert outputs["data_upload_command"] == f"aws s3 sync ./dataset s3://{outputs['bucket_name']}/data/"
    assert outputs["dashboard_url"].endswith("#dashboards:name=trainstack-dev")
    assert "aws ssm start-session" in outputs["ssm_session_command"]


def test_every_resource_belongs_to_a_component_with_a_trainstack_type(example_stack: StackRun) -> None:
    components = {r.name: r.type for r in example_stack.resources if r.type.startswith("trainstack:")}
    assert set(components.values()) == {
        "trainstack:storage:Storage",
        "trainstack:network:Network",
        "trainstack:identity:Identity",
        "trainstack:fleet:Fleet",
        "trainstack:observability:Observability",
        "trainstack:capacity:CapacityFallback",
        "trainstack:queue:DefaultJob",
        "trainstack:scheduler:Scheduler",
    }
    for resource in example_stack.resources:
        if not resource.type.startswith("trainstack:"):
            assert resource.parent in components, resource.name
            assert resource.name.startswith(f"{resource.parent}-"), resource.name


def test_subnets_only_in_zones_that_offer_a_chosen_type(example_stack: StackRun) -> None:
    zones = {s.inputs["availabilityZone"] for s in example_stack.of_type("aws:ec2/subnet:Subnet")}
    assert zones == {"us-east-1a", "us-east-1b", "us-east-1d"}


def test_public_subnets_cost_nothing_no_nat_gateway(example_stack: StackRun) -> None:
    assert not example_stack.of_type("aws:ec2/natGateway:NatGateway")
    (interface,) = example_stack.one("aws:ec2/launchTemplate:LaunchTemplate").inputs["networkInterfaces"]
    assert interface["associatePublicIpAddress"] == "true"


def test_private_subnets_route_through_one_nat_gateway(private_stack: StackRun) -> None:
    nat = private_stack.one("aws:ec2/natGateway:NatGateway")
    assert nat.inputs["subnetId"].startswith("network-public-")
    tables = private_stack.of_type("aws:ec2/routeTable:RouteTable")
    private_routes = next(t for t in tables if t.name.endswith("private-rt")).inputs["routes"]
    assert private_routes == [{"cidrBlock": "0.0.0.0/0", "natGatewayId": f"{nat.name}-id"}]


def test_s3_traffic_takes_the_free_gateway_endpoint(private_stack: StackRun) -> None:
    endpoint = private_stack.one("aws:ec2/vpcEndpoint:VpcEndpoint").inputs
    assert endpoint["serviceName"] == "com.amazonaws.us-east-1.s3"
    assert endpoint["vpcEndpointType"] == "Gateway"
    assert len(endpoint["routeTableIds"]) == 2


def test_group_is_all_spot_price_capacity_optimized_with_rebalancing(example_stack: StackRun) -> None:
    group = example_stack.one(ASG).inputs
    distribution = group["mixedInstancesPolicy"]["instancesDistribution"]
    assert distribution["onDemandBaseCapacity"] == 0
    assert distribution["onDemandPercentageAboveBaseCapacity"] == 0
    assert distribution["spotAllocationStrategy"] == "price-capacity-optimized"
    assert group["capacityRebalance"] is True
    # The default pool (one instance, one job) weighs its types by throughput (g6e.xlarge = 6 units), so its
    # sizes count units: room for two instances of its heaviest type, as capacity rebalancing launches the
    # replacement before it terminates the old one.
    assert (group["minSize"], group["maxSize"], group["desiredCapacity"]) == (0, 12, 1)
    assert group["name"] == "trainstack-dev-gpu"
    assert group["waitForCapacityTimeout"] == "0"


def test_group_keeps_the_instances_own_scale_to_zero_on_later_updates(example_stack: StackRun) -> None:
    assert example_stack.one(ASG).ignore_changes == ("desiredCapacity",)


def test_group_drains_through_a_termination_lifecycle_hook(example_stack: StackRun) -> None:
    (hook,) = example_stack.one(ASG).inputs["initialLifecycleHooks"]
    assert hook["name"] == LIFECYCLE_HOOK_NAME
    assert hook["lifecycleTransition"] == "autoscaling:EC2_INSTANCE_TERMINATING"
    assert hook["defaultResult"] == "CONTINUE"


def test_group_tags_reach_the_instances(example_stack: StackRun) -> None:
    tags = {t["key"]: t for t in example_stack.one(ASG).inputs["tags"]}
    assert tags["trainstack:stack"]["value"] == "dev"
    assert all(t["propagateAtLaunch"] for t in tags.values())


def test_on_demand_mix_and_max_price_come_from_config() -> None:
    config = {
        **example_config(),
        "trainstack:onDemandBaseCapacity": 1,
        "trainstack:onDemandPercentageAboveBase": 50,
        "trainstack:spotMaxPrice": "0.75",
    }
    group = run_stack(config).one(ASG).inputs
    distribution = group["mixedInstancesPolicy"]["instancesDistribution"]
    assert (distribution["onDemandBaseCapacity"], distribution["onDemandPercentageAboveBaseCapacity"]) == (
        1,
        50,
    )
    assert distribution["spotMaxPrice"] == "0.75"
    assert (group["maxSize"], group["desiredCapacity"]) == (
        12,
        1,
    )  # units: room for rebalancing's replacement


def test_launch_template_boots_the_resolved_ami_from_its_root_device(example_stack: StackRun) -> None:
    template = example_stack.one("aws:ec2/launchTemplate:LaunchTemplate").inputs
    assert template["imageId"] == AMI_ID
    assert template["blockDeviceMappings"][0]["deviceName"] == ROOT_DEVICE
    assert template["blockDeviceMappings"][0]["ebs"]["volumeSize"] == 150
    assert template["metadataOptions"]["instanceMetadataTags"] == "enabled"


def test_pinned_ami_is_used_as_is() -> None:
    stack = run_stack({**example_config(), "trainstack:amiId": "ami-0fedcba9876543210"})
    assert stack.one("aws:ec2/launchTemplate:LaunchTemplate").inputs["imageId"] == "ami-0fedcba9876543210"


def test_event_rules_send_readable_sentences_to_the_topic(example_stack: StackRun) -> None:
    rules = {
        r.name: r.inputs
        for r in example_stack.of_type("aws:cloudwatch/eventRule:EventRule")
        if r.parent == "observability"
    }
    targets = [
        r
        for r in example_stack.of_type("aws:cloudwatch/eventTarget:EventTarget")
        if r.parent == "observability"
    ]
    assert len(rules) == len(targets) == 3
    for target in targets:
        assert target.inputs["arn"] == example_stack.outputs["topic_arn"]
        transformer = target.inputs["inputTransformer"]
        sentence = json.loads(transformer["inputTemplate"])
        assert isinstance(sentence, str) and sentence.startswith("trainstack dev: ")
        for placeholder in transformer["inputPaths"]:
            assert f"<{placeholder}>" in sentence
    patterns = [json.loads(rule["eventPattern"]) for rule in rules.values()]
    detail_types = {t for p in patterns for t in p["detail-type"]}
    assert "EC2 Spot Instance Interruption Warning" in detail_types
    assert "EC2 Instance Rebalance Recommendation" in detail_types
    assert "EC2 Instance Launch Unsuccessful" in detail_types
    group_rule = next(p for p in patterns if p["source"] == ["aws.autoscaling"])
    assert group_rule["detail"] == {"AutoScalingGroupName": ["trainstack-dev-gpu"]}


def test_event_alert_templates_only_use_declared_placeholders() -> None:
    for alert in event_alerts("dev", "g"):
        used = {part.split(">", 1)[0] for part in alert.template.split("<")[1:]}
        assert used == set(alert.input_paths), alert.role


def test_topic_policy_lets_eventbridge_budgets_and_alarms_publish(example_stack: StackRun) -> None:
    policy = json.loads(example_stack.one("aws:sns/topicPolicy:TopicPolicy").inputs["policy"])
    services = {s["Principal"]["Service"] for s in policy["Statement"]}
    assert services == {"events.amazonaws.com", "budgets.amazonaws.com", "cloudwatch.amazonaws.com"}
    assert all(s["Condition"]["StringEquals"]["aws:SourceAccount"] for s in policy["Statement"])


def test_gpu_idle_alarm_watches_the_agents_metric_for_thirty_minutes(example_stack: StackRun) -> None:
    alarm = example_stack.one("aws:cloudwatch/metricAlarm:MetricAlarm").inputs
    assert (alarm["namespace"], alarm["metricName"]) == ("trainstack", "GPUUtilization")
    assert alarm["dimensions"] == {"AutoScalingGroupName": "trainstack-dev-gpu"}
    assert alarm["period"] * alarm["evaluationPeriods"] == 30 * 60
    assert (alarm["statistic"], alarm["threshold"], alarm["comparisonOperator"]) == (
        "Average",
        10,
        "LessThanThreshold",
    )
    # No instance, no data, no alarm: it speaks only while instances are in service.
    assert alarm["treatMissingData"] == "notBreaching"
    assert alarm["alarmActions"] == [example_stack.outputs["topic_arn"]]


def test_dashboard_shows_gpu_instances_and_logs(example_stack: StackRun) -> None:
    body = json.loads(example_stack.one("aws:cloudwatch/dashboard:Dashboard").inputs["dashboardBody"])
    titles = {w["properties"]["title"] for w in body["widgets"]}
    assert titles == {
        "GPU utilisation (%)",
        "Instances in service",
        "CPU, memory and GPU memory (%)",
        "Disk (bytes/s)",
        "Network (bytes/s)",
        "Agent and trainer log",
    }
    assert "GroupInServiceInstances" in example_stack.one(ASG).inputs["enabledMetrics"]


def test_budget_alerts_go_to_the_topic_without_an_email(example_stack: StackRun) -> None:
    budget = example_stack.one("aws:budgets/budget:Budget").inputs
    assert (budget["budgetType"], budget["timeUnit"], budget["limitAmount"]) == ("COST", "MONTHLY", "100")
    kinds = {(n["notificationType"], n["threshold"]) for n in budget["notifications"]}
    assert kinds == {("ACTUAL", 80), ("FORECASTED", 100)}
    for notification in budget["notifications"]:
        assert notification["subscriberSnsTopicArns"] == [example_stack.outputs["topic_arn"]]
    assert not example_stack.of_type("aws:sns/topicSubscription:TopicSubscription")


def test_alert_email_subscribes_and_receives_budget_alerts() -> None:
    stack = run_stack({**example_config(), "trainstack:alertEmail": "ml-team@example.com"})
    subscription = stack.one("aws:sns/topicSubscription:TopicSubscription").inputs
    assert (subscription["protocol"], subscription["endpoint"]) == ("email", "ml-team@example.com")
    for notification in stack.one("aws:budgets/budget:Budget").inputs["notifications"]:
        assert notification["subscriberEmailAddresses"] == ["ml-team@example.com"]


def test_destroy_keeps_only_the_bucket_its_key_and_the_code_bundle_by_default(
    example_stack: StackRun,
) -> None:
    kept = {r.type for r in example_stack.resources if r.retain_on_delete}
    assert "aws:s3/bucket:Bucket" in kept
    assert "aws:kms/key:Key" in kept
    assert "aws:s3/bucketObjectv2:BucketObjectv2" in kept
    # Kept with the bucket so a retained bucket stays private, encrypted and TLS-only.
    assert all(t.startswith(("aws:s3/bucket", "aws:kms/key:Key")) for t in kept), kept
    assert all(b.inputs["forceDestroy"] is False for b in example_stack.of_type("aws:s3/bucket:Bucket"))
    for type_token in BILLING_TYPES_DELETED_ON_DESTROY:
        assert not any(r.retain_on_delete for r in example_stack.of_type(type_token)), type_token


def test_destroy_removes_everything_when_data_is_not_retained() -> None:
    stack = shared_run({"trainstack:retainDataOnDestroy": False})
    # Only the code bundle and the default job's record keep retain_on_delete (for replacements: a running
    # job keeps its code and record); the force-destroyed bucket takes them with every other object.
    kept = [r for r in stack.resources if r.retain_on_delete]
    assert [r.type for r in kept] == ["aws:s3/bucketObjectv2:BucketObjectv2"] * 2
    assert kept[0].name == "fleet-bundle" and kept[1].name.endswith("-record")
    assert all(b.inputs["forceDestroy"] is True for b in stack.of_type("aws:s3/bucket:Bucket"))
    assert stack.one("aws:kms/key:Key").inputs["deletionWindowInDays"] == 7


def test_program_runs_as_pulumi_runs_it_with_only_infra_on_sys_path() -> None:
    # Pulumi executes infra/__main__.py with infra/ (not the repository root) first on sys.path, in a
    # virtualenv where trainstack itself may not be installed.
    script = f"""
import importlib.util, sys
sys.path = [p for p in sys.path if p not in ("", {str(REPO_ROOT)!r}) and "__editable__" not in p]
sys.meta_path = [finder for finder in sys.meta_path if "editable" not in repr(finder).lower()]
sys.path.insert(0, {str(REPO_ROOT / "infra")!r})
assert importlib.util.find_spec("bootstrap") is None, "the repository root must not be importable yet"
spec = importlib.util.spec_from_file_location("program", {str(Path(__file__).with_name("program.py"))!r})
program = sys.modules["program"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(program)
print(program.run_stack().outputs["group_name"])
"""
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT / "infra",
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("trainstack-dev-gpu")


def test_the_harness_sends_the_engine_the_stack_traces_pulumi_makes() -> None:
    """tests/infra/program.py makes each registration's stack trace itself (pulumi's is a fifth of a run's
    CPU): the same frames, files and lines as pulumi.runtime.resource._get_stack_trace, frames without a
    file (exec'd code, `<frozen runpy>`) included."""
    from pulumi.runtime import resource
    from pulumi.runtime.proto import source_pb2

    from tests.infra import program

    made: list[tuple[source_pb2.StackTrace, source_pb2.StackTrace]] = []

    class Resource:  # pulumi's Resource.__init__ registers: where both are asked
        def __init__(self) -> None:
            made.append((resource._get_stack_trace(), program._stack_trace()))

    class CustomResource(Resource):
        def __init__(self) -> None:
            super().__init__()

    class Bucket(CustomResource):
        def __init__(self) -> None:
            super().__init__()

    def declare() -> None:
        Bucket()

    declare()
    exec(compile("declare()", "<program>", "exec"), {"declare": declare})
    (pulumis, ours), (pulumis_exec, ours_exec) = made
    assert resource._get_stack_trace is not program._stack_trace, "outside a run pulumi's own is in place"
    assert len(pulumis.frames) > 5 and ours == pulumis
    assert pulumis.frames[0].pc.uri == Path(__file__).as_uri()  # declare(), the user code, comes first
    assert ours_exec == pulumis_exec and not ours_exec.frames[1].HasField("pc")  # the exec'd line: none
    shallow = [program._stack_trace(), resource._get_stack_trace()]  # under three __init__: no frames
    assert shallow[0] == shallow[1] == source_pb2.StackTrace()

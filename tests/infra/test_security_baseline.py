"""DESIGN.md's security baseline, one test per control, on the resources the example stack registers."""

from __future__ import annotations

import json

from infra.policies import actions_of
from tests.infra.program import ACCOUNT_ID, StackRun, example_config, run_stack

LT = "aws:ec2/launchTemplate:LaunchTemplate"
ASG = "aws:autoscaling/group:Group"


def _key_arn(stack: StackRun) -> str:
    return str(stack.outputs["kms_key_arn"])


def _launch_template_ebs(stack: StackRun) -> dict:
    (mapping,) = stack.one(LT).inputs["blockDeviceMappings"]
    return mapping["ebs"]


def test_launch_template_requires_imdsv2_EC2_8_EC2_170_AutoScaling_3(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    metadata = example_stack.one(LT).inputs["metadataOptions"]
    assert metadata["httpTokens"] == "required"
    assert metadata["httpEndpoint"] == "enabled"


def test_launch_template_metadata_hop_limit_is_one_AutoScaling_4(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    assert example_stack.one(LT).inputs["metadataOptions"]["httpPutResponseHopLimit"] == 1


def test_root_volume_is_encrypted_with_the_stack_cmk_EC2_3_EC2_181(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    ebs = _launch_template_ebs(example_stack)
    assert ebs["encrypted"] == "true"
    assert ebs["kmsKeyId"] == _key_arn(example_stack)
    assert ebs["volumeType"] == "gp3"


def test_private_networking_gives_no_public_ip_EC2_9_EC2_25(private_stack: StackRun) -> None:  # noqa: N802 - named after the control
    (interface,) = private_stack.one(LT).inputs["networkInterfaces"]
    assert interface["associatePublicIpAddress"] == "false"
    group_subnets = set(private_stack.one(ASG).inputs["vpcZoneIdentifiers"])
    private_subnets = {
        f"{s.name}-id" for s in private_stack.of_type("aws:ec2/subnet:Subnet") if "private" in s.name
    }
    assert group_subnets == private_subnets


def test_subnets_never_assign_public_ips_by_default_EC2_15(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    for subnet in example_stack.of_type("aws:ec2/subnet:Subnet"):
        assert subnet.inputs["mapPublicIpOnLaunch"] is False, subnet.name


def test_group_spans_at_least_two_zones_AutoScaling_2(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    subnet_ids = example_stack.one(ASG).inputs["vpcZoneIdentifiers"]
    zones = {
        s.inputs["availabilityZone"]
        for s in example_stack.of_type("aws:ec2/subnet:Subnet")
        if f"{s.name}-id" in subnet_ids
    }
    assert len(zones) >= 2


def test_group_uses_several_instance_types_AutoScaling_6(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    overrides = example_stack.one(ASG).inputs["mixedInstancesPolicy"]["launchTemplate"]["overrides"]
    assert len({o["instanceType"] for o in overrides}) >= 2


def test_group_uses_a_launch_template_not_a_launch_configuration_AutoScaling_9(  # noqa: N802 - named after the control
    example_stack: StackRun,
) -> None:
    group = example_stack.one(ASG).inputs
    assert "launchConfiguration" not in group
    spec = group["mixedInstancesPolicy"]["launchTemplate"]["launchTemplateSpecification"]
    assert spec["launchTemplateId"] == f"{example_stack.one(LT).name}-id"
    assert not example_stack.of_type("aws:ec2/launchConfiguration:LaunchConfiguration")


def test_default_security_group_allows_nothing_EC2_2(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    default = example_stack.one("aws:ec2/defaultSecurityGroup:DefaultSecurityGroup").inputs
    assert default.get("ingress", []) == []
    assert default.get("egress", []) == []


def test_vpc_flow_logs_are_on_EC2_6(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    flow_log = example_stack.one("aws:ec2/flowLog:FlowLog").inputs
    assert flow_log["vpcId"] == f"{example_stack.one('aws:ec2/vpc:Vpc').name}-id"
    assert flow_log["trafficType"] == "ALL"


def test_instances_accept_no_inbound_traffic_by_default_EC2_18_EC2_19_CIS_5_3(  # noqa: N802 - named after the control
    example_stack: StackRun,
) -> None:
    group = example_stack.one("aws:ec2/securityGroup:SecurityGroup").inputs
    assert group.get("ingress", []) == []


def test_ssh_opens_only_port_22_to_the_listed_cidrs_EC2_18_EC2_19_CIS_5_3() -> None:  # noqa: N802 - named after the control
    stack = run_stack({**example_config(), "trainstack:sshIngressCidrs": ["203.0.113.7/32", "2001:db8::/64"]})
    ingress = stack.one("aws:ec2/securityGroup:SecurityGroup").inputs["ingress"]
    assert {(r["fromPort"], r["toPort"], r["protocol"]) for r in ingress} == {(22, 22, "tcp")}
    cidrs = [c for r in ingress for c in r.get("cidrBlocks", []) + r.get("ipv6CidrBlocks", [])]
    assert sorted(cidrs) == ["2001:db8::/64", "203.0.113.7/32"]


def test_bucket_blocks_all_public_access_S3_1_S3_8(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    block = example_stack.one("aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock").inputs
    for setting in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets"):
        assert block[setting] is True, setting


def test_bucket_policy_denies_requests_without_tls_S3_5(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    policy = json.loads(example_stack.one("aws:s3/bucketPolicy:BucketPolicy").inputs["policy"])
    bucket_arn = f"arn:aws:s3:::{example_stack.outputs['bucket_name']}"
    (deny,) = [
        s for s in policy["Statement"] if s.get("Condition", {}).get("Bool", {}).get("aws:SecureTransport")
    ]
    assert deny["Effect"] == "Deny"
    assert deny["Condition"]["Bool"]["aws:SecureTransport"] == "false"
    assert deny["Action"] == "s3:*"
    assert set(deny["Resource"]) == {bucket_arn, f"{bucket_arn}/*"}


def test_bucket_encrypts_with_the_stack_cmk_and_refuses_other_keys_S3_17(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    (rule,) = example_stack.one(
        "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration"
    ).inputs["rules"]
    assert rule["applyServerSideEncryptionByDefault"] == {
        "sseAlgorithm": "aws:kms",
        "kmsMasterKeyId": _key_arn(example_stack),
    }
    assert rule["bucketKeyEnabled"] is True
    policy = json.loads(example_stack.one("aws:s3/bucketPolicy:BucketPolicy").inputs["policy"])
    other_keys = [s for s in policy["Statement"] if "ArnNotEquals" in s.get("Condition", {})]
    assert other_keys and other_keys[0]["Effect"] == "Deny"
    condition = other_keys[0]["Condition"]["ArnNotEquals"]
    assert condition["s3:x-amz-server-side-encryption-aws-kms-key-id"] == _key_arn(example_stack)


def test_bucket_versioning_is_enabled_S3_14(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    versioning = example_stack.one("aws:s3/bucketVersioning:BucketVersioning").inputs
    assert versioning["versioningConfiguration"]["status"] == "Enabled"


def test_bucket_lifecycle_aborts_uploads_and_expires_old_versions_S3_10_S3_13(  # noqa: N802 - named after the control
    example_stack: StackRun,
) -> None:
    rules = example_stack.one("aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration").inputs[
        "rules"
    ]
    assert all(rule["status"] == "Enabled" for rule in rules)
    assert any(r.get("abortIncompleteMultipartUpload", {}).get("daysAfterInitiation") == 1 for r in rules)
    assert any(r.get("noncurrentVersionExpiration", {}).get("noncurrentDays") == 30 for r in rules)


def test_bucket_disables_acls_S3_12(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    controls = example_stack.one("aws:s3/bucketOwnershipControls:BucketOwnershipControls").inputs
    assert controls["rule"]["objectOwnership"] == "BucketOwnerEnforced"
    assert "acl" not in example_stack.one("aws:s3/bucket:Bucket").inputs


def test_kms_key_rotates_KMS_4(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    assert example_stack.one("aws:kms/key:Key").inputs["enableKeyRotation"] is True


def test_no_document_allows_every_kms_action_KMS_1_KMS_2(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    documents = [
        json.loads(r.inputs["policy"]) for r in example_stack.of_type("aws:iam/rolePolicy:RolePolicy")
    ]
    documents.append(json.loads(example_stack.one("aws:kms/key:Key").inputs["policy"]))
    for document in documents:
        for action in actions_of(document):
            assert action.lower() not in ("kms:*", "*"), action
            assert "*" not in action, action


def test_iam_policies_grant_no_wildcard_action_IAM_1_IAM_21(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    for policy in example_stack.of_type("aws:iam/rolePolicy:RolePolicy"):
        for action in actions_of(json.loads(policy.inputs["policy"])):
            assert "*" not in action, f"{policy.name}: {action}"
    assert not example_stack.of_type("aws:iam/policy:Policy"), (
        "customer managed policies would need the same test"
    )


def test_alert_topic_is_encrypted_with_the_stack_cmk_SNS_1(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    assert example_stack.one("aws:sns/topic:Topic").inputs["kmsMasterKeyId"] == _key_arn(example_stack)


def test_every_log_group_has_retention_and_the_stack_cmk_CloudWatch(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    groups = example_stack.of_type("aws:cloudwatch/logGroup:LogGroup")
    assert len(groups) == 2
    for group in groups:
        assert group.inputs["retentionInDays"] == 30, group.name
        assert group.inputs["kmsKeyId"] == _key_arn(example_stack), group.name


def test_key_policy_lets_alert_sources_use_the_key_for_the_encrypted_topic(example_stack: StackRun) -> None:
    policy = json.loads(example_stack.one("aws:kms/key:Key").inputs["policy"])
    services: set[str] = set()
    for statement in policy["Statement"]:
        principal = statement["Principal"]
        if isinstance(principal, dict) and "Service" in principal:
            found = principal["Service"]
            services.update([found] if isinstance(found, str) else found)
    assert {"events.amazonaws.com", "budgets.amazonaws.com", "cloudwatch.amazonaws.com"} <= services
    assert "logs.us-east-1.amazonaws.com" in services
    assert ACCOUNT_ID in json.dumps(policy)

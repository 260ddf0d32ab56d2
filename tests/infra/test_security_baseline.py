"""The security baseline (SECURITY.md), one test per control, on the resources the example stack registers."""

from __future__ import annotations

import json

from infra.iam.common import actions_of
from tests.infra.program import ACCOUNT_ID, RecordedResource, StackRun, example_config, run_stack, shared_run

LT = "aws:ec2/launchTemplate:LaunchTemplate"
ASG = "aws:autoscaling/group:Group"


def _key_arn(stack: StackRun) -> str:
    return str(stack.outputs["kms_key_arn"])


def _data_bucket(stack: StackRun, type_token: str) -> RecordedResource:
    """The data bucket (or its companion of that type), not the access-log bucket's."""
    (found,) = [r for r in stack.of_type(type_token) if "access-log" not in r.name]
    return found


def _access_log_bucket(stack: StackRun, type_token: str) -> RecordedResource:
    (found,) = [r for r in stack.of_type(type_token) if "access-logs" in r.name]
    return found


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


def test_vpc_flow_logs_are_kept_a_year_and_training_logs_as_configured_CloudWatch_16() -> None:  # noqa: N802 - named after the control
    def retention(stack: StackRun) -> dict[str, int]:
        return {
            g.inputs["name"]: g.inputs["retentionInDays"]
            for g in stack.of_type("aws:cloudwatch/logGroup:LogGroup")
        }

    default = retention(shared_run())
    assert default["/trainstack/dev/vpc-flow-logs"] == 365
    assert default["/trainstack/dev"] == 30
    tuned = retention(
        run_stack(
            {**example_config(), "trainstack:flowLogRetentionDays": 731, "trainstack:logRetentionDays": 7}
        )
    )
    assert tuned["/trainstack/dev/vpc-flow-logs"] == 731
    assert tuned["/trainstack/dev"] == 7


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
    block = _data_bucket(example_stack, "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock").inputs
    for setting in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets"):
        assert block[setting] is True, setting


def test_bucket_policy_denies_requests_without_tls_S3_5(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    policy = json.loads(_data_bucket(example_stack, "aws:s3/bucketPolicy:BucketPolicy").inputs["policy"])
    bucket_arn = f"arn:aws:s3:::{example_stack.outputs['bucket_name']}"
    (deny,) = [
        s for s in policy["Statement"] if s.get("Condition", {}).get("Bool", {}).get("aws:SecureTransport")
    ]
    assert deny["Effect"] == "Deny"
    assert deny["Condition"]["Bool"]["aws:SecureTransport"] == "false"
    assert deny["Action"] == "s3:*"
    assert set(deny["Resource"]) == {bucket_arn, f"{bucket_arn}/*"}


def test_bucket_encrypts_with_the_stack_cmk_and_refuses_other_keys_S3_17(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    (rule,) = _data_bucket(
        example_stack,
        "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
    ).inputs["rules"]
    assert rule["applyServerSideEncryptionByDefault"] == {
        "sseAlgorithm": "aws:kms",
        "kmsMasterKeyId": _key_arn(example_stack),
    }
    assert rule["bucketKeyEnabled"] is True
    policy = json.loads(_data_bucket(example_stack, "aws:s3/bucketPolicy:BucketPolicy").inputs["policy"])
    other_keys = [s for s in policy["Statement"] if "ArnNotEquals" in s.get("Condition", {})]
    assert other_keys and other_keys[0]["Effect"] == "Deny"
    condition = other_keys[0]["Condition"]["ArnNotEquals"]
    assert condition["s3:x-amz-server-side-encryption-aws-kms-key-id"] == _key_arn(example_stack)


def test_bucket_versioning_is_enabled_S3_14(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    versioning = _data_bucket(example_stack, "aws:s3/bucketVersioning:BucketVersioning").inputs
    assert versioning["versioningConfiguration"]["status"] == "Enabled"


def test_bucket_lifecycle_aborts_uploads_and_expires_old_versions_S3_10_S3_13(  # noqa: N802 - named after the control
    example_stack: StackRun,
) -> None:
    rules = _data_bucket(
        example_stack, "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration"
    ).inputs["rules"]
    assert all(rule["status"] == "Enabled" for rule in rules)
    assert any(r.get("abortIncompleteMultipartUpload", {}).get("daysAfterInitiation") == 1 for r in rules)
    assert any(r.get("noncurrentVersionExpiration", {}).get("noncurrentDays") == 30 for r in rules)


def test_bucket_disables_acls_S3_12(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    controls = _data_bucket(example_stack, "aws:s3/bucketOwnershipControls:BucketOwnershipControls").inputs
    assert controls["rule"]["objectOwnership"] == "BucketOwnerEnforced"
    assert "acl" not in _data_bucket(example_stack, "aws:s3/bucket:Bucket").inputs


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
    assert len(groups) >= 2
    for group in groups:
        expected = 365 if group.inputs["name"].endswith("/vpc-flow-logs") else 30
        assert group.inputs["retentionInDays"] == expected, group.name
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


def test_bucket_access_is_logged_to_its_own_log_bucket_S3_9(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    (logging,) = example_stack.of_type("aws:s3/bucketLogging:BucketLogging")
    data = _data_bucket(example_stack, "aws:s3/bucket:Bucket")
    logs = _access_log_bucket(example_stack, "aws:s3/bucket:Bucket")
    assert logging.inputs["bucket"] == f"{data.name}-id"
    assert logging.inputs["targetBucket"] == f"{logs.name}-id"
    assert logging.inputs["targetPrefix"] == "s3-access/"
    assert not [
        r
        for r in example_stack.of_type("aws:s3/bucketLogging:BucketLogging")
        if r.inputs["bucket"] == f"{logs.name}-id"
    ]


def test_access_log_bucket_is_locked_down_with_sse_s3_and_expiry(example_stack: StackRun) -> None:
    block = _access_log_bucket(example_stack, "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock").inputs
    assert all(
        block[s] is True
        for s in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets")
    )
    ownership = _access_log_bucket(example_stack, "aws:s3/bucketOwnershipControls:BucketOwnershipControls")
    assert ownership.inputs["rule"]["objectOwnership"] == "BucketOwnerEnforced"
    (rule,) = _access_log_bucket(
        example_stack,
        "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
    ).inputs["rules"]
    # S3 log delivery supports only SSE-S3 default encryption on its target bucket, not SSE-KMS.
    assert rule["applyServerSideEncryptionByDefault"] == {"sseAlgorithm": "AES256"}
    (expiry,) = _access_log_bucket(
        example_stack, "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration"
    ).inputs["rules"]
    assert expiry["status"] == "Enabled" and expiry["expiration"]["days"] == 365
    assert expiry["noncurrentVersionExpiration"]["noncurrentDays"] >= 1


def test_only_s3_log_delivery_for_this_bucket_and_account_may_write_access_logs(
    example_stack: StackRun,
) -> None:
    policy = json.loads(
        _access_log_bucket(example_stack, "aws:s3/bucketPolicy:BucketPolicy").inputs["policy"]
    )
    allows = [s for s in policy["Statement"] if s["Effect"] == "Allow"]
    (delivery,) = allows
    assert delivery["Principal"] == {"Service": "logging.s3.amazonaws.com"}
    assert delivery["Action"] == "s3:PutObject"
    assert delivery["Resource"].endswith("/s3-access/*")
    data_arn = f"arn:aws:s3:::{example_stack.outputs['bucket_name']}"
    assert delivery["Condition"] == {
        "StringEquals": {"aws:SourceAccount": ACCOUNT_ID},
        "ArnLike": {"aws:SourceArn": data_arn},
    }
    (deny,) = [s for s in policy["Statement"] if s["Effect"] == "Deny"]
    assert deny["Condition"] == {"Bool": {"aws:SecureTransport": "false"}} and deny["Action"] == "s3:*"

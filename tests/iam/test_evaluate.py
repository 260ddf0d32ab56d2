"""The evaluator's IAM semantics, the extra authorizations of some calls, and the failure message."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.iam.check import check_calls, check_folder, report
from tests.iam.evaluate import (
    Caller,
    Request,
    UnmodelledConditionError,
    arn_matches,
    conditions_hold,
    decide,
)
from tests.iam.principals import CAPACITY_FALLBACK, CLI, INSTANCE, caller, resource_policy
from tests.iam.requests import Stack, requests_for

STACK = Stack("trainstack-test", "us-east-1")
REGION = "us-east-1"


def _call(principal: str, service: str, operation: str, **params: Any) -> dict[str, Any]:
    return {
        "principal": principal,
        "service": service,
        "operation": operation,
        "region": REGION,
        "params": params,
    }


def _refusals(*calls: dict[str, Any]) -> set[tuple[str, str, str]]:
    findings, _ = check_calls(calls)
    return {(f.principal, f.action, f.resource) for f in findings}


# --- IAM semantics ---------------------------------------------------------------------------------------


def test_arn_wildcards_match_within_the_resource_part_but_not_across_the_account() -> None:
    assert arn_matches("arn:aws:s3:::b/jobs/*", "arn:aws:s3:::b/jobs/a/b/c.pt")
    assert not arn_matches("arn:aws:s3:::b/jobs/*", "arn:aws:s3:::b/data/x")
    group = "arn:aws:autoscaling:us-east-1:1:autoScalingGroup:{}:autoScalingGroupName/g"
    assert arn_matches(group.format("*"), group.format("abc-123"))
    assert not arn_matches("arn:aws:sns:*:1:t", "arn:aws:sns:us-east-1:2:t")
    assert arn_matches("arn:aws:s3:::b?", "arn:aws:s3:::bx")
    assert not arn_matches("arn:aws:s3:::B", "arn:aws:s3:::b"), "ARNs match case-sensitively"


def test_conditions_follow_iams_rules_for_absent_keys_and_lists() -> None:
    known = frozenset({"s3:prefix"})
    listing = Request("s3:ListBucket", "arn:aws:s3:::b", {"s3:prefix": ["jobs/a/"]}, known)
    unprefixed = Request("s3:ListBucket", "arn:aws:s3:::b", {}, known)
    like = {"StringLike": {"s3:prefix": ["data/*", "jobs/*"]}}
    assert conditions_hold(like, listing), "the values of one key are ORed"
    assert not conditions_hold(like, unprefixed), "a positive operator on an absent key is false"
    assert conditions_hold({"StringNotEquals": {"s3:prefix": "x"}}, unprefixed), "a negated one is true"
    assert conditions_hold({"StringLikeIfExists": {"s3:prefix": "x"}}, unprefixed)
    assert conditions_hold({"Null": {"s3:prefix": "true"}}, unprefixed)
    assert not conditions_hold({"Null": {"s3:prefix": "true"}}, listing)
    with pytest.raises(UnmodelledConditionError, match="aws:ResourceTag/team"):
        conditions_hold({"StringEquals": {"aws:ResourceTag/team": "ml"}}, listing)
    with pytest.raises(UnmodelledConditionError, match="ForAnyValue"):
        conditions_hold({"ForAnyValue:StringLike": {"s3:prefix": "x"}}, listing)


def test_an_explicit_deny_wins_over_any_allow_and_nothing_allowed_is_denied() -> None:
    allow_all_s3 = {"Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
    caller = Caller("r", "arn:aws:iam::1:role/r", "1", [allow_all_s3])
    bucket_policy = {"Statement": [{"Sid": "NoPuts", "Effect": "Deny", "Principal": "*", "Action": "s3:Put*",
                                    "Resource": "arn:aws:s3:::b/*"}]}  # fmt: skip
    put = Request("s3:PutObject", "arn:aws:s3:::b/k")
    get = Request("s3:GetObject", "arn:aws:s3:::b/k")
    assert decide(put, caller, bucket_policy, key_policy=False).reason == "explicitly denied by NoPuts"
    assert decide(get, caller, bucket_policy, key_policy=False).allowed
    nothing = Caller("r", "arn:aws:iam::1:role/r", "1", [])
    assert not decide(get, nothing, None, key_policy=False).allowed


def test_a_key_policy_that_leaves_it_to_iam_needs_the_callers_policy_too() -> None:
    key_policy = {"Statement": [{"Effect": "Allow", "Principal": {"AWS": "arn:aws:iam::1:root"},
                                 "Action": "kms:Decrypt", "Resource": "*"}]}  # fmt: skip
    decrypt = Request("kms:Decrypt", "arn:aws:kms:us-east-1:1:key/k")
    granted = {"Statement": [{"Effect": "Allow", "Action": "kms:Decrypt", "Resource": decrypt.resource}]}
    assert decide(
        decrypt, Caller("r", "arn:aws:iam::1:role/r", "1", [granted]), key_policy, key_policy=True
    ).allowed
    assert not decide(
        decrypt, Caller("r", "arn:aws:iam::1:role/r", "1", []), key_policy, key_policy=True
    ).allowed
    assert not decide(
        decrypt, Caller("r", "arn:aws:iam::1:role/r", "1", [granted]), None, key_policy=True
    ).allowed


# --- what AWS checks for a call ---------------------------------------------------------------------------


def test_sse_kms_objects_need_the_stacks_key_and_versions_their_own_actions() -> None:
    bucket, key = STACK.bucket, "jobs/a/checkpoints/latest.json"

    def actions(operation: str, **params: str) -> list[tuple[str, str]]:
        call = _call(INSTANCE, "s3", operation, Bucket=bucket, Key=key, **params)
        return [(r.action, r.resource) for r in requests_for(call, STACK)]

    obj = f"arn:aws:s3:::{bucket}/{key}"
    assert actions("GetObject") == [("s3:GetObject", obj), ("kms:Decrypt", STACK.key_arn)]
    assert actions("HeadObject") == [("s3:GetObject", obj)]
    assert actions("GetObject", VersionId="v1")[0] == ("s3:GetObjectVersion", obj)
    assert actions("PutObject") == [("s3:PutObject", obj), ("kms:GenerateDataKey", STACK.key_arn)]
    assert actions("CompleteMultipartUpload", UploadId="u") == [
        ("s3:PutObject", obj),
        ("kms:Decrypt", STACK.key_arn),
    ]
    assert actions("DeleteObject", VersionId="v1") == [("s3:DeleteObjectVersion", obj)]


def test_an_update_naming_a_launch_template_is_checked_for_launching_from_it() -> None:
    distribution = {"InstancesDistribution": {"OnDemandPercentageAboveBaseCapacity": 100}}
    only = _call(CAPACITY_FALLBACK, "autoscaling", "UpdateAutoScalingGroup",
                 AutoScalingGroupName=STACK.group_name, MixedInstancesPolicy=distribution)  # fmt: skip
    assert [r.action for r in requests_for(only, STACK)] == ["autoscaling:UpdateAutoScalingGroup"]
    template = {"LaunchTemplateSpecification": {"LaunchTemplateId": "lt-1", "Version": "3"}}
    mixed = {**distribution, "LaunchTemplate": template}
    named = _call(CAPACITY_FALLBACK, "autoscaling", "UpdateAutoScalingGroup",
                  AutoScalingGroupName=STACK.group_name, MixedInstancesPolicy=mixed)  # fmt: skip
    assert {r.action for r in requests_for(named, STACK)} == {
        "autoscaling:UpdateAutoScalingGroup", "ec2:RunInstances", "iam:PassRole", "ec2:CreateTags"
    }  # fmt: skip


def test_the_instance_uses_the_stacks_key_only_through_s3_and_sns() -> None:
    """S3 (SSE-KMS objects) and SNS (the encrypted topic) call KMS for the instance, with kms:ViaService
    their endpoint; nothing on the instance calls KMS itself, so a direct call is refused."""
    who = caller(INSTANCE, STACK)
    key_policy, _ = resource_policy(STACK.key_arn, STACK)

    def allowed(action: str, **context: list[str]) -> bool:
        # A direct call carries no kms:ViaService: the key is known to the model, and absent.
        request = Request(action, STACK.key_arn, context, frozenset({"kms:viaservice"}))
        return decide(request, who, key_policy, key_policy=True).allowed

    for service in ("s3", "sns"):
        via = {"kms:viaservice": [f"{service}.{REGION}.amazonaws.com"]}
        assert allowed("kms:Decrypt", **via) and allowed("kms:GenerateDataKey", **via)
    assert not allowed("kms:Decrypt", **{"kms:viaservice": [f"ec2.{REGION}.amazonaws.com"]})
    assert not allowed("kms:GenerateDataKey", **{"kms:viaservice": [f"logs.{REGION}.amazonaws.com"]})
    for action in ("kms:Decrypt", "kms:GenerateDataKey", "kms:DescribeKey"):
        assert not allowed(action), f"{action} called directly"
    # What the recorded calls ask for: an SSE-KMS read and a publish to the encrypted topic.
    read = _call(INSTANCE, "s3", "GetObject", Bucket=STACK.bucket, Key="jobs/a/checkpoints/latest.json")
    publish = _call(INSTANCE, "sns", "Publish", TopicArn=STACK.topic_arn, Message="m")
    assert _refusals(read, publish) == set()


# --- the check against the declared policies ---------------------------------------------------------------


def test_the_declared_policies_refuse_what_aws_would_and_the_failure_names_principal_action_resource(
    tmp_path: Path,
) -> None:
    group = STACK.group_name
    template = {"LaunchTemplateSpecification": {"LaunchTemplateId": "lt-1", "Version": "3"}}
    calls = [
        _call(
            CAPACITY_FALLBACK,
            "autoscaling",
            "UpdateAutoScalingGroup",
            AutoScalingGroupName=group,
            MixedInstancesPolicy={"LaunchTemplate": template},
        ),
        _call(INSTANCE, "s3", "GetObject", Bucket=STACK.bucket, Key="jobs/x/latest.json", VersionId="v1"),
        _call(INSTANCE, "s3", "ListObjectsV2", Bucket=STACK.bucket),
        _call(INSTANCE, "s3", "PutObject", Bucket=STACK.bucket, Key="data/x"),
        _call(
            INSTANCE,
            "autoscaling",
            "SetDesiredCapacity",
            AutoScalingGroupName="someone-elses-gpu",
            DesiredCapacity=0,
        ),
        _call(CLI, "s3", "PutObject", Bucket=STACK.bucket, Key="data/x", ServerSideEncryption="AES256"),
        _call(INSTANCE, "s3", "GetObjectAcl", Bucket=STACK.bucket, Key="jobs/x"),
    ]
    bucket = f"arn:aws:s3:::{STACK.bucket}"
    assert _refusals(*calls) >= {
        (CAPACITY_FALLBACK, "ec2:RunInstances", "arn:aws:ec2:us-east-1:123456789012:launch-template/lt-1"),
        (CAPACITY_FALLBACK, "iam:PassRole", "arn:aws:iam::123456789012:role/trainstack-test-instance"),
        (CAPACITY_FALLBACK, "ec2:CreateTags", "arn:aws:ec2:us-east-1:123456789012:instance/*"),
        (INSTANCE, "s3:GetObjectVersion", f"{bucket}/jobs/x/latest.json"),
        (INSTANCE, "s3:ListBucket", bucket),  # no prefix: the s3:prefix condition does not hold
        (INSTANCE, "s3:PutObject", f"{bucket}/data/x"),  # data/ is read-only
        (
            INSTANCE,
            "autoscaling:SetDesiredCapacity",
            "arn:aws:autoscaling:us-east-1:123456789012:autoScalingGroup:00000000-0000-0000-0000-000000000000:"
            "autoScalingGroupName/someone-elses-gpu",
        ),
        (CLI, "s3:PutObject", f"{bucket}/data/x"),  # the bucket policy refuses SSE-S3
        (INSTANCE, "s3.GetObjectAcl", "?"),  # a call the model does not know fails until it is modelled
    }
    # What a session failure prints: principal, action and resource first.
    recording = tmp_path / "instance-role-1.jsonl"
    recording.write_text("".join(json.dumps(c) + "\n" for c in calls))
    findings, _, principals = check_folder(tmp_path)
    lines = report(findings)
    assert any(line.startswith(f"{CAPACITY_FALLBACK}: iam:PassRole on arn:aws:iam::") for line in lines)
    assert principals == {INSTANCE: 5, CAPACITY_FALLBACK: 1, CLI: 1}


def test_what_the_agent_and_the_function_do_is_allowed() -> None:
    bucket, group = STACK.bucket, STACK.group_name
    distribution = {"InstancesDistribution": {"OnDemandPercentageAboveBaseCapacity": 100}}
    calls = [
        _call(INSTANCE, "autoscaling", "DescribeAutoScalingGroups", AutoScalingGroupNames=[group]),
        _call(INSTANCE, "s3", "ListObjectsV2", Bucket=bucket, Prefix="jobs/a/"),
        _call(INSTANCE, "s3", "GetObject", Bucket=bucket, Key="data/train/0.png"),
        _call(INSTANCE, "s3", "PutObject", Bucket=bucket, Key="jobs/a/latest.json", IfNoneMatch="*"),
        _call(INSTANCE, "s3", "CompleteMultipartUpload", Bucket=bucket, Key="jobs/a/ckpt.pt", UploadId="u"),
        _call(INSTANCE, "s3", "DeleteObjects", Bucket=bucket, Delete={"Objects": [{"Key": "jobs/a/old.pt"}]}),
        _call(
            INSTANCE,
            "autoscaling",
            "CompleteLifecycleAction",
            AutoScalingGroupName=group,
            LifecycleHookName="drain",
            LifecycleActionResult="CONTINUE",
            InstanceId="i-1",
        ),
        _call(
            INSTANCE,
            "autoscaling",
            "TerminateInstanceInAutoScalingGroup",
            InstanceId="i-1",
            ShouldDecrementDesiredCapacity=True,
        ),
        _call(
            INSTANCE, "logs", "PutLogEvents", logGroupName=STACK.log_group, logStreamName="i-1", logEvents=[]
        ),
        _call(INSTANCE, "sns", "Publish", TopicArn=STACK.topic_arn, Message="m"),
        _call(INSTANCE, "cloudwatch", "PutMetricData", Namespace="trainstack", MetricData=[]),
        _call(
            CAPACITY_FALLBACK,
            "autoscaling",
            "UpdateAutoScalingGroup",
            AutoScalingGroupName=group,
            MixedInstancesPolicy=distribution,
        ),
        _call(CLI, "s3", "PutObject", Bucket=bucket, Key="data/x"),
    ]
    assert _refusals(*calls) == set()

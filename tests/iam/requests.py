"""What AWS authorizes for one recorded call: the IAM actions, the resource ARNs and the condition keys.

One API call is often several authorizations. Besides the call's own action (GetObject with a version id
is s3:GetObjectVersion; DeleteObjects is s3:DeleteObject per key), AWS checks, for the calls made here:

- S3 objects under SSE-KMS (every object of the stack's bucket: its default encryption is the stack's key
  and its policy refuses any other): GetObject, CopyObject's source, UploadPartCopy's source and
  CompleteMultipartUpload need kms:Decrypt; PutObject, CopyObject, CreateMultipartUpload, UploadPart and
  UploadPartCopy need kms:GenerateDataKey (S3 User Guide, "Using server-side encryption with AWS KMS keys"
  and "Multipart upload and permissions"). HeadObject decrypts nothing.
- UpdateAutoScalingGroup (also Create) that names a launch template, at the top level or in a mixed
  instances policy: ec2:RunInstances on the template and what it launches, iam:PassRole on the instance
  profile's role, ec2:CreateTags because trainstack's template tags instances and volumes (EC2 Auto
  Scaling User Guide, "Control Amazon EC2 launch template usage in Auto Scaling groups": checked "when an
  Auto Scaling group is created or updated using a launch template"). An update that names no template,
  only the instances distribution, is checked for autoscaling:UpdateAutoScalingGroup alone.
- GetObject or HeadObject of a key that does not exist (moto answered NoSuchKey or 404, as the recording's
  `answer` says): AWS answers 404 only to a caller that may also s3:ListBucket the bucket, AccessDenied to
  any other (S3 API reference, GetObject and HeadObject, "Permissions"). That listing is authorized with the
  object's key as `s3:prefix` (as AWS does; Ceph's RGW adds the key the same way to match it), so a
  prefix-conditioned ListBucket covering the key is enough. Nothing is decrypted for a missing object.

Which stack a resource belongs to is read from its name, as the embedded stack names them (demo/stack.py):
`<stack>-data` (bucket), `<stack>-gpu` (group), `/trainstack/<stack>` (log group), `<stack>-alerts`
(topic). A call that names an instance only (SetInstanceHealth, TerminateInstanceInAutoScalingGroup) is
authorized on AWS against the group that instance is in: here the group of the stack the same process
named last.

A job's secrets (bootstrap/secrets.py) live under `/trainstack/<stack>/` (SSM) and `trainstack/<stack>/`
(Secrets Manager): GetParameter(s) with decryption and GetSecretValue are also kms:Decrypt on the stack's key,
made by the service for the caller, so the request carries `kms:ViaService` and the encryption context the
service sends (`PARAMETER_ARN`, `SecretARN`; Systems Manager User Guide, "How AWS Systems Manager Parameter
Store uses AWS KMS"; Secrets Manager User Guide, "Secret encryption and decryption"). `trainstack secrets set`
(the CLI's PutParameter with the stack's key) is kms:Encrypt through SSM, judged by the key policy.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tests.iam.evaluate import Request

ACCOUNT = "123456789012"  # moto's account: every recorded call was made in it
PARTITION = "aws"
# The group's ARN carries an id AWS generates; the program's patterns leave it open (`*`).
GROUP_ID = "00000000-0000-0000-0000-000000000000"


class UnmappedCallError(Exception):
    """A call the model does not know: it must be added here before the check can pass."""


@dataclass(frozen=True)
class Stack:
    """The ARNs of one stack's resources in the recording's account and region."""

    name: str
    region: str
    account: str = ACCOUNT

    @property
    def bucket(self) -> str:
        return f"{self.name}-data"

    @property
    def bucket_arn(self) -> str:
        return f"arn:{PARTITION}:s3:::{self.bucket}"

    @property
    def key_arn(self) -> str:
        # The key's id is generated; requests and policies name the same stand-in, so what is checked is
        # that the action is granted on the stack's key, whatever its id.
        return f"arn:{PARTITION}:kms:{self.region}:{self.account}:key/{self.name}-key"

    @property
    def topic_arn(self) -> str:
        return f"arn:{PARTITION}:sns:{self.region}:{self.account}:{self.name}-alerts"

    @property
    def log_group(self) -> str:
        return f"/trainstack/{self.name}"

    @property
    def log_group_arn(self) -> str:
        return f"arn:{PARTITION}:logs:{self.region}:{self.account}:log-group:{self.log_group}"

    @property
    def group_name(self) -> str:
        return f"{self.name}-gpu"

    def group_arn(self, name: str | None = None) -> str:
        return (
            f"arn:{PARTITION}:autoscaling:{self.region}:{self.account}:autoScalingGroup:{GROUP_ID}:"
            f"autoScalingGroupName/{name or self.group_name}"
        )

    @property
    def instance_role_arn(self) -> str:
        return f"arn:{PARTITION}:iam::{self.account}:role/{self.name}-instance"

    @property
    def job_role_arn(self) -> str:
        return f"arn:{PARTITION}:iam::{self.account}:role/{self.name}-job"


def stack_named_by(call: Mapping[str, Any]) -> str | None:
    """The stack a call's resource names, or None when it names none (Describe*, an instance id)."""
    params = call["params"]
    names = [
        (params.get("Bucket"), "-data"),
        (params.get("AutoScalingGroupName"), "-gpu"),
        (*params.get("AutoScalingGroupNames", [None])[:1], "-gpu"),
        (str(params.get("TopicArn", "")).rsplit(":", 1)[-1] or None, "-alerts"),
    ]
    for name, suffix in names:
        if isinstance(name, str) and name.endswith(suffix):
            return name.removesuffix(suffix)
        if isinstance(name, str) and suffix == "-gpu" and "-gpu-" in name:
            # A pool's group, `<stack>-gpu-<pool>` (infra/config/ pool_group_name; no pool name holds gpu).
            return name.rpartition("-gpu-")[0]
    group = params.get("logGroupName")
    if isinstance(group, str) and group.startswith("/trainstack/"):
        return group.removeprefix("/trainstack/").split("/")[0]
    # A secret's parameter or secret id: /trainstack/<stack>/<name> or trainstack/<stack>/<name>.
    secret = params.get("Name") or (params.get("Names") or [None])[0] or params.get("SecretId")
    if call["service"] in ("ssm", "secretsmanager") and isinstance(secret, str):
        parts = secret.lstrip("/").split("/")
        if len(parts) > 2 and parts[0] == "trainstack":
            return parts[1]
    return None


def _request(action: str, resource: str, why: str, **context: list[str]) -> Request:
    return Request(action=action, resource=resource, context=context, why=why)


# Condition keys these requests model even when absent from one of them.
_S3_KEYS = frozenset(
    {
        "s3:prefix",
        "s3:x-amz-server-side-encryption",
        "s3:x-amz-server-side-encryption-aws-kms-key-id",
        "s3:if-none-match",
        "s3:if-match",
    }
)
_STAR_ACTIONS = {
    ("autoscaling", "DescribeAutoScalingGroups"): "autoscaling:DescribeAutoScalingGroups",
    ("autoscaling", "DescribeAutoScalingInstances"): "autoscaling:DescribeAutoScalingInstances",
    ("autoscaling", "DescribeScalingActivities"): "autoscaling:DescribeScalingActivities",
    ("ec2", "DescribeSpotPriceHistory"): "ec2:DescribeSpotPriceHistory",
    ("ec2", "GetSpotPlacementScores"): "ec2:GetSpotPlacementScores",
    ("pricing", "GetProducts"): "pricing:GetProducts",
    # `trainstack top`: CloudWatch's metric reads take no resource ARN.
    ("cloudwatch", "GetMetricData"): "cloudwatch:GetMetricData",
    ("cloudwatch", "ListMetrics"): "cloudwatch:ListMetrics",
    ("ssm", "GetCommandInvocation"): "ssm:GetCommandInvocation",
}
_GROUP_ACTIONS = {
    "SetDesiredCapacity",
    "CompleteLifecycleAction",
    "RecordLifecycleActionHeartbeat",
    "UpdateAutoScalingGroup",
    # A pool of several lanes protects a training instance from scale-in (it names its group).
    "SetInstanceProtection",
}
_INSTANCE_GROUP_ACTIONS = {"SetInstanceHealth", "TerminateInstanceInAutoScalingGroup"}


def requests_for(call: Mapping[str, Any], stack: Stack | None) -> list[Request]:
    """Every authorization AWS makes for `call`; `stack`: the stack the call's process works for."""
    service, operation, params = call["service"], call["operation"], call["params"]
    why = f"{service}.{operation}"
    if (service, operation) in _STAR_ACTIONS:
        return [_request(_STAR_ACTIONS[service, operation], "*", why)]
    if service == "sts" and operation == "GetCallerIdentity":
        return []  # needs no permission: AWS answers it for any valid credentials
    if service == "sts" and operation == "AssumeRole":
        # The caller's side; the role's trust policy is checked in tests/infra (job role scoping).
        return [_request("sts:AssumeRole", params["RoleArn"], why)]
    if service == "s3":
        return list(_s3(operation, params, stack, why, call.get("answer")))
    if service == "autoscaling":
        return list(_autoscaling(operation, params, stack, why))
    # FilterLogEvents, GetLogEvents: `trainstack logs` and `run`'s following, as the dev box's role.
    if service == "logs" and operation in (
        "CreateLogStream",
        "DescribeLogStreams",
        "PutLogEvents",
        "FilterLogEvents",
        "GetLogEvents",
    ):
        group = f"arn:{PARTITION}:logs:{call['region']}:{ACCOUNT}:log-group:{params['logGroupName']}"
        if operation == "PutLogEvents":
            group = f"{group}:log-stream:{params['logStreamName']}"
        return [_request(f"logs:{operation}", group, why)]
    if service == "sns" and operation == "Publish":
        publish = [_request("sns:Publish", params["TopicArn"], why)]
        if stack is not None and params["TopicArn"] == stack.topic_arn:
            # The topic is encrypted with the stack's key: SNS asks KMS for the publisher (SNS developer
            # guide, "Encryption at rest": kms:GenerateDataKey and kms:Decrypt).
            via = {"kms:viaservice": [f"sns.{stack.region}.amazonaws.com"]}
            publish += [
                _request(action, stack.key_arn, f"{why} (encrypted topic)", **via)
                for action in ("kms:GenerateDataKey", "kms:Decrypt")
            ]
        return publish
    if service == "ssm" and operation in ("GetParameter", "GetParameters", "PutParameter"):
        return list(_ssm(operation, params, call["region"], stack, why))
    if service == "secretsmanager" and operation == "GetSecretValue":
        return list(_secretsmanager(params, call["region"], stack, why))
    if service == "ec2-instance-connect" and operation == "SendSSHPublicKey":
        # `trainstack dev proxy`: the key is for one OS user of one instance (the ec2:osuser condition key).
        instance = f"arn:{PARTITION}:ec2:{call['region']}:{ACCOUNT}:instance/{params['InstanceId']}"
        user = {"ec2:osuser": [params["InstanceOSUser"]]}
        return [_request("ec2-instance-connect:SendSSHPublicKey", instance, why, **user)]
    if service == "ssm" and operation == "SendCommand":
        # `trainstack dev jupyter|tensorboard`: authorized on the document and on each target instance.
        ec2 = f"arn:{PARTITION}:ec2:{call['region']}:{ACCOUNT}"
        document = f"arn:{PARTITION}:ssm:{call['region']}::document/{params['DocumentName']}"
        targets = [f"{ec2}:instance/{i}" for i in params["InstanceIds"]]
        return [_request("ssm:SendCommand", arn, why) for arn in (document, *targets)]
    if service == "cloudwatch" and operation == "PutMetricData":
        return [
            _request("cloudwatch:PutMetricData", "*", why, **{"cloudwatch:namespace": [params["Namespace"]]})
        ]
    raise UnmappedCallError(f"{service}.{operation}")


def _parameter_arn(region: str, name: str) -> str:
    return f"arn:{PARTITION}:ssm:{region}:{ACCOUNT}:parameter/{name.lstrip('/')}"


def _own_key(key: Any, stack: Stack | None) -> str:
    """A key ARN of the stack's account and region stands for the stack's key (see _put_context)."""
    own = stack is not None and str(key).startswith(
        f"arn:{PARTITION}:kms:{stack.region}:{stack.account}:key/"
    )
    return stack.key_arn if own and stack is not None else str(key)


def _ssm(
    operation: str, params: Mapping[str, Any], region: str, stack: Stack | None, why: str
) -> Iterator[Request]:
    via = {"kms:viaservice": [f"ssm.{region}.amazonaws.com"]}
    if operation == "PutParameter":
        arn = _parameter_arn(region, params["Name"])
        yield _request("ssm:PutParameter", arn, why)
        if params.get("Type") == "SecureString":
            key = _own_key(params["KeyId"], stack) if params.get("KeyId") else "alias/aws/ssm"
            yield _request("kms:Encrypt", key, f"{why} (SecureString)", **via, **_parameter_context(arn))
        return
    names = [params["Name"]] if operation == "GetParameter" else list(params["Names"])
    for name in names:
        arn = _parameter_arn(region, name)
        yield _request(f"ssm:{operation}", arn, why)
        if params.get("WithDecryption") and stack is not None:
            # `trainstack secrets set` encrypts with the stack's key: decrypting is kms:Decrypt through SSM.
            yield _request(
                "kms:Decrypt", stack.key_arn, f"{why} (SecureString)", **via, **_parameter_context(arn)
            )


def _parameter_context(arn: str) -> dict[str, list[str]]:
    return {"kms:encryptioncontext:parameter_arn": [arn]}


def _secretsmanager(
    params: Mapping[str, Any], region: str, stack: Stack | None, why: str
) -> Iterator[Request]:
    secret_id = str(params["SecretId"])
    # A name gets the six random characters AWS appends to every secret's ARN.
    arn = (
        secret_id
        if secret_id.startswith("arn:")
        else (f"arn:{PARTITION}:secretsmanager:{region}:{ACCOUNT}:secret:{secret_id}-AbCdEf")
    )
    yield _request("secretsmanager:GetSecretValue", arn, why)
    if stack is not None:
        yield _request(
            "kms:Decrypt",
            stack.key_arn,
            f"{why} (a secret on the stack's key)",
            **{
                "kms:viaservice": [f"secretsmanager.{region}.amazonaws.com"],
                "kms:encryptioncontext:secretarn": [arn],
            },
        )


def _object(bucket: str, key: str) -> str:
    return f"arn:{PARTITION}:s3:::{bucket}/{key}"


def _kms(action: str, stack: Stack | None, bucket: str, why: str) -> Iterator[Request]:
    """The stack's bucket encrypts every object with the stack's key; another bucket's key is unknown."""
    if stack is not None and bucket == stack.bucket:
        # S3 calls KMS on the caller's behalf: kms:ViaService is S3's regional endpoint.
        via = {"kms:viaservice": [f"s3.{stack.region}.amazonaws.com"]}
        yield _request(action, stack.key_arn, f"{why} (SSE-KMS object)", **via)
    else:
        yield _request(
            action, f"arn:{PARTITION}:kms:*:{ACCOUNT}:key/unknown-key-of-{bucket}", f"{why} (SSE-KMS)"
        )


def _put_context(params: Mapping[str, Any], stack: Stack | None) -> dict[str, list[str]]:
    context: dict[str, list[str]] = {}
    # Conditional writes: the bucket policy refuses the stack's roles an unconditional write of a submission
    # (S3 User Guide, "Enforce conditional writes on Amazon S3 buckets").
    for param, name in (("IfNoneMatch", "s3:if-none-match"), ("IfMatch", "s3:if-match")):
        if params.get(param):
            context[name] = [str(params[param])]
    if params.get("ServerSideEncryption"):
        context["s3:x-amz-server-side-encryption"] = [params["ServerSideEncryption"]]
    key = params.get("SSEKMSKeyId")
    if key:
        # A key's id is generated and the recording does not know the stack's: a key ARN of the stack's own
        # account and region stands for the stack's key (callers read it from the stack's outputs); an alias
        # (alias/aws/s3), a bare id or another account's key is judged as itself.
        own = stack is not None and str(key).startswith(
            f"arn:{PARTITION}:kms:{stack.region}:{stack.account}:key/"
        )
        context["s3:x-amz-server-side-encryption-aws-kms-key-id"] = [stack.key_arn if own and stack else key]
    return context


# What moto (and AWS, to a caller that may list the key) answers a read of a missing object: GetObject's
# NoSuchKey, HeadObject's bare 404 (a HEAD has no body to carry a code).
MISSING_OBJECT_ERRORS = frozenset({"NoSuchKey", "404", "NotFound"})


def _missing(answer: Mapping[str, Any] | None) -> str | None:
    """The error a read was answered with when it says the object is missing, else None."""
    if answer and answer.get("status") == 404 and answer.get("error") in MISSING_OBJECT_ERRORS:
        return "NoSuchKey" if answer["error"] == "NoSuchKey" else "404 Not Found"
    return None


def _s3(
    operation: str,
    params: Mapping[str, Any],
    stack: Stack | None,
    why: str,
    answer: Mapping[str, Any] | None = None,
) -> Iterator[Request]:
    bucket = params.get("Bucket", "")
    bucket_arn = f"arn:{PARTITION}:s3:::{bucket}"

    def s3(action: str, resource: str, **context: list[str]) -> Request:
        return Request(action, resource, context, _S3_KEYS, why)

    if operation in ("ListObjectsV2", "ListObjects", "ListObjectVersions"):
        # s3:prefix is absent when the listing names no prefix: a prefix condition then does not hold.
        context = {"s3:prefix": [params["Prefix"]]} if "Prefix" in params else {}
        action = "s3:ListBucketVersions" if operation == "ListObjectVersions" else "s3:ListBucket"
        yield s3(action, bucket_arn, **context)
    elif operation == "HeadBucket":
        yield s3("s3:ListBucket", bucket_arn)
    elif operation == "GetBucketLocation":
        yield s3("s3:GetBucketLocation", bucket_arn)
    elif operation in ("GetObject", "HeadObject"):
        key = params["Key"]
        yield s3("s3:GetObjectVersion" if params.get("VersionId") else "s3:GetObject", _object(bucket, key))
        missing = _missing(answer)
        if missing:
            yield Request(
                "s3:ListBucket",
                bucket_arn,
                {"s3:prefix": [key]},
                _S3_KEYS,
                f"{why} of {key}, answered {missing}",
                refusal=f"AWS would answer AccessDenied here, not {missing}: S3 tells a missing key only to "
                "a caller that may list it; grant s3:ListBucket on the bucket with an s3:prefix condition "
                "matching the key (or make the code read AccessDenied there as possibly missing)",
            )
        elif operation == "GetObject":
            yield from _kms("kms:Decrypt", stack, bucket, why)
    elif operation in ("PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload"):
        yield s3("s3:PutObject", _object(bucket, params["Key"]), **_put_context(params, stack))
        if operation != "CompleteMultipartUpload":
            yield from _kms("kms:GenerateDataKey", stack, bucket, why)
        if operation == "CompleteMultipartUpload":
            yield from _kms("kms:Decrypt", stack, bucket, why)
    elif operation in ("CopyObject", "UploadPartCopy"):
        source = params["CopySource"]
        if isinstance(source, str):
            source_bucket, _, source_key = source.lstrip("/").partition("/")
            source_version = None
        else:
            source_bucket, source_key, source_version = (
                source["Bucket"],
                source["Key"],
                source.get("VersionId"),
            )
        action = "s3:GetObjectVersion" if source_version else "s3:GetObject"
        yield s3(action, _object(source_bucket, source_key))
        yield s3("s3:PutObject", _object(bucket, params["Key"]), **_put_context(params, stack))
        yield from _kms("kms:Decrypt", stack, source_bucket, why)
        yield from _kms("kms:GenerateDataKey", stack, bucket, why)
    elif operation == "AbortMultipartUpload":
        yield s3("s3:AbortMultipartUpload", _object(bucket, params["Key"]))
    elif operation == "DeleteObject":
        action = "s3:DeleteObjectVersion" if params.get("VersionId") else "s3:DeleteObject"
        yield s3(action, _object(bucket, params["Key"]))
    elif operation == "DeleteObjects":
        # One request, one authorization per key (S3 API reference, DeleteObjects).
        for item in params["Delete"]["Objects"]:
            action = "s3:DeleteObjectVersion" if item.get("VersionId") else "s3:DeleteObject"
            yield s3(action, _object(bucket, item["Key"]))
    else:
        raise UnmappedCallError(f"s3.{operation}")


def _autoscaling(
    operation: str, params: Mapping[str, Any], stack: Stack | None, why: str
) -> Iterator[Request]:
    if operation in _GROUP_ACTIONS:
        name = params["AutoScalingGroupName"]
        region_stack = stack or Stack(name.removesuffix("-gpu").rpartition("-gpu-")[0] or name, "us-east-1")
        yield _request(f"autoscaling:{operation}", region_stack.group_arn(name), why)
        if operation == "UpdateAutoScalingGroup":
            yield from _launch_template_checks(params, region_stack, why)
    elif operation in _INSTANCE_GROUP_ACTIONS:
        if stack is None:
            raise UnmappedCallError(
                f"autoscaling.{operation} on {params.get('InstanceId')}: no stack named before it"
            )
        yield _request(f"autoscaling:{operation}", stack.group_arn(), f"{why} ({params.get('InstanceId')})")
    else:
        raise UnmappedCallError(f"autoscaling.{operation}")


def _templates(params: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    found = [params["LaunchTemplate"]] if params.get("LaunchTemplate") else []
    mixed = params.get("MixedInstancesPolicy", {}).get("LaunchTemplate", {})
    if mixed.get("LaunchTemplateSpecification"):
        found.append(mixed["LaunchTemplateSpecification"])
    found += [
        o["LaunchTemplateSpecification"]
        for o in mixed.get("Overrides", [])
        if "LaunchTemplateSpecification" in o
    ]
    return found


def _launch_template_checks(params: Mapping[str, Any], stack: Stack, why: str) -> Iterator[Request]:
    """What AWS checks when the update names a launch template: launching from it as the caller."""
    ec2 = f"arn:{PARTITION}:ec2:{stack.region}:{stack.account}"
    for spec in _templates(params):
        template = f"{ec2}:launch-template/{spec.get('LaunchTemplateId') or spec.get('LaunchTemplateName')}"
        because = f"{why} names launch template {template.rsplit('/', 1)[-1]}"
        for resource in (template, f"{ec2}:instance/*", f"{ec2}:volume/*", f"{ec2}:network-interface/*"):
            yield _request("ec2:RunInstances", resource, because)
        yield _request("iam:PassRole", stack.instance_role_arn, f"{because} (its instance profile)")
        yield _request("ec2:CreateTags", f"{ec2}:instance/*", f"{because} (its tag specifications)")

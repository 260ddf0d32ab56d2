"""The policies: one per control of the security baseline (SECURITY.md), all mandatory."""

from __future__ import annotations

from typing import TypeVar

from pulumi_policy import (
    Policy,
    PolicyConfigSchema,
    ResourceValidationPolicy,
    Severity,
    StackValidationPolicy,
)

from . import capacity, compute, containment, exposure, grants, identity, network, observability, storage
from . import resource_types as t
from .control import resource_policy, stack_policy

_LAUNCHERS = (t.LAUNCH_TEMPLATE, t.INSTANCE, t.LAUNCH_CONFIGURATION)
_IAM_DOCUMENTS = (t.IAM_POLICY, t.IAM_ROLE, *t.IAM_INLINE_POLICIES)


_Configurable = TypeVar("_Configurable", ResourceValidationPolicy, StackValidationPolicy)


def _with_config(policy: _Configurable, schema: PolicyConfigSchema) -> _Configurable:
    policy.config_schema = schema
    return policy


def _trusted_accounts(policy: StackValidationPolicy) -> StackValidationPolicy:
    return _with_config(
        policy,
        PolicyConfigSchema(
            properties={
                "trustedAccountIds": {
                    "type": "array",
                    "items": {"type": "string", "pattern": "^[0-9]{12}$"},
                    "default": [],
                }
            }
        ),
    )


# Issue 24: effective permissions (identity, resource and trust policies alike), what groups launch, egress,
# the S3 endpoint, and what user data runs.
ISSUE_24_POLICIES: list[Policy] = [
    resource_policy(
        "iam-escalation-on-named-resources",
        ["CKV_AWS_286", "CKV_AWS_355"],
        "Identity policies (managed, inline and AWS managed ones attached) allow iam:PassRole, "
        "sts:AssumeRole, launch template versions, IAM policy and credential changes and function code "
        "updates on named resources only, however the action is spelled (iam:Pass*, *, NotAction).",
        grants.IDENTITY_DOCUMENT_CARRIERS,
        grants.no_escalation_on_unnamed_resources,
        Severity.CRITICAL,
        'Resource: ["arn:aws:iam::<account>:role/<name>"] (no wildcard) for iam:PassRole and the like',
    ),
    resource_policy(
        "iam-data-access-on-named-resources",
        ["CKV_AWS_288", "CKV_AWS_355"],
        "Identity policies (managed, inline and AWS managed ones attached, e.g. AmazonS3ReadOnlyAccess) "
        "read or write objects, SSM parameters and secrets only in a named bucket, parameter path or "
        "secret path.",
        grants.IDENTITY_DOCUMENT_CARRIERS,
        grants.no_data_access_on_unnamed_resources,
        Severity.HIGH,
        'Resource: "arn:aws:s3:::<bucket>/<prefix>*", "arn:aws:ssm:<region>:<account>:parameter/trainstack/'
        '<stack>/*"',
    ),
    _trusted_accounts(
        stack_policy(
            "s3-bucket-policy-not-public",
            ["S3.6", "CKV_AWS_70"],
            "Bucket policies grant nothing to everyone (Principal *, without a condition on this account, "
            "organization, source or VPC endpoint) nor to another account.",
            exposure.bucket_policy_not_public,
            Severity.CRITICAL,
            "Principal: this account's roles; or a condition on aws:SourceAccount/aws:SourceVpce",
        )
    ),
    _trusted_accounts(
        stack_policy(
            "kms-key-policy-not-public",
            ["KMS.5", "CKV_AWS_33"],
            "KMS key policies grant nothing to everyone (Principal *, without a condition on this account) "
            "nor to another account.",
            exposure.key_policy_not_public,
            Severity.CRITICAL,
            'Principal {"AWS": "arn:aws:iam::<this account>:root"}, or * with aws:PrincipalAccount',
        )
    ),
    _trusted_accounts(
        stack_policy(
            "iam-trust-policy-not-public",
            ["CKV_AWS_60"],
            "Role trust policies let only named services or this account's principals assume the role: "
            'never Principal * or {"AWS": "*"} without a restricting condition, never another account.',
            exposure.trust_policy_not_public,
            Severity.CRITICAL,
            'Principal {"Service": "ec2.amazonaws.com"} or this account\'s role ARNs',
        )
    ),
    _trusted_accounts(
        stack_policy(
            "sns-topic-policy-not-public",
            ["SNS.4", "CKV_AWS_169"],
            "SNS topic policies grant nothing to everyone (without a condition on this account or source) "
            "nor to another account.",
            exposure.topic_policy_not_public,
            Severity.HIGH,
            "Principal: a service with aws:SourceAccount and aws:SourceArn conditions",
        )
    ),
    _trusted_accounts(
        stack_policy(
            "lambda-permission-not-public",
            ["Lambda.1", "CKV_AWS_301", "CKV_AWS_364"],
            "Lambda permissions let no one outside the account invoke a function, and services only for a "
            "named source (source_arn or source_account).",
            exposure.lambda_permission_not_public,
            Severity.HIGH,
            'aws.lambda_.Permission(principal="events.amazonaws.com", source_arn=rule.arn, ...)',
        )
    ),
    _trusted_accounts(
        stack_policy(
            "ebs-snapshot-not-public",
            ["EC2.1"],
            "No EBS snapshot (nor AMI) is shared with everyone or with another account.",
            exposure.snapshots_not_public,
            Severity.CRITICAL,
            "remove the aws.ec2.SnapshotCreateVolumePermission / aws.ec2.AmiLaunchPermission",
        )
    ),
    stack_policy(
        "launch-templates-declared",
        ["AutoScaling.3", "AutoScaling.4"],
        "Auto Scaling groups, their per-type overrides and instances launch only launch templates this "
        "stack declares, so the IMDS, EBS and user-data rules judged what runs.",
        compute.groups_launch_declared_templates,
        Severity.HIGH,
        "launch_template_specification={'launch_template_id': template.id, ...} of this stack's template",
    ),
    resource_policy(
        "no-all-protocol-egress-to-internet",
        ["CKV_AWS_382"],
        "No security group allows all protocols and ports out to the internet (more than an IPv4 /8 or an "
        "IPv6 /32); egress names its ports.",
        [t.SECURITY_GROUP, t.SECURITY_GROUP_RULE, t.SECURITY_GROUP_EGRESS_RULE],
        network.no_all_protocol_egress_to_the_internet,
        Severity.HIGH,
        'egress=[{"protocol": "tcp", "from_port": 443, "to_port": 443, "cidr_blocks": ["0.0.0.0/0"]}]',
    ),
    stack_policy(
        "s3-endpoint-policy-scoped",
        ["data-perimeter"],
        "S3 VPC endpoints carry a policy that reaches named buckets only (no policy, or s3:* on *, lets "
        "data leave to any bucket of any account).",
        network.s3_endpoint_policy_scoped,
        Severity.HIGH,
        'policy: Allow s3:GetObject/PutObject on "arn:aws:s3:::<bucket>/*" and s3:ListBucket on the bucket',
    ),
    resource_policy(
        "no-piped-downloads-in-user-data",
        ["boot-supply-chain"],
        "EC2 user data never pipes a download into a shell or interpreter (curl | bash, wget -O- | sh, "
        "bash <(curl ...)): what runs at boot is pinned by a hash.",
        _LAUNCHERS,
        compute.no_piped_downloads_in_user_data,
        Severity.HIGH,
        "download to a file, check its SHA-256 (sha256sum -c), then run it; or ship it in the hashed bundle",
    ),
]

# Issue 34: the job's containment, each control this round adds or keeps (SECURITY.md T7, T9, T10, T11, T15),
# and the teardown of the stack's data and audit trail.
ISSUE_34_POLICIES: list[Policy] = [
    stack_policy(
        "job-role-contained",
        ["job-containment"],
        "The role the job instances hand a job is taken by the job instances' role alone (aws:PrincipalArn), "
        "writes only under jobs/, reads no whole bucket, and is denied, without a condition, every write of "
        "the "
        "agent's control objects (state/*, jobs/*/state/*, jobs/*/job.json, jobs/*/checkpoints/latest.json).",
        containment.job_role_contained,
        Severity.CRITICAL,
        "a Deny of s3:PutObject, s3:DeleteObject, s3:AbortMultipartUpload on the control objects; trust "
        "Principal "
        '{"AWS": "arn:aws:iam::<account>:root"} with '
        '{"ArnEquals": {"aws:PrincipalArn": "<instance role ARN>"}}',
    ),
    stack_policy(
        "instance-roles-launch-nothing",
        ["job-containment", "CKV_AWS_286"],
        "Roles instances run as (the agents', the dev box's) never launch, start, change or tag instances, "
        "rewrite launch templates, pass a role or run commands on other instances; the job instances' role "
        "takes the job role only, and a dev box's role has no EC2, IAM or STS action.",
        containment.instance_roles_launch_nothing,
        Severity.CRITICAL,
        "remove ec2:RunInstances, iam:PassRole, ec2:CreateTags, ssm:SendCommand, sts:AssumeRole... from the "
        "role",
    ),
    stack_policy(
        "s3-instance-roles-through-endpoint",
        ["data-perimeter"],
        "With an S3 endpoint in the stack, every bucket the instances' roles (and the job role) reach denies "
        "them s3:* on the bucket and its objects outside the stack's endpoint (aws:SourceVpce or "
        "aws:SourceVpc).",
        containment.instance_roles_through_endpoint,
        Severity.HIGH,
        'Deny "s3:*" for Principal "*" with '
        '{"ArnEquals": {"aws:PrincipalArn": [<roles>]}, "StringNotEquals": '
        '{"aws:SourceVpce": "<endpoint id>"}}',
    ),
    stack_policy(
        "s3-submissions-create-only",
        ["job-containment"],
        "A bucket the stack's roles (the instances', the dev box's, the job's) write submissions in denies "
        "each of them s3:PutObject of job-code/*, jobs/*/job.json and queue/* without If-None-Match "
        '({"Null": {"s3:if-none-match": "true"}}: created, never overwritten), and s3:PutObject, '
        "s3:DeleteObject, s3:DeleteObjectVersion on code/*, the environment's code the agent runs as root.",
        containment.submissions_create_only,
        Severity.CRITICAL,
        'Deny "s3:PutObject" on <bucket>/job-code/*, <bucket>/jobs/*/job.json, <bucket>/queue/* with '
        '{"ArnEquals": {"aws:PrincipalArn": [<roles>]}, "Null": {"s3:if-none-match": "true"}}; Deny '
        '"s3:PutObject", "s3:DeleteObject", "s3:DeleteObjectVersion" on <bucket>/code/* with '
        '{"ArnEquals": {"aws:PrincipalArn": [<roles>]}}',
    ),
    resource_policy(
        "job-sandbox-in-user-data",
        ["job-containment"],
        "User data that starts trainstack's agent writes the job sandbox (the job's own user, and an "
        "owner-matched reject of its packets to IMDS) and the agent's unit runs it before every start.",
        _LAUNCHERS,
        compute.job_sandbox_in_user_data,
        Severity.CRITICAL,
        "ship bootstrap/instance/job-sandbox.sh as rendered, with "
        "ExecStartPre=/usr/local/sbin/trainstack-job-"
        "sandbox in trainstack-agent.service",
    ),
    resource_policy(
        "iam-no-teardown-of-data-or-audit-trail",
        ["S3.6", "CloudWatch.16", "audit-trail"],
        "No identity policy allows deleting or reopening a bucket (DeleteBucket, PutBucketPolicy, ...), "
        "deleting "
        "or shortening logs and flow logs (DeleteLogGroup, DeleteFlowLogs, ...), stopping a trail or "
        "retiring "
        "a key, on any resource, its own stack's included.",
        grants.IDENTITY_DOCUMENT_CARRIERS,
        grants.no_teardown_of_data_or_audit_trail,
        Severity.HIGH,
        "remove the action; the operator administers the bucket, logs and keys with their own credentials",
    ),
]

POLICIES: list[Policy] = [
    resource_policy(
        "imdsv2-required",
        ["EC2.8", "EC2.170", "AutoScaling.3"],
        "Instances, launch templates and launch configurations require IMDSv2 session tokens.",
        _LAUNCHERS,
        compute.imdsv2_required,
        Severity.HIGH,
        'metadata_options={"http_tokens": "required", ...}',
    ),
    resource_policy(
        "imds-hop-limit-one",
        ["AutoScaling.4"],
        "The instance metadata response hop limit is 1, so containers cannot reach the role's credentials.",
        _LAUNCHERS,
        compute.imds_hop_limit_one,
        Severity.MEDIUM,
        'metadata_options={"http_put_response_hop_limit": 1, ...}',
    ),
    resource_policy(
        "ebs-encrypted-with-cmk",
        ["EC2.181", "EC2.3"],
        "Every EBS volume (launch template mappings, instance devices, volumes) is encrypted with a KMS CMK.",
        (*_LAUNCHERS, t.EBS_VOLUME),
        compute.ebs_encrypted_with_cmk,
        Severity.HIGH,
        'block_device_mappings=[{"ebs": {"encrypted": "true", "kms_key_id": key.arn, ...}}]',
    ),
    stack_policy(
        "no-public-ip-with-private-networking",
        ["EC2.9", "EC2.25"],
        "With egress through a NAT gateway, no instance or launch template assigns a public IPv4 address.",
        network.no_public_ip_with_private_networking,
        Severity.HIGH,
        'network_interfaces=[{"associate_public_ip_address": "false", ...}]',
    ),
    resource_policy(
        "group-spans-zones-and-types",
        ["AutoScaling.2", "AutoScaling.6"],
        "Auto Scaling groups span two or more Availability Zones (one in a placement group) and two or more "
        "instance types.",
        [t.AUTOSCALING_GROUP],
        compute.group_spans_zones_and_types,
        Severity.MEDIUM,
        "vpc_zone_identifiers in >= 2 AZs; mixed_instances_policy with >= 2 instance type overrides",
    ),
    resource_policy(
        "group-uses-launch-template",
        ["AutoScaling.9"],
        "Auto Scaling groups launch from launch templates, never from (deprecated) launch configurations.",
        [t.AUTOSCALING_GROUP, t.LAUNCH_CONFIGURATION],
        compute.group_uses_launch_template,
        Severity.MEDIUM,
        "launch_template=... or mixed_instances_policy.launch_template.launch_template_specification=...",
    ),
    stack_policy(
        "default-security-group-closed",
        ["EC2.2"],
        "Each VPC's default security group is managed by the stack and allows no traffic in or out.",
        network.default_security_group_closed,
        Severity.HIGH,
        "aws.ec2.DefaultSecurityGroup(vpc_id=vpc.id) with no ingress and no egress",
    ),
    stack_policy(
        "vpc-flow-logs-enabled",
        ["EC2.6"],
        "Every VPC has a flow log recording at least rejected traffic.",
        network.vpc_flow_logs_enabled,
        Severity.MEDIUM,
        'aws.ec2.FlowLog(vpc_id=vpc.id, traffic_type="ALL", ...)',
    ),
    _with_config(
        stack_policy(
            "vpc-flow-logs-retained",
            ["CloudWatch.16"],
            "Log groups that receive VPC flow logs keep them at least a year (minimumRetentionDays).",
            network.vpc_flow_logs_retained,
            Severity.MEDIUM,
            "aws.cloudwatch.LogGroup(retention_in_days=365, ...) as the flow log's log_destination",
        ),
        PolicyConfigSchema(
            properties={
                "minimumRetentionDays": {
                    "type": "integer",
                    "minimum": 1,
                    "default": network.FLOW_LOG_MINIMUM_RETENTION_DAYS,
                }
            }
        ),
    ),
    _with_config(
        resource_policy(
            "no-unrestricted-ingress",
            ["EC2.18", "EC2.19", "CIS 5.2", "CIS 5.3"],
            "Ingress from the internet (sources whose union exceeds an IPv4 /8 or an IPv6 /32, 0.0.0.0/0 "
            "included), from another security group or from a prefix list the pack cannot see into is "
            "refused on every security group (SSM replaces SSH); a self-referencing rule between the "
            "group's own members passes.",
            [t.SECURITY_GROUP, t.SECURITY_GROUP_RULE, t.SECURITY_GROUP_INGRESS_RULE],
            network.no_unrestricted_ingress,
            Severity.CRITICAL,
            "ingress only from narrow CIDRs (at most a /8 together) or the group itself (self = true); reach "
            "instances with SSM Session Manager",
        ),
        PolicyConfigSchema(
            properties={
                "authorizedPublicPorts": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 65535},
                    "default": [],
                },
                "authorizedPrefixListIds": {"type": "array", "items": {"type": "string"}, "default": []},
            }
        ),
    ),
    stack_policy(
        "s3-public-access-blocked",
        ["S3.1", "S3.8"],
        "Every bucket has a public access block with all four settings on.",
        storage.public_access_blocked,
        Severity.CRITICAL,
        "aws.s3.BucketPublicAccessBlock(bucket=b.id, block_public_acls=True, block_public_policy=True, "
        "ignore_public_acls=True, restrict_public_buckets=True)",
    ),
    stack_policy(
        "s3-tls-only",
        ["S3.5"],
        "Every bucket policy denies requests that do not use TLS (aws:SecureTransport = false).",
        storage.tls_only,
        Severity.HIGH,
        'a bucket policy statement: Deny, Principal "*", Action "s3:*", '
        'Condition {"Bool": {"aws:SecureTransport": "false"}}',
    ),
    stack_policy(
        "s3-sse-kms",
        ["S3.17"],
        "Every bucket encrypts by default with SSE-KMS under a customer managed key (access log buckets: "
        "SSE-S3, the only default encryption S3 log delivery supports).",
        storage.sse_kms,
        Severity.HIGH,
        "aws.s3.BucketServerSideEncryptionConfiguration with sse_algorithm aws:kms and kms_master_key_id",
    ),
    stack_policy(
        "s3-versioning-enabled",
        ["S3.14"],
        "Every bucket has versioning enabled.",
        storage.versioning_enabled,
        Severity.MEDIUM,
        'aws.s3.BucketVersioning(bucket=b.id, versioning_configuration={"status": "Enabled"})',
    ),
    stack_policy(
        "s3-lifecycle-configured",
        ["S3.13", "S3.10"],
        "Every bucket has a lifecycle configuration; versioned buckets expire noncurrent versions.",
        storage.lifecycle_configured,
        Severity.LOW,
        "aws.s3.BucketLifecycleConfiguration with abort_incomplete_multipart_upload and "
        "noncurrent_version_expiration",
    ),
    resource_policy(
        "s3-no-acls",
        ["S3.12"],
        "Buckets grant access through policies only: no ACLs, object ownership BucketOwnerEnforced.",
        (*t.BUCKET_ACLS, *t.BUCKETS, t.BUCKET_OWNERSHIP_CONTROLS),
        storage.no_acls,
        Severity.MEDIUM,
        "drop aws.s3.BucketAcl; BucketOwnershipControls rule object_ownership BucketOwnerEnforced",
    ),
    stack_policy(
        "s3-access-logging",
        ["S3.9"],
        "Every bucket has server access logging to a separate log bucket (log buckets themselves are "
        "exempt).",
        storage.access_logging_enabled,
        Severity.MEDIUM,
        "aws.s3.BucketLogging(bucket=b.id, target_bucket=log_bucket.id, target_prefix=...) and a log bucket "
        "policy allowing logging.s3.amazonaws.com s3:PutObject with aws:SourceAccount/aws:SourceArn",
    ),
    resource_policy(
        "kms-key-rotation-enabled",
        ["KMS.4"],
        "Symmetric customer managed KMS keys have automatic rotation enabled.",
        [t.KMS_KEY],
        storage.key_rotation_enabled,
        Severity.MEDIUM,
        "aws.kms.Key(enable_key_rotation=True, ...)",
    ),
    resource_policy(
        "kms-no-decrypt-on-all-keys",
        ["KMS.1", "KMS.2"],
        "IAM policies (managed and inline) do not allow kms:Decrypt or kms:ReEncryptFrom on all KMS keys.",
        _IAM_DOCUMENTS,
        identity.no_decrypt_on_all_keys,
        Severity.HIGH,
        'Resource: [key.arn] in every statement that allows "kms:Decrypt"',
    ),
    _with_config(
        resource_policy(
            "iam-no-wildcard-actions",
            ["IAM.1", "IAM.21"],
            "IAM policies (managed and inline) allow named actions only: no * or ? in an action "
            "(s3:*, s3:?*, s3:*Object*) unless in allowedActionPatterns, and no Allow+NotAction.",
            _IAM_DOCUMENTS,
            identity.no_wildcard_actions,
            Severity.HIGH,
            'Action: ["s3:GetObject", ...] instead of "s3:*"',
        ),
        PolicyConfigSchema(
            properties={
                "allowedActionPatterns": {"type": "array", "items": {"type": "string"}, "default": []}
            }
        ),
    ),
    resource_policy(
        "iam-no-admin-managed-policies",
        ["IAM.1", "CIS 1.16", "CKV_AWS_274"],
        "No AWS managed AdministratorAccess, PowerUserAccess, *Administrator or *FullAccess policy is "
        "attached (role managedPolicyArns or any policy attachment).",
        identity.MANAGED_POLICY_ATTACHERS,
        identity.no_admin_managed_policies,
        Severity.CRITICAL,
        "attach a customer managed policy (or inline policy) naming the actions and resources the role needs",
    ),
    resource_policy(
        "sns-topic-encrypted",
        ["SNS.1"],
        "SNS topics are encrypted at rest with a customer managed KMS key, never the AWS managed "
        "alias/aws/sns.",
        [t.SNS_TOPIC],
        observability.topic_encrypted,
        Severity.MEDIUM,
        "aws.sns.Topic(kms_master_key_id=key.id, ...)",
    ),
    _with_config(
        resource_policy(
            "log-group-retained-and-encrypted",
            ["CloudWatch.16"],
            "CloudWatch log groups have a retention period and are encrypted with a customer managed key.",
            [t.LOG_GROUP],
            observability.log_group_retained_and_encrypted,
            Severity.LOW,
            "aws.cloudwatch.LogGroup(retention_in_days=30, kms_key_id=key.arn, ...)",
        ),
        PolicyConfigSchema(
            properties={"minimumRetentionDays": {"type": "integer", "minimum": 1, "default": 1}}
        ),
    ),
    resource_policy(
        "no-secrets-in-user-data",
        ["CKV_AWS_46"],
        "EC2 user data holds no credentials (keys, passwords, tokens): it is readable from the instance.",
        _LAUNCHERS,
        compute.no_secrets_in_user_data,
        Severity.CRITICAL,
        "fetch secrets at boot from SSM Parameter Store or Secrets Manager with the instance role",
    ),
    *capacity.POLICIES,
    *ISSUE_24_POLICIES,
    *ISSUE_34_POLICIES,
]

"""The pulumi-aws v7 type tokens the rules read (checked against the installed pulumi_aws package)."""

from __future__ import annotations

LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
LAUNCH_CONFIGURATION = "aws:ec2/launchConfiguration:LaunchConfiguration"
INSTANCE = "aws:ec2/instance:Instance"
EBS_VOLUME = "aws:ebs/volume:Volume"
AUTOSCALING_GROUP = "aws:autoscaling/group:Group"

VPC = "aws:ec2/vpc:Vpc"
NAT_GATEWAY = "aws:ec2/natGateway:NatGateway"
FLOW_LOG = "aws:ec2/flowLog:FlowLog"
SECURITY_GROUP = "aws:ec2/securityGroup:SecurityGroup"
SECURITY_GROUP_RULE = "aws:ec2/securityGroupRule:SecurityGroupRule"
SECURITY_GROUP_INGRESS_RULE = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
DEFAULT_SECURITY_GROUP = "aws:ec2/defaultSecurityGroup:DefaultSecurityGroup"

# pulumi-aws v7 renamed the *V2 S3 resources; the old tokens remain as deprecated aliases.
BUCKETS = ("aws:s3/bucket:Bucket", "aws:s3/bucketV2:BucketV2")
BUCKET_POLICY = "aws:s3/bucketPolicy:BucketPolicy"
BUCKET_PUBLIC_ACCESS_BLOCK = "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock"
ACCOUNT_PUBLIC_ACCESS_BLOCK = "aws:s3/accountPublicAccessBlock:AccountPublicAccessBlock"
BUCKET_VERSIONINGS = (
    "aws:s3/bucketVersioning:BucketVersioning",
    "aws:s3/bucketVersioningV2:BucketVersioningV2",
)
BUCKET_ENCRYPTIONS = (
    "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
    "aws:s3/bucketServerSideEncryptionConfigurationV2:BucketServerSideEncryptionConfigurationV2",
)
BUCKET_LIFECYCLES = (
    "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration",
    "aws:s3/bucketLifecycleConfigurationV2:BucketLifecycleConfigurationV2",
)
BUCKET_ACLS = ("aws:s3/bucketAcl:BucketAcl", "aws:s3/bucketAclV2:BucketAclV2")
BUCKET_OWNERSHIP_CONTROLS = "aws:s3/bucketOwnershipControls:BucketOwnershipControls"
BUCKET_LOGGINGS = ("aws:s3/bucketLogging:BucketLogging", "aws:s3/bucketLoggingV2:BucketLoggingV2")

KMS_KEY = "aws:kms/key:Key"
IAM_POLICY = "aws:iam/policy:Policy"
IAM_ROLE = "aws:iam/role:Role"
IAM_INLINE_POLICIES = (
    "aws:iam/rolePolicy:RolePolicy",
    "aws:iam/userPolicy:UserPolicy",
    "aws:iam/groupPolicy:GroupPolicy",
)

# What attaches managed policies (by ARN) to roles, users and groups.
ROLE_POLICY_ATTACHMENT = "aws:iam/rolePolicyAttachment:RolePolicyAttachment"
USER_POLICY_ATTACHMENT = "aws:iam/userPolicyAttachment:UserPolicyAttachment"
GROUP_POLICY_ATTACHMENT = "aws:iam/groupPolicyAttachment:GroupPolicyAttachment"
POLICY_ATTACHMENT = "aws:iam/policyAttachment:PolicyAttachment"
ROLE_POLICY_ATTACHMENTS_EXCLUSIVE = "aws:iam/rolePolicyAttachmentsExclusive:RolePolicyAttachmentsExclusive"
USER_POLICY_ATTACHMENTS_EXCLUSIVE = "aws:iam/userPolicyAttachmentsExclusive:UserPolicyAttachmentsExclusive"
GROUP_POLICY_ATTACHMENTS_EXCLUSIVE = "aws:iam/groupPolicyAttachmentsExclusive:GroupPolicyAttachmentsExclusive"

SNS_TOPIC = "aws:sns/topic:Topic"
LOG_GROUP = "aws:cloudwatch/logGroup:LogGroup"

# Resource policies and shares (issue 24): who else may use a key, topic, function, snapshot or image.
KMS_KEY_POLICY = "aws:kms/keyPolicy:KeyPolicy"
SNS_TOPIC_POLICY = "aws:sns/topicPolicy:TopicPolicy"
LAMBDA_PERMISSION = "aws:lambda/permission:Permission"
SNAPSHOT_CREATE_VOLUME_PERMISSION = "aws:ec2/snapshotCreateVolumePermission:SnapshotCreateVolumePermission"
AMI_LAUNCH_PERMISSION = "aws:ec2/amiLaunchPermission:AmiLaunchPermission"

SECURITY_GROUP_EGRESS_RULE = "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule"
VPC_ENDPOINT = "aws:ec2/vpcEndpoint:VpcEndpoint"
VPC_ENDPOINT_POLICY = "aws:ec2/vpcEndpointPolicy:VpcEndpointPolicy"

"""The stack's IAM, KMS, S3 and SNS policy documents as pure functions of ARNs: data, tested without AWS or
mocks (tests/iam evaluates them). Not the policy pack (policypack/), which judges what the program declares.

- `common`: what every document shares: the document shape, the `kms:ViaService` values, ARN patterns, the
  actions that take no resource ARN, the keys a submission writes, service trust policies.
- `machine_roles`: the identity documents of the roles whose credentials run the stack's code: the
  instance's, the job's and the dev box's (and the Session Manager policy the instance and the dev box share).
- `resource_policies`: the key's, the bucket's and the alert topic's own policies.
- `service_roles`: what AWS services do for the stack: the capacity fallback's and the scheduler's
  functions, and VPC flow logs.
"""

"""Least privilege for the instance (issue 24, part 2), as the program declares it under Pulumi mocks: no
AWS managed SSM policy, Session Manager's exact statements, the job role and its scoping, and the capacity
function's cost-cap permissions. The session policy the agent narrows the job role with is
tests/bootstrap/test_jobuser.py's."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bootstrap.jobuser import job_session_policy
from infra.iam import common, machine_roles
from tests.iam import principals
from tests.iam.evaluate import Caller, Request, decide
from tests.iam.requests import Stack
from tests.infra.program import ACCOUNT_ID, StackRun, example_config, run_stack

REGION = "us-east-1"
ROLE = "aws:iam/role:Role"
ROLE_POLICY = "aws:iam/rolePolicy:RolePolicy"
FUNCTION = "aws:lambda/function:Function"


@pytest.fixture(scope="module")
def capped_without_fallback() -> StackRun:
    """A cost cap and no spot fallback: the function is declared for the cap alone."""
    return run_stack({**example_config(), "trainstack:maxCostUsd": "25", "trainstack:spotFallbackMinutes": 0})


def _role_policies(stack: StackRun) -> dict[str, dict[str, Any]]:
    return {r.name: json.loads(r.inputs["policy"]) for r in stack.of_type(ROLE_POLICY)}


def _actions(document: dict[str, Any]) -> set[str]:
    return set(common.actions_of(document))


class _Mocked(Stack):
    """tests/iam's stack model with the ARNs the Pulumi mocks give the example stack."""

    bucket_arn = "arn:aws:s3:::trainstack-dev-0123456789"
    key_arn = f"arn:aws:kms:{REGION}:{ACCOUNT_ID}:key/1234abcd-12ab-34cd-56ef-1234567890ab"
    topic_arn = f"arn:aws:sns:{REGION}:{ACCOUNT_ID}:trainstack-dev-alerts"
    log_group_arn = f"arn:aws:logs:{REGION}:{ACCOUNT_ID}:log-group:/trainstack/dev"


MOCKED = _Mocked("trainstack-dev", REGION, ACCOUNT_ID)


# --- Session Manager without AmazonSSMManagedInstanceCore -------------------------------------------------


def test_no_aws_managed_policy_is_attached_to_any_role(example_stack: StackRun) -> None:
    assert not example_stack.of_type("aws:iam/rolePolicyAttachment:RolePolicyAttachment")
    for role in example_stack.of_type(ROLE):
        assert not role.inputs.get("managedPolicyArns"), role.name


def test_session_manager_gets_exactly_its_documented_actions(example_stack: StackRun) -> None:
    document = _role_policies(example_stack)["identity-session-manager"]
    assert document == {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "RegisterWithSystemsManager",
                "Effect": "Allow",
                "Action": "ssm:UpdateInstanceInformation",
                "Resource": f"arn:aws:ec2:{REGION}:{ACCOUNT_ID}:instance/*",
            },
            {
                "Sid": "SessionManagerChannels",
                "Effect": "Allow",
                "Action": [
                    "ssmmessages:CreateControlChannel",
                    "ssmmessages:CreateDataChannel",
                    "ssmmessages:OpenControlChannel",
                    "ssmmessages:OpenDataChannel",
                ],
                "Resource": "*",
            },
            {
                "Sid": "SsmAgentMessages",
                "Effect": "Allow",
                "Action": [
                    "ec2messages:AcknowledgeMessage",
                    "ec2messages:DeleteMessage",
                    "ec2messages:FailMessage",
                    "ec2messages:GetEndpoint",
                    "ec2messages:GetMessages",
                    "ec2messages:SendReply",
                ],
                "Resource": "*",
            },
        ],
    }


def test_nothing_on_the_instance_may_read_ssm_parameters(example_stack: StackRun) -> None:
    instance = principals.caller(principals.INSTANCE, MOCKED)
    attached = _role_policies(example_stack)
    assert instance.identity == [attached["identity-instance-policy"], attached["identity-session-manager"]]
    parameter = f"arn:aws:ssm:{REGION}:{ACCOUNT_ID}:parameter/any/other/teams/secret"
    for action in ("ssm:GetParameter", "ssm:GetParameters", "ssm:GetParametersByPath", "ssm:GetDocument"):
        assert not decide(Request(action, parameter), instance, None, key_policy=False).allowed, action
    # The only parameters the instance may read are its stack's own secrets (`secrets:`, issue 24 part 1).
    for name in ("identity-instance-policy", "identity-session-manager"):
        for statement in attached[name]["Statement"]:
            reads = [a for a in common.actions_of({"Statement": [statement]}) if a.startswith("ssm:Get")]
            resources = (
                statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
            )
            if reads:
                assert all(":parameter/trainstack/dev/" in r for r in resources), (name, statement)


# --- the job role ------------------------------------------------------------------------------------------


def test_job_role_is_trusted_only_by_the_stacks_instance_role(example_stack: StackRun) -> None:
    (role,) = [r for r in example_stack.of_type(ROLE) if r.name == "identity-job-role"]
    assert role.inputs["name"] == "trainstack-dev-job"
    assert role.inputs["maxSessionDuration"] == 3600
    (statement,) = json.loads(role.inputs["assumeRolePolicy"])["Statement"]
    assert statement["Principal"] == {"AWS": f"arn:aws:iam::{ACCOUNT_ID}:root"}
    assert statement["Action"] == "sts:AssumeRole"
    assert statement["Condition"] == {
        "ArnEquals": {"aws:PrincipalArn": f"arn:aws:iam::{ACCOUNT_ID}:role/trainstack-dev-instance"}
    }
    # ... and the instance role may take exactly that role, nothing else by sts.
    instance = _role_policies(example_stack)["identity-instance-policy"]
    assume = [s for s in instance["Statement"] if "sts:AssumeRole" in common.actions_of({"Statement": [s]})]
    assert assume == [
        {
            "Sid": "AssumeTheJobRole",
            "Effect": "Allow",
            "Action": "sts:AssumeRole",
            "Resource": f"arn:aws:iam::{ACCOUNT_ID}:role/trainstack-dev-job",
        }
    ]


def _job_caller() -> Caller:
    role = machine_roles.job_role_policy(
        bucket_arn=MOCKED.bucket_arn,
        key_arn=MOCKED.key_arn,
        region=REGION,
        log_group_arn=MOCKED.log_group_arn,
    )
    return Caller("job", MOCKED.job_role_arn, ACCOUNT_ID, [role])


def _allowed(caller: Caller, action: str, key_or_arn: str, session: dict[str, Any] | None = None) -> bool:
    resource = key_or_arn if key_or_arn.startswith("arn:") else f"{MOCKED.bucket_arn}/{key_or_arn}"
    request = Request(action, resource)
    role_allows = decide(request, caller, None, key_policy=False).allowed
    if session is None:
        return role_allows
    # A session policy intersects: the role and the session document must both allow, neither deny.
    session_caller = Caller("job-session", MOCKED.job_role_arn, ACCOUNT_ID, [session])
    return role_allows and decide(request, session_caller, None, key_policy=False).allowed


def test_job_role_policy_is_what_the_program_attaches(example_stack: StackRun) -> None:
    assert _role_policies(example_stack)["identity-job-policy"] == machine_roles.job_role_policy(
        bucket_arn=MOCKED.bucket_arn,
        key_arn=MOCKED.key_arn,
        region=REGION,
        log_group_arn=MOCKED.log_group_arn,
    )


@pytest.mark.parametrize(
    "key",
    [
        "state/current-job.json",
        "state/ledger.json",
        "state/data-manifest.json",
        "jobs/charlm-1a2b3c4d/state/ledger.json",
        "jobs/charlm-1a2b3c4d/state/lease.json",
        "jobs/charlm-1a2b3c4d/job.json",
        "jobs/another-9f8e7d6c/state/ledger.json",
        "code/abc/bundle.tar.gz",
        "data/train/0.jpg",
    ],
)
def test_no_job_credentials_may_write_the_agents_state_the_code_or_the_data(key: str) -> None:
    job = _job_caller()
    for action in ("s3:PutObject", "s3:DeleteObject"):
        assert not _allowed(job, action, key), f"the job role may {action} {key}"


def test_the_session_narrows_the_role_to_one_job() -> None:
    session = job_session_policy(
        role_arn=MOCKED.job_role_arn,
        bucket=MOCKED.bucket,
        job_id="charlm-1a2b3c4d",
        region=REGION,
        log_group="/trainstack/dev",
        log_stream="charlm-1a2b3c4d/i-0123/job",
    )
    # The bucket in the mocks is another name: the session is written for the bucket the agent knows.
    session = json.loads(json.dumps(session).replace(MOCKED.bucket, "trainstack-dev-0123456789"))
    job = _job_caller()
    own = "jobs/charlm-1a2b3c4d/checkpoints/step-10/model.pt"
    assert _allowed(job, "s3:PutObject", own, session)
    assert _allowed(job, "s3:GetObject", own, session)
    assert _allowed(job, "s3:GetObject", "data/train/0.jpg", session)
    assert not _allowed(job, "s3:PutObject", "jobs/other-00000000/checkpoints/x", session)
    assert not _allowed(job, "s3:GetObject", "jobs/other-00000000/results/x", session)
    assert not _allowed(job, "s3:PutObject", "jobs/charlm-1a2b3c4d/state/ledger.json", session)
    stream = f"{MOCKED.log_group_arn}:log-stream:charlm-1a2b3c4d/i-0123"
    assert _allowed(job, "logs:PutLogEvents", f"{stream}/job", session)
    assert not _allowed(job, "logs:PutLogEvents", f"{stream}/agent", session)
    assert not _allowed(job, "logs:PutLogEvents", f"{stream}/trainer", session)


# --- the cost cap outside the instance ---------------------------------------------------------------------


def test_a_cost_cap_declares_the_function_even_without_the_spot_fallback(
    capped_without_fallback: StackRun,
) -> None:
    # The capacity function (the scheduler, infra/scheduler.py, is every stack's other function).
    (function,) = [f for f in capped_without_fallback.of_type(FUNCTION) if f.parent == "capacity"]
    variables = function.inputs["environment"]["variables"]
    assert variables["FALLBACK_MINUTES"] == "0"
    assert variables["MAX_COST_USD"] == "25"
    assert variables["BUCKET"] == capped_without_fallback.outputs["bucket_name"]
    assert variables["TOPIC_ARN"] == capped_without_fallback.outputs["topic_arn"]
    assert "cost cap" in function.inputs["description"]


def test_the_functions_cost_cap_permissions_are_exactly_these(capped_without_fallback: StackRun) -> None:
    document = _role_policies(capped_without_fallback)["capacity-policy"]
    assert document == principals.capacity_fallback_policy(MOCKED)
    by_sid = {s["Sid"]: s for s in document["Statement"]}
    bucket = MOCKED.bucket_arn
    assert by_sid["ReadTheCurrentJobsLedger"] == {
        "Sid": "ReadTheCurrentJobsLedger",
        "Effect": "Allow",
        "Action": "s3:GetObject",
        "Resource": [
            f"{bucket}/state/current-job.json",
            f"{bucket}/jobs/*/state/ledger.json",
            f"{bucket}/state/ledger.json",
        ],
    }
    # Listing exactly those keys: S3 answers a missing ledger NoSuchKey (not AccessDenied) only then.
    assert by_sid["KnowAMissingLedgerIsMissing"] == {
        "Sid": "KnowAMissingLedgerIsMissing",
        "Effect": "Allow",
        "Action": "s3:ListBucket",
        "Resource": bucket,
        "Condition": {
            "StringLike": {
                "s3:prefix": ["state/current-job.json", "jobs/*/state/ledger.json", "state/ledger.json"]
            }
        },
    }
    assert by_sid["UseStackKeyThroughS3AndSns"]["Action"] == ["kms:Decrypt", "kms:GenerateDataKey"]
    assert by_sid["UseStackKeyThroughS3AndSns"]["Resource"] == MOCKED.key_arn
    assert by_sid["UseStackKeyThroughS3AndSns"]["Condition"] == {
        "StringEquals": {"kms:ViaService": [f"s3.{REGION}.amazonaws.com", f"sns.{REGION}.amazonaws.com"]}
    }
    assert by_sid["StopTheGroupAtTheCap"]["Action"] == "autoscaling:SetDesiredCapacity"
    assert by_sid["StopTheGroupAtTheCap"]["Resource"].endswith("autoScalingGroupName/trainstack-dev-gpu")
    assert by_sid["SayWhy"] == {
        "Sid": "SayWhy",
        "Effect": "Allow",
        "Action": "sns:Publish",
        "Resource": MOCKED.topic_arn,
    }
    # Nothing written: the function reads (and may list) two keys and acts through the group.
    assert not {a for a in _actions(document) if a.startswith("s3:")} - {"s3:GetObject", "s3:ListBucket"}


def test_without_a_cap_the_function_reads_nothing(example_stack: StackRun) -> None:
    document = _role_policies(example_stack)["capacity-policy"]
    assert document == principals.capacity_fallback_policy(MOCKED, cost_cap=False)
    assert not {a for a in _actions(document) if a.split(":")[0] in ("s3", "kms", "sns")}

"""A submitter is not root, judged as AWS would judge the calls (the stack's bucket policy and the dev role's
own policy): the dev role creates a job's code, record and queue entry and overwrites none, never writes the
environment's code (which the agent runs as root), and reads what `trainstack jobs` shows, never a job's
weights or result files. Tried as an attacker holding the dev box's role would."""

from __future__ import annotations

from typing import Any

import pytest

from tests.iam.check import check_calls
from tests.iam.evaluate import Caller, Request, decide
from tests.iam.principals import CLI, DEV, INSTANCE, caller, resource_policy
from tests.iam.requests import _S3_KEYS as S3_KEYS
from tests.iam.requests import Stack

STACK = Stack("trainstack-test", "us-east-1")
BUCKET = f"{STACK.name}-data"
SHA = "a" * 64


def _refused(principal: str, operation: str, key: str, **params: Any) -> bool:
    call = {
        "principal": principal,
        "service": "s3",
        "operation": operation,
        "region": STACK.region,
        "params": {"Bucket": BUCKET, "Key": key, **params},
    }
    findings, _ = check_calls([call])
    return any(f.action.startswith("s3:") for f in findings)


@pytest.mark.parametrize(
    "key", ["jobs/resnet-11111111/job.json", "queue/resnet-11111111.json", f"job-code/{SHA}/bundle.tar.gz"]
)
def test_the_dev_role_creates_a_submission_and_never_overwrites_one(key: str) -> None:
    assert not _refused(DEV, "PutObject", key, IfNoneMatch="*"), "creating is what `trainstack run` does"
    assert _refused(DEV, "PutObject", key), "an unconditional write could replace another job's"


@pytest.mark.parametrize("principal", [DEV, INSTANCE])
def test_no_stack_role_writes_or_deletes_the_environments_code(principal: str) -> None:
    key = f"code/{SHA}/bundle.tar.gz"
    assert _refused(principal, "PutObject", key, IfNoneMatch="*")
    assert _refused(principal, "DeleteObject", key)


def test_the_bucket_refuses_code_writes_even_to_a_dev_role_widened_by_mistake() -> None:
    # The bucket's Deny holds whatever the role's own policy says: a widened policy is not enough.
    dev = caller(DEV, STACK)
    widened = Caller(
        dev.name,
        dev.arn,
        dev.account,
        [{"Statement": [{"Effect": "Allow", "Action": "s3:PutObject", "Resource": f"{STACK.bucket_arn}/*"}]}],
    )
    policy, _ = resource_policy(f"{STACK.bucket_arn}/code/x", STACK)
    for key, header in [(f"code/{SHA}/bundle.tar.gz", "*"), ("jobs/resnet-11111111/job.json", None)]:
        context = {"aws:principalarn": [dev.arn], "aws:securetransport": ["true"]}
        if header:
            context["s3:if-none-match"] = [header]
        request = Request("s3:PutObject", f"{STACK.bucket_arn}/{key}", context, S3_KEYS)
        decision = decide(request, widened, policy, key_policy=False)
        assert not decision.allowed and "explicitly denied" in decision.reason, (key, decision)


def test_the_dev_role_reads_what_jobs_shows_and_never_weights_or_results() -> None:
    job = "jobs/resnet-11111111"
    for shown in ("job.json", "state/ledger.json", "state/progress.json", "checkpoints/latest.json"):
        assert not _refused(DEV, "GetObject", f"{job}/{shown}"), shown
    for hidden in ("checkpoints/step-00000100/model.pt", "results/model.safetensors", "results/stdout.log"):
        assert _refused(DEV, "GetObject", f"{job}/{hidden}"), hidden


def test_the_operator_still_deploys_code_and_the_default_job_unconditionally() -> None:
    # `pulumi up` (the user's own credentials) writes code/ and the default job's record without a condition.
    assert not _refused(CLI, "PutObject", f"code/{SHA}/bundle.tar.gz")
    assert not _refused(CLI, "PutObject", "jobs/resnet-11111111/job.json")

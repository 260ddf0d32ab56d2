"""The IAM check's model of a job's secrets (issue 24): what GetParameter, GetSecretValue and `trainstack
secrets set` ask of IAM, and that the instance role gets its own stack's path only,
decrypting through the service."""

from __future__ import annotations

from typing import Any

from infra.iam import machine_roles
from tests.iam.check import check_calls
from tests.iam.evaluate import Caller, Request, decide
from tests.iam.principals import CLI, INSTANCE
from tests.iam.requests import ACCOUNT, Stack, requests_for

REGION = "us-east-1"
STACK = Stack("dev", REGION)
PARAMETER = f"arn:aws:ssm:{REGION}:{ACCOUNT}:parameter/trainstack/dev/hf-token"


def _call(principal: str, service: str, operation: str, client: int = 1, **params: Any) -> dict[str, Any]:
    return {
        "principal": principal,
        "service": service,
        "operation": operation,
        "region": REGION,
        "client": client,
        "params": params,
    }


def test_reading_a_securestring_is_the_parameter_and_the_stacks_key_through_ssm() -> None:
    call = _call(INSTANCE, "ssm", "GetParameter", Name="/trainstack/dev/hf-token", WithDecryption=True)
    read, decrypt = requests_for(call, STACK)
    assert (read.action, read.resource) == ("ssm:GetParameter", PARAMETER)
    assert (decrypt.action, decrypt.resource) == ("kms:Decrypt", STACK.key_arn)
    assert decrypt.context == {
        "kms:viaservice": [f"ssm.{REGION}.amazonaws.com"],
        "kms:encryptioncontext:parameter_arn": [PARAMETER],
    }


def test_the_agent_reads_its_own_stacks_secrets_and_no_other() -> None:
    own = [
        _call(INSTANCE, "ssm", "GetParameter", Name="/trainstack/dev/hf-token", WithDecryption=True),
        _call(
            INSTANCE,
            "ssm",
            "GetParameters",
            Names=["/trainstack/dev/a", "/trainstack/dev/b"],
            WithDecryption=True,
        ),
        _call(INSTANCE, "secretsmanager", "GetSecretValue", client=2, SecretId="trainstack/dev/wandb"),
    ]
    findings, checked = check_calls(own)
    assert findings == [] and checked == 8
    # The process's SSM client, bound to its stack, reaching for another stack's or the account's parameters.
    elsewhere = [
        *own[:1],
        _call(INSTANCE, "ssm", "GetParameter", Name="/trainstack/prod/hf-token", WithDecryption=True),
        _call(INSTANCE, "ssm", "GetParameter", Name="/other/db-password", WithDecryption=True),
    ]
    refused = {(f.action, f.resource) for f in check_calls(elsewhere)[0]}
    assert (
        "ssm:GetParameter",
        f"arn:aws:ssm:{REGION}:{ACCOUNT}:parameter/trainstack/prod/hf-token",
    ) in refused
    assert ("ssm:GetParameter", f"arn:aws:ssm:{REGION}:{ACCOUNT}:parameter/other/db-password") in refused


def test_the_secret_statements_decrypt_only_through_the_service_for_the_stacks_path() -> None:
    # The secret statements alone (without the instance policy's other key statement): kms:ViaService and the
    # encryption context decide.
    document = {
        "Statement": machine_roles.secret_read_statements(
            key_arn=STACK.key_arn, log_group_arn=STACK.log_group_arn
        )
    }
    role = Caller(INSTANCE, STACK.instance_role_arn, ACCOUNT, [document])

    def allowed(**context: list[str]) -> bool:
        return decide(Request("kms:Decrypt", STACK.key_arn, context), role, None, key_policy=False).allowed

    via_ssm = [f"ssm.{REGION}.amazonaws.com"]
    assert allowed(**{"kms:viaservice": via_ssm, "kms:encryptioncontext:parameter_arn": [PARAMETER]})
    other = PARAMETER.replace("/dev/", "/prod/")
    assert not allowed(**{"kms:viaservice": via_ssm, "kms:encryptioncontext:parameter_arn": [other]})
    secret = f"arn:aws:secretsmanager:{REGION}:{ACCOUNT}:secret:trainstack/dev/wandb-AbCdEf"
    via_secrets = [f"secretsmanager.{REGION}.amazonaws.com"]
    assert allowed(**{"kms:viaservice": via_secrets, "kms:encryptioncontext:secretarn": [secret]})
    # A direct kms:Decrypt (no service in between) is not what these statements allow.
    direct = {"kms:viaservice": [], "kms:encryptioncontext:parameter_arn": [PARAMETER]}
    assert not allowed(**direct)


def test_secrets_set_encrypts_with_the_stacks_key_through_ssm_as_the_key_policy_allows() -> None:
    key = f"arn:aws:kms:{REGION}:{ACCOUNT}:key/1234abcd-12ab-34cd-56ef-1234567890ab"
    call = _call(CLI, "ssm", "PutParameter", Name="/trainstack/dev/hf-token", Type="SecureString", KeyId=key)
    put, encrypt = requests_for(call, STACK)
    assert (put.action, encrypt.action, encrypt.resource) == (
        "ssm:PutParameter",
        "kms:Encrypt",
        STACK.key_arn,
    )
    assert check_calls([call]) == ([], 2)

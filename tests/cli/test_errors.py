"""Every failure a user can hit is one line on stderr, naming what failed and the fix; never a traceback."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError, NoCredentialsError
from botocore.stub import Stubber

from trainstack.aws import Clients, explain

from .conftest import REGION, Deployed, Result


def _client_error(code: str, operation: str = "DescribeAutoScalingGroups") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": f"{code} message"}}, operation)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (NoCredentialsError(), "no AWS credentials found: run `aws configure`"),
        (_client_error("AccessDenied"), "permission denied: DescribeAutoScalingGroups was refused"),
        (_client_error("UnauthorizedOperation"), "permission denied: DescribeAutoScalingGroups was refused"),
        # A missing key read without s3:ListBucket is AccessDenied on AWS: the line says so.
        (
            _client_error("AccessDenied", "GetObject"),
            "permission denied: GetObject was refused (AccessDenied message); grant your identity that "
            "action (see `aws sts get-caller-identity`) or use a profile that has it; S3 also answers so for "
            "a key that does not exist yet when your identity lacks s3:ListBucket on the bucket",
        ),
        (_client_error("ExpiredToken"), "AWS credentials expired (ExpiredToken): refresh them"),
        (_client_error("InvalidClientTokenId"), "AWS rejected the credentials (InvalidClientTokenId)"),
        (_client_error("Throttling"), "AWS DescribeAutoScalingGroups failed: Throttling: Throttling message"),
    ],
)
def test_aws_failures_become_one_line_with_the_fix(error: Exception, expected: str):
    message = str(explain(error))
    assert message.startswith(expected)
    assert "\n" not in message


def test_permission_denied_on_a_command_is_one_line_not_a_traceback(deployed: Deployed):
    # FAKE at the client boundary: moto does not enforce IAM, so a stubbed client refuses the call.
    autoscaling = boto3.client("autoscaling", region_name=REGION)
    stub = Stubber(autoscaling)
    stub.add_client_error(
        "describe_auto_scaling_groups", "AccessDenied", "User: arn:aws:iam::1:user/x is not authorized"
    )
    stub.activate()

    result = deployed.run("status", clients=Clients(None, overrides={"autoscaling": autoscaling}))

    assert result.code == 1
    assert result.out == ""
    assert result.err == (
        "trainstack: error: permission denied: DescribeAutoScalingGroups was refused "
        "(User: arn:aws:iam::1:user/x is not authorized); grant your identity that action "
        "(see `aws sts get-caller-identity`) or use a profile that has it\n"
    )


def test_no_credentials_on_a_command_is_one_line(deployed: Deployed, monkeypatch: pytest.MonkeyPatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    result = deployed.run("status")
    assert result.code == 1
    assert result.err.startswith("trainstack: error: no AWS credentials found")
    assert result.err.count("\n") == 1


def test_no_stack_is_one_line(cli: Callable[..., Result], tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no pulumi CLI either
    result = cli("status", "--cwd", str(tmp_path))
    assert result.code == 1
    assert result.err == (
        f"trainstack: error: no stack selected in {tmp_path.resolve()}: pass --stack NAME or run "
        "`pulumi stack select NAME`\n"
    )


def test_a_missing_outputs_file_says_how_to_write_one(cli: Callable[..., Result], tmp_path: Path):
    result = cli("status", "--stack", "dev", "--cwd", str(tmp_path), "--outputs", str(tmp_path / "nope.json"))
    assert result.code == 1
    assert "no such file; write it with `pulumi stack output --json > FILE`" in result.err

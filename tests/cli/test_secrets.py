"""`trainstack secrets set|list|delete` against the moto server: the value comes from stdin and is stored as a
SecureString with the stack's key; nothing the CLI prints ever holds it."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import boto3
import pytest

from bootstrap.secrets import resolve
from tests.cli.conftest import REGION, Deployed, Result
from trainstack_job.secret_refs import parse_ref

TOKEN = "hf_" + "Zz9" * 11 + "q"


@pytest.fixture()
def stdin(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    def feed(text: str) -> None:
        monkeypatch.setattr("sys.stdin", io.StringIO(text))

    return feed


def _instance_client(service: str) -> Any:
    from bootstrap import aws

    return aws.client(service, REGION)


def _ssm() -> Any:
    return boto3.client("ssm", region_name=REGION)


def test_set_stores_a_securestring_with_the_stacks_key_from_stdin(
    deployed: Deployed, stdin: Callable[[str], None]
) -> None:
    stdin(TOKEN + "\n")
    result = deployed.run("secrets", "set", "hf-token")
    assert result.code == 0, result.err
    assert "/trainstack/test/hf-token" in result.out and "secrets: {ENV_NAME: hf-token}" in result.out
    assert TOKEN not in result.out + result.err
    parameter = _ssm().get_parameter(Name="/trainstack/test/hf-token", WithDecryption=True)["Parameter"]
    assert (parameter["Type"], parameter["Value"]) == ("SecureString", TOKEN)  # the final newline dropped
    described = _ssm().describe_parameters(
        ParameterFilters=[{"Key": "Name", "Values": ["/trainstack/test/hf-token"]}]
    )["Parameters"][0]
    assert described["KeyId"] == deployed.kms_key_arn
    # ... and the agent reads it back by reference, as the job's environment would get it.
    read = resolve({"HF_TOKEN": parse_ref("hf-token")}, stack="test", clients=_instance_client)
    assert read == {"HF_TOKEN": TOKEN}


def test_set_refuses_to_replace_without_overwrite(deployed: Deployed, stdin: Callable[[str], None]) -> None:
    stdin("first-value")
    assert deployed.run("secrets", "set", "wandb").code == 0
    stdin("second-value")
    refused = deployed.run("secrets", "set", "wandb")
    assert refused.code == 1
    assert refused.err == (
        "trainstack: error: /trainstack/test/wandb already exists: pass --overwrite to replace its value "
        "(`trainstack secrets set wandb --overwrite`)\n"
    )
    stdin("second-value")
    assert deployed.run("secrets", "set", "wandb", "--overwrite").code == 0
    value = _ssm().get_parameter(Name="/trainstack/test/wandb", WithDecryption=True)["Parameter"]["Value"]
    assert value == "second-value"


@pytest.mark.parametrize(
    ("argv", "text", "fragment"),
    [
        (["hf-token"], "", "no value for hf-token on stdin"),
        (["/trainstack/prod/x"], "v", "not as a path or ARN"),
        (["secretsmanager:wandb"], "v", "trainstack stores secrets in SSM only"),
        (["big"], "x" * 5000, "over 4096 bytes"),
    ],
)
def test_set_refuses_with_one_line(
    deployed: Deployed, stdin: Callable[[str], None], argv: list[str], text: str, fragment: str
) -> None:
    stdin(text)
    result = deployed.run("secrets", "set", *argv)
    assert result.code == 1 and fragment in result.err and result.err.count("\n") == 1


def test_the_value_is_never_an_argument() -> None:
    from trainstack.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["secrets", "set", "hf-token", TOKEN])


def test_list_shows_names_and_dates_never_values(deployed: Deployed, stdin: Callable[[str], None]) -> None:
    stdin(TOKEN)
    deployed.run("secrets", "set", "hf-token")
    # Another stack's parameter and a plain String under this stack's path (made by hand).
    _ssm().put_parameter(Name="/trainstack/other/hf-token", Value="other-stack-value", Type="SecureString")
    _ssm().put_parameter(Name="/trainstack/test/legacy", Value="plain-text-value", Type="String")
    boto3.client("secretsmanager", region_name=REGION).create_secret(
        Name="trainstack/test/wandb", SecretString="wandb-secret-value"
    )
    listing = deployed.run("secrets", "list", "--json")
    assert listing.code == 0, listing.err
    names = [(s["name"], s["store"], s["type"]) for s in listing.json()["secrets"]]
    assert names == [
        ("hf-token", "ssm", "SecureString"),
        ("legacy", "ssm", "String"),
        ("secretsmanager:wandb", "secretsmanager", "secret"),
    ]
    assert all(s["last_modified"] for s in listing.json()["secrets"])
    table = deployed.run("secrets", "list")
    assert "hf-token" in table.out and "unencrypted: set it again with --overwrite" in table.out
    for result in (listing, table):
        for value in (TOKEN, "other-stack-value", "plain-text-value", "wandb-secret-value"):
            assert value not in result.out + result.err


def test_delete_removes_the_parameter_and_names_a_missing_one(
    deployed: Deployed, stdin: Callable[[str], None]
) -> None:
    stdin(TOKEN)
    deployed.run("secrets", "set", "hf-token")
    deleted: Result = deployed.run("secrets", "delete", "hf-token")
    assert deleted.code == 0 and "deleted /trainstack/test/hf-token" in deleted.out
    again = deployed.run("secrets", "delete", "hf-token")
    assert again.code == 1
    assert "no secret hf-token: /trainstack/test/hf-token does not exist" in again.err
    assert deployed.run("secrets", "list").out.startswith("no secrets under /trainstack/test/")

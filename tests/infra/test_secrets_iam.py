"""Secrets by reference at preview (issue 24): the instance role may read the stack's own path only,
decrypting through the service; preview refuses secret-looking `env` and config values; a job's `secrets:`
travels as names and passes the pack's user-data scan. Under Pulumi mocks, no AWS."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from infra.config import StackConfig, StackConfigError, parse_stack_config
from infra.defaultjob import submit_stack_job
from policypack.user_data import decode, scan_user_data
from tests.infra.program import ACCOUNT_ID, REGION, StackRun, example_config, run_stack
from trainstack_job.secret_refs import parameter_name, secret_id

HF = "hf_" + "Qw3" * 11 + "e"


def _instance_statements(stack: StackRun) -> dict[str, dict[str, Any]]:
    (policy,) = [
        r for r in stack.of_type("aws:iam/rolePolicy:RolePolicy") if r.name == "identity-instance-policy"
    ]
    return {s["Sid"]: s for s in json.loads(policy.inputs["policy"])["Statement"]}


def test_the_instance_role_reads_the_stacks_own_secret_path_only(example_stack: StackRun) -> None:
    by_sid = _instance_statements(example_stack)
    parameters = f"arn:aws:ssm:{REGION}:{ACCOUNT_ID}:parameter{parameter_name('dev', '*')}"
    secrets = f"arn:aws:secretsmanager:{REGION}:{ACCOUNT_ID}:secret:{secret_id('dev', '*')}"
    assert parameters == f"arn:aws:ssm:{REGION}:{ACCOUNT_ID}:parameter/trainstack/dev/*"
    assert by_sid["ReadOwnSecretParameters"] == {
        "Sid": "ReadOwnSecretParameters",
        "Effect": "Allow",
        "Action": ["ssm:GetParameter", "ssm:GetParameters"],
        "Resource": parameters,
    }
    assert by_sid["ReadOwnSecrets"]["Action"] == "secretsmanager:GetSecretValue"
    assert by_sid["ReadOwnSecrets"]["Resource"] == secrets
    key = example_stack.outputs["kms_key_arn"]
    assert by_sid["DecryptOwnParametersThroughSsm"]["Resource"] == key
    assert by_sid["DecryptOwnParametersThroughSsm"]["Condition"] == {
        "StringEquals": {"kms:ViaService": f"ssm.{REGION}.amazonaws.com"},
        "StringLike": {"kms:EncryptionContext:PARAMETER_ARN": parameters},
    }
    assert by_sid["DecryptOwnSecretsThroughSecretsManager"]["Condition"] == {
        "StringEquals": {"kms:ViaService": f"secretsmanager.{REGION}.amazonaws.com"},
        "StringLike": {"kms:EncryptionContext:SecretARN": secrets},
    }


def test_no_statement_reads_parameters_or_secrets_beyond_the_path(example_stack: StackRun) -> None:
    for statement in _instance_statements(example_stack).values():
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        if any(a.startswith(("ssm:GetParameter", "secretsmanager:")) for a in actions):
            assert statement["Resource"].endswith("trainstack/dev/*"), statement


def test_another_stack_gets_its_own_path() -> None:
    by_sid = _instance_statements(run_stack(stack="prod"))
    assert by_sid["ReadOwnSecretParameters"]["Resource"].endswith(":parameter/trainstack/prod/*")
    assert by_sid["ReadOwnSecrets"]["Resource"].endswith(":secret:trainstack/prod/*")


# --- preview ------------------------------------------------------------------------------------------------


def _parse(**raw: Any) -> StackConfig:
    return parse_stack_config(raw, region="us-east-1", project="trainstack", stack="dev")


def _problems(**raw: Any) -> list[str]:
    with pytest.raises(StackConfigError) as error:
        _parse(**raw)
    return [line for line in str(error.value).splitlines() if line.startswith("  - ")]


def _job(tmp_path: Path, text: str) -> str:
    (tmp_path / "train.py").write_text("print('training')\n")
    (tmp_path / "job.yaml").write_text(text)
    return str(tmp_path / "job.yaml")


def test_preview_refuses_a_token_in_job_env_even_folded_by_yaml(tmp_path: Path) -> None:
    # A folded scalar: the raw text never holds the token on one line; the parsed value does.
    job = _job(
        tmp_path, f'name: j\ncommand: [python, train.py]\nenv:\n  HUB_SETTING: "{HF[:12]}\\\n    {HF[12:]}"\n'
    )
    (line,) = _problems(job=job)
    assert line == (
        f"  - trainstack:job: {job}: env.HUB_SETTING: its value looks like a Hugging Face token, and env is "
        "written in plain text into user data, Pulumi state and the preview diff; store it with "
        "`trainstack secrets set NAME` and reference it under secrets: {HUB_SETTING: NAME} "
        "(docs/job-contract.md, Secrets)"
    )
    assert HF not in line


def test_a_job_with_secrets_passes_preview_and_carries_names_only(tmp_path: Path) -> None:
    job = _job(tmp_path, "name: j\ncommand: [python, train.py]\nsecrets: {HF_TOKEN: hf-token}\n")
    config = _parse(job=job)
    # The job reaches the agent through its record in the queue (infra/defaultjob.py).
    agent = submit_stack_job(config, "2026-01-01T00:00:00Z").record["agent"]
    assert agent["user_job"] is not None and agent["user_job"]["secrets"] == {"HF_TOKEN": "hf-token"}


def test_preview_refuses_a_bad_reference(tmp_path: Path) -> None:
    job = _job(tmp_path, "name: j\ncommand: [python, train.py]\nsecrets: {HF_TOKEN: /trainstack/prod/hf}\n")
    (line,) = _problems(job=job)
    assert line.startswith(
        f"  - trainstack:job: {job}: secrets.HF_TOKEN: '/trainstack/prod/hf': name it under"
    )


def _training_config(tmp_path: Path, extra: dict[str, Any]) -> str:
    import yaml

    base = yaml.safe_load(Path(example_config()["trainstack:trainingConfig"]).read_text())
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({**base, **extra}))
    return str(path)


def test_the_built_in_trainers_secrets_section_is_the_agents_not_the_trainers(tmp_path: Path) -> None:
    path = _training_config(
        tmp_path, {"secrets": {"HF_TOKEN": "hf-token", "WANDB_API_KEY": "secretsmanager:wb"}}
    )
    config = _parse(trainingConfig=path)
    assert config.job["secrets"] == {"HF_TOKEN": "hf-token", "WANDB_API_KEY": "secretsmanager:wb"}
    bad = _training_config(tmp_path, {"secrets": {"HF_TOKEN": "vault:x"}})
    (line,) = _problems(trainingConfig=bad)
    assert "secrets.HF_TOKEN: unknown store 'vault'" in line


def test_a_credential_in_the_trainers_config_fails_preview_by_its_key(tmp_path: Path) -> None:
    path = _training_config(tmp_path, {"data": {"url": "https://user:pa55word@example.com/d.tar"}})
    lines = _problems(trainingConfig=path)
    assert any(": data.url: looks like credentials in a URL" in line for line in lines), lines
    assert not any("pa55word" in line for line in lines)


def test_the_programs_job_record_with_secrets_carries_names_and_passes_the_scan(tmp_path: Path) -> None:
    job = _job(
        tmp_path, "name: j\ncommand: [python, train.py]\nsecrets: {HF_TOKEN: hf-token, WANDB_API_KEY: wb}\n"
    )
    stack = run_stack({**example_config(), "trainstack:job": job})
    (template,) = stack.of_type("aws:ec2/launchTemplate:LaunchTemplate")
    written = template.inputs["userData"]
    decoded = decode(written, base64_encoded=True)
    assert "HF_TOKEN" not in decoded, "no job in user-data"
    assert scan_user_data(written, decoded) == []
    # The same scan over the job's record, which now carries the job's secrets section (names only).
    objects = stack.of_type("aws:s3/bucketObjectv2:BucketObjectv2")
    (record,) = [r for r in objects if r.name.endswith("-record")]
    content = record.inputs["content"]
    assert '"HF_TOKEN": "hf-token"' in content
    assert scan_user_data(content, content) == []


def test_the_scan_finds_a_token_an_old_or_hand_made_agent_config_puts_in_user_data() -> None:
    from bootstrap.agent_config import AgentConfig
    from bootstrap.cloud_init import render_user_data

    config = AgentConfig(
        region="us-east-1",
        bucket="trainstack-dev-data",
        group_name="g",
        topic_arn="arn:t",
        log_group="/trainstack/dev",
        user_job={
            "name": "j",
            "command": ["python", "t.py"],
            "env": {"WANDB_API_KEY": "0123456789abcdef" * 2},
        },
    )
    text = render_user_data(config, bundle_key="code/x.tar.gz", bundle_sha256="0" * 64)
    encoded = base64.b64encode(text.encode()).decode()
    assert scan_user_data(encoded, decode(encoded, base64_encoded=True)) == ["a credential in WANDB_API_KEY"]

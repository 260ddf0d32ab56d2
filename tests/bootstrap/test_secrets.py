"""A job's secrets by reference (issue 24): job.yaml and the built-in trainer's config name them, the agent
reads them into the job's environment only, and nothing else ever holds a value: not the event log, the job's
shipped output, a failure report, the agent config or a file in the scratch folder. A missing or refused
secret is one permanent line naming it and the fix; secret-looking `env` is refused at preview.

The supervisor's environment builder runs in-process against the moto server (SSM and Secrets Manager); no
trainer starts, except one fake job that prints its secret, to show its output is masked."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import boto3
import pytest

from bootstrap.agent_config import AgentConfig
from bootstrap.eventlog import EventLog
from bootstrap.secrets import MASK, Redactor, SecretUnavailableError, resolve
from bootstrap.stops import StopRequests
from bootstrap.supervisor import Supervisor
from bootstrap.trainer import TrainerPaths
from tests.conftest import MotoServer
from trainstack_job.credentials import env_secret_problem, find_secret_values
from trainstack_job.jobfile import JobSpec, JobSpecError
from trainstack_job.secret_refs import SecretRef, parse_ref, parse_secrets

REGION = "us-east-1"
STACK = "dev"
TOKEN = "hf_" + "Ab1" * 11 + "x"  # what a Hugging Face token looks like
WANDB = "0123456789abcdef" * 2 + "01234567"  # 40 hex: a W&B key


# --- reference syntax ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "store", "location"),
    [
        ("hf-token", "ssm", "/trainstack/dev/hf-token"),
        ("ssm:hf-token", "ssm", "/trainstack/dev/hf-token"),
        ("team/hf-token", "ssm", "/trainstack/dev/team/hf-token"),
        ("secretsmanager:wandb", "secretsmanager", "trainstack/dev/wandb"),
    ],
)
def test_a_reference_is_a_name_under_the_stacks_own_path(text: str, store: str, location: str) -> None:
    ref = parse_ref(text)
    assert (ref.store, ref.location(STACK)) == (store, location)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("/trainstack/prod/hf-token", "not as a path or ARN"),
        ("arn:aws:ssm:us-east-1:1:parameter/x", "not as a path or ARN"),
        ("../prod/hf-token", "letters, digits"),
        ("vault:hf-token", "unknown store 'vault'"),
        ("ssm:", "letters, digits"),
    ],
)
def test_a_reference_outside_the_stacks_path_is_refused(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        parse_ref(text)


def test_secrets_mapping_problems_name_the_key() -> None:
    refs, problems = parse_secrets(
        {"HF_TOKEN": "hf-token", "TRAINSTACK_X": "a", "bad-name": "b", "EMPTY": "", "NUM": 3},
        "job.yaml: secrets",
    )
    assert refs == {"HF_TOKEN": SecretRef("ssm", "hf-token")}
    assert [p.split(":")[1].strip() for p in problems] == [
        "secrets.TRAINSTACK_X",
        "secrets.bad-name",
        "secrets.EMPTY",
        "secrets.NUM",
    ]


# --- preview refuses secret-looking env ---------------------------------------------------------------------

SECRET_VALUES = [
    ("AKIAIOSFODNN7EXAMPLE", "an AWS access key ID"),
    ("ASIAIOSFODNN7EXAMPLE", "an AWS access key ID"),
    ("wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "an AWS secret access key"),
    ("ghp_" + "a1B2" * 9, "a GitHub token"),
    ("github_pat_" + "A1b2" * 8, "a GitHub token"),
    (TOKEN, "a Hugging Face token"),
    (WANDB, "a W&B API key"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----", "a private key"),
    ("-----BEGIN OPENSSH PRIVATE KEY-----", "a private key"),
    ("machine api.wandb.ai\n  login user\n  password s3cr3tpass", "a .netrc password"),
    ("machine huggingface.co login me password s3cr3tpass", "a .netrc password"),
    ("https://alice:s3cr3t@example.com/repo.git", "credentials in a URL"),
    ("postgres://bob:hunter22@db:5432/x", "credentials in a URL"),
]


@pytest.mark.parametrize(("value", "kind"), SECRET_VALUES)
def test_preview_refuses_a_secret_looking_value_in_env_without_repeating_it(value: str, kind: str) -> None:
    raw = {"name": "job", "command": ["python", "train.py"], "env": {"SOME_SETTING": value}}
    with pytest.raises(JobSpecError) as caught:
        JobSpec.from_mapping(raw, "job.yaml")
    (line,) = caught.value.problems
    assert line.startswith("job.yaml: env.SOME_SETTING: its value looks like " + kind)
    assert "secrets:" in line and "trainstack secrets set" in line and "\n" not in line
    assert value not in line and value.splitlines()[-1] not in line


@pytest.mark.parametrize(
    "name",
    ["HF_TOKEN", "WANDB_API_KEY", "API_KEY", "DB_PASSWORD", "PASSWORD", "CLIENT_SECRET", "AWS_ACCESS_KEY_ID",
     "MY_PASSPHRASE", "SSH_KEY", "GITHUB_TOKEN"],
)  # fmt: skip
def test_preview_refuses_a_secret_looking_name_in_env(name: str) -> None:
    raw = {"name": "job", "command": ["python", "train.py"], "env": {name: "plain-looking"}}
    with pytest.raises(JobSpecError) as caught:
        JobSpec.from_mapping(raw, "job.yaml")
    (line,) = caught.value.problems
    assert line.startswith(f"job.yaml: env.{name}: its name says it holds a credential")
    assert f"secrets: {{{name}: NAME}}" in line and "plain-looking" not in line


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("WANDB_MODE", "offline"),
        ("TOKENIZERS_PARALLELISM", "false"),
        ("MAX_NEW_TOKENS", "512"),
        ("TOKEN_BUDGET", 4096),  # a number is no credential, whatever the name
        ("HF_TOKEN", ""),
        ("GIT_COMMIT", "0123456789abcdef0123456789abcdef01234567"),  # 40 hex named as a commit
        ("DATA_URL", "https://example.com/data.tar"),
        ("KEY_PATH", "/data/keys/public.pem"),
        ("CACHE_DIR", "/scratch/cache/huggingface/transformers/models/bert"),
    ],
)
def test_ordinary_env_passes(name: str, value: Any) -> None:
    assert env_secret_problem("job.yaml: env", name, value) is None


def test_env_and_secrets_may_not_name_the_same_variable() -> None:
    raw = {
        "name": "job",
        "command": ["python", "train.py"],
        "env": {"HF_HOME": "/scratch/hf"},
        "secrets": {"HF_HOME": "hf-home"},
    }
    with pytest.raises(JobSpecError, match=r"secrets\.HF_HOME: also set in env"):
        JobSpec.from_mapping(raw, "job.yaml")


def test_secrets_travel_in_the_agent_config_as_references_only() -> None:
    raw = {"name": "job", "command": ["python", "t.py"], "secrets": {"HF_TOKEN": "ssm:hf-token"}}
    spec = JobSpec.from_mapping(raw, "job.yaml")
    assert spec.to_mapping()["secrets"] == {"HF_TOKEN": "hf-token"}
    assert JobSpec.from_mapping(spec.to_mapping(), "agent config") == spec
    # A job without secrets keeps the mapping (and so the job id) it always had.
    assert "secrets" not in JobSpec.from_mapping({"name": "job", "command": ["x"]}, "j").to_mapping()


def test_a_config_value_that_looks_like_a_credential_is_found_by_its_key() -> None:
    found = find_secret_values({"train": {"lr": 0.1}, "logging": {"wandb_key": WANDB}}, "cfg.yaml")
    (line,) = found
    assert line.startswith("cfg.yaml: logging.wandb_key: looks like a W&B API key") and WANDB not in line


# --- resolution ---------------------------------------------------------------------------------------------


@pytest.fixture()
def stores(aws: MotoServer) -> tuple[Any, Any, str]:
    """The stack's key, an SSM SecureString and a Secrets Manager secret under /trainstack/dev/."""
    key = boto3.client("kms", region_name=REGION).create_key()["KeyMetadata"]["Arn"]
    ssm = boto3.client("ssm", region_name=REGION)
    ssm.put_parameter(Name="/trainstack/dev/hf-token", Value=TOKEN, Type="SecureString", KeyId=key)
    ssm.put_parameter(Name="/trainstack/dev/plain", Value="not-encrypted", Type="String")
    manager = boto3.client("secretsmanager", region_name=REGION)
    manager.create_secret(Name="trainstack/dev/wandb", SecretString=WANDB, KmsKeyId=key)
    manager.create_secret(Name="trainstack/dev/binary", SecretBinary=b"\x00\x01")
    return ssm, manager, key


def _clients(service: str) -> Any:
    # Recorded as the instance role's calls, as the agent's are (bootstrap/aws.py): the IAM check judges them.
    from bootstrap import aws

    return aws.client(service, REGION)


def test_references_resolve_from_both_stores(stores: Any) -> None:
    refs = {"HF_TOKEN": parse_ref("hf-token"), "WANDB_API_KEY": parse_ref("secretsmanager:wandb")}
    assert resolve(refs, stack=STACK, clients=_clients) == {"HF_TOKEN": TOKEN, "WANDB_API_KEY": WANDB}


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        (
            "missing",
            "secrets.X: SSM parameter /trainstack/dev/missing does not exist; store it with "
            "`trainstack secrets set missing --stack dev`, then `trainstack resume`",
        ),
        (
            "plain",
            "secrets.X: SSM parameter /trainstack/dev/plain is a String parameter, stored unencrypted; ",
        ),
        (
            "secretsmanager:gone",
            "secrets.X: Secrets Manager secret trainstack/dev/gone does not exist; create it",
        ),
        (
            "secretsmanager:binary",
            "secrets.X: Secrets Manager secret trainstack/dev/binary holds SecretBinary",
        ),
    ],
)
def test_a_missing_or_unusable_secret_is_one_line_naming_it_and_the_fix(
    stores: Any, ref: str, expected: str
) -> None:
    with pytest.raises(SecretUnavailableError) as caught:
        resolve({"X": parse_ref(ref)}, stack=STACK, clients=_clients)
    assert str(caught.value).startswith(expected)
    assert "\n" not in str(caught.value)


class _Denied:
    """An SSM client whose role may not read the parameter (moto does not evaluate IAM)."""

    def get_parameter(self, **_: Any) -> Any:
        from botocore.exceptions import ClientError

        raise ClientError(
            {"Error": {"Code": "AccessDeniedException", "Message": "not authorized"}}, "GetParameter"
        )


def test_a_denied_secret_names_the_path_the_role_may_read() -> None:
    with pytest.raises(SecretUnavailableError) as caught:
        resolve({"HF_TOKEN": parse_ref("hf-token")}, stack=STACK, clients=lambda _: _Denied())
    line = str(caught.value)
    assert line.startswith(
        "secrets.HF_TOKEN: reading SSM parameter /trainstack/dev/hf-token was refused (AccessDeniedException)"
    )
    assert "/trainstack/dev/*" in line and "trainstack secrets set hf-token" in line


def test_throttling_is_not_a_permanent_failure() -> None:
    from botocore.exceptions import ClientError

    class Throttled:
        def get_parameter(self, **_: Any) -> Any:
            raise ClientError({"Error": {"Code": "ThrottlingException", "Message": "slow"}}, "GetParameter")

    with pytest.raises(ClientError):
        resolve({"HF_TOKEN": parse_ref("hf-token")}, stack=STACK, clients=lambda _: Throttled())


def test_the_redactor_masks_values_longest_first() -> None:
    redact = Redactor([TOKEN, TOKEN[:10], "abc"])
    assert redact(f"token={TOKEN} part={TOKEN[:10]} abc") == f"token={MASK} part={MASK} abc"


# --- the supervisor: the job's environment only -------------------------------------------------------------


def _supervisor(
    tmp_path: Path, *, user_job: JobSpec | None, job: dict[str, Any] | None = None
) -> tuple[Supervisor, io.StringIO]:
    stream = io.StringIO()
    log = EventLog(stream)
    config = AgentConfig(
        region=REGION,
        bucket="trainstack-dev-data",
        group_name="g",
        topic_arn="arn:t",
        log_group="/trainstack/dev",
        stack=STACK,
        job=job or {},
        user_job=user_job.to_mapping() if user_job else None,
    )
    supervisor = Supervisor(
        config,
        log,
        StopRequests(log, deadline_seconds=100),
        user_job=user_job,
        job_root=tmp_path / "jobroot",
        trainer_command=[sys.executable, "-c", "pass"],
        tick_seconds=0.05,
    )
    return supervisor, stream


def _user_job(tmp_path: Path, script: str) -> JobSpec:
    root = tmp_path / "jobroot"
    root.mkdir(exist_ok=True)
    (root / "job.py").write_text(script)
    raw = {
        "name": "secret-job",
        "command": ["python", "job.py"],
        "env": {"WANDB_MODE": "offline"},
        "secrets": {"HF_TOKEN": "hf-token", "WANDB_API_KEY": "secretsmanager:wandb"},
    }
    return JobSpec.from_mapping(raw, "job.yaml", base_dir=root)


def _every_file_under(root: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in root.rglob("*") if path.is_file()}


def test_a_user_jobs_secrets_reach_its_environment_and_nothing_else(stores: Any, tmp_path: Path) -> None:
    # The job prints its secrets: the agent's shipped copy of its output and any failure report are masked.
    script = "import os\nprint('token', os.environ['HF_TOKEN'], os.environ['WANDB_API_KEY'])\nexit(3)\n"
    spec = _user_job(tmp_path, script)
    supervisor, events = _supervisor(tmp_path, user_job=spec)
    shipped: list[str] = []
    paths = TrainerPaths(scratch=tmp_path / "scratch")
    trainer = supervisor.job_process(
        paths, 0, None, identity=None, spot_interruptions=(0, 0.0), log_sink=lambda: shipped.append
    )
    assert trainer._env["HF_TOKEN"] == TOKEN and trainer._env["WANDB_API_KEY"] == WANDB
    assert trainer._env["WANDB_MODE"] == "offline"
    trainer.start()
    code = trainer._process.wait(timeout=60) if trainer._process else None
    assert code == 3
    if trainer._pump:
        trainer._pump.join(timeout=10)
        assert not trainer._pump.is_alive(), "the trainer's output was not all read within 10 s of its exit"
    failure = supervisor.classify_exit(code, None, _persisted(), trainer)

    log_text = events.getvalue()
    records = [json.loads(line) for line in log_text.splitlines()]
    (resolved,) = [r for r in records if r["message"] == "secrets resolved into the job's environment"]
    assert resolved["secrets"] == {
        "HF_TOKEN": "/trainstack/dev/hf-token",
        "WANDB_API_KEY": "trainstack/dev/wandb",
    }
    assert any(f"token {MASK} {MASK}" in line for line in shipped), shipped
    written = _every_file_under(tmp_path)
    config_yaml = supervisor.config.to_yaml()
    for value in (TOKEN, WANDB):
        assert value not in log_text, "a secret reached the event log"
        assert not any(value in line for line in shipped), "a secret reached the shipped job output"
        assert not any(value in line for line in getattr(failure, "lines", [])), (
            "a secret reached the failure"
        )
        assert value not in getattr(failure, "reason", "")
        assert value not in config_yaml, "a secret reached the agent config"
        leaked = [str(path) for path, content in written.items() if value.encode() in content]
        assert not leaked, f"a secret reached the disk: {leaked}"


def _persisted() -> Any:
    from bootstrap.persist import PersistResult

    return PersistResult(None, None)


def test_the_built_in_trainers_secrets_come_from_its_config_and_the_trainer_never_sees_the_section(
    stores: Any, tmp_path: Path
) -> None:
    job = {"train": {"steps": 2}, "secrets": {"HF_TOKEN": "hf-token"}}
    supervisor, events = _supervisor(tmp_path, user_job=None, job=job)
    paths = TrainerPaths(scratch=tmp_path / "scratch")
    trainer = supervisor.job_process(
        paths, 0, None, identity=None, spot_interruptions=(0, 0.0), log_sink=lambda: lambda _: None
    )
    assert trainer._env["HF_TOKEN"] == TOKEN
    assert trainer._job == {"train": {"steps": 2}}
    trainer.start()
    if trainer._process:
        trainer._process.wait(timeout=60)
    assert "secrets" not in paths.config_file.read_text()
    assert all(TOKEN.encode() not in content for content in _every_file_under(tmp_path).values())
    assert TOKEN not in events.getvalue()


def test_a_missing_secret_is_a_permanent_one_line_job_failure(aws: MotoServer, tmp_path: Path) -> None:
    spec = _user_job(tmp_path, "print('never runs')\n")
    supervisor, _ = _supervisor(tmp_path, user_job=spec)
    with pytest.raises(JobSpecError) as caught:
        supervisor.job_process(
            TrainerPaths(scratch=tmp_path / "scratch"),
            0,
            None,
            identity=None,
            spot_interruptions=(0, 0.0),
            log_sink=lambda: lambda _: None,
        )
    # bootstrap/lifecycle.py turns a JobSpecError into a permanent failure: no other life retries it.
    (line,) = caught.value.problems
    assert line == (
        "secrets.HF_TOKEN: SSM parameter /trainstack/dev/hf-token does not exist; store it with "
        "`trainstack secrets set hf-token --stack dev`, then `trainstack resume`"
    )


def test_no_secrets_no_calls(tmp_path: Path) -> None:
    def refuse(service: str) -> Any:
        raise AssertionError(f"no secrets named: no {service} client")

    supervisor, _ = _supervisor(tmp_path, user_job=None, job={"train": {"steps": 1}})
    supervisor._secret_clients = refuse
    assert supervisor.job_secrets() == {}


def test_redactor_masks_each_line_of_a_multi_line_value() -> None:
    # The job's output reaches the redactor one line at a time: a PEM key printed whole must not leak.
    key = "\n".join(
        [
            "-----BEGIN PRIVATE KEY-----",
            "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC",
            "BKcwggSjAgEAAoIBAQC7",
            "-----END PRIVATE KEY-----",
        ]
    )
    redact = Redactor([key])
    for line in key.splitlines():
        assert redact(line) == MASK
    assert redact("step 10 loss 0.5") == "step 10 loss 0.5"

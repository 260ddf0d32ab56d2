"""The launch template's user-data: fits EC2, valid cloud-config, no secrets, the stack's agent config and no
job (jobs are submitted to the stack's queue: tests/infra/test_default_job.py)."""

from __future__ import annotations

import base64
import dataclasses
import re
from pathlib import Path

import pytest
import yaml

import infra.fleet
from bootstrap.agent_config import AgentConfig
from infra.fleet import LIFECYCLE_HOOK_NAME, agent_config
from tests.cloud_config import assert_valid_cloud_config
from tests.infra.program import StackRun

EC2_USER_DATA_LIMIT = 16 * 1024
# Shapes of credentials and secrets (checkov CKV_AWS_46 looks for the same kinds of things).
_SECRET_PATTERNS = {
    "AWS access key id": re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),
    "AWS secret key assignment": re.compile(r"aws_secret_access_key|secret_access_key\s*[:=]", re.IGNORECASE),
    "private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "password or token assignment": re.compile(
        r"\b(password|passwd|api[_-]?key|token)\s*[:=]\s*\S+", re.IGNORECASE
    ),
    "40-char base64 secret": re.compile(r"(?<![A-Za-z0-9/+])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+])"),
}


def _user_data(stack: StackRun) -> str:
    encoded = stack.one("aws:ec2/launchTemplate:LaunchTemplate").inputs["userData"]
    return base64.b64decode(encoded).decode()


def _written_file(user_data: str, path: str) -> str:
    document = yaml.safe_load(user_data)
    (entry,) = [f for f in document["write_files"] if f["path"] == path]
    return str(entry["content"])


def test_user_data_fits_ec2s_16_kb_limit_before_base64(example_stack: StackRun) -> None:
    assert len(_user_data(example_stack).encode()) < EC2_USER_DATA_LIMIT


def test_user_data_is_valid_cloud_config_per_cloud_init_schema(
    example_stack: StackRun, tmp_path: Path
) -> None:
    assert_valid_cloud_config(_user_data(example_stack), tmp_path)


def test_user_data_holds_no_secret_looking_values_CKV_AWS_46(example_stack: StackRun) -> None:  # noqa: N802 - named after the control
    user_data = _user_data(example_stack)
    for kind, pattern in _SECRET_PATTERNS.items():
        assert not pattern.search(user_data), f"user-data contains a {kind}"


def test_user_data_carries_the_stacks_agent_config(example_stack: StackRun) -> None:
    loaded = AgentConfig.from_mapping(
        yaml.safe_load(_written_file(_user_data(example_stack), "/etc/trainstack/agent.yaml"))
    )
    outputs = example_stack.outputs
    assert loaded.bucket == outputs["bucket_name"]
    assert loaded.group_name == outputs["group_name"]
    assert loaded.topic_arn == outputs["topic_arn"]
    assert loaded.log_group == outputs["log_group_name"]
    assert loaded.region == outputs["region"]
    assert loaded.gpu_required is True
    # The agent's bootstrap only: no job, so the agent takes the queue's head.
    assert (loaded.job_id, loaded.job_name, loaded.job, loaded.user_job, loaded.resume_from) == (
        "",
        "",
        {},
        None,
        None,
    )


def test_agent_config_carries_the_jobs_guards() -> None:
    from infra.config import parse_stack_config

    config = parse_stack_config(
        {
            "maxCostUsd": "25",
            "maxConsecutiveFailures": "5",
            "stallTimeoutMinutes": "12",
            "instanceCount": "1",
        },
        region="eu-west-1",
        project="trainstack",
        stack="prod",
    )
    built = agent_config(
        config, bucket="trainstack-prod-1", topic_arn="arn:aws:sns:eu-west-1:1:t", log_group="/l"
    )
    assert (built.max_cost_usd, built.max_consecutive_failures, built.stall_minutes) == (25.0, 5, 12.0)
    assert (built.instance_count, built.stack, built.group_name) == (1, "prod", "trainstack-prod-gpu")
    assert AgentConfig.from_mapping(yaml.safe_load(built.to_yaml())) == built


def test_agent_completes_the_groups_drain_hook(example_stack: StackRun) -> None:
    loaded = AgentConfig.from_mapping(
        yaml.safe_load(_written_file(_user_data(example_stack), "/etc/trainstack/agent.yaml"))
    )
    assert loaded.lifecycle_hook == LIFECYCLE_HOOK_NAME


def test_a_trainer_config_far_over_16_kb_deploys_it_travels_in_the_jobs_record(tmp_path: Path) -> None:
    from tests.infra.program import example_config, run_stack

    huge = tmp_path / "huge.yaml"
    # Valid for the trainer (the agent overrides output.dir on the instance) but far over 16 KB.
    huge.write_text(yaml.safe_dump({"output": {"dir": "/x" * 10_000}}))
    stack = run_stack({**example_config(), "trainstack:trainingConfig": str(huge)})
    assert len(_user_data(stack).encode()) < EC2_USER_DATA_LIMIT
    (record,) = [
        r for r in stack.of_type("aws:s3/bucketObjectv2:BucketObjectv2") if r.name.endswith("-record")
    ]
    assert "/x" * 10_000 in record.inputs["content"]


def test_user_data_over_ec2s_limit_is_one_stack_error_naming_the_cause() -> None:
    from bootstrap.cloud_init import render_user_data
    from infra.config import StackConfigError, parse_stack_config
    from infra.fleet import _user_data

    config = parse_stack_config({}, region="eu-west-1", project="trainstack", stack="prod")
    built = agent_config(
        config, bucket="trainstack-prod-1", topic_arn="arn:aws:sns:eu-west-1:1:t", log_group="/l"
    )
    # Only a hand-made agent config can hold a job (a job is never in user-data): one like that, too big.
    oversized = dataclasses.replace(built, job={"notes": ["x" * 100] * 200})
    with pytest.raises(StackConfigError) as error:
        _user_data(oversized, f"code/{'0' * 64}/bundle.tar.gz", "0" * 64)
    message = str(error.value)
    assert "\n" not in message and message.startswith("trainstack: launch template user-data: user-data is ")
    assert "trainstack run" in message
    assert render_user_data(built, bundle_key=f"code/{'0' * 64}/bundle.tar.gz", bundle_sha256="0" * 64)


def test_a_failed_stack_run_leaves_nothing_that_formats_a_traceback_when_it_is_freed(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed run leaves hundreds of futures whose exception nobody retrieved; asyncio reports each when the
    garbage collector frees it, which may be later, inside another test's code, where formatting a traceback
    can break an `ast.parse` in progress on Python 3.11 (tests/infra/program.py). Most are freed in the run
    that made them, and every report is one line with no traceback."""
    import gc
    import logging

    from bootstrap.cloud_init import UserDataError
    from infra.config import StackConfigError
    from tests.infra.program import example_config, run_stack

    def too_big(*args: object, **kwargs: object) -> str:
        raise UserDataError("user-data is 20000 bytes, over EC2's 16384")

    # A failure inside an apply, after most resources are registered: what leaves futures behind.
    monkeypatch.setattr(infra.fleet, "render_user_data", too_big)
    with caplog.at_level(logging.WARNING, logger="asyncio"):
        try:
            run_stack(example_config())
        except StackConfigError:
            pass
        else:
            pytest.fail("the oversized user-data was accepted")
        gc.collect()
    reports = [r for r in caplog.records if r.name == "asyncio"]
    assert reports, "the failed run left no unretrieved future: nothing here is tested"
    for report in reports:
        assert report.exc_info is None and "never retrieved" in report.getMessage(), report.getMessage()

"""The stack's job: its id from its definition (infra/jobdef.py), resumeFrom, what reaches the queue."""

from __future__ import annotations

import base64
import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import yaml

from bootstrap.agent_config import AgentConfig, AgentConfigError
from bootstrap.cloud_init import USER_DATA_LIMIT_BYTES, UserDataError, render_user_data
from infra.bundle import build_bundle
from infra.config import StackConfig, StackConfigError, parse_stack_config
from infra.defaultjob import submit_stack_job
from infra.fleet import agent_config
from infra.jobdef import JobDefinition, define_stack_job
from tests.cloud_config import assert_valid_cloud_config
from tests.infra.program import REPO_ROOT, RecordedResource, StackRun, example_config
from trainstack_job.jobs import check_job_id

BUNDLE_OBJECT = "aws:s3/bucketObjectv2:BucketObjectv2"


def _config(**raw: object) -> StackConfig:
    return parse_stack_config(raw, region="us-east-1", project="trainstack", stack="dev")


def _repo_copy(tmp_path: Path) -> Path:
    """The bundled packages somewhere else: ids must not depend on where the repository is checked out."""
    root = tmp_path / "elsewhere"
    for package in ("training", "bootstrap", "trainstack_job"):
        shutil.copytree(REPO_ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _user_job(tmp_path: Path, train: str = "print('training')\n") -> Path:
    (tmp_path / "train.py").write_text(train)
    (tmp_path / "job.yaml").write_text("name: charlm-small\ncommand: [python, train.py]\n")
    return tmp_path / "job.yaml"


def _agent_bundle(stack: StackRun) -> RecordedResource:
    (bundle,) = [r for r in stack.of_type(BUNDLE_OBJECT) if r.name == "fleet-bundle"]
    return bundle


def test_the_bundle_object_survives_a_pulumi_up_that_changes_the_code(example_stack: StackRun) -> None:
    # A running job's replacement boots the bundle the job started with: a replace must not delete it.
    bundle = _agent_bundle(example_stack)
    assert bundle.retain_on_delete
    assert bundle.inputs["key"].startswith("code/")


def test_the_stack_exports_its_job_and_the_jobs_prefix(example_stack: StackRun) -> None:
    outputs = example_stack.outputs
    config = _config(
        **{k.split(":", 1)[1]: v for k, v in example_config().items() if k.startswith("trainstack:")}
    )
    assert outputs["job_id"] == define_stack_job(config).job_id
    assert outputs["job_id"].startswith(f"{config.training_config.stem}-")
    check_job_id(outputs["job_id"])
    assert outputs["jobs_prefix"] == "jobs/"
    # The legacy job's prefixes stay exported for stacks that still hold it.
    assert (outputs["checkpoints_prefix"], outputs["state_prefix"]) == ("checkpoints/", "state/")


def test_user_data_names_the_bundle_it_boots_and_no_job(example_stack: StackRun, tmp_path: Path) -> None:
    template = example_stack.one("aws:ec2/launchTemplate:LaunchTemplate").inputs
    text = base64.b64decode(template["userData"]).decode()
    assert len(text.encode()) < USER_DATA_LIMIT_BYTES
    assert_valid_cloud_config(text, tmp_path)
    document = yaml.safe_load(text)
    files = {entry["path"]: entry["content"] for entry in document["write_files"]}
    loaded = AgentConfig.from_mapping(yaml.safe_load(files["/etc/trainstack/agent.yaml"]))
    # The stack's job is in the queue (tests/infra/test_default_job.py), not here.
    assert (loaded.job_id, loaded.job_name, loaded.resume_from) == ("", "", None)
    assert example_stack.outputs["job_id"] not in text
    assert loaded.bundle_key == _agent_bundle(example_stack).inputs["key"]
    assert f"BUNDLE_SHA256={loaded.bundle_sha256}" in files["/etc/trainstack/bundle.env"]
    assert loaded.prefixes.jobs == "jobs/"


def test_the_same_definition_is_the_same_job_anywhere_and_at_any_time(tmp_path: Path) -> None:
    config = _config()
    here = define_stack_job(config)
    assert define_stack_job(config) == here
    elsewhere = _repo_copy(tmp_path)
    for path in (elsewhere / "training").rglob("*.py"):
        os.utime(path, (1, 1))
    assert define_stack_job(config, root=elsewhere) == here
    assert here.job_id == f"default-{here.digest[:8]}"


def test_stack_settings_and_the_agents_code_are_not_a_new_job(tmp_path: Path) -> None:
    base = define_stack_job(_config())
    assert define_stack_job(_config(instanceCount=1, maxCostUsd="25", rootVolumeSizeGb=200)) == base
    root = _repo_copy(tmp_path)
    (root / "bootstrap" / "agent.py").write_text("# a newer agent\n", encoding="utf-8")
    (root / "trainstack_job" / "contract.py").write_text("# a newer contract\n", encoding="utf-8")
    # The trainer runs the config the agent writes from AgentConfig.job, not the files under configs/.
    (root / "training" / "configs" / "tiny.yaml").write_text("train: {epochs: 99}\n", encoding="utf-8")
    assert define_stack_job(_config(), root=root) == base


def test_a_changed_trainer_config_or_trainer_code_is_a_new_job(tmp_path: Path) -> None:
    config = _config()
    base = define_stack_job(config)
    changed = dict(config.job, train={**config.job["train"], "epochs": config.job["train"]["epochs"] + 1})
    assert define_stack_job(dataclasses.replace(config, job=changed)).job_id != base.job_id
    root = _repo_copy(tmp_path)
    with (root / "training" / "loop.py").open("a", encoding="utf-8") as file:
        file.write("\n# a trainer change\n")
    assert define_stack_job(config, root=root).job_id != base.job_id


def test_a_users_job_is_named_by_its_job_file_and_defined_by_its_own_code(tmp_path: Path) -> None:
    job_file = _user_job(tmp_path)
    config = _config(job=str(job_file))
    first = define_stack_job(config)
    assert first.name == "charlm-small" and first.job_id.startswith("charlm-small-")
    (tmp_path / "train.py").write_text("print('training, better')\n")
    assert define_stack_job(config).job_id != first.job_id
    (tmp_path / "train.py").write_text("print('training')\n")
    assert define_stack_job(config) == first


def test_resume_from_is_part_of_the_definition(tmp_path: Path) -> None:
    fresh = define_stack_job(_config())
    tuned = define_stack_job(_config(resumeFrom=fresh.job_id))
    assert tuned.resume_from == fresh.job_id
    assert tuned.name == fresh.name and tuned.job_id != fresh.job_id
    assert define_stack_job(_config(resumeFrom="legacy")).resume_from == "legacy"
    # What the agent runs it from: the job's record (the `agent` fields), written by `pulumi up`.
    record = submit_stack_job(_config(resumeFrom=fresh.job_id), "2026-01-01T00:00:00Z").record
    assert (record["job_id"], record["resume_from"]) == (tuned.job_id, fresh.job_id)
    assert (record["agent"]["job_id"], record["agent"]["resume_from"]) == (tuned.job_id, fresh.job_id)


@pytest.mark.parametrize("value", ["Default-1A2B3C4D", "../state", "a b", "-x"])
def test_resume_from_that_is_not_a_job_id_fails_preview_on_one_line(value: str) -> None:
    with pytest.raises(StackConfigError) as error:
        _config(resumeFrom=value)
    (line,) = [line for line in str(error.value).splitlines() if "resumeFrom" in line]
    assert line.startswith(f"  - trainstack:resumeFrom: {value!r} is not a job id")
    assert "`trainstack jobs` lists them" in line


def test_resume_from_the_jobs_own_id_fails_preview(monkeypatch: pytest.MonkeyPatch) -> None:
    # The id includes resumeFrom, so only a digest collision makes them equal: stand one in.
    import infra.config.jobs

    monkeypatch.setattr(
        infra.config.jobs,
        "define_job",
        lambda **_: JobDefinition("default-1a2b3c4d", "default", "1a2b3c4d" * 8),
    )
    with pytest.raises(
        StackConfigError, match=r"trainstack:resumeFrom: 'default-1a2b3c4d' is this stack's own job"
    ):
        _config(resumeFrom="default-1a2b3c4d")


def test_agent_config_refuses_a_job_id_that_could_not_name_a_prefix() -> None:
    raw = {
        "region": "us-east-1",
        "bucket": "trainstack-dev",
        "group_name": "g",
        "topic_arn": "t",
        "log_group": "/l",
    }
    assert AgentConfig.from_mapping(raw).job_id == "legacy"
    assert (
        AgentConfig.from_mapping({**raw, "job_id": "default-1a2b3c4d", "resume_from": "legacy"}).resume_from
        == "legacy"
    )
    for bad, key in (
        ({"job_id": "../x"}, "'job_id'"),
        ({"resume_from": "Not An Id"}, "'resume_from'"),
        ({"bundle_sha256": "abc"}, "'bundle_sha256'"),
        ({"prefixes": {"jobs": "/jobs"}}, "'prefixes.jobs'"),
    ):
        with pytest.raises(AgentConfigError, match=key):
            AgentConfig.from_mapping({**raw, **bad})


def test_user_data_refuses_an_agent_config_naming_another_bundle() -> None:
    bundle = build_bundle()
    config = agent_config(_config(), bucket="trainstack-dev-1", topic_arn="t", log_group="/l", bundle=bundle)
    assert (config.bundle_key, config.bundle_sha256) == (bundle.key(), bundle.sha256)
    render_user_data(config, bundle_key=bundle.key(), bundle_sha256=bundle.sha256)
    other = "0f" * 32
    with pytest.raises(UserDataError, match="is not the bundle booted"):
        render_user_data(config, bundle_key=f"code/{other}/bundle.tar.gz", bundle_sha256=other)

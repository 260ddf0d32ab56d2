"""The stack's default job is submitted to the queue by `pulumi up` (infra/defaultjob.py), never rendered into
the launch template: a job change rolls no template version, an unchanged job changes no object. Under Pulumi
mocks, no AWS."""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest
import yaml

import infra.defaultjob
from infra.config import StackConfigError
from tests.infra.program import RecordedResource, StackRun, example_config, run_stack

OBJECT = "aws:s3/bucketObjectv2:BucketObjectv2"
TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
CHARLM = "examples/charlm/job.yaml"
FIRST_UP = "2026-03-01T09:00:00Z"


@pytest.fixture(scope="module")
def charlm_stack() -> StackRun:
    """The example stack running the charlm example job (a user's job: its own bundle)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(infra.defaultjob, "submission_time", lambda: FIRST_UP)
        return run_stack({**example_config(), "trainstack:job": CHARLM})


def _objects(stack: StackRun) -> dict[str, RecordedResource]:
    """The default job's objects by role (bundle, record, entry); the agent's bundle as `agent-bundle`."""
    found: dict[str, RecordedResource] = {}
    for resource in stack.of_type(OBJECT):
        if resource.name == "fleet-bundle":
            found["agent-bundle"] = resource
        else:
            assert resource.parent == "default-job", resource.name
            found[resource.name.rsplit("-", 1)[1]] = resource
    return found


def _template(stack: StackRun) -> dict[str, Any]:
    return stack.one(TEMPLATE).inputs


def _agent_yaml(stack: StackRun) -> dict[str, Any]:
    document = yaml.safe_load(base64.b64decode(_template(stack)["userData"]).decode())
    (entry,) = [f for f in document["write_files"] if f["path"] == "/etc/trainstack/agent.yaml"]
    return dict(yaml.safe_load(entry["content"]))


def test_user_data_holds_no_job_and_a_job_change_rolls_no_template_version(
    example_stack: StackRun, charlm_stack: StackRun, tmp_path: Path
) -> None:
    agent = _agent_yaml(example_stack)
    assert (agent["job_id"], agent["job_name"], agent["job"], agent["user_job"], agent["resume_from"]) == (
        "",
        "",
        {},
        None,
        None,
    )
    tuned = tmp_path / "tuned.yaml"
    trainer = yaml.safe_load(Path(example_config()["trainstack:trainingConfig"]).read_text())
    tuned.write_text(yaml.safe_dump({**trainer, "train": {**trainer["train"], "lr": 0.0123}}))
    retrained = run_stack({**example_config(), "trainstack:trainingConfig": str(tuned)})

    # Another trainer config, or a user's job instead: other jobs, the very same launch template.
    assert retrained.outputs["job_id"] != example_stack.outputs["job_id"] != charlm_stack.outputs["job_id"]
    assert _template(retrained) == _template(example_stack) == _template(charlm_stack)
    assert _objects(charlm_stack)["agent-bundle"].inputs == _objects(example_stack)["agent-bundle"].inputs


def test_a_users_job_is_three_objects_its_bundle_its_record_and_its_queue_entry(
    charlm_stack: StackRun,
) -> None:
    objects = _objects(charlm_stack)
    job_id = charlm_stack.outputs["job_id"]
    assert job_id.startswith("charlm-")
    bundle, record, entry = (objects[role].inputs for role in ("bundle", "record", "entry"))

    data = base64.b64decode(bundle["contentBase64"])
    sha = hashlib.sha256(data).hexdigest()
    assert bundle["key"] == f"code/{sha}/bundle.tar.gz" != objects["agent-bundle"].inputs["key"]
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(data))) as tar:
        names = set(tar.getnames())
    assert {"job/train.py", "job/job.yaml", "bootstrap/agent.py"} <= names

    assert record["key"] == f"jobs/{job_id}/job.json"
    body = json.loads(record["content"])
    assert (body["job_id"], body["source"], body["submitted_at"]) == (job_id, "pulumi", FIRST_UP)
    assert (body["bundle_key"], body["bundle_sha256"]) == (bundle["key"], sha)
    assert body["agent"]["user_job"]["name"] == "charlm" and body["agent"]["job_id"] == job_id

    assert entry["key"] == f"queue/{job_id}.json"
    assert json.loads(entry["content"]) == {"job_id": job_id, "submitted_at": FIRST_UP, "now": False}

    # Written as every upload must be (the bucket policy refuses any other encryption), the deployer's too.
    kms_key = charlm_stack.outputs["kms_key_arn"]
    for written in (bundle, record, entry):
        assert (written["serverSideEncryption"], written["kmsKeyId"]) == ("aws:kms", kms_key)
    assert record["contentType"] == entry["contentType"] == "application/json"


def test_a_running_jobs_code_and_record_survive_a_new_definition_its_unstarted_entry_does_not(
    charlm_stack: StackRun,
) -> None:
    objects = _objects(charlm_stack)
    assert objects["bundle"].retain_on_delete and objects["record"].retain_on_delete
    assert not objects["entry"].retain_on_delete
    # Logical names carry the job id: a new definition is new resources, never an update of these.
    job_id = charlm_stack.outputs["job_id"]
    assert {objects[role].name for role in ("bundle", "record", "entry")} == {
        f"default-job-{job_id}-{role}" for role in ("bundle", "record", "entry")
    }


def test_the_built_in_trainers_job_runs_the_agents_own_bundle_declared_once(example_stack: StackRun) -> None:
    objects = _objects(example_stack)
    assert "bundle" not in objects, "one object per key: the trainer's job bundle is the agent's"
    record = json.loads(objects["record"].inputs["content"])
    assert record["bundle_key"] == objects["agent-bundle"].inputs["key"]
    assert record["agent"]["job"]["train"], "the trainer config travels in the record"
    assert record["agent"]["user_job"] is None


def test_an_unchanged_job_declares_the_same_objects_at_every_up(
    charlm_stack: StackRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    same_time = {n: r.inputs for n, r in _objects(charlm_stack).items()}
    with monkeypatch.context() as patch:
        patch.setattr(infra.defaultjob, "submission_time", lambda: FIRST_UP)
        again = {
            n: r.inputs
            for n, r in _objects(run_stack({**example_config(), "trainstack:job": CHARLM})).items()
        }
    assert again == same_time

    # A later up computes a later time; Pulumi keeps the first deployment's record and entry (ignore_changes
    # on their content), and nothing else in them differs.
    monkeypatch.setattr(infra.defaultjob, "submission_time", lambda: "2026-03-02T10:00:00Z")
    later = run_stack({**example_config(), "trainstack:job": CHARLM})
    later_objects = _objects(later)
    for role, resource in later_objects.items():
        before = same_time[role]
        if role in ("record", "entry"):
            assert "content" in resource.ignore_changes
            first, second = json.loads(before["content"]), json.loads(resource.inputs["content"])
            for moment in ("submitted_at", "created_at"):
                first.pop(moment, None), second.pop(moment, None)
            assert first == second
            assert {**resource.inputs, "content": ""} == {**before, "content": ""}
        else:
            assert resource.inputs == before
    assert set(_objects(later)["bundle"].ignore_changes) == {"key", "contentBase64"}


def test_the_exported_job_id_is_the_submitted_one(example_stack: StackRun) -> None:
    job_id = example_stack.outputs["job_id"]
    assert _objects(example_stack)["record"].inputs["key"] == f"jobs/{job_id}/job.json"
    assert _objects(example_stack)["entry"].inputs["key"] == f"queue/{job_id}.json"


def test_preview_still_refuses_a_bad_default_job_with_every_problem_in_one_run(tmp_path: Path) -> None:
    bad_trainer = tmp_path / "bad.yaml"
    bad_trainer.write_text(yaml.safe_dump({"train": {"epochz": 2}}))
    (tmp_path / "job.yaml").write_text("name: j\ncommand: [python, missing.py]\n")
    with pytest.raises(StackConfigError) as error:
        run_stack(
            {
                **example_config(),
                "trainstack:trainingConfig": str(bad_trainer),
                "trainstack:job": str(tmp_path / "job.yaml"),
                "trainstack:resumeFrom": "Not An Id",
            }
        )
    lines = [line for line in str(error.value).splitlines() if line.startswith("  - ")]
    keys = [line.split(":", 2)[1] for line in lines]
    assert {"trainingConfig", "job", "resumeFrom"} <= set(keys), lines
    assert any("epochz" in line and "did you mean" in line for line in lines), lines


def test_the_group_waits_for_the_default_job_in_the_queue(
    example_stack: StackRun, charlm_stack: StackRun
) -> None:
    """On the first `pulumi up` the group launches at once: an instance that booted before its job was queued
    would find the queue empty and scale the group to zero, so the default job would never run. The group is
    declared to wait for the job's queue entry (and the entry for its record, the record for its bundle)."""
    for stack in (example_stack, charlm_stack):
        (group,) = stack.of_type("aws:autoscaling/group:Group")
        objects = _objects(stack)
        assert objects["entry"].name in group.depends_on, group.depends_on
        assert objects["record"].name in objects["entry"].depends_on
        bundle = objects.get("bundle", objects["agent-bundle"])
        assert bundle.name in objects["record"].depends_on

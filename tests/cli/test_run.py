"""`trainstack run`, `jobs`, `cancel` and sweeps against the moto stack: what a submission writes, in which
order, what it refuses, what it never touches, and following a job to its end."""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml
from botocore.exceptions import ClientError

from infra import bundle as bundle_module
from infra.jobdef import define_job
from infra.submission import prepare_submission
from trainstack import follow as follow_module
from trainstack import run as run_module
from trainstack.aws import Clients
from trainstack.errors import CliError
from trainstack.run import (
    InvalidJobError,
    RunRequest,
    check_capacity,
    read_job,
    report_invalid,
    type_offer,
    upload,
    wake_group,
)
from trainstack.stack import StackOutputs
from trainstack.state import Group
from trainstack_job.datasets import Manifest, ManifestFile
from trainstack_job.resources import ResourceRequest, TypeOffer

from .conftest import BUCKET, GROUP, LOG_GROUP, REGION, REPO, Deployed

CONFIG = REPO / "training" / "configs" / "default.yaml"
JOB_FILE = """
name: tiny
command: [python, train.py]
env: {EPOCHS: "3"}
"""


@pytest.fixture(autouse=True)
def _fast_follow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(follow_module, "POLL_SECONDS", 0.05)
    monkeypatch.setattr(follow_module, "LOG_GRACE_SECONDS", 0.2)


@pytest.fixture()
def user_job(tmp_path: Path) -> Path:
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "train.py").write_text("print('hello')\n", encoding="utf-8")
    job_file = folder / "job.yaml"
    job_file.write_text(JOB_FILE, encoding="utf-8")
    return job_file


def _keys(deployed: Deployed, prefix: str) -> list[str]:
    listed = deployed.s3().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(item["Key"] for item in listed.get("Contents", []))


def _get(deployed: Deployed, key: str) -> dict[str, Any]:
    return dict(json.loads(deployed.s3().get_object(Bucket=BUCKET, Key=key)["Body"].read()))


def _put(deployed: Deployed, key: str, document: dict[str, Any]) -> None:
    deployed.s3().put_object(Bucket=BUCKET, Key=key, Body=json.dumps(document).encode())


def _submit(deployed: Deployed, *argv: str) -> dict[str, Any]:
    result = deployed.run("run", *argv, "--json")
    assert result.code == 0, result.err
    return dict(result.json())


def _template_versions(deployed: Deployed) -> list[tuple[int, str]]:
    found = deployed.ec2().describe_launch_template_versions(LaunchTemplateName=f"{GROUP}-lt")
    return sorted(
        (v["VersionNumber"], json.dumps(v["LaunchTemplateData"], sort_keys=True))
        for v in found["LaunchTemplateVersions"]
    )


def test_run_uploads_bundle_then_record_then_entry_and_detach_prints_the_id(deployed: Deployed):
    before = _template_versions(deployed)
    result = deployed.run("run", "--config", str(CONFIG), "--detach")
    assert result.code == 0, result.err
    job_id = result.out.strip()
    assert job_id.startswith("default-") and "\n" not in job_id, "--detach prints the id alone"

    record = _get(deployed, f"jobs/{job_id}/job.json")
    entry = _get(deployed, f"queue/{job_id}.json")
    assert (record["job_id"], record["source"], record["name"]) == (job_id, "run", "default")
    agent = record["agent"]
    assert agent["job_id"] == job_id and agent["user_job"] is None
    assert agent["job"]["train"]["lr"] == 0.1, "the trainer config travels in the record"
    # A submission's code is the job's, under job-code/: the environment's code/ is `pulumi up`'s alone.
    assert agent["bundle_key"] == f"job-code/{agent['bundle_sha256']}/bundle.tar.gz"
    assert _keys(deployed, "job-code/") == [agent["bundle_key"]]
    assert _keys(deployed, "code/") == [], "a submitter never writes the code the agent runs as root"
    assert (entry["job_id"], entry["now"], entry["submitted_at"]) == (job_id, False, record["submitted_at"])
    assert _template_versions(deployed) == before, "submitting never rolls a launch-template version"
    assert deployed.group()["DesiredCapacity"] == 2, "a group at zero wakes with the job's instance count"


def test_two_runs_of_the_same_code_are_two_jobs_sharing_one_bundle(deployed: Deployed):
    first = _submit(deployed, "--config", str(CONFIG))
    second = _submit(deployed, "--config", str(CONFIG))
    assert first["jobs"][0]["job_id"] != second["jobs"][0]["job_id"], "a re-run is a new job"
    assert len(first["bundles_uploaded"]) == 1 and second["bundles_uploaded"] == []
    assert len(_keys(deployed, "job-code/")) == 1
    assert second["scaled_up_to"] is None, "the group already woke for the first job"


def test_jobs_lists_the_queue_in_order_and_cancel_withdraws_a_queued_job(deployed: Deployed, user_job: Path):
    first = _submit(deployed, "--config", str(CONFIG))["jobs"][0]["job_id"]
    second = _submit(deployed, str(user_job))["jobs"][0]["job_id"]
    third = _submit(deployed, str(user_job), "--name", "tiny-again")["jobs"][0]["job_id"]
    assert second.startswith("tiny-") and third.startswith("tiny-again-")

    rows = {row["job_id"]: row for row in deployed.run("jobs", "--json").json()["jobs"]}
    assert [(rows[j]["status"], rows[j]["queue_position"]) for j in (first, second, third)] == [
        ("queued", 1),
        ("queued", 2),
        ("queued", 3),
    ]
    assert "queued #2" in deployed.run("jobs").out

    cancelled = deployed.run("cancel", second)
    assert cancelled.code == 0, cancelled.err
    assert f"cancelled job {second}: it leaves the queue and will never run" in cancelled.out
    rows = {row["job_id"]: row for row in deployed.run("jobs", "--json").json()["jobs"]}
    assert [(rows[j]["status"], rows[j]["queue_position"]) for j in (first, second, third)] == [
        ("queued", 1),
        ("cancelled", None),
        ("queued", 2),
    ]
    again = deployed.run("cancel", second)
    assert again.code == 1 and f"cancel {second}: the job is already cancelled" in again.err

    status = deployed.run("status", "--job", third)
    assert status.code == 0 and f"job {third} is queued, position 2" in " ".join(status.out.split())
    logs = deployed.run("logs", "--job", third)
    assert logs.code == 0 and logs.err.startswith(f"trainstack: job {third} is queued, position 2:")
    pulled = deployed.run("results", "pull", str(user_job.parent / "out"), "--job", second)
    assert pulled.code == 1 and f"(job {second}: training is cancelled)" in pulled.err


def test_now_goes_ahead_of_the_queue_and_a_job_that_yielded_waits_again(deployed: Deployed):
    waiting = _submit(deployed, "--config", str(CONFIG))["jobs"][0]["job_id"]
    urgent = _submit(deployed, "--config", str(CONFIG), "--now")["jobs"][0]["job_id"]
    assert _get(deployed, f"queue/{urgent}.json")["now"] is True
    rows = {row["job_id"]: row for row in deployed.run("jobs", "--json").json()["jobs"]}
    assert (rows[urgent]["queue_position"], rows[waiting]["queue_position"]) == (1, 2)
    # The agent ran `urgent`, then `waiting` yielded to another `--now` job: its ledger says queued again.
    _put(deployed, f"jobs/{urgent}/state/ledger.json", {"status": "running", "lives": []})
    _put(deployed, f"jobs/{waiting}/state/ledger.json", {"status": "queued", "lives": []})
    _put(deployed, f"jobs/{waiting}/state/progress.json", {"step": 40, "total_steps": 100})
    status = deployed.run("status", "--json", "--job", waiting).json()
    assert status["status"] == "queued" and f"job {waiting} is queued, position 1" in status["next_step"]


def test_cancelling_the_only_queued_job_puts_a_group_that_woke_for_it_back_to_zero(deployed: Deployed):
    job_id = _submit(deployed, "--config", str(CONFIG))["jobs"][0]["job_id"]
    assert deployed.group()["DesiredCapacity"] == 2
    result = deployed.run("cancel", job_id)
    assert result.code == 0 and "nothing else is queued, so the group is back at zero" in result.out
    assert deployed.group()["DesiredCapacity"] == 0


def test_cancel_of_a_running_job_asks_its_agent_to_checkpoint_then_stop(deployed: Deployed):
    job_id = _submit(deployed, "--config", str(CONFIG))["jobs"][0]["job_id"]
    _put(deployed, f"jobs/{job_id}/state/ledger.json", {"status": "running", "lives": []})
    result = deployed.run("cancel", job_id)
    assert result.code == 0, result.err
    assert "its agent checkpoints, then stops it" in result.out
    assert _get(deployed, f"jobs/{job_id}/state/cancel.json")["by"] == "trainstack cancel"
    assert deployed.run("cancel", "nope-12345678").err.count("no such job") == 1


def test_a_sweep_queues_one_named_job_per_grid_point_in_grid_order(deployed: Deployed):
    result = _submit(
        deployed, "--config", str(CONFIG), "--sweep", "train.lr=0.1,0.03", "--sweep", "train.batch_size=32,64"
    )
    names = [job["name"] for job in result["jobs"]]
    assert names == [
        "default-lr0.1-bs32",
        "default-lr0.1-bs64",
        "default-lr0.03-bs32",
        "default-lr0.03-bs64",
    ]
    queue = [entry for entry in deployed.run("jobs", "--json").json()["jobs"] if entry["queue_position"]]
    assert [row["name"] for row in sorted(queue, key=lambda r: r["queue_position"])] == names
    record = _get(deployed, f"jobs/{result['jobs'][2]['job_id']}/job.json")
    assert record["sweep"] == {"name": "default", "point": {"train.lr": 0.03, "train.batch_size": 32}}
    assert (record["agent"]["job"]["train"]["lr"], record["agent"]["job"]["train"]["batch_size"]) == (
        0.03,
        32,
    )
    assert len(_keys(deployed, "job-code/")) == 1, "one bundle for the whole sweep"


def test_a_bad_sweep_or_config_is_every_problem_one_line_each_and_nothing_is_submitted(
    deployed: Deployed, tmp_path: Path
):
    result = deployed.run("run", "--config", str(CONFIG), "--sweep", "train.lrr=0.1,0.2", "--detach")
    assert result.code == 1
    lines = result.err.splitlines()
    assert len(lines) == 3, "two points, one line each, and the summary"
    assert "(--sweep lrr0.1): train.lrr: unknown key" in lines[0] and "did you mean train.lr" in lines[0]
    assert lines[-1] == "trainstack: error: nothing submitted: 2 problems; fix and run again"

    broken = tmp_path / "broken.yaml"
    broken.write_text("train: {epochs: -1, optimizer: rmsprop}\nmodle: {}\n", encoding="utf-8")
    result = deployed.run("run", "--config", str(broken), "--sweep", "bogus", "--detach")
    assert result.code == 1 and "--sweep 'bogus': expected KEY=V1,V2" in result.err
    deployed.outputs_file.unlink()  # the job is checked before the stack is read: no outputs needed
    result = deployed.run("run", "--config", str(broken), "--detach")
    assert result.code == 1 and result.err.count(f"{broken}: ") >= 3, result.err
    assert "train.epochs: must be at least 1" in result.err and "modle: unknown section" in result.err
    # Saved in Latin-1 (an accent in a comment), and a job file that is not text at all: one line each.
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("# r\xe9glages\ntrain: {epochs: 1}\n".encode("latin-1"))
    result = deployed.run("run", "--config", str(latin), "--detach")
    assert result.code == 1 and f"--config {latin}: not UTF-8 text (byte 3: " in result.err, result.err
    binary = tmp_path / "job.yaml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00")
    result = deployed.run("run", str(binary), "--detach")
    assert result.code == 1 and f"{binary}: not UTF-8 text (byte 0: " in result.err, result.err
    assert "save it as UTF-8" in result.err and "Traceback" not in result.err
    assert _keys(deployed, "") == [] and deployed.group()["DesiredCapacity"] == 0


def test_a_user_jobs_sweep_sets_environment_variables(deployed: Deployed, user_job: Path):
    result = _submit(deployed, str(user_job), "--sweep", "LR=1e-3,3e-4")
    envs = [
        _get(deployed, f"jobs/{job['job_id']}/job.json")["agent"]["user_job"]["env"] for job in result["jobs"]
    ]
    assert envs == [{"EPOCHS": "3", "LR": "1e-3"}, {"EPOCHS": "3", "LR": "3e-4"}]
    assert deployed.group()["DesiredCapacity"] == 1, "a user's job runs on one instance"
    bad = deployed.run("run", str(user_job), "--sweep", "train.lr=0.1", "--detach")
    assert bad.code == 1 and "--sweep train.lr: a user's job is swept through its environment" in bad.err


def test_jobs_sweep_ranks_the_jobs_by_their_final_metric(deployed: Deployed):
    jobs = _submit(deployed, "--config", str(CONFIG), "--sweep", "train.lr=0.1,0.03,0.01", "--name", "lrs")[
        "jobs"
    ]
    for job, accuracy in zip(jobs[:2], (0.61, 0.74), strict=True):
        root = f"jobs/{job['job_id']}/"
        _put(
            deployed, root + "state/ledger.json", {"status": "completed", "lives": [], "total_cost_usd": 1.5}
        )
        _put(deployed, root + "results/metrics.json", {"final": {"val_accuracy": accuracy, "val_loss": 1.0}})
    report = deployed.run("jobs", "--sweep", "lrs", "--json").json()
    ranked = [(row["name"], row["metric"], row["status"]) for row in report["jobs"]]
    assert ranked == [
        ("lrs-lr0.03", 0.74, "completed"),
        ("lrs-lr0.1", 0.61, "completed"),
        ("lrs-lr0.01", None, "queued"),
    ]
    human = deployed.run("jobs", "--sweep", "lrs").out
    assert "best first by final.val_accuracy" in human and human.index("lrs-lr0-03") < human.index(
        "lrs-lr0-1-"
    )
    unknown = deployed.run("jobs", "--sweep", "nope")
    assert unknown.code == 1 and "sweeps in this stack: lrs" in unknown.err


def test_a_job_needing_more_instances_than_the_group_allows_is_refused(deployed: Deployed):
    result = deployed.run("run", "--config", str(CONFIG), "--instances", "3", "--detach")
    assert result.code == 1 and result.err.count("\n") == 1
    # The stack's one pool (its outputs from before pools) holds 2: no pool serves 3, refused before upload.
    assert "the job: no pool serves 3 instances (default offers 1x L4 24 GiB (g6.xlarge)" in result.err
    assert "up to 2 instances" in result.err
    deployed.autoscaling().update_auto_scaling_group(AutoScalingGroupName=GROUP, MaxSize=1)
    result = deployed.run("run", "--config", str(CONFIG), "--detach")
    assert result.code == 1 and "needs 2 instances" in result.err, "the stack's instanceCount by default"
    assert _keys(deployed, "") == [] and deployed.group()["DesiredCapacity"] == 0

    one = _submit(deployed, "--config", str(CONFIG), "--instances", "1")["jobs"][0]["job_id"]
    assert _get(deployed, f"jobs/{one}/job.json")["agent"]["instance_count"] == 1
    assert deployed.group()["DesiredCapacity"] == 1


def test_data_pins_the_pushed_version_and_an_unpushed_dataset_is_refused(deployed: Deployed, user_job: Path):
    missing = deployed.run("run", str(user_job), "--data", "corpus", "--detach")
    assert missing.code == 1 and "--data corpus: dataset 'corpus' has no pushed version" in missing.err
    assert "trainstack data push DIR --name corpus" in missing.err
    manifest = Manifest("corpus", {"shard-0.txt": ManifestFile(size=5, sha256="a" * 64)})
    _put(deployed, "state/datasets/corpus.json", manifest.to_json("datasets/corpus/"))
    job_id = _submit(deployed, str(user_job), "--data", "corpus")["jobs"][0]["job_id"]
    record = _get(deployed, f"jobs/{job_id}/job.json")
    pinned = {"name": "corpus", "version": manifest.version}
    assert record["dataset"] == pinned
    assert (record["agent"]["dataset"], record["agent"]["dataset_version"]) == ("corpus", manifest.version)
    assert record["agent"]["instance_count"] == 1, "a user's job trains on one instance"
    not_images = deployed.run("run", "--config", str(CONFIG), "--data", "corpus", "--detach")
    assert not_images.code == 1 and "s3://trainstack-test-data/datasets/corpus" in not_images.err


def test_a_definition_is_one_id_for_pulumi_and_a_new_id_for_every_run():
    def submit(at: str, *, unique: bool, **extra: Any) -> Any:
        return prepare_submission(
            trainer_config={"train": {"epochs": 1}},
            training_config_path=CONFIG,
            user_job=None,
            user_job_dir=None,
            submitted_at=at,
            source="run" if unique else "pulumi",
            unique=unique,
            **extra,
        )

    defined = define_job(trainer_config={"train": {"epochs": 1}}, training_config_path=CONFIG)
    first, again = submit("2026-01-01T00:00:00Z", unique=False), submit("2026-02-01T00:00:00Z", unique=False)
    assert first.job_id == again.job_id == defined.job_id, "pulumi up: equal definitions, equal ids"
    runs = {submit(f"2026-01-01T00:00:0{i}Z", unique=True).job_id for i in range(3)}
    assert len(runs) == 3 and defined.job_id not in runs, "trainstack run: every submission a new job"
    named = submit("2026-01-01T00:00:00Z", unique=True, name="resnet", now=True)
    assert named.job_id.startswith("resnet-") and named.entry["now"] is True
    keys = [key for key, _, _ in named.objects("stack-code/")]
    assert keys == [f"stack-code/{named.bundle.sha256}/bundle.tar.gz", named.record_key, named.entry_key]
    record = json.loads(named.objects("stack-code/")[1][1])
    assert record["bundle_key"] == record["agent"]["bundle_key"] == keys[0], (
        "the record names the uploaded key"
    )


def test_a_record_that_exists_stops_the_submission_before_its_queue_entry(deployed: Deployed):
    submission = prepare_submission(
        trainer_config={"train": {"epochs": 1}},
        training_config_path=CONFIG,
        user_job=None,
        user_job_dir=None,
        submitted_at="2026-01-01T00:00:00+00:00",
        source="run",
        unique=True,
    )
    _put(deployed, submission.record_key, {"job_id": submission.job_id})
    outputs = StackOutputs(json.loads(deployed.outputs_file.read_text()), "test")
    with pytest.raises(CliError, match=r"already exists: job .* was submitted before"):
        upload(Clients(REGION), outputs, [submission])
    assert _keys(deployed, "queue/") == [], "no entry without its own record"


class RefusingQueueWrites:
    """The user's S3 client, with PutObject on queue/ refused as an identity without that grant would be."""

    def __init__(self, s3: Any) -> None:
        self._s3 = s3

    def __getattr__(self, name: str) -> Any:
        return getattr(self._s3, name)

    def put_object(self, **request: Any) -> Any:
        if str(request["Key"]).startswith("queue/"):
            error = {"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}
            raise ClientError(error, "PutObject")  # type: ignore[arg-type]
        return self._s3.put_object(**request)


def test_a_refused_queue_write_leaves_no_queued_job_and_the_group_asleep(deployed: Deployed):
    s3 = RefusingQueueWrites(boto3.client("s3", region_name=REGION))
    refused = Clients(None, overrides={"s3": s3})
    result = deployed.run("run", "--config", str(CONFIG), "--sweep", "train.lr=0.1,0.2", clients=refused)
    assert result.code == 1 and result.err.count("\n") == 1
    assert "permission denied: PutObject was refused" in result.err
    assert _keys(deployed, "queue/") == [] and deployed.group()["DesiredCapacity"] == 0
    rows = deployed.run("jobs", "--json").json()["jobs"]
    assert [row["status"] for row in rows] == ["not started"] * 2, "records alone are no queued jobs"


def test_a_corrupt_queue_entry_is_one_line_naming_it(deployed: Deployed):
    deployed.s3().put_object(Bucket=BUCKET, Key="queue/x-12345678.json", Body=b"{not json")
    result = deployed.run("jobs")
    assert result.code == 1 and result.err.count("\n") == 1
    assert "queue/x-12345678.json is not a queue entry" in result.err


class Polls:
    """Counts the follower's pauses between two polls (its `wait`), so that a fake agent acts between polls
    instead of sleeping for a time a loaded machine overruns; and plays a Ctrl-C at a chosen pause."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self._ctrl_c_at: int | None = None
        self._changed = threading.Condition()
        monkeypatch.setattr(follow_module, "wait", self._wait)

    def _wait(self, seconds: float) -> None:
        time.sleep(seconds)
        with self._changed:
            if self._ctrl_c_at is not None and self.count >= self._ctrl_c_at:
                raise KeyboardInterrupt
            self.count += 1
            self._changed.notify_all()

    def seen(self) -> None:
        """Return once the follower has made a whole poll that began after this call: the count moves as
        a poll begins, so the first move may be a poll under way and the second ends a whole one."""
        with self._changed:
            target = self.count + 2
            assert self._changed.wait_for(lambda: self.count >= target, timeout=60), "the follower hung"

    def ctrl_c_after_the_next_poll(self) -> None:
        with self._changed:
            self._ctrl_c_at = self.count + 1


class FakeAgent:
    """Plays the agent for a followed job: takes it from the queue, logs, reports progress, ends it, and
    ships its last log line after the end, as the real agent's exit flush does."""

    def __init__(self, deployed: Deployed, end: str, polls: Polls, *, ships_end: bool = True) -> None:
        self.deployed, self.end, self.polls, self.ships_end = deployed, end, polls, ships_end
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.never_queued = False

    def _run(self) -> None:
        s3 = self.deployed.s3()
        job_id = ""
        deadline = time.monotonic() + 60
        while not job_id:
            if time.monotonic() > deadline:
                self.never_queued = True  # the test's own assert says so, not the global timeout
                return
            found = s3.list_objects_v2(Bucket=BUCKET, Prefix="queue/").get("Contents", [])
            job_id = found[0]["Key"][len("queue/") : -len(".json")] if found else ""
            time.sleep(0.02)
        state = f"jobs/{job_id}/state/"
        logs_client = boto3.client("logs", region_name=REGION)
        stream = f"{job_id}/i-0123456789abcdef0/trainer"
        logs_client.create_log_stream(logGroupName=LOG_GROUP, logStreamName=stream)

        def log(message: str) -> None:
            logs_client.put_log_events(
                logGroupName=LOG_GROUP,
                logStreamName=stream,
                logEvents=[{"timestamp": int(time.time() * 1000), "message": message}],
            )

        log("epoch 1/1 step 5/10 loss 1.0")
        life = {"instance_id": "i-0123456789abcdef0", "outcome": "running", "started_at": _now()}
        ledger = {"status": "running", "lives": [life], "total_cost_usd": 0.25}
        _put(self.deployed, state + "ledger.json", ledger)
        _put(self.deployed, state + "progress.json", {"step": 5, "total_steps": 10, "updated_at": _now()})
        # Running until the follower has seen it: a fixed pause can fall between two polls of a slow one.
        self.polls.seen()
        _put(self.deployed, state + "progress.json", {"step": 10, "total_steps": 10, "updated_at": _now()})
        ended = {**life, "outcome": self.end, "ended_at": _now()}
        _put(
            self.deployed,
            state + "ledger.json",
            {**ledger, "lives": [ended], "status": self.end, "total_cost_usd": 0.5},
        )
        # The follower has seen the end; only then the last lines: shipped after the end, they must still
        # print, and the agent's `end` event (its life's last word) ends the wait for late lines.
        self.polls.seen()
        log("final line, shipped as the agent exits")
        if not self.ships_end:
            # Its `end` event never comes (an instance gone mid-flush): a Ctrl-C skips the rest of the wait.
            self.polls.ctrl_c_after_the_next_poll()
            return
        agent_stream = f"{job_id}/i-0123456789abcdef0/agent"
        logs_client.create_log_stream(logGroupName=LOG_GROUP, logStreamName=agent_stream)
        logs_client.put_log_events(
            logGroupName=LOG_GROUP,
            logStreamName=agent_stream,
            logEvents=[
                {
                    "timestamp": int(time.time() * 1000),
                    "message": json.dumps({"stage": "end", "message": self.end}),
                }
            ],
        )


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


@pytest.mark.parametrize(("end", "code", "ships_end"), [("completed", 0, True), ("failed", 1, False)])
def test_following_a_job_prints_its_logs_and_exits_by_its_outcome(
    deployed: Deployed, end: str, code: int, ships_end: bool, monkeypatch: pytest.MonkeyPatch
):
    # Long enough that only the agent's `end` event can end the wait for late lines within the test's time.
    monkeypatch.setattr(follow_module, "LOG_GRACE_SECONDS", 600.0)
    agent = FakeAgent(deployed, end, Polls(monkeypatch), ships_end=ships_end)
    agent.thread.start()
    result = deployed.run("run", "--config", str(CONFIG))
    agent.thread.join(5)
    assert not agent.never_queued, "trainstack run queued no job within 60 s"
    assert result.code == code, result.out + result.err
    assert not agent.thread.is_alive(), "the fake agent did not end within 5 s of the run"
    assert "epoch 1/1 step 5/10 loss 1.0" in result.out, "the job's log lines"
    assert "running, step 5/10" in result.out or "running, step 10/10" in result.out, "the status line"
    lines = result.out.strip().splitlines()
    assert "final line, shipped as the agent exits" in result.out, "a line shipped after the job's end"
    assert lines[-1].startswith("job default-") and f" {end}: step 10/10, cost $0.50" in lines[-1]


def test_ctrl_c_while_following_detaches_and_never_cancels(
    deployed: Deployed, monkeypatch: pytest.MonkeyPatch
):
    def interrupt(_seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(follow_module, "wait", interrupt)
    result = deployed.run("run", "--config", str(CONFIG))
    assert result.code == 0, result.err
    assert "detached; job default-" in result.out and "trainstack logs --job default-" in result.out
    assert [key for key in _keys(deployed, "jobs/") if key.endswith("cancel.json")] == []
    rows = deployed.run("jobs", "--json").json()["jobs"]
    assert [row["status"] for row in rows] == ["queued"]


# -- what a run refuses before it reads the stack, and what it writes and says ---------------------------


def _problems(request: RunRequest) -> list[str]:
    with pytest.raises(InvalidJobError) as raised:
        read_job(request)
    return raised.value.problems


def test_a_run_names_exactly_one_of_a_job_file_and_a_training_config(user_job: Path) -> None:
    """Neither or both is one line saying to give one of the two, with an example of each."""
    for request in (RunRequest(), RunRequest(job_file=user_job, config_file=CONFIG)):
        with pytest.raises(CliError) as raised:
            read_job(request)
        assert str(raised.value) == (
            "trainstack run: give a job file (trainstack run examples/charlm/job.yaml) or a training config "
            "for the built-in trainer (trainstack run --config training/configs/default.yaml), one of the two"
        )


def test_every_bad_flag_is_one_line_beside_the_configs_own_problems(tmp_path: Path) -> None:
    """Each bad flag, the config's resources and the sweep are named together, one line each."""
    config = tmp_path / "bad.yaml"
    config.write_text("train: {epochs: 1}\nresources: {gpus: 'L4:x'}\n", encoding="utf-8")
    problems = _problems(
        RunRequest(
            config_file=config,
            name="Bad_Name",
            parallel=0,
            sweeps=("train.lr=0.1", "train.lr=0.2"),
            priority=1001,
            instances=0,
            dataset="Bad Name",
            gpus="x:y",
            min_gpu_memory_gb=0,
        )
    )
    starts = [
        "--name 'Bad_Name': lowercase letters, digits and '-', at most 40",
        "--parallel 0: how many points of a --sweep run at once (1 or more); give it with --sweep",
        "--priority 1001: from -1000 to 1000 (higher runs first; default 0)",
        "--instances 0: a job trains on at least 1 instance",
        "--data Bad Name",
        f"{config}: resources.gpus: 'L4:x' is not a GPU request",
        "--gpus: 'x:y' is not a GPU request",
        "--min-gpu-memory-gb 0: a size in GB, e.g. 24",
        "--sweep train.lr: given twice",
    ]
    assert len(problems) == len(starts) and all(
        problem.startswith(start) for problem, start in zip(problems, starts, strict=True)
    ), problems


@pytest.mark.parametrize(
    ("priority", "accepted"), [(-1001, False), (-1000, True), (1000, True), (1001, False)]
)
def test_a_priority_is_accepted_from_minus_1000_to_1000(priority: int, accepted: bool) -> None:
    """The priority's bounds are part of its range; one past them is refused."""
    request = RunRequest(config_file=CONFIG, priority=priority)
    if accepted:
        assert read_job(request).request.priority == priority
    else:
        assert _problems(request) == [
            f"--priority {priority}: from -1000 to 1000 (higher runs first; default 0)"
        ]


def test_a_config_that_is_not_yaml_names_its_line(tmp_path: Path) -> None:
    """A YAML syntax error is one line naming the file and the line where the parser stopped."""
    config = tmp_path / "tabbed.yaml"
    config.write_text("a: 1\nb: 2\n\tc: 3\n", encoding="utf-8")
    assert _problems(RunRequest(config_file=config)) == [
        f"--config {config} line 3: not valid YAML; fix the syntax there"
    ]


def test_the_command_lines_resources_go_over_the_config_files(tmp_path: Path) -> None:
    """--pool, --gpus, --min-gpu-memory-gb and --instances replace what the file's `resources:` asks."""
    config = tmp_path / "wide.yaml"
    text = CONFIG.read_text(encoding="utf-8")
    config.write_text(text + "\nresources: {pool: small, gpus: 'L4:1', instances: 2}\n", encoding="utf-8")
    assert read_job(RunRequest(config_file=config)).definition.resources == ResourceRequest(
        pool="small", gpu_model="L4", gpus=1, instances=2
    )
    flags = RunRequest(config_file=config, pool="big", gpus="A100:8", min_gpu_memory_gb=40, instances=1)
    assert read_job(flags).definition.resources == ResourceRequest(
        pool="big", gpu_model="A100", gpus=8, min_gpu_memory_gb=40, instances=1
    )


def test_a_users_job_runs_on_one_instance_whether_the_flag_or_its_file_asks_more(user_job: Path) -> None:
    """A user's job asking for several instances is refused naming the flag, or its file's key."""
    assert _problems(RunRequest(job_file=user_job, instances=2)) == [
        "--instances 2: a user's job runs on one instance (multi-node runs the built-in trainer, --config); "
        "use a multi-GPU instance type for more GPUs"
    ]
    user_job.write_text(JOB_FILE + "resources: {instances: 2}\n", encoding="utf-8")
    (problem,) = _problems(RunRequest(job_file=user_job))
    assert problem.startswith("resources.instances 2: a user's job runs on one instance")
    assert read_job(RunRequest(job_file=user_job, instances=1)).definition.resources.instances == 1


def test_a_job_folder_too_large_to_bundle_is_named_by_its_job_file(
    user_job: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bundle's refusal names the job file given, not the stack key `pulumi up` would name."""
    monkeypatch.setattr(bundle_module, "MAX_JOB_BYTES", 1)
    (problem,) = _problems(RunRequest(job_file=user_job))
    assert problem.startswith(
        f"{user_job}: the workdir {user_job.parent.resolve()} holds 0 MiB; keep data out"
    )


def test_a_users_sweep_is_one_job_per_point_each_recording_its_point(user_job: Path) -> None:
    """Each point of a user's sweep carries its values; every point's problem is named, not only the last."""
    job = read_job(RunRequest(job_file=user_job, sweeps=("LR=1,2",)))
    assert [(v.name, v.point) for v in job.variants] == [("tiny-lr1", {"LR": 1}), ("tiny-lr2", {"LR": 2})]
    assert job.sweep == "tiny"
    problems = _problems(RunRequest(job_file=user_job, sweeps=("TRAINSTACK_X=a,b",)))
    assert [problem.split(":")[0] for problem in problems] == [
        f"{user_job} (--sweep txa)",
        f"{user_job} (--sweep txb)",
    ]


def test_an_invalid_job_is_each_problem_on_its_own_line_then_how_many(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each problem is one stderr line, then a count that agrees in number; the exit status is 1."""
    for problems, count in ((["one"], "1 problem"), (["one", "two"], "2 problems")):
        assert report_invalid(InvalidJobError(problems)) == 1
        lines = [f"trainstack: error: {problem}" for problem in problems]
        lines.append(f"trainstack: error: nothing submitted: {count}; fix and run again")
        assert capsys.readouterr().err == "".join(f"{line}\n" for line in lines)


def test_an_invalid_jobs_message_is_every_problem_in_one_line() -> None:
    """Where the error is shown as one message (`--json`, a caller's log), it still holds every problem."""
    error = InvalidJobError(["job.yaml: name: missing", "job.yaml: command: not a list"])
    assert str(error) == "job.yaml: name: missing; job.yaml: command: not a list"
    assert error.problems == ["job.yaml: name: missing", "job.yaml: command: not a list"]


def test_a_yaml_error_with_or_without_a_place_is_one_line_naming_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PyYAML's syntax errors carry the line; an error without one (a constructor's, a plugin's) still gives
    the one line, without a made-up place."""
    config = tmp_path / "train.yaml"
    config.write_text("model:\n  name: [unclosed\n", encoding="utf-8")
    (line,) = _problems(RunRequest(config_file=config))
    assert line.startswith(f"--config {config} line ") and line.endswith(
        ": not valid YAML; fix the syntax there"
    )

    def unplaced(_text: str) -> object:
        raise yaml.YAMLError("no place to give")

    monkeypatch.setattr(run_module.yaml, "safe_load", unplaced)
    assert _problems(RunRequest(config_file=config)) == [
        f"--config {config}: not valid YAML; fix the syntax there"
    ]


def test_a_queue_time_is_utc_with_a_z_whatever_the_machines_zone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The queue runs by this time, so every submitter writes the form `pulumi up` writes: UTC, `Z`, to the
    microsecond, whatever zone the submitting machine is in."""
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        moment = datetime(2026, 12, 6, 21, 0, 0, 5, tzinfo=timezone(timedelta(hours=9)))
        assert run_module._queue_time(moment) == "2026-12-06T12:00:00.000005Z"
    finally:
        monkeypatch.undo()
        time.tzset()


def test_an_instance_type_the_catalogue_lacks_offers_no_gpus() -> None:
    """A pool's unknown instance type is matched as one with no GPUs, known ones with their catalogue's."""
    assert type_offer("x9.unknown") == TypeOffer("x9.unknown", None, 0, 0)
    assert type_offer("g6.xlarge") == TypeOffer("g6.xlarge", "L4", 1, 24)


def test_a_job_needing_more_instances_than_its_group_holds_says_how_to_fix_it() -> None:
    """A group that holds exactly the job's instances takes it; one fewer is refused with both fixes."""
    check_capacity(Group(GROUP, 0, 0, 2), 2)
    with pytest.raises(CliError) as raised:
        check_capacity(Group(GROUP, 0, 0, 1), 2)
    assert str(raised.value) == (
        f"the job needs 2 instances and group {GROUP} allows at most 1: ask for fewer (--instances N), or "
        "raise trainstack:instanceCount and `pulumi up` first"
    )


class _Scaling:
    """The autoscaling client wake_group talks to: records each resize asked for."""

    def __init__(self) -> None:
        self.asked: list[dict[str, Any]] = []

    def autoscaling(self) -> _Scaling:
        return self

    def update_auto_scaling_group(self, **request: Any) -> None:
        self.asked.append(request)


@pytest.mark.parametrize(
    ("desired", "max_size", "free", "wanted"),
    [(0, 4, 0, 2), (1, 4, 0, None), (1, 4, 1, 3), (1, 2, 1, 2), (2, 2, 1, None)],
)
def test_a_group_wakes_at_zero_or_grows_only_for_a_free_lane_never_past_its_maximum(
    desired: int, max_size: int, free: int, wanted: int | None
) -> None:
    """At zero a group gets the job's instances; up, only a free lane adds them (capped); else it stays."""
    scaling = _Scaling()
    group = Group("g", desired, 0, max_size)
    assert wake_group(scaling, group, 2, free_lanes=free) == wanted  # type: ignore[arg-type]
    expected = [] if wanted is None else [{"AutoScalingGroupName": "g", "DesiredCapacity": wanted}]
    assert scaling.asked == expected


def test_a_record_and_its_entry_are_encrypted_json_and_the_answer_says_what_was_asked(
    deployed: Deployed,
) -> None:
    """The record and entry are JSON under the stack's key; the answer names the flags' effect."""
    result = _submit(deployed, "--config", str(CONFIG), "--instances", "2", "--now")
    (job,) = result["jobs"]
    for key in (f"jobs/{job['job_id']}/job.json", f"queue/{job['job_id']}.json"):
        head = deployed.s3().head_object(Bucket=BUCKET, Key=key)
        assert head["ContentType"] == "application/json", key
        assert (head["ServerSideEncryption"], head["SSEKMSKeyId"]) == ("aws:kms", deployed.kms_key_arn), key
    assert _get(deployed, f"jobs/{job['job_id']}/job.json")["agent"]["instance_count"] == 2
    assert (result["now"], result["sweep"], result["dataset"], job["sweep"]) == (True, None, None, None)
    swept = _submit(deployed, "--config", str(CONFIG), "--sweep", "train.lr=0.1,0.2", "--name", "lrs")
    assert swept["sweep"] == "lrs" and swept["now"] is False


class _HeadSaysAbsent:
    """The user's S3 client as a submission racing another sees it: the bundle's HEAD said not there."""

    def __init__(self, s3: Any) -> None:
        self._s3 = s3

    def __getattr__(self, name: str) -> Any:
        return getattr(self._s3, name)

    def head_object(self, **request: Any) -> Any:
        raise ClientError({"Error": {"Code": "404", "Message": "Not Found"}}, "HeadObject")


def test_a_bundle_another_submission_wrote_first_is_never_written_again(deployed: Deployed) -> None:
    """The bundle is created only if absent: one written since the check is left as it is, and not claimed."""
    first = _submit(deployed, "--config", str(CONFIG))
    racing = Clients(None, overrides={"s3": _HeadSaysAbsent(boto3.client("s3", region_name=REGION))})
    result = deployed.run("run", "--config", str(CONFIG), "--json", clients=racing)
    assert result.code == 0, result.err
    assert len(first["bundles_uploaded"]) == 1 and result.json()["bundles_uploaded"] == []
    assert len(_keys(deployed, "queue/")) == 2


def test_a_sweep_says_each_queued_job_then_how_to_compare_them(deployed: Deployed) -> None:
    """A sweep's human answer: one line per queued job, then the sweep, the group woken and the command."""
    result = deployed.run("run", "--config", str(CONFIG), "--sweep", "train.lr=0.1,0.03")
    assert result.code == 0, result.err
    ids = [row["job_id"] for row in deployed.run("jobs", "--json").json()["jobs"]]
    lines = result.out.strip().splitlines()
    assert sorted(lines[:2]) == sorted(f"queued {job_id}" for job_id in ids) and len(lines) == 3
    assert lines[2] == (
        f"sweep default: 2 jobs queued; group {GROUP} scaled up to 2; compare them with "
        "`trainstack jobs --sweep default`"
    )


def test_a_followed_job_first_says_its_place_and_the_group_it_woke(
    deployed: Deployed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Following starts with the job's queue position and, when it woke the group, to what size."""

    def interrupt(_seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(follow_module, "wait", interrupt)
    first = deployed.run("run", "--config", str(CONFIG))
    second = deployed.run("run", "--config", str(CONFIG))
    ids = {row["queue_position"]: row["job_id"] for row in deployed.run("jobs", "--json").json()["jobs"]}
    assert first.out.splitlines()[0] == (
        f"submitted {ids[1]} (queued, position 1); group {GROUP} scaled up to 2; Ctrl-C stops following, "
        "never the job"
    )
    assert second.out.splitlines()[0] == (
        f"submitted {ids[2]} (queued, position 2); Ctrl-C stops following, never the job"
    )


def test_the_json_names_each_jobs_code_bundle_as_it_lies_in_the_bucket(deployed: Deployed) -> None:
    """`trainstack run --json`'s `bundle_key` is the object the agent will fetch: under job-code/, by its
    sha256, and there."""
    report = _submit(deployed, "--config", str(CONFIG))
    (job,) = report["jobs"]
    record = _get(deployed, f"jobs/{job['job_id']}/job.json")
    assert job["bundle_key"] == record["agent"]["bundle_key"]
    assert job["bundle_key"] == f"job-code/{record['agent']['bundle_sha256']}/bundle.tar.gz"
    assert _keys(deployed, "job-code/") == [job["bundle_key"]]


def test_a_job_an_instance_took_before_it_was_described_is_said_queued_without_a_position(
    deployed: Deployed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the upload and the first look an instance may take the job: it has no place in the queue
    any more, and the line says so plainly rather than `position None`."""

    def taken(clients: Any, outputs: Any, job_id: str) -> dict[str, Any]:
        return {"job_id": job_id, "status": "running", "queue_position": None}

    def interrupt(_seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "describe", taken)
    monkeypatch.setattr(follow_module, "wait", interrupt)
    result = deployed.run("run", "--config", str(CONFIG))
    first = result.out.splitlines()[0]
    assert first.startswith("submitted default-") and first.endswith(
        f" (queued); group {GROUP} scaled up to 2; Ctrl-C stops following, never the job"
    ), first

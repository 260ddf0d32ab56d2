"""Issue 34 part 2: a job cannot fake losing its own lease (bootstrap/persist.py, bootstrap/lifecycle.py,
bootstrap/jobuser.py's session policy).

The job owns its local checkpoint folder and, before this fix, could write its whole S3 prefix, the job's
`checkpoints/latest.json` included. A fencing token it wrote there (2^62) made its holder stop as superseded
(`latest.json` carried a higher token than the holder's) and became the floor of every later lease. Now the
lease record (under `state/`, which the job cannot write) alone says who holds the lease, the floor is the
agent's own record of the tokens it wrote, and the job's session cannot write `latest.json` at all.
"""

from __future__ import annotations

import io
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from bootstrap import supervisor
from bootstrap.eventlog import EventLog
from bootstrap.jobuser import job_session_policy
from bootstrap.lease import JobLease, LeaseLostError
from bootstrap.lifecycle import InstanceLife
from bootstrap.persist import CheckpointPersister
from bootstrap.phases.writer import take_role
from bootstrap.standby import Role
from bootstrap.trainer import TrainerPaths
from demo.imds import ImdsSimulator
from demo.stack import LocalStack
from infra.iam.machine_roles import job_role_policy
from tests.bootstrap.test_fencing import Events
from tests.checkpoints import commit_step
from tests.conftest import MotoServer
from tests.iam.evaluate import Caller, Request, decide

FORGED = 2**62
BUCKET = "trainstack-forged"
JOB = "forger-1a2b3c4d"
PREFIX = f"jobs/{JOB}/checkpoints"
LATEST_KEY = f"{PREFIX}/latest.json"
LEASE_KEY = f"jobs/{JOB}/state/lease.json"
TOKEN_RECORD_KEY = f"jobs/{JOB}/state/latest-token.json"
ROLE = "arn:aws:iam::123456789012:role/trainstack-dev-job"
STALE = 60.0


@pytest.fixture()
def s3(aws: MotoServer) -> Any:
    client = boto3.client("s3", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    return client


def latest(s3: Any, bucket: str = BUCKET, key: str = LATEST_KEY) -> dict[str, Any]:
    return dict(json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read()))


def soon() -> float:
    return time.monotonic() + 20


# --- the holder is not stopped by a token no lease handed out ----------------------------------------------


def test_a_token_the_job_forged_in_latest_json_does_not_stop_its_holder(s3: Any, tmp_path: Path) -> None:
    holder = JobLease(s3, BUCKET, LEASE_KEY, holder="i-a", life_id="i-a@life", stale_seconds=STALE)
    assert holder.try_acquire(time.time()) == 1
    local = tmp_path / "checkpoints"
    local.mkdir()
    events = Events()
    lost: list[LeaseLostError] = []
    persister = CheckpointPersister(
        s3, BUCKET, PREFIX, local, events, fence=holder, on_lease_lost=lost.append
    )
    commit_step(local, 3)
    assert persister.persist_newest(soon()) == 3
    forged = {"step": 3, "epoch": 0, "dir": "step-3", "token": FORGED}

    # The job's own folder: its latest.json is never uploaded, the agent writes its own over it.
    (local / "latest.json").write_text(json.dumps(forged))
    commit_step(local, 4)
    assert persister.persist_newest(soon()) == 4
    assert (latest(s3)["step"], latest(s3)["token"]) == (4, 1)
    assert json.loads((local / "latest.json").read_text())["token"] == 1

    # The job's S3 prefix, had its credentials allowed the write (its session now denies it, below).
    s3.put_object(Bucket=BUCKET, Key=LATEST_KEY, Body=json.dumps(forged).encode())
    commit_step(local, 5)
    assert persister.persist_newest(soon()) == 5, "the holder stopped on a token no lease handed out"
    assert lost == [] and persister.lease_lost is None
    assert (latest(s3)["step"], latest(s3)["token"]) == (5, 1), "the forged token was not replaced"
    assert holder.check().token == 1
    said = events.messages("latest.json carries token")
    assert said == [
        f"latest.json carries token {FORGED}, but the lease names this holder with token 1: replaced "
        "(a token above the lease's was never handed out; only the lease record says who writes the job's "
        "checkpoints)"
    ]
    [(stage, _, fields)] = [r for r in events.records if r[1].startswith("latest.json carries token")]
    assert (stage, fields) == (
        "checkpoint",
        {"level": "warning", "uri": f"s3://{BUCKET}/{LATEST_KEY}", "token": 1},
    )
    assert not events.messages("lease lost")


def test_a_higher_token_the_lease_did_hand_out_still_stops_the_old_holder(s3: Any, tmp_path: Path) -> None:
    """The other side of the rule: a lease record that names another holder supersedes, as before."""
    old = JobLease(s3, BUCKET, LEASE_KEY, holder="i-a", life_id="i-a@life", stale_seconds=STALE)
    assert old.try_acquire(time.time() - 2 * STALE) == 1
    new = JobLease(s3, BUCKET, LEASE_KEY, holder="i-b", life_id="i-b@life", stale_seconds=STALE)
    assert new.try_acquire(time.time()) == 2
    commit_step(tmp_path / "b", 4)
    CheckpointPersister(s3, BUCKET, PREFIX, tmp_path / "b", Events(), fence=new).persist_newest(soon())
    commit_step(tmp_path / "a", 9)
    with pytest.raises(LeaseLostError, match=r"lease lost to i-b \(token 2\)"):
        CheckpointPersister(s3, BUCKET, PREFIX, tmp_path / "a", Events(), fence=old).persist_newest(soon())
    assert (latest(s3)["step"], latest(s3)["token"]) == (4, 2)


# --- the next lease's floor --------------------------------------------------------------------------------


@pytest.fixture()
def scratch() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="trainstack-forged-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _life(stack: LocalStack, scratch: Path, **config: Any) -> InstanceLife:
    life = InstanceLife(
        stack.agent_config(job_id=JOB, poll_seconds=0.2, scratch_dir=str(scratch), **config),
        log=EventLog(io.StringIO()),
        identity_wait_seconds=2,
        release_wait_seconds=0,
        state_poll_seconds=0.5,
        tick_seconds=0.1,
        job_root=scratch,
    )
    return life


def test_the_next_lease_starts_above_the_lease_record_never_above_a_forged_latest_json(
    stack: LocalStack, imds: ImdsSimulator, scratch: Path
) -> None:
    s3 = stack.client("s3")
    lease_key, latest_key = f"jobs/{JOB}/state/lease.json", f"jobs/{JOB}/checkpoints/latest.json"
    now = time.time()
    released = {"holder": "i-old", "life_id": "old", "token": 1, "acquired_at": now - 100}
    released |= {"heartbeat_at": now - 50, "released_at": now - 50, "stop_step": 3, "job_id": JOB}
    s3.put_object(Bucket=stack.bucket, Key=lease_key, Body=json.dumps(released).encode())
    forged = {"step": 3, "epoch": 0, "dir": "step-3", "token": FORGED}
    s3.put_object(Bucket=stack.bucket, Key=latest_key, Body=json.dumps(forged).encode())
    (scratch / "checkpoints").mkdir()
    (scratch / "checkpoints" / "latest.json").write_text(json.dumps(forged))

    life = _life(stack, scratch)
    life.identity = life.imds.identity("us-east-1")
    try:
        assert take_role(life, TrainerPaths(scratch)) is Role.HOLDER
    finally:
        life._stop_background()
    taken = stack.read_json(lease_key)
    assert taken is not None and taken["token"] == 2, "the forged token became the next lease's floor"

    # A lease deleted by hand: the agent's own record of the tokens it wrote is the floor (job-proof: state/).
    s3.delete_object(Bucket=stack.bucket, Key=lease_key)
    record = json.dumps({"token": 5}).encode()
    s3.put_object(Bucket=stack.bucket, Key=f"jobs/{JOB}/state/latest-token.json", Body=record)
    again = _life(stack, scratch)
    again.identity = again.imds.identity("us-east-1")
    try:
        assert take_role(again, TrainerPaths(scratch)) is Role.HOLDER
    finally:
        again._stop_background()
    taken = stack.read_json(lease_key)
    assert taken is not None and taken["token"] == 6


FORGER = r"""
import json, os, sys, time
from pathlib import Path
import boto3
from trainstack_job import Job

job = Job.from_env()
local = Path(os.environ["TRAINSTACK_CHECKPOINT_DIR"]) / "latest.json"

def confirmed(step):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            value = json.loads(local.read_text())
        except (OSError, ValueError):
            value = {}
        # The agent writes its own latest.json, with its token, once S3 has the step.
        if value.get("step") == step and isinstance(value.get("token"), int) and value["token"] < 2**62:
            return True
        time.sleep(0.05)
    return False

with job.save_checkpoint(1) as directory:
    (directory / "state.json").write_text("{}")
assert confirmed(1), "step 1 never confirmed"
forged = {"step": 1, "epoch": 0, "dir": "step-1", "token": 2**62}
local.write_text(json.dumps(forged))
wrote = "denied"
try:
    bucket, key = sys.argv[1], sys.argv[2]
    boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=json.dumps(forged).encode())
    wrote = "written"
except Exception as exc:
    wrote = type(exc).__name__
with job.save_checkpoint(2) as directory:
    (directory / "state.json").write_text("{}")
said = {"forged_in_s3": wrote, "step_2_confirmed": confirmed(2)}
(job.output_dir / "result.json").write_text(json.dumps(said))
"""


def test_a_job_that_forges_a_token_keeps_training_and_completes(
    stack: LocalStack, imds: ImdsSimulator, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end: a job that writes 2^62 into its latest.json, locally and in S3 (moto does not enforce the
    session's deny, so here its credentials allow it), is not stopped as superseded: it completes, the
    lease's token stays 1 and the job's latest.json carries the agent's token again."""
    monkeypatch.setattr(supervisor, "CREDENTIALS_DIR", scratch / "credentials")
    (scratch / "job").mkdir()
    (scratch / "job" / "forge.py").write_text(FORGER)
    latest_key = f"jobs/{JOB}/checkpoints/latest.json"
    spec = {
        "name": "forger",
        "command": [sys.executable, "forge.py", stack.bucket, latest_key],
        "workdir": "job",
        "data": {"sync": False},
    }
    # The stack's own job role, the one its instance role may take (the session's IAM check holds it to that).
    role = f"arn:aws:iam::123456789012:role/{stack.name}-job"
    life = _life(stack, scratch, user_job=spec, job_role_arn=role)
    lines: list[dict[str, Any]] = []
    life.log.add_sink(lambda line: lines.append(json.loads(line)))
    result = life.run()
    stops = [e for e in lines if e["stage"] == "stop"]
    assert result.outcome == "completed", stops
    assert not [e for e in lines if e.get("reason") == "lease_lost"], "the holder stopped as superseded"
    said = stack.read_json(f"jobs/{JOB}/results/result.json")
    assert said == {"forged_in_s3": "written", "step_2_confirmed": True}
    lease = stack.read_json(f"jobs/{JOB}/state/lease.json")
    assert lease is not None and lease["token"] == 1
    final = stack.read_json(latest_key)
    assert final is not None and (final["step"], final["token"]) == (2, 1)
    # The agent's own record of the token it wrote: the next lease's floor, where the job cannot write.
    record = stack.read_json(f"jobs/{JOB}/state/latest-token.json")
    assert record is not None and record["token"] == 1


# --- the job's own credentials cannot write latest.json -----------------------------------------------------


def test_the_jobs_session_cannot_write_its_checkpoint_pointer_but_still_its_checkpoints() -> None:
    """What AWS grants the job is the intersection of its role's policy and the session policy the agent
    passes: the session denies `latest.json` whatever the role allows (the role should deny it too: see
    SECURITY.md, "The job on the instance")."""
    bucket_arn = "arn:aws:s3:::b-data"
    role = job_role_policy(
        bucket_arn=bucket_arn,
        key_arn="arn:aws:kms:us-east-1:123456789012:key/k",
        region="us-east-1",
        log_group_arn="arn:aws:logs:us-east-1:123456789012:log-group:/l",
    )
    session = job_session_policy(
        role_arn=ROLE, bucket="b-data", job_id=JOB, region="us-east-1", log_group="/l", log_stream=None
    )

    def allowed(action: str, key: str) -> bool:
        request = Request(action, f"{bucket_arn}/{key}")
        by_role = decide(request, Caller("job", ROLE, "123456789012", [role]), None, key_policy=False)
        by_session = decide(request, Caller("job", ROLE, "123456789012", [session]), None, key_policy=False)
        return by_role.allowed and by_session.allowed

    for action in ("s3:PutObject", "s3:DeleteObject"):
        assert not allowed(action, f"jobs/{JOB}/checkpoints/latest.json"), action
        assert allowed(action, f"jobs/{JOB}/checkpoints/step-10/model.pt"), action
    assert allowed("s3:GetObject", f"jobs/{JOB}/checkpoints/latest.json"), "the job still reads it"
    assert not allowed("s3:PutObject", f"jobs/{JOB}/state/latest-token.json"), "nor the agent's token record"

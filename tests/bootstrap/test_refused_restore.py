"""A checkpoint S3 refuses to hand over at restore, under the real agent's lives (bootstrap/persist.py:
CheckpointRefusedError): the life fails naming the object and the fix, it never starts the job over at step 0
nor moves `latest.json` back, the next life tries again, and a refusal that persists ends in the crash-loop
guard (the group scaled to zero, one notification), never in a bill for a crash loop.

S3's refusal is injected at the agent's own S3 client: its GETs and HEADs of the checkpoint's step objects
are answered 403 AccessDenied, as AWS answers a role without s3:GetObject on them or a KMS key the role cannot
decrypt with; botocore parses that answer and raises as for a real one. `latest.json`, the ledger, the lease
and the dataset stay readable. Each life builds its own clients, so the next life sees a healthy S3.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
from botocore.awsrequest import AWSPreparedRequest, AWSResponse, HTTPHeaders

from bootstrap.eventlog import EventLog
from bootstrap.lifecycle import InstanceLife, LifeResult
from bootstrap.persist import CheckpointPersister
from demo.imds import ImdsSimulator
from demo.stack import LocalStack
from tests.checkpoints import commit_step

MakeLife = Callable[..., InstanceLife]

ACCESS_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code><Message>Access Denied'
    b"</Message><RequestId>REFUSED0TEST0001</RequestId></Error>"
)


class _Body:
    """The raw body botocore reads an answer from (`AWSResponse.raw.stream()`)."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self._data


class RefusedCheckpoint:
    """The life's S3 client refuses every read of an object under `checkpoints/step-` (AccessDenied)."""

    def __init__(self, life: InstanceLife) -> None:
        self.refused: list[str] = []
        self._lock = threading.Lock()
        self._prefix = f"/{life.config.bucket}/{life.config.prefixes.checkpoints}step-"
        life.clients.s3.meta.events.register("before-send.s3", self._answer)

    def _answer(self, request: AWSPreparedRequest, **_: Any) -> AWSResponse | None:
        path = unquote(urlsplit(request.url).path)
        if request.method not in ("GET", "HEAD") or not path.startswith(self._prefix):
            return None
        with self._lock:
            self.refused.append(path.removeprefix("/"))
        # A HEAD answer has no body: botocore then names the error by its status, as it does on AWS.
        body = ACCESS_DENIED if request.method == "GET" else b""
        headers = HTTPHeaders()
        headers["Content-Type"] = "application/xml"
        headers["x-amz-request-id"] = "REFUSED0TEST0001"
        return AWSResponse(request.url, 403, headers, _Body(body))


class Events:
    """The agent's events of one life, parsed."""

    def __init__(self, life: InstanceLife) -> None:
        self.records: list[dict[str, Any]] = []
        life.log.add_sink(lambda line: self.records.append(json.loads(line)))

    def messages(self) -> list[str]:
        return [record["message"] for record in self.records]

    def one(self, message: str) -> dict[str, Any]:
        found = [record for record in self.records if record["message"] == message]
        assert len(found) == 1, f"{message!r} said {len(found)} times: {self.messages()}"
        return found[0]


def refusal(stack: LocalStack, step: int) -> str:
    """The one line a life fails with when S3 refuses the checkpoint at `step`, the newest one."""
    return (
        f"s3://{stack.bucket}/checkpoints/step-{step}/manifest.json: S3 refused to "
        f"read it (AccessDenied) and no older checkpoint is left: not starting the job over without its step "
        f"{step}; grant the identity reading it (on an instance, the instance role) s3:GetObject on it and "
        "kms:Decrypt on its key"
    )


def checkpoint_objects(stack: LocalStack) -> list[tuple[str, str]]:
    """Every version of every object under checkpoints/: a write of any kind adds one."""
    listing = stack.client("s3").list_object_versions(Bucket=stack.bucket, Prefix="checkpoints/")
    return sorted((v["Key"], v["VersionId"]) for v in listing.get("Versions", []))


def latest_history(stack: LocalStack) -> list[int]:
    """Every step `checkpoints/latest.json` ever named, oldest first (the bucket is versioned)."""
    s3 = stack.client("s3")
    listing = s3.list_object_versions(Bucket=stack.bucket, Prefix="checkpoints/latest.json")
    steps = []
    # S3 lists a key's versions newest first; LastModified has whole seconds, too coarse to sort by.
    for version in reversed(listing.get("Versions", [])):
        body = s3.get_object(Bucket=stack.bucket, Key=version["Key"], VersionId=version["VersionId"])["Body"]
        steps.append(int(json.loads(body.read())["step"]))
    return steps


def progress_step(life: InstanceLife) -> int:
    progress = Path(str(life.config.scratch_dir)) / "output" / "progress.json"
    try:
        return int(json.loads(progress.read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def fails_on_the_refusal(life: InstanceLife, stack: LocalStack, step: int) -> tuple[LifeResult, Events]:
    """Runs one life whose S3 refuses the checkpoint and checks the promise for it: it fails (or gives the
    job up, once the guard trips) naming the object and the fix, no trainer ever started, nothing written
    under checkpoints/."""
    refused = RefusedCheckpoint(life)
    events = Events(life)
    written = checkpoint_objects(stack)
    result = life.run()
    assert result.outcome in ("failed", "gave_up"), f"a refused restore ended {result.outcome}"
    assert refused.refused, "S3 was never asked for the checkpoint: the refusal proves nothing"
    assert events.one("instance life failed")["error"] == refusal(stack, step)
    assert "trainer starting" not in events.messages(), "the job started over without its checkpoint"
    assert progress_step(life) == 0, "the trainer trained in a life that could not restore"
    assert not any(Path(str(life.config.scratch_dir), "checkpoints").glob("step-*")), "half a restore left"
    assert checkpoint_objects(stack) == written, "a life that could not restore wrote a checkpoint"
    assert stack.read_json("checkpoints/latest.json")["step"] == step  # type: ignore[index]
    return result, events


def test_a_refused_restore_fails_the_life_and_the_next_life_resumes_the_confirmed_step(
    make_life: MakeLife, stack: LocalStack, imds: ImdsSimulator
) -> None:
    # Every third step a checkpoint: latest.json has a history to keep moving forward, in lives 1 and 3.
    fake = {"steps": 10**9, "step_seconds": 0.02, "checkpoint_every": 3}
    first = make_life(fake=fake)
    running = ThreadPoolExecutor(max_workers=1).submit(first.run)
    wait_until(lambda: progress_step(first) >= 7, 60, "life 1 to train")
    imds.inject_spot_notice()
    assert running.result(timeout=60).outcome == "preempted"
    latest = stack.read_json("checkpoints/latest.json")
    assert latest is not None and latest["step"] >= 7
    confirmed = int(latest["step"])
    imds.clear_events()

    # Life 2, a fresh scratch disk: S3 refuses the checkpoint. Its steps end, so a life that started over
    # would complete in a second (and fail the test) instead of training forever.
    short = {**fake, "steps": confirmed + 3}
    second = make_life(fake=short)
    result, events = fails_on_the_refusal(second, stack, confirmed)
    assert (result.outcome, result.exit_code) == ("failed", 1), "systemd starts the next life"
    said = events.one("life failed; systemd starts the next life")
    assert (said["reason"], said["consecutive_failures"]) == (refusal(stack, confirmed), 1)
    ledger = stack.read_json("state/ledger.json")
    assert ledger is not None and ledger["status"] == "running" and ledger["consecutive_failures"] == 1
    assert [life["outcome"] for life in ledger["lives"]] == ["preempted", "failed"]
    assert stack.group()["DesiredCapacity"] == 1, "one refusal is retried: the job is not given up"
    assert stack.alerts() == [], "no notification for a life the next one retries"

    # Life 3: S3 hands the checkpoint over again.
    third = make_life(fake=short)
    events = Events(third)
    assert third.run().outcome == "completed"
    assert events.one("restored checkpoint from S3")["step"] == confirmed
    assert events.one("trainer starting")["restored_step"] == confirmed
    ledger = stack.read_json("state/ledger.json")
    assert ledger is not None and ledger["status"] == "completed" and ledger["consecutive_failures"] == 0
    assert [life["outcome"] for life in ledger["lives"]] == ["preempted", "failed", "completed"]
    history = latest_history(stack)
    assert history == sorted(history) and history[-1] > confirmed, f"latest.json moved back: {history}"
    (alert,) = stack.alerts()
    assert "training completed" in alert["Subject"]


@pytest.fixture()
def confirmed_step_7(stack: LocalStack, tmp_path: Path) -> int:
    """A job with checkpoint step 7 confirmed in S3, uploaded by the persister an agent uses."""
    local = tmp_path / "earlier-life"
    commit_step(local, 7)
    writer = CheckpointPersister(stack.client("s3"), stack.bucket, "checkpoints", local, EventLog())
    assert writer.persist_newest(deadline=time.monotonic() + 30) == 7
    writer.close()
    return 7


def test_a_refusal_that_persists_ends_in_the_crash_loop_guard_scaled_to_zero_with_one_notification(
    make_life: MakeLife, stack: LocalStack, confirmed_step_7: int
) -> None:
    results = [
        fails_on_the_refusal(make_life(max_consecutive_failures=3), stack, confirmed_step_7)[0]
        for _ in range(3)
    ]
    assert [(r.outcome, r.exit_code) for r in results] == [("failed", 1), ("failed", 1), ("gave_up", 0)]
    ledger = stack.read_json("state/ledger.json")
    assert ledger is not None and ledger["status"] == "failed" and ledger["consecutive_failures"] == 3
    assert [life["outcome"] for life in ledger["lives"]] == ["failed"] * 3
    assert stack.group()["DesiredCapacity"] == 0, "a refusal that persists must not keep the group billing"
    (alert,) = stack.alerts()
    assert "failed 3 times in a row; group scaled to zero" in alert["Subject"]
    assert f"Last failure on {ledger['lives'][-1]['instance_id']}: {refusal(stack, 7)}" in alert["Message"]


def test_a_manifest_naming_a_file_outside_its_step_fails_the_life_and_root_writes_nothing_there(
    make_life: MakeLife, stack: LocalStack, confirmed_step_7: int, tmp_path: Path
) -> None:
    """The job writes its own S3 prefix: a manifest naming `/etc/ld.so.preload` (here a stand-in) would have
    the agent, root, write that file at restore. The step is refused like one S3 refuses: the life fails
    naming the manifest and the fix, nothing is written there, and the job is never said to be restored."""
    preload = tmp_path / "etc" / "ld.so.preload"
    preload.parent.mkdir()
    preload.write_bytes(b"root's own\n")
    planted = b"/tmp/job-owned.so\n"
    s3 = stack.client("s3")
    key = f"checkpoints/step-{confirmed_step_7}/manifest.json"
    manifest = json.loads(s3.get_object(Bucket=stack.bucket, Key=key)["Body"].read())
    manifest["files"][str(preload)] = {"sha256": hashlib.sha256(planted).hexdigest(), "size": len(planted)}
    s3.put_object(Bucket=stack.bucket, Key=f"checkpoints/step-7/{preload}", Body=planted)
    s3.put_object(Bucket=stack.bucket, Key=key, Body=json.dumps(manifest).encode())
    life = make_life()
    events = Events(life)
    result = life.run()
    assert preload.read_bytes() == b"root's own\n", "the restore wrote outside the checkpoint folder"
    assert (result.outcome, result.exit_code) == ("failed", 1)
    folder = f"s3://{stack.bucket}/checkpoints/step-7/"
    assert events.one("instance life failed")["error"] == (
        f"{folder}manifest.json: names {str(preload)!r} (an absolute path), outside the step's folder, so it "
        "is never restored, and no older checkpoint is left: not starting the job over without its step 7; "
        f"delete the step (aws s3 rm --recursive {folder}) to resume from an older checkpoint or start "
        "over, and fix what wrote that manifest (its names are relative to the step's folder)"
    )
    assert "restored checkpoint from S3" not in events.messages()
    assert "trainer starting" not in events.messages(), "the job started over without its checkpoint"
    assert stack.read_json("checkpoints/latest.json")["step"] == 7  # type: ignore[index]

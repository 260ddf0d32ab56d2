"""Checkpoint persistence (bootstrap/persist.py) against the moto server. Restore picks the newest
checkpoint that verifies and never one above `latest.json`; S3's conflict answers are retried, any other
error is not; old steps are pruned down to `keep`; what `finish` reports is what S3 holds; every journal
line is well formed. The lease's fencing of these writes: test_fencing.py."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import boto3
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

import bootstrap.persist as persist_module
from bootstrap.checkpoint_store import close_when_done
from bootstrap.lease import LeaseLostError
from bootstrap.persist import (
    CheckpointPersister,
    CheckpointRefusedError,
    PersistResult,
    UploadAbandonedError,
    bounded,
)
from tests import checkpoints
from tests.conftest import MotoServer

BUCKET = "trainstack-persist"
PREFIX = "jobs/demo-1a2b3c4d/checkpoints"
LATEST_KEY = f"{PREFIX}/latest.json"


# The persister's journal lines an operator filters on (`.level == "warning"`): what went wrong or was
# skipped. Every other line is informational and carries no level.
WARNINGS = ("failed", "skipping", "NOT confirmed", "not confirmed", "unreadable", "lease lost")
# What each line must name for an operator to act on it (which step, where, why), never left empty.
NAMES = {
    "restored checkpoint from S3": ("step", "uri"),
    "using the checkpoint already on this instance": ("step",),
    "skipping a damaged local checkpoint": ("step", "why"),
    "skipping an S3 checkpoint without a manifest": ("step",),
    "skipping an S3 checkpoint that fails verification": ("step", "why"),
    "skipping an S3 checkpoint that cannot be read": ("step", "error"),
    "S3 latest.json is unreadable": ("uri",),
    "checkpoint confirmed in S3": ("step", "upload_s"),
    "lease lost to": ("uri", "token"),
    "on_lease_lost failed": ("error",),
    "checkpoint upload failed": ("uri", "error"),
    "newest checkpoint NOT confirmed": ("newest_local_step", "error"),
    "pruning old S3 checkpoints failed": ("error",),
    "S3 uploads work again": ("confirmed_step",),
}


class Events:
    """The persister's event sink, kept for assertions; each line is checked as the journal shows it: stage
    `checkpoint`, level `warning` exactly on the warnings, and the names each line must carry."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict[str, Any]]] = []
        SINKS.append(self)

    def event(self, stage: str, message: str, **fields: Any) -> None:
        self.records.append((stage, message, fields))

    def malformed(self) -> list[tuple[str, str, dict[str, Any]]]:
        """Lines that break the journal's shape (checked after the test: the persister's threads catch
        whatever a sink raises)."""
        bad = []
        for stage, message, fields in self.records:
            warning = any(word in message for word in WARNINGS)
            names = [n for start, ns in NAMES.items() if message.startswith(start) for n in ns]
            if (
                stage != "checkpoint"
                or fields.get("level") != ("warning" if warning else None)
                or any(fields.get(name) in (None, "None") for name in names)
            ):
                bad.append((stage, message, fields))
        return bad

    def messages(self, starting: str) -> list[str]:
        """The lines that start with this text, as an operator reads and greps them."""
        return [message for _, message, _ in self.records if message.startswith(starting)]


SINKS: list[Events] = []


@pytest.fixture(autouse=True)
def journal_lines_are_well_formed() -> Iterator[None]:
    SINKS.clear()
    yield
    assert [line for sink in SINKS for line in sink.malformed()] == []


@pytest.fixture()
def s3(aws: MotoServer) -> Any:
    client = boto3.client("s3", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    return client


def commit_step(root: Path, step: int, size: int = 1000) -> bytes:
    """A committed checkpoint as any job writes it, at epoch 1; returns its data."""
    return checkpoints.commit_step(root, step, size, epoch=1)


def persister(s3: Any, root: Path, events: Events | None = None, keep: int = 3) -> CheckpointPersister:
    root.mkdir(parents=True, exist_ok=True)
    return CheckpointPersister(s3, BUCKET, PREFIX, root, events or Events(), keep=keep, poll_seconds=0.05)


def soon() -> float:
    return time.monotonic() + 20


def upload(s3: Any, root: Path, *steps: int) -> dict[int, bytes]:
    """Steps confirmed in S3 one after the other, as one life would; returns each step's data."""
    owner = persister(s3, root)
    data = {}
    for step in steps:
        data[step] = commit_step(root, step)
        assert owner.persist_newest(soon()) == step
    return data


def remote_steps(s3: Any) -> set[int]:
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}/").get("Contents", [])]
    return {int(k[len(PREFIX) + 1 :].split("/")[0].removeprefix("step-")) for k in keys if "/step-" in k}


# -- restore -------------------------------------------------------------------------------------------


def test_restore_brings_back_the_newest_confirmed_step_with_its_bytes_and_latest(
    s3: Any, tmp_path: Path
) -> None:
    data = upload(s3, tmp_path / "first", 2, 4)
    fresh = tmp_path / "replacement"
    events = Events()
    replacement = persister(s3, fresh, events)
    assert replacement.restore() == 4
    assert (fresh / "step-4" / "state.bin").read_bytes() == data[4]
    assert json.loads((fresh / "latest.json").read_text())["step"] == 4
    assert replacement.confirmed_step == 4
    assert replacement.finish(soon()).confirmed, "a restored step is already in S3"
    assert events.messages("restored checkpoint from S3")
    assert not list(fresh.glob(".step-*")), "no staging directory is left behind"


def test_a_fresh_job_restores_nothing(s3: Any, tmp_path: Path) -> None:
    fresh = persister(s3, tmp_path / "fresh")
    assert fresh.restore() is None
    assert fresh.confirmed_step is None
    assert fresh.finish(soon()) == PersistResult(None, None)


def test_restore_never_uses_a_step_above_latest_a_partial_upload(s3: Any, tmp_path: Path) -> None:
    upload(s3, tmp_path / "first", 3)
    # A later step whose files and manifest landed, but latest.json was never moved to it.
    s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/step-9/state.bin", Body=b"x")
    manifest = {"step": 9, "epoch": 1, "files": {"state.bin": {"sha256": hashlib.sha256(b"x").hexdigest()}}}
    s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/step-9/manifest.json", Body=json.dumps(manifest))
    assert persister(s3, tmp_path / "replacement").restore() == 3


def test_a_damaged_s3_checkpoint_is_skipped_for_the_older_one_that_verifies(s3: Any, tmp_path: Path) -> None:
    data = upload(s3, tmp_path / "first", 2, 5)
    s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/step-5/state.bin", Body=b"bit rot")
    events = Events()
    replacement = persister(s3, tmp_path / "replacement", events)
    assert replacement.restore() == 2
    assert (tmp_path / "replacement" / "step-2" / "state.bin").read_bytes() == data[2]
    assert not (tmp_path / "replacement" / "step-5").exists()
    (why,) = [
        f["why"] for _, m, f in events.records if m == "skipping an S3 checkpoint that fails verification"
    ]
    # The line names the folder as the operator finds it on disk, never the agent's /proc descriptor path.
    staging = str(tmp_path / "replacement" / ".step-5.download-")
    assert staging in why and "/proc/" not in why and "state.bin" in why, why


def test_an_s3_step_without_a_manifest_is_skipped(s3: Any, tmp_path: Path) -> None:
    upload(s3, tmp_path / "first", 2, 5)
    s3.delete_object(Bucket=BUCKET, Key=f"{PREFIX}/step-5/manifest.json")
    events = Events()
    assert persister(s3, tmp_path / "replacement", events).restore() == 2
    assert events.messages("skipping an S3 checkpoint without a manifest")


def test_an_unreadable_latest_counts_as_absent_and_the_next_write_replaces_it(
    s3: Any, tmp_path: Path
) -> None:
    upload(s3, tmp_path / "first", 2)
    s3.put_object(Bucket=BUCKET, Key=LATEST_KEY, Body=b"{not json")
    events = Events()
    owner = persister(s3, tmp_path / "replacement", events)
    assert owner.read_latest()[0] is None and owner.read_latest()[1] is not None
    assert events.messages("S3 latest.json is unreadable; it will be replaced")
    commit_step(tmp_path / "replacement", 7)
    assert owner.persist_newest(soon()) == 7
    assert json.loads(s3.get_object(Bucket=BUCKET, Key=LATEST_KEY)["Body"].read())["step"] == 7


def test_a_local_checkpoint_at_least_as_new_wins_and_a_damaged_one_does_not(s3: Any, tmp_path: Path) -> None:
    upload(s3, tmp_path / "first", 3)
    local = tmp_path / "same-instance"
    local.mkdir()
    commit_step(local, 4)  # this instance's earlier life saved step 4; S3 never got it
    (local / ".step-5.tmp").mkdir()  # and was killed while writing step 5
    owner = persister(s3, local)
    assert owner.restore() == 4
    assert not (local / ".step-5.tmp").exists(), "a half-written step is cleared away"
    assert not (local / "step-3").exists(), "S3's older step is not downloaded over it"
    assert owner.finish(soon()).confirmed_step == 4, "the local step goes up before the replacement uses it"

    damaged = tmp_path / "damaged"
    damaged.mkdir()
    commit_step(damaged, 8)
    (damaged / "step-8" / "state.bin").write_bytes(b"truncated")
    events = Events()
    assert persister(s3, damaged, events).restore() == 4
    assert events.messages("skipping a damaged local checkpoint")


@pytest.mark.parametrize("asked", [1, 2], ids=["before-the-download", "between-files"])
def test_a_restore_asked_to_stop_stops(s3: Any, tmp_path: Path, asked: int) -> None:
    """A stop (spot notice) during the restore ends it at once, leaving nothing half-restored."""
    upload(s3, tmp_path / "first", 3)
    calls: list[int] = []

    def should_abort() -> bool:
        calls.append(1)
        return len(calls) >= asked

    replacement = tmp_path / "replacement"
    with pytest.raises(UploadAbandonedError, match=r"^restore interrupted$"):
        persister(s3, replacement).restore(should_abort=should_abort)
    assert sorted(p.name for p in replacement.iterdir()) == [], "no step, no staging, no latest.json"


# -- conditional writes --------------------------------------------------------------------------------


class ConflictOnce:
    """S3 answering the first put of latest.json with `response` (a racing writer), then normally."""

    def __init__(self, client: Any, response: dict[str, Any]) -> None:
        self._client = client
        self._response = response
        self.refused = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def put_object(self, **kwargs: Any) -> Any:
        if kwargs["Key"] == LATEST_KEY and not self.refused:
            self.refused += 1
            raise ClientError(self._response, "PutObject")  # type: ignore[arg-type]
        return self._client.put_object(**kwargs)


@pytest.mark.parametrize(
    "response",
    [
        {"Error": {"Code": "PreconditionFailed"}, "ResponseMetadata": {"HTTPStatusCode": 412}},
        {"Error": {"Code": "ConditionalRequestConflict"}, "ResponseMetadata": {"HTTPStatusCode": 409}},
        {"Error": {"Code": "PreconditionFailed"}},  # the code alone
        {"Error": {}, "ResponseMetadata": {"HTTPStatusCode": 412}},  # the status alone
        {"Error": {}, "ResponseMetadata": {"HTTPStatusCode": 409}},
        {"Error": {"Code": "ConditionalRequestConflict"}},
        {"ResponseMetadata": {"HTTPStatusCode": 412}},  # no error body at all
    ],
    ids=["412", "409", "code-only", "412-only", "409-only", "conflict-code-only", "no-error-body"],
)
def test_a_conflicting_write_of_latest_is_read_again_and_retried(
    s3: Any, tmp_path: Path, response: dict[str, Any]
) -> None:
    racing = ConflictOnce(s3, response)
    owner = persister(racing, tmp_path / "a")
    commit_step(tmp_path / "a", 3)
    assert owner.persist_newest(soon()) == 3
    assert racing.refused == 1
    assert json.loads(s3.get_object(Bucket=BUCKET, Key=LATEST_KEY)["Body"].read())["step"] == 3


def test_any_other_error_writing_latest_is_not_taken_for_a_conflict(s3: Any, tmp_path: Path) -> None:
    denied = {"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}
    owner = persister(ConflictOnce(s3, denied), tmp_path / "a")
    commit_step(tmp_path / "a", 3)
    with pytest.raises(ClientError):
        owner.persist_newest(soon())
    assert owner.confirmed_step is None


def test_a_missing_bucket_is_an_error_not_a_fresh_job(s3: Any, tmp_path: Path) -> None:
    owner = CheckpointPersister(s3, "no-such-bucket", PREFIX, tmp_path / "a", Events())
    with pytest.raises(ClientError):
        owner.restore()


# -- pruning and the end -------------------------------------------------------------------------------


def test_background_uploads_keep_only_the_newest_steps_in_s3(s3: Any, tmp_path: Path) -> None:
    local = tmp_path / "a"
    owner = persister(s3, local, keep=2)
    owner.start()
    for step in (1, 2, 3, 4):
        commit_step(local, step)
        deadline = time.monotonic() + 20
        while owner.confirmed_step != step:
            assert time.monotonic() < deadline, f"step {step} not confirmed"
            time.sleep(0.02)
    result = owner.finish(soon())
    owner.close()
    assert result.confirmed and result.confirmed_step == 4
    assert remote_steps(s3) == {3, 4}
    assert persister(s3, tmp_path / "replacement").restore() == 4


def test_finish_reports_a_step_only_local_as_not_confirmed(s3: Any, tmp_path: Path) -> None:
    local = tmp_path / "a"
    owner = persister(s3, local)
    commit_step(local, 3)
    assert owner.persist_newest(soon()) == 3
    commit_step(local, 4)
    events = Events()
    late = CheckpointPersister(s3, BUCKET, PREFIX, local, events)
    late.restore()
    result = late.finish(time.monotonic() - 1)  # the deadline has passed: no time to upload
    assert (result.newest_local_step, result.confirmed_step, result.confirmed) == (4, 3, False)
    said = [f for _, m, f in events.records if m.startswith("newest checkpoint NOT confirmed in S3")]
    assert len(said) == 1 and said[0]["error"] == "", "nothing was tried: no error to report"
    assert (said[0]["newest_local_step"], said[0]["confirmed_step"]) == (4, 3), "the replacement resumes at 3"


@pytest.mark.parametrize(
    ("result", "confirmed"),
    [
        (PersistResult(None, None), True),
        (PersistResult(5, 5), True),
        (PersistResult(5, 7), True),
        (PersistResult(5, 4), False),
        (PersistResult(5, None), False),
        (PersistResult(5, 5, lease_lost=True), False),
        (PersistResult(None, None, lease_lost=True), False),
    ],
)
def test_confirmed_means_nothing_saved_is_missing_from_s3(result: PersistResult, confirmed: bool) -> None:
    assert result.confirmed is confirmed


def test_a_failing_lease_lost_callback_does_not_undo_the_stop_of_writes(s3: Any, tmp_path: Path) -> None:
    class Lost:
        token = 1

        def check(self) -> None:
            raise LeaseLostError("i-b", 2)

    def callback(error: LeaseLostError) -> None:
        raise RuntimeError("the caller's reaction failed: " + "x" * 300)

    events = Events()
    owner = CheckpointPersister(
        s3, BUCKET, PREFIX, tmp_path / "a", events, fence=Lost(), on_lease_lost=callback
    )
    commit_step(tmp_path / "a", 3)
    with pytest.raises(LeaseLostError):
        owner.persist_newest(soon())
    assert owner.lease_lost is not None and remote_steps(s3) == set()
    said = [f["error"] for _, m, f in events.records if m == "on_lease_lost failed"]
    # A journal line stays readable: the error is cut at 200 characters.
    assert said == [("the caller's reaction failed: " + "x" * 300)[:200]]
    assert owner.finish(soon()).lease_lost


def test_the_lease_lost_event_is_a_checkpoint_warning_naming_the_uri_and_the_losing_token(
    s3: Any, tmp_path: Path
) -> None:
    """What an operator reads in the journal: a warning of the checkpoint stage, with where and who."""

    class Lost:
        token = 4

        def check(self) -> None:
            raise LeaseLostError("i-b", 5, "s3://bucket/jobs/x/state/lease.json")

    events = Events()
    owner = CheckpointPersister(s3, BUCKET, PREFIX, tmp_path / "a", events, fence=Lost())
    commit_step(tmp_path / "a", 3)
    with pytest.raises(LeaseLostError):
        owner.persist_newest(soon())
    lost = [(stage, fields) for stage, message, fields in events.records if "lease lost" in message]
    assert lost == [
        ("checkpoint", {"level": "warning", "uri": "s3://bucket/jobs/x/state/lease.json", "token": 4})
    ]


def dropped() -> NoReturn:
    """How a blackholed request ends once its test releases it: its connection is reset, and it never
    reaches S3. A released request that went through landed in the next test's bucket of the same name
    (moto is reset between tests, the abandoned thread is not)."""
    raise EndpointConnectionError(endpoint_url="https://s3.us-east-1.amazonaws.com")


class Hung:
    """An S3 whose reads never answer (a blackholed endpoint)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def get_object(self, **kwargs: Any) -> Any:
        self.release.wait(30)
        dropped()


def test_reading_latest_gives_up_at_the_callers_deadline(s3: Any, tmp_path: Path) -> None:
    hung = Hung(s3)
    owner = persister(hung, tmp_path / "a")
    try:
        started = time.monotonic()
        with pytest.raises(UploadAbandonedError):
            owner.latest_token(time.monotonic() + 0.2)
        with pytest.raises(UploadAbandonedError):
            owner.read_latest(time.monotonic() + 0.2)
        # Bounded by the deadline, not by S3: generous for a loaded 2-core machine, far below the hang.
        assert time.monotonic() - started < 15
    finally:
        hung.release.set()


def test_a_checkpoint_with_files_in_subfolders_goes_up_and_comes_back_whole(s3: Any, tmp_path: Path) -> None:
    """Frameworks save sharded checkpoints as folders (`model/shard-0.bin`): restored byte for byte."""
    local = tmp_path / "first"
    staging = local / ".step-6.tmp"
    files = {"model/shard-0.bin": os.urandom(300), "optim/deep/state.bin": os.urandom(200)}
    for name, data in files.items():
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        (staging / name).write_bytes(data)
    listed = {n: {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d)} for n, d in files.items()}
    (staging / "manifest.json").write_text(json.dumps({"step": 6, "epoch": 2, "files": listed}))
    staging.rename(local / "step-6")
    assert persister(s3, local).persist_newest(soon()) == 6
    fresh = tmp_path / "replacement"
    assert persister(s3, fresh).restore() == 6
    for name, data in files.items():
        assert (fresh / "step-6" / name).read_bytes() == data


def test_restore_creates_the_scratch_folder_and_survives_leftovers_it_cannot_remove(
    s3: Any, tmp_path: Path
) -> None:
    upload(s3, tmp_path / "first", 3)
    scratch = tmp_path / "nvme" / "job" / "checkpoints"  # a fresh instance: nothing there yet
    events = Events()
    assert CheckpointPersister(s3, BUCKET, PREFIX, scratch, events).restore() == 3
    (scratch / ".step-4.tmp").write_bytes(b"a file where a folder was expected")
    assert CheckpointPersister(s3, BUCKET, PREFIX, scratch, events).restore() == 3


def test_a_local_step_equal_to_s3s_is_used_as_it_is_not_downloaded_again(s3: Any, tmp_path: Path) -> None:
    local = tmp_path / "same-instance"
    upload(s3, local, 3)
    marker = local / "step-3" / "state.bin"
    before = marker.stat().st_mtime_ns
    events = Events()
    counting = CountingWrites(s3)
    owner = persister(counting, local, events)
    assert owner.restore() == 3
    assert marker.stat().st_mtime_ns == before, "the local copy was replaced by a download"
    assert events.messages("using the checkpoint already on this instance")
    assert not events.messages("restored checkpoint from S3")
    # S3 already holds it (latest.json names it): confirmed as it is, the final flush uploads nothing.
    assert owner.confirmed_step == 3
    assert owner.finish(soon()).confirmed and counting.writes == []


class CountingWrites:
    """S3, recording the key of every object written."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.writes: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def put_object(self, **kwargs: Any) -> Any:
        self.writes.append(kwargs["Key"])
        return self._client.put_object(**kwargs)


def test_with_latest_json_unreadable_restore_takes_the_newest_step_that_verifies(
    s3: Any, tmp_path: Path
) -> None:
    """An unreadable latest.json counts as absent: every step in S3 is a candidate, newest first, and the
    one restored is confirmed (S3 holds it, verified)."""
    data = upload(s3, tmp_path / "first", 2, 5)
    s3.put_object(Bucket=BUCKET, Key=LATEST_KEY, Body=b"\x00 torn")
    fresh = tmp_path / "replacement"
    owner = persister(s3, fresh)
    assert owner.restore() == 5
    assert (fresh / "step-5" / "state.bin").read_bytes() == data[5]
    assert owner.confirmed_step == 5


@pytest.mark.parametrize("manifest", [b"[1, 2]", b'{"files": ["state.bin"]}', b"{not json"])
def test_an_s3_manifest_that_is_not_a_manifest_is_skipped_for_the_older_step(
    s3: Any, tmp_path: Path, manifest: bytes
) -> None:
    data = upload(s3, tmp_path / "first", 2, 5)
    s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/step-5/manifest.json", Body=manifest)
    events = Events()
    replacement = persister(s3, tmp_path / "replacement", events)
    assert replacement.restore() == 2
    assert (tmp_path / "replacement" / "step-2" / "state.bin").read_bytes() == data[2]
    assert events.messages("skipping an S3 checkpoint without a manifest")


class Unavailable:
    """S3 refusing the first `failures` writes (an outage), then answering."""

    def __init__(self, client: Any, failures: int) -> None:
        self._client = client
        self.failures = failures

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def put_object(self, **kwargs: Any) -> Any:
        if self.failures:
            self.failures -= 1
            response: Any = {
                # S3's answers can be long (an HTML page from a proxy): the journal keeps 200 characters.
                "Error": {"Code": "ServiceUnavailable", "Message": "Please reduce your request rate. " * 10},
                "ResponseMetadata": {"HTTPStatusCode": 503},
            }
            raise ClientError(response, "PutObject")
        return self._client.put_object(**kwargs)


def test_background_uploads_retry_through_an_outage_and_say_so_once(s3: Any, tmp_path: Path) -> None:
    local = tmp_path / "a"
    events = Events()
    owner = persister(Unavailable(s3, failures=2), local, events)
    owner.start()
    commit_step(local, 3)
    deadline = time.monotonic() + 30  # two backoffs (1 s, 2 s) on a loaded 2-core machine
    while owner.confirmed_step != 3:
        assert time.monotonic() < deadline, "the upload was not retried once S3 came back"
        time.sleep(0.05)
    commit_step(local, 4)  # the next upload, with S3 healthy, is no news
    while owner.confirmed_step != 4:
        assert time.monotonic() < deadline, "step 4 not confirmed"
        time.sleep(0.05)
    result = owner.finish(soon())
    owner.close()
    assert result.confirmed
    failed = [
        f for _, m, f in events.records if m == "checkpoint upload failed; retrying (the local copy is kept)"
    ]
    assert len(failed) == 1 and "ServiceUnavailable" in failed[0]["error"] and len(failed[0]["error"]) == 200
    back = [f for _, m, f in events.records if m == "S3 uploads work again"]
    assert back == [{"confirmed_step": 3}], "the recovery is said once, with what S3 now holds"
    assert persister(s3, tmp_path / "replacement").restore() == 4


class NoDeletes:
    """S3 where this role may write but not delete (a tightened bucket policy)."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def delete_objects(self, **kwargs: Any) -> Any:
        response: Any = {
            "Error": {"Code": "AccessDenied", "Message": "denied by the bucket policy " + "y" * 300},
            "ResponseMetadata": {"HTTPStatusCode": 403},
        }
        raise ClientError(response, "DeleteObjects")


def test_pruning_that_fails_is_reported_and_never_costs_a_confirmed_step(s3: Any, tmp_path: Path) -> None:
    local = tmp_path / "a"
    events = Events()
    owner = persister(NoDeletes(s3), local, events, keep=1)
    owner.start()
    for step in (1, 2):
        commit_step(local, step)
        deadline = time.monotonic() + 20
        while owner.confirmed_step != step:
            assert time.monotonic() < deadline, f"step {step} not confirmed"
            time.sleep(0.02)
    assert owner.finish(soon()).confirmed
    owner.close()
    assert remote_steps(s3) == {1, 2}, "nothing deleted"
    failed = [f for _, m, f in events.records if m == "pruning old S3 checkpoints failed"]
    assert failed and "AccessDenied" in failed[0]["error"]
    assert all(len(f["error"]) == 200 for f in failed), "S3's long answer is cut at 200 characters"


def test_s3_checks_every_checkpoint_file_against_its_sha256(s3: Any, tmp_path: Path) -> None:
    """Each file goes up with its SHA-256, which S3 verifies on arrival and keeps: a file damaged on the way
    is refused, not stored (the manifest names the same digest for restore to verify)."""
    data = upload(s3, tmp_path / "a", 5)[5]
    stored = s3.head_object(Bucket=BUCKET, Key=f"{PREFIX}/step-5/state.bin", ChecksumMode="ENABLED")
    digest = hashlib.sha256(data).digest()
    assert stored.get("ChecksumSHA256") == base64.b64encode(digest).decode()
    manifest = s3.head_object(Bucket=BUCKET, Key=f"{PREFIX}/step-5/manifest.json", ChecksumMode="ENABLED")
    body = (tmp_path / "a" / "step-5" / "manifest.json").read_bytes()
    assert manifest.get("ChecksumSHA256") == base64.b64encode(hashlib.sha256(body).digest()).decode()


def test_a_final_flush_s3_keeps_refusing_says_why_and_never_sleeps_past_its_deadline(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flush retries until its deadline (every second of S3 back is worth a try), then reports the
    step as NOT confirmed with S3's answer; its waits between tries end at the deadline, never after it."""
    local = tmp_path / "a"
    commit_step(local, 7)
    events = Events()
    owner = persister(Unavailable(s3, failures=10**6), local, events)
    overshoot: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        if threading.current_thread() is threading.main_thread():
            overshoot.append(time.monotonic() + seconds - deadline)
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    deadline = time.monotonic() + 1.5
    result = owner.finish(deadline)
    assert (result.newest_local_step, result.confirmed) == (7, False)
    said = [f for _, m, f in events.records if m.startswith("newest checkpoint NOT confirmed in S3")]
    assert len(said) == 1 and "ServiceUnavailable" in said[0]["error"] and len(said[0]["error"]) == 200
    # A tick of an upload in flight (0.1 s) at most; a wait between tries ends at the deadline.
    assert overshoot and max(overshoot) <= 0.2, "a wait between tries outlasted the deadline"


def test_a_confirmed_final_flush_says_so_in_the_line_operators_look_for(s3: Any, tmp_path: Path) -> None:
    local = tmp_path / "a"
    commit_step(local, 2)
    events = Events()
    assert persister(s3, local, events).finish(soon()).confirmed
    confirmed = [f for _, m, f in events.records if m == "newest checkpoint confirmed in S3"]
    assert confirmed == [{"step": 2}]


class PassingFence:
    """A lease that still names this persister's token (1), until `hang` makes its check never answer."""

    token = 1

    def __init__(self) -> None:
        self.hang = False
        self.release = threading.Event()

    def check(self) -> None:
        if self.hang:
            self.release.wait(10)
            dropped()


def test_a_lease_check_that_never_answers_gives_up_at_the_deadline_saying_which_call(
    s3: Any, tmp_path: Path
) -> None:
    fence = PassingFence()
    fence.hang = True
    owner = CheckpointPersister(s3, BUCKET, PREFIX, tmp_path / "a", Events(), fence=fence)
    commit_step(tmp_path / "a", 3)
    try:
        with pytest.raises(UploadAbandonedError) as gave_up:
            owner.persist_newest(time.monotonic() + 0.3)
    finally:
        fence.release.set()
    assert str(gave_up.value) == "check-lease: no answer from S3 before the deadline"


class HungManifest:
    """S3 that takes the files but never answers the write of an object named `hangs` (a request blackholed
    mid-upload): by default the manifest."""

    def __init__(self, client: Any, hangs: str = "/manifest.json") -> None:
        self._client = client
        self._hangs = hangs
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def put_object(self, **kwargs: Any) -> Any:
        if kwargs["Key"].endswith(self._hangs):
            self.release.wait(10)
            dropped()
        return self._client.put_object(**kwargs)


def test_a_manifest_write_that_never_answers_gives_up_at_the_deadline(s3: Any, tmp_path: Path) -> None:
    hung = HungManifest(s3)
    owner = persister(hung, tmp_path / "a")
    commit_step(tmp_path / "a", 3)
    try:
        with pytest.raises(
            UploadAbandonedError, match=r"^put-manifest: no answer from S3 before the deadline$"
        ):
            owner.persist_newest(time.monotonic() + 1.5)
    finally:
        hung.release.set()
    assert owner.confirmed_step is None


def test_latest_json_carries_the_steps_epoch(s3: Any, tmp_path: Path) -> None:
    upload(s3, tmp_path / "a", 5)
    latest = json.loads(s3.get_object(Bucket=BUCKET, Key=LATEST_KEY)["Body"].read())
    assert (latest["step"], latest["epoch"], latest["dir"]) == (5, 1, "step-5")
    # Served as JSON to whoever reads it through the console or a presigned URL.
    assert s3.head_object(Bucket=BUCKET, Key=LATEST_KEY)["ContentType"] == "application/json"
    # The local copy says the same (the job and `trainstack` read it on the instance).
    local = json.loads((tmp_path / "a" / "latest.json").read_text())
    assert (local["step"], local["epoch"], local["dir"]) == (5, 1, "step-5")


def test_a_higher_token_in_latest_json_is_the_lease_lost_to_its_writer(s3: Any, tmp_path: Path) -> None:
    """The fence passed, but latest.json already carries a newer holder's token: this holder lost."""
    s3.put_object(
        Bucket=BUCKET, Key=LATEST_KEY, Body=json.dumps({"step": 3, "epoch": 1, "token": 2}).encode()
    )
    events = Events()
    owner = CheckpointPersister(s3, BUCKET, PREFIX, tmp_path / "a", events, fence=PassingFence())
    commit_step(tmp_path / "a", 5)
    with pytest.raises(LeaseLostError) as lost:
        owner.persist_newest(soon())
    uri = f"s3://{BUCKET}/{LATEST_KEY}"
    assert (lost.value.holder, lost.value.token, lost.value.uri) == ("the writer of latest.json", 2, uri)
    said = [fields for _, message, fields in events.records if "lease lost" in message]
    assert said == [{"level": "warning", "uri": uri, "token": 1}]
    assert json.loads(s3.get_object(Bucket=BUCKET, Key=LATEST_KEY)["Body"].read())["token"] == 2


class CountingLatest:
    def __init__(self, client: Any) -> None:
        self._client = client
        self.latest_writes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def put_object(self, **kwargs: Any) -> Any:
        self.latest_writes += kwargs["Key"] == LATEST_KEY
        return self._client.put_object(**kwargs)


def test_latest_json_already_naming_the_step_is_confirmed_without_a_write(s3: Any, tmp_path: Path) -> None:
    """A retry after a lost answer (or another life's upload of the same step): nothing to move."""
    upload(s3, tmp_path / "a", 5)
    counting = CountingLatest(s3)
    again = persister(counting, tmp_path / "a")
    assert again.persist_newest(soon()) == 5
    assert counting.latest_writes == 0


def test_a_step_naming_a_file_outside_its_folder_is_not_confirmed_and_the_line_says_which(
    s3: Any, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    (root / "step-7").mkdir(parents=True)
    files = {"../../x.txt": {"sha256": "0" * 64, "size": 1}}
    (root / "step-7" / "manifest.json").write_text(json.dumps({"step": 7, "epoch": 0, "files": files}))
    events = Events()
    assert not persister(s3, root, events).finish(soon()).confirmed
    said = [f for _, m, f in events.records if m.startswith("newest checkpoint NOT confirmed")]
    assert len(said) == 1
    assert said[0]["error"].startswith(
        f"step 7: '../../x.txt' is not a regular file inside {root / 'step-7'}"
    )


def test_each_confirmed_upload_says_how_long_it_took(s3: Any, tmp_path: Path) -> None:
    """The agent sizes its stop budget on the slowest upload (bootstrap/supervisor.py); the journal line
    shows each to the hundredth of a second."""
    local = tmp_path / "a"
    events = Events()
    owner = persister(s3, local, events)
    took = []
    for step in (1, 2):
        commit_step(local, step)
        begun = time.monotonic()
        assert owner.persist_newest(soon()) == step
        took.append(time.monotonic() - begun)
    assert len(owner.upload_seconds) == 2
    assert all(0 < s <= t for s, t in zip(owner.upload_seconds, took, strict=True)), "each upload's own time"
    said = [f for _, m, f in events.records if m == "checkpoint confirmed in S3"]
    assert [f["upload_s"] for f in said] == [round(s, 2) for s in owner.upload_seconds]
    assert all(isinstance(f["upload_s"], float) for f in said)


def test_a_call_given_up_at_its_deadline_never_holds_up_the_process_exit() -> None:
    """A blackholed request keeps its thread until botocore's own timeout; the agent must still exit."""
    hung = threading.Event()
    try:
        with pytest.raises(
            UploadAbandonedError, match=r"^put-latest: no answer from S3 before the deadline$"
        ):
            bounded(lambda: hung.wait(10), time.monotonic() + 0.05, "put-latest")
        left = [t for t in threading.enumerate() if t.name == "s3-put-latest"]
        assert left and all(t.daemon for t in left)
    finally:
        hung.set()


def test_s3_keeps_the_newest_three_checkpoints_by_default(s3: Any, tmp_path: Path) -> None:
    local = tmp_path / "a"
    owner = CheckpointPersister(s3, BUCKET, PREFIX, local, Events())
    for step in (1, 2, 3, 4):
        commit_step(local, step)
        assert owner.persist_newest(soon(), background=True) == step
    assert remote_steps(s3) == {2, 3, 4}


@pytest.mark.parametrize("prefix", [PREFIX, "XRAY/run-X"])
def test_a_prefix_written_with_slashes_around_it_gives_the_same_keys(
    s3: Any, tmp_path: Path, prefix: str
) -> None:
    local = tmp_path / "a"
    commit_step(local, 1)
    owner = CheckpointPersister(s3, BUCKET, f"/{prefix}/", local, Events())
    assert owner.persist_newest(soon()) == 1
    assert owner.uri == f"s3://{BUCKET}/{prefix}"
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"]}
    assert keys == {f"{prefix}/step-1/state.bin", f"{prefix}/step-1/manifest.json", f"{prefix}/latest.json"}


class NewerStepDuringUpload:
    """S3 during whose file upload the trainer commits the next step."""

    def __init__(self, client: Any, root: Path) -> None:
        self._client = client
        self._root = root

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def put_object(self, **kwargs: Any) -> Any:
        if kwargs["Key"].endswith("step-3/state.bin") and not (self._root / "step-4").exists():
            commit_step(self._root, 4)
        return self._client.put_object(**kwargs)


def test_an_upload_overtaken_by_a_newer_step_says_which_step_overtook_it(s3: Any, tmp_path: Path) -> None:
    local = tmp_path / "a"
    commit_step(local, 3)
    owner = persister(NewerStepDuringUpload(s3, local), local)
    with pytest.raises(UploadAbandonedError) as dropped:
        owner.persist_newest(soon())
    assert str(dropped.value) == "step 3: superseded by step 4"
    assert owner.persist_newest(soon()) == 4, "the newest goes up next"


# -- restore when S3 refuses, the background thread, the end (the restore/background half) ------------


class RefusingReads:
    """S3 that lists and answers `latest.json` and manifests but refuses to hand over the files of the steps
    named (a role without s3:GetObject on them, a key it cannot decrypt with)."""

    def __init__(self, client: Any, *steps: int, code: str | None = "AccessDenied") -> None:
        self._client = client
        self._steps = steps
        self._code = code

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def download_file(self, bucket: str, key: str, filename: str, **kwargs: Any) -> None:
        if any(f"/step-{step}/" in key for step in self._steps):
            status = 403 if self._code == "AccessDenied" else 503
            response: Any = {"ResponseMetadata": {"HTTPStatusCode": status}}
            if self._code is not None:  # (None: an answer without an error body, as a proxy may give)
                response["Error"] = {"Code": self._code}
            raise ClientError(response, "GetObject")
        self._client.download_file(bucket, key, filename, **kwargs)


def test_a_checkpoint_s3_refuses_mid_restore_is_never_restored_and_the_older_one_is_used(
    s3: Any, tmp_path: Path
) -> None:
    local = tmp_path / "first"
    data = upload(s3, local, 2)
    # Step 5 in two files: the first comes down, S3 refuses the second.
    staging = local / ".step-5.tmp"
    staging.mkdir()
    files = {"a-model.bin": os.urandom(200), "b-optim.bin": os.urandom(100)}
    for name, body in files.items():
        (staging / name).write_bytes(body)
    listed = {n: {"sha256": hashlib.sha256(b).hexdigest(), "size": len(b)} for n, b in files.items()}
    (staging / "manifest.json").write_text(json.dumps({"step": 5, "epoch": 3, "files": listed}))
    staging.rename(local / "step-5")
    assert persister(s3, local).persist_newest(soon()) == 5

    class RefusingSecond(RefusingReads):
        def download_file(self, bucket: str, key: str, filename: str, **kwargs: Any) -> None:
            if key.endswith("step-5/b-optim.bin"):
                super().download_file(bucket, key, filename, **kwargs)
            self._client.download_file(bucket, key, filename, **kwargs)

    fresh = tmp_path / "replacement"
    events = Events()
    assert persister(RefusingSecond(s3, 5), fresh, events).restore() == 2
    assert (fresh / "step-2" / "state.bin").read_bytes() == data[2]
    assert not (fresh / "step-5").exists(), "half a checkpoint is never left where the job looks"
    assert sorted(p.name for p in fresh.iterdir()) == ["latest.json", "step-2"], "no staging left behind"
    assert json.loads((fresh / "latest.json").read_text())["step"] == 2
    said = [f for _, m, f in events.records if m == "skipping an S3 checkpoint that cannot be read"]
    assert len(said) == 1 and said[0]["step"] == 5 and "AccessDenied" in said[0]["error"]
    assert events.messages("restored checkpoint from S3")


GRANT = (
    "grant the identity reading it (on an instance, the instance role) s3:GetObject on it and kms:Decrypt on "
    "its key"
)
KEY_OFF = (
    "its KMS key is disabled or pending deletion: enable it (aws kms enable-key; first aws kms "
    "cancel-key-deletion if its deletion is scheduled)"
)
LATER = "S3 did not serve it; a later start tries again"


# S3 passes KMS's refusal of an SSE-KMS object's key on under KMS's own code.
@pytest.mark.parametrize(
    ("code", "fix"),
    [
        ("AccessDenied", GRANT),
        ("KMS.AccessDeniedException", GRANT),
        ("KMS.DisabledException", KEY_OFF),
        ("KMS.KMSInvalidStateException", KEY_OFF),
        (
            "KMS.NotFoundException",
            "its KMS key no longer exists, so S3 can never decrypt it: delete the job's checkpoints under "
            f"s3://{BUCKET}/{PREFIX}/ to start the job over",
        ),
        ("SlowDown", LATER),
        (None, LATER),
    ],
)
def test_with_no_older_checkpoint_a_refused_restore_fails_naming_the_object_rather_than_start_over(
    s3: Any, tmp_path: Path, code: str | None, fix: str
) -> None:
    """Starting over would write step 1 over the step latest.json names (a new lease holder's token wins):
    the confirmed checkpoint would be lost to a permission, a key or an outage. The life fails instead,
    saying which object and the fix S3's answer calls for: a grant, the key enabled, a later start."""
    upload(s3, tmp_path / "first", 2, 5)
    fresh = tmp_path / "replacement"
    events = Events()
    with pytest.raises(CheckpointRefusedError) as refused:
        persister(RefusingReads(s3, 2, 5, code=code), fresh, events).restore()
    assert str(refused.value) == (
        f"s3://{BUCKET}/{PREFIX}/step-5/state.bin: S3 refused to read it ({code or 'no error code'}) and no "
        f"older checkpoint is left: not starting the job over without its step 5; {fix}"
    ), "the newest checkpoint S3 refused is the one named"
    assert [f["step"] for _, m, f in events.records if m.startswith("skipping an S3")] == [5, 2]
    assert sorted(p.name for p in fresh.iterdir()) == [], "nothing half-restored, no latest.json claimed"
    assert json.loads(s3.get_object(Bucket=BUCKET, Key=LATEST_KEY)["Body"].read())["step"] == 5


class RefusingManifests(RefusingReads):
    """S3 that refuses the manifest of the steps named (the first read a restore makes of a step)."""

    def get_object(self, **request: Any) -> Any:
        if any(request["Key"].endswith(f"/step-{step}/manifest.json") for step in self._steps):
            denied: Any = {"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}
            raise ClientError(denied, "GetObject")
        return self._client.get_object(**request)


def test_a_refused_manifest_is_a_refused_checkpoint_older_one_used_or_one_line_naming_it(
    s3: Any, tmp_path: Path
) -> None:
    """The manifest is a checkpoint's first object a restore reads: S3 refusing it is no damaged checkpoint
    (skipped for nothing) and no traceback, but the same refusal as for any of its files."""
    data = upload(s3, tmp_path / "first", 2, 5)
    events = Events()
    fresh = tmp_path / "replacement"
    assert persister(RefusingManifests(s3, 5), fresh, events).restore() == 2
    assert (fresh / "step-2" / "state.bin").read_bytes() == data[2]

    with pytest.raises(CheckpointRefusedError) as refused:
        persister(RefusingManifests(s3, 2, 5), tmp_path / "third").restore()
    assert str(refused.value).startswith(
        f"s3://{BUCKET}/{PREFIX}/step-5/manifest.json: S3 refused to read it (AccessDenied) and no older "
        "checkpoint is left: not starting the job over without its step 5"
    )
    assert json.loads(s3.get_object(Bucket=BUCKET, Key=LATEST_KEY)["Body"].read())["step"] == 5


def test_a_refused_restore_falls_back_to_the_older_checkpoint_on_this_instance(
    s3: Any, tmp_path: Path
) -> None:
    local = tmp_path / "same-instance"
    upload(s3, local, 3)
    commit_step(tmp_path / "other", 5)
    assert persister(s3, tmp_path / "other").persist_newest(soon()) == 5
    events = Events()
    assert persister(RefusingReads(s3, 5), local, events).restore() == 3
    assert events.messages("using the checkpoint already on this instance")


def test_a_checkpoint_with_a_file_gone_from_s3_is_damaged_and_skipped_not_an_error(
    s3: Any, tmp_path: Path
) -> None:
    """A file the manifest names but S3 no longer holds cannot come back by retrying: like a checkpoint
    that fails verification it is skipped, for an older one or, with none, a fresh start that says why."""
    upload(s3, tmp_path / "first", 4)
    s3.delete_object(Bucket=BUCKET, Key=f"{PREFIX}/step-4/state.bin")
    events = Events()
    fresh = tmp_path / "replacement"
    assert persister(s3, fresh, events).restore() is None
    said = [f for _, m, f in events.records if m == "skipping an S3 checkpoint that cannot be read"]
    assert len(said) == 1 and said[0]["step"] == 4
    assert not (fresh / "step-4").exists()


def test_a_damaged_local_step_is_replaced_by_the_confirmed_one_of_the_same_number(
    s3: Any, tmp_path: Path
) -> None:
    data = upload(s3, tmp_path / "first", 6)[6]
    local = tmp_path / "same-instance"
    local.mkdir()
    commit_step(local, 6)  # this instance's earlier life wrote its own step 6, then the disk damaged it
    (local / "step-6" / "state.bin").write_bytes(b"torn write")
    events = Events()
    assert persister(s3, local, events).restore() == 6
    assert (local / "step-6" / "state.bin").read_bytes() == data
    assert events.messages("skipping a damaged local checkpoint")
    latest = json.loads((local / "latest.json").read_text())
    assert (latest["step"], latest["epoch"], latest["dir"]) == (6, 1, "step-6"), "the job resumes its epoch"


class HangingManifestWrite(HungManifest):
    """HungManifest that says when a write of a manifest has begun hanging."""

    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self.hanging = threading.Event()

    def put_object(self, **kwargs: Any) -> Any:
        if kwargs["Key"].endswith("/manifest.json"):
            self.hanging.set()
        return super().put_object(**kwargs)


def test_the_final_flush_gives_up_at_its_deadline_when_s3_never_answers(s3: Any, tmp_path: Path) -> None:
    """A spot stop has two minutes: a blackholed write must not hold the flush (and the instance) past the
    deadline it was given; the step is reported NOT confirmed, naming the call."""
    hung = HangingManifestWrite(s3)
    local = tmp_path / "a"
    commit_step(local, 3)
    events = Events()
    try:
        started = time.monotonic()
        result = persister(hung, local, events).finish(started + 0.5)
        took = time.monotonic() - started
    finally:
        hung.release.set()
    assert (result.newest_local_step, result.confirmed) == (3, False)
    said = [f for _, m, f in events.records if m.startswith("newest checkpoint NOT confirmed in S3")]
    assert [f["error"] for f in said] == ["put-manifest: no answer from S3 before the deadline"]
    assert took < 5, "bounded by the deadline (generous for a loaded 2-core machine), not by S3's 10 s hang"


def test_a_background_upload_hung_in_s3_does_not_hold_the_final_flush_past_its_deadline(
    s3: Any, tmp_path: Path
) -> None:
    hung = HangingManifestWrite(s3)
    local = tmp_path / "a"
    owner = persister(hung, local)
    before = set(threading.enumerate())
    owner.start()
    started = [t for t in threading.enumerate() if t not in before]
    assert started and all(t.daemon for t in started), "a persister thread never holds up the agent's exit"
    commit_step(local, 3)
    try:
        assert hung.hanging.wait(20), "the background upload never reached the manifest"
        begun = time.monotonic()
        result = owner.finish(begun + 1.0)
        took = time.monotonic() - begun
    finally:
        hung.release.set()
        owner.close()
    assert (result.newest_local_step, result.confirmed) == (3, False)
    # The flush waits for the background thread at most 5 s, and never past its deadline: 1 s here, and
    # generous for a loaded 2-core machine, far below the 5 s bound and S3's 10 s hang.
    assert took < 4, "the hung background upload was awaited past the deadline"


def test_once_a_stop_began_the_background_path_writes_nothing_and_leaves_it_to_the_final_flush(
    s3: Any, tmp_path: Path
) -> None:
    local = tmp_path / "a"
    commit_step(local, 3)
    owner = persister(s3, local)
    assert owner.finish(soon()).confirmed_step == 3
    commit_step(local, 4)
    with pytest.raises(UploadAbandonedError) as stopped:
        owner.persist_newest(soon(), background=True)
    assert str(stopped.value) == "step 4: a stop began; the final flush takes over"
    assert remote_steps(s3) == {3}
    assert owner.persist_newest(soon()) == 4, "the final flush's path still writes"


def test_close_releases_the_transfer_threads(s3: Any, tmp_path: Path) -> None:
    """An agent that runs job after job on one instance builds a persister per job: each must give its
    transfer threads back, or threads pile up life after life."""
    before = set(threading.enumerate())
    local = tmp_path / "a"
    owner = persister(s3, local)
    commit_step(local, 1)
    assert owner.persist_newest(soon()) == 1
    assert [t for t in threading.enumerate() if t not in before and not t.daemon], "no transfer threads?"
    owner.close()
    deadline = time.monotonic() + 15
    while left := [t for t in threading.enumerate() if t not in before and not t.daemon]:
        assert time.monotonic() < deadline, f"threads left after close(): {left}"
        time.sleep(0.02)


def test_close_never_holds_up_the_exit_on_a_transfer_hung_in_s3(s3: Any, tmp_path: Path) -> None:
    """The transfer threads wait for a hung request until botocore's own timeout; whatever close() starts to
    shut them down must not keep the agent's process alive after its life has ended."""
    hung = HungManifest(s3, hangs="/state.bin")  # a checkpoint file's upload this time
    local = tmp_path / "a"
    owner = persister(hung, local)
    commit_step(local, 2)
    try:
        with pytest.raises(UploadAbandonedError, match=r"^step 2: deadline passed$"):
            owner.persist_newest(time.monotonic() + 0.5)
        before = set(threading.enumerate())
        begun = time.monotonic()
        owner.close()
        assert time.monotonic() - begun < 5, "close() waited on the hung request"
        started = [t for t in threading.enumerate() if t not in before]
        assert started and all(t.daemon for t in started), "a thread close() started keeps the process alive"
    finally:
        hung.release.set()


def test_a_lease_first_found_lost_at_the_final_flush_writes_nothing_and_says_so_once(
    s3: Any, tmp_path: Path
) -> None:
    """No background upload checked the lease since it was lost (a stop right after a step): the flush's own
    check finds it, writes nothing, and reports the step as not confirmed because the lease is gone."""

    class LostMeanwhile:
        token = 3
        lost = False

        def check(self) -> None:
            if self.lost:
                raise LeaseLostError("i-new", 4, "s3://bucket/jobs/x/state/lease.json")

    local = tmp_path / "a"
    commit_step(local, 7)
    fence = LostMeanwhile()
    events = Events()
    owner = CheckpointPersister(s3, BUCKET, PREFIX, local, events, fence=fence)
    assert owner.persist_newest(soon()) == 7
    events.records.clear()
    fence.lost = True
    commit_step(local, 8)
    result = owner.finish(soon())
    assert result == PersistResult(8, 7, lease_lost=True) and not result.confirmed
    assert remote_steps(s3) == {7}
    assert [m for _, m, _ in events.records] == [
        "lease lost to i-new (token 4): this instance no longer writes the job's checkpoints",
        "this instance's checkpoints were not confirmed: it lost the job's lease, "
        "and the new holder continues the job from its own",
    ]
    assert events.records[-1][2] == {"level": "warning", "newest_local_step": 8, "confirmed_step": 7}


def test_a_background_upload_overtaken_by_a_newer_step_goes_on_with_the_newer_one(
    s3: Any, tmp_path: Path
) -> None:
    """Dropping the overtaken step is no failure: the newer one goes up at the next poll, while the job
    runs, not only at the final flush."""
    local = tmp_path / "a"
    owner = persister(NewerStepDuringUpload(s3, local), local)
    commit_step(local, 3)
    owner.start()
    deadline = time.monotonic() + 20
    try:
        while owner.confirmed_step != 4:
            assert time.monotonic() < deadline, "the newer step was not uploaded in the background"
            time.sleep(0.02)
    finally:
        owner.finish(soon())
        owner.close()
    assert remote_steps(s3) >= {4}


class LatestAnswering:
    """S3 answering every read of latest.json with `response` (a ClientError)."""

    def __init__(self, client: Any, response: dict[str, Any]) -> None:
        self._client = client
        self._response = response

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def get_object(self, **kwargs: Any) -> Any:
        if kwargs["Key"] == LATEST_KEY:
            raise ClientError(self._response, "GetObject")  # type: ignore[arg-type]
        return self._client.get_object(**kwargs)


@pytest.mark.parametrize("code", ["NoSuchKey", "404", "NotFound"])
def test_every_spelling_of_not_found_for_latest_json_means_no_checkpoint_yet(
    s3: Any, tmp_path: Path, code: str
) -> None:
    answer = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": 404}}
    owner = persister(LatestAnswering(s3, answer), tmp_path / "a")
    assert owner.read_latest() == (None, None)
    assert owner.latest_token() is None
    assert owner.restore() is None


@pytest.mark.parametrize(
    "answer",
    [
        {"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}},
        {"ResponseMetadata": {"HTTPStatusCode": 500}},  # no error body at all
    ],
    ids=["access-denied", "no-error-body"],
)
def test_any_other_answer_reading_latest_json_is_an_error_never_a_fresh_job(
    s3: Any, tmp_path: Path, answer: dict[str, Any]
) -> None:
    upload(s3, tmp_path / "first", 3)
    with pytest.raises(ClientError):
        persister(LatestAnswering(s3, answer), tmp_path / "replacement").restore()


class FenceHangingFrom:
    """A lease that still names token 1, whose check stops answering from its `call`-th call on."""

    token = 1

    def __init__(self, call: int) -> None:
        self.call = call
        self.calls = 0
        self.release = threading.Event()

    def check(self) -> None:
        self.calls += 1
        if self.calls >= self.call:
            self.release.wait(10)
            dropped()


class LatestHanging(LatestAnswering):
    """S3 whose reads (`read-latest`) or writes (`put-latest`) of latest.json never answer."""

    def __init__(self, client: Any, call: str) -> None:
        super().__init__(client, {})
        self.call = call
        self.release = threading.Event()

    def get_object(self, **kwargs: Any) -> Any:
        if kwargs["Key"] == LATEST_KEY and self.call == "read-latest":
            self.release.wait(10)
            dropped()
        return self._client.get_object(**kwargs)

    def put_object(self, **kwargs: Any) -> Any:
        if kwargs["Key"] == LATEST_KEY and self.call == "put-latest":
            self.release.wait(10)
            dropped()
        return self._client.put_object(**kwargs)


@pytest.mark.parametrize(
    ("hangs", "call"),
    [
        ("the lease check before the manifest", "check-lease"),
        ("the lease check before latest.json", "check-lease"),
        ("the lease check after latest.json names a higher token", "check-lease"),
        ("the read of latest.json", "read-latest"),
        ("the write of latest.json", "put-latest"),
    ],
)
def test_moving_latest_json_gives_up_at_the_deadline_when_s3_never_answers(
    s3: Any, tmp_path: Path, hangs: str, call: str
) -> None:
    """The files are up; the calls that commit the step (the manifest, then latest.json) are bounded by the
    same deadline (a spot stop has two minutes), and nothing is claimed confirmed."""
    if "higher token" in hangs:
        before = {"step": 3, "epoch": 1, "token": 2}
        s3.put_object(Bucket=BUCKET, Key=LATEST_KEY, Body=json.dumps(before).encode())
    # The lease is checked before the files (1), the manifest (2), latest.json (3) and, when latest.json
    # names a higher token, once more (4): the checks before the one that hangs pass.
    checks = {"the manifest": 2, "before latest.json": 3, "higher token": 4}
    fence = FenceHangingFrom(next((n for words, n in checks.items() if words in hangs), 99))
    client = LatestHanging(s3, call) if call in {"read-latest", "put-latest"} else s3
    local = tmp_path / "a"
    commit_step(local, 5)
    owner = CheckpointPersister(
        s3=client, bucket=BUCKET, prefix=PREFIX, local_dir=local, log=Events(), fence=fence
    )
    try:
        with pytest.raises(UploadAbandonedError) as gave_up:
            owner.persist_newest(time.monotonic() + 2)
    finally:
        fence.release.set()
        if isinstance(client, LatestHanging):
            client.release.set()
    assert str(gave_up.value) == f"{call}: no answer from S3 before the deadline"
    assert owner.confirmed_step is None
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"]}
    assert (f"{PREFIX}/step-5/manifest.json" in keys) is ("the manifest" not in hangs)


class AlwaysConflicting(ConflictOnce):
    """S3 where another writer wins every conditional write of latest.json."""

    def put_object(self, **kwargs: Any) -> Any:
        if kwargs["Key"] == LATEST_KEY:
            self.refused += 1
            raise ClientError(self._response, "PutObject")  # type: ignore[arg-type]
        return self._client.put_object(**kwargs)


def test_latest_json_lost_to_other_writers_every_time_gives_up_naming_it_and_claims_nothing(
    s3: Any, tmp_path: Path
) -> None:
    racing = AlwaysConflicting(s3, {"Error": {"Code": "PreconditionFailed"}, "ResponseMetadata": {}})
    owner = persister(racing, tmp_path / "a")
    commit_step(tmp_path / "a", 3)
    with pytest.raises(RuntimeError) as gave_up:
        owner.persist_newest(soon())
    assert str(gave_up.value) == f"s3://{BUCKET}/{LATEST_KEY}: too many concurrent writers; will retry"
    assert 1 < racing.refused <= 10, "retried a few times, not forever"
    assert owner.confirmed_step is None


@pytest.mark.parametrize(("written", "read"), [(4, 4), (True, None), ("9", None), (2.5, None), (None, None)])
def test_only_a_whole_number_in_latest_json_counts_as_a_lease_token(
    s3: Any, tmp_path: Path, written: Any, read: int | None
) -> None:
    """The token is the floor the next lease starts above: a `true` or a "9" written by hand is no token
    (never `True > 0`, never a string compared with numbers)."""
    body = {"step": 3, "epoch": 1, "token": written}
    s3.put_object(Bucket=BUCKET, Key=LATEST_KEY, Body=json.dumps(body).encode())
    owner = persister(s3, tmp_path / "a")
    assert owner.latest_token() == read
    assert owner.read_latest()[0] == 3


def test_a_file_the_job_removed_before_its_upload_gives_the_step_up_saying_which(
    s3: Any, tmp_path: Path
) -> None:
    """The job may prune a step the persister has not uploaded yet (its own `keep`): that step is given
    up, naming the file, and nothing is claimed."""
    local = tmp_path / "a"
    commit_step(local, 3)
    (local / "step-3" / "state.bin").unlink()
    owner = persister(s3, local)
    with pytest.raises(UploadAbandonedError) as gave_up:
        owner.persist_newest(soon())
    assert str(gave_up.value) == f"step 3: {local / 'step-3' / 'state.bin'} removed locally before its upload"
    assert owner.confirmed_step is None and remote_steps(s3) == set()


def test_a_link_in_a_step_is_never_followed_and_the_step_says_why(s3: Any, tmp_path: Path) -> None:
    """The agent may run as root: a checkpoint file that is a link (to /etc/shadow, to the agent's own
    files) is never read, and the step is not uploaded, saying which file and what to do."""
    secret = tmp_path / "agent-only.txt"
    secret.write_bytes(b"not the job's")
    local = tmp_path / "ckpt"
    commit_step(local, 4)
    (local / "step-4" / "state.bin").unlink()
    (local / "step-4" / "state.bin").symlink_to(secret)
    with pytest.raises(UploadAbandonedError) as refused:
        persister(s3, local).persist_newest(soon())
    assert str(refused.value) == (
        f"step 4: 'state.bin' is not a regular file inside {local / 'step-4'}; not uploaded "
        "(the job's checkpoint must hold plain files)"
    )
    assert remote_steps(s3) == set()


def test_a_checkpoint_folder_reached_through_a_link_outside_it_is_uploaded(s3: Any, tmp_path: Path) -> None:
    """Links above the step folder (the scratch disk mounted through a link) are the instance's, not the
    job's: only links inside the step count."""
    (tmp_path / "nvme").mkdir()
    (tmp_path / "scratch").symlink_to(tmp_path / "nvme")
    local = tmp_path / "scratch" / "ckpt"
    commit_step(local, 2)
    assert persister(s3, local).persist_newest(soon()) == 2


def test_with_no_prefix_the_checkpoints_sit_at_the_buckets_top(s3: Any, tmp_path: Path) -> None:
    local = tmp_path / "a"
    commit_step(local, 1)
    owner = CheckpointPersister(s3, BUCKET, "/", local, Events())
    assert owner.persist_newest(soon()) == 1
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"]}
    assert keys == {"step-1/state.bin", "step-1/manifest.json", "latest.json"}
    assert CheckpointPersister(s3, BUCKET, "", tmp_path / "b", Events()).restore() == 1


def test_a_step_the_job_prunes_right_after_it_was_listed_is_given_up_saying_so(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = tmp_path / "a"
    commit_step(local, 3)
    listed = persist_module.committed_steps

    def listed_then_pruned(root: Path) -> list[int]:
        steps = listed(root)
        shutil.rmtree(root / "step-3", ignore_errors=True)  # the job's own `keep`, a moment later
        return steps

    monkeypatch.setattr(persist_module, "committed_steps", listed_then_pruned)
    owner = persister(s3, local)
    with pytest.raises(UploadAbandonedError) as gave_up:
        owner.persist_newest(soon())
    assert str(gave_up.value) == "step 3: removed locally before its upload"
    assert owner.confirmed_step is None and remote_steps(s3) == set()


class ManifestRefusedOnce:
    """S3 that refuses the first write of a manifest (a hiccup after the files went up)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.refused = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def put_object(self, **kwargs: Any) -> Any:
        if kwargs["Key"].endswith("/manifest.json") and not self.refused:
            self.refused = True
            response: Any = {"Error": {"Code": "InternalError"}, "ResponseMetadata": {"HTTPStatusCode": 500}}
            raise ClientError(response, "PutObject")
        return self._client.put_object(**kwargs)


def test_a_step_whose_files_are_up_is_not_committed_past_the_deadline_or_after_a_stop(
    s3: Any, tmp_path: Path
) -> None:
    """The files are in S3, only the manifest is missing: still, a flush past its deadline writes nothing,
    and once a stop began the background path leaves the manifest to the final flush."""
    local = tmp_path / "a"
    commit_step(local, 3)
    owner = persister(ManifestRefusedOnce(s3), local)
    with pytest.raises(ClientError):
        owner.persist_newest(soon(), background=True)
    manifest = f"{PREFIX}/step-3/manifest.json"

    def keys() -> set[str]:
        return {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET).get("Contents", [])}

    assert f"{PREFIX}/step-3/state.bin" in keys() and manifest not in keys()
    with pytest.raises(UploadAbandonedError) as late:
        owner.persist_newest(time.monotonic() - 1)
    assert str(late.value) == "step 3: deadline passed"
    owner.close()  # the stop
    with pytest.raises(UploadAbandonedError) as stopped:
        owner.persist_newest(soon(), background=True)
    assert str(stopped.value) == "step 3: a stop began; the final flush takes over"
    assert manifest not in keys()
    assert owner.persist_newest(soon()) == 3, "the final flush writes only what is missing"


def test_a_confirmed_step_is_not_written_again(s3: Any, tmp_path: Path) -> None:
    """The background thread polls twice a second: a step S3 already holds costs no request."""
    local = tmp_path / "a"
    commit_step(local, 3)
    counting = CountingWrites(s3)
    owner = persister(counting, local)
    assert owner.persist_newest(soon()) == 3
    counting.writes.clear()
    for _ in range(3):
        assert owner.persist_newest(soon(), background=True) == 3
    assert counting.writes == []


# -- an upload's file descriptor, and the token record kept only when asked ----------------------------


class _Future:
    """A transfer's future: done, or cancelled (its result raises)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error

    def result(self) -> None:
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize("error", [None, RuntimeError("cancelled"), KeyboardInterrupt()])
def test_an_uploads_descriptor_is_closed_however_its_transfer_ended(tmp_path: Path, error: Any) -> None:
    # The job's files are opened by root with O_NOFOLLOW and handed to the transfer: the descriptor must be
    # closed once the transfer has no task left, and a cancelled transfer's error was said where it was
    # cancelled (this runs on a daemon thread: raising here would only print a traceback).
    handle = os.open(tmp_path / "part", os.O_CREAT | os.O_RDONLY)
    close_when_done(_Future(error), handle)
    with pytest.raises(OSError):
        os.fstat(handle)


def test_without_a_token_record_no_record_is_read_or_written(s3: Any, tmp_path: Path) -> None:
    calls: list[str] = []

    class Watched:
        def __getattr__(self, name: str) -> Any:
            calls.append(name)
            return getattr(s3, name)

    events = Events()
    keeper = persister(Watched(), tmp_path / "ckpt", events)
    assert keeper.token_floor(soon()) is None
    keeper._record_token(7, soon())
    assert not [c for c in calls if c in ("get_object", "put_object")], calls
    assert events.records == [], "nothing to record is no failure to say either"


def _held_under(root: Path) -> list[str]:
    """This process's open descriptors on files under `root`."""
    held = []
    for entry in Path("/proc/self/fd").iterdir():
        try:
            target = str(entry.readlink())
        except OSError:  # closed while listed
            continue
        if target.startswith(str(root)):
            held.append(target)
    return held


def test_every_file_an_upload_opened_is_closed_once_its_transfer_is_done(s3: Any, tmp_path: Path) -> None:
    # Each file goes up through a descriptor root opened (never following a link the job put); a long job
    # uploads thousands: one left open per file would run the agent out of descriptors.
    root = tmp_path / "ckpt"
    upload(s3, root, 1, 2, 3)
    deadline = time.monotonic() + 10
    while _held_under(root) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _held_under(root) == [], "files the uploads opened were still open 10 s after them"


def test_an_abandoned_uploads_file_stays_open_while_its_request_is_out_then_is_closed(
    s3: Any, tmp_path: Path
) -> None:
    """A deadline gives up on a file whose request S3 never answers: its descriptor stays open while the
    request is out (the part may still read it, and a number closed early could be the next file the agent
    opens), and is closed once the request ends, so abandoned uploads leak no descriptor."""
    hung = HungManifest(s3, hangs="/state.bin")
    local = tmp_path / "a"
    owner = persister(hung, local)
    commit_step(local, 2)
    try:
        with pytest.raises(UploadAbandonedError, match=r"^step 2: deadline passed$"):
            owner.persist_newest(time.monotonic() + 0.5)
        held = [path for path in _held_under(local) if path.endswith("/state.bin")]
        assert held, "closed while its request was still out"
    finally:
        hung.release.set()
    deadline = time.monotonic() + 15
    while _held_under(local) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _held_under(local) == [], "an abandoned upload's file was never closed"
    owner.close()


RECORD_KEY = "jobs/demo-1a2b3c4d/state/latest-token.json"


def recorder(s3: Any, root: Path) -> CheckpointPersister:
    root.mkdir(parents=True, exist_ok=True)
    return CheckpointPersister(s3, BUCKET, PREFIX, root, Events(), poll_seconds=0.05, token_record=RECORD_KEY)


@pytest.mark.parametrize("token", ["7", True, 7.5, None, [7]])
def test_a_token_record_holding_no_whole_number_gives_no_floor(s3: Any, tmp_path: Path, token: Any) -> None:
    """Damaged by hand (or by a bug): no floor is read from it, rather than a text or a fraction compared
    with the lease's tokens; the next recorded token replaces it."""
    s3.put_object(Bucket=BUCKET, Key=RECORD_KEY, Body=json.dumps({"token": token}).encode())
    keeper = recorder(s3, tmp_path / "ckpt")
    assert keeper.token_floor(soon()) is None
    keeper._record_token(4, soon())
    assert json.loads(s3.get_object(Bucket=BUCKET, Key=RECORD_KEY)["Body"].read())["token"] == 4


def test_a_token_record_read_that_s3_never_answers_gives_up_at_the_deadline_naming_the_read(
    s3: Any, tmp_path: Path
) -> None:
    released = threading.Event()

    class Stalled:
        def __getattr__(self, name: str) -> Any:
            return getattr(s3, name)

        def get_object(self, **call: Any) -> Any:
            released.wait(10)  # a blackholed request: no answer, no error
            return s3.get_object(**call)

    keeper = recorder(Stalled(), tmp_path / "ckpt")
    started = time.monotonic()
    try:
        with pytest.raises(UploadAbandonedError) as gave_up:
            keeper.token_floor(time.monotonic() + 0.3)
    finally:
        released.set()
    assert time.monotonic() - started < 5, "the read held the caller past its deadline"
    assert str(gave_up.value) == "read-token-record: no answer from S3 before the deadline"

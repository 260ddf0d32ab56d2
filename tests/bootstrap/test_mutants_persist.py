"""Checkpoint persistence (bootstrap/persist.py): the promises `make mutate` found untested, against the moto
server. Restore picks the newest checkpoint that verifies and never one above `latest.json`; S3's conflict
answers are retried, any other error is not; old steps are pruned down to `keep`; what `finish` reports is
what S3 holds."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from bootstrap.lease import LeaseLostError
from bootstrap.persist import CheckpointPersister, PersistResult, UploadAbandonedError, bounded
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
    assert events.messages("skipping an S3 checkpoint that fails verification")


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


def test_a_restore_asked_to_stop_stops(s3: Any, tmp_path: Path) -> None:
    upload(s3, tmp_path / "first", 3)
    with pytest.raises(UploadAbandonedError):
        persister(s3, tmp_path / "replacement").restore(should_abort=lambda: True)
    assert not (tmp_path / "replacement" / "step-3").exists()


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
        raise RuntimeError("the caller's reaction failed")

    events = Events()
    owner = CheckpointPersister(
        s3, BUCKET, PREFIX, tmp_path / "a", events, fence=Lost(), on_lease_lost=callback
    )
    commit_step(tmp_path / "a", 3)
    with pytest.raises(LeaseLostError):
        owner.persist_newest(soon())
    assert owner.lease_lost is not None and remote_steps(s3) == set()
    assert events.messages("on_lease_lost failed")
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


class Hung:
    """An S3 whose reads never answer (a blackholed endpoint)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def get_object(self, **kwargs: Any) -> Any:
        self.release.wait(30)
        return self._client.get_object(**kwargs)


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
    assert persister(s3, local, events).restore() == 3
    assert marker.stat().st_mtime_ns == before, "the local copy was replaced by a download"
    assert events.messages("using the checkpoint already on this instance")
    assert not events.messages("restored checkpoint from S3")


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
                "Error": {"Code": "ServiceUnavailable"},
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
    result = owner.finish(soon())
    owner.close()
    assert result.confirmed
    failed = [
        f for _, m, f in events.records if m == "checkpoint upload failed; retrying (the local copy is kept)"
    ]
    assert len(failed) == 1 and "ServiceUnavailable" in failed[0]["error"]
    assert persister(s3, tmp_path / "replacement").restore() == 3


class NoDeletes:
    """S3 where this role may write but not delete (a tightened bucket policy)."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def delete_objects(self, **kwargs: Any) -> Any:
        response: Any = {"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}
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


def test_s3_checks_every_checkpoint_file_against_its_sha256(s3: Any, tmp_path: Path) -> None:
    """Each file goes up with its SHA-256, which S3 verifies on arrival and keeps: a file damaged on the way
    is refused, not stored (the manifest names the same digest for restore to verify)."""
    data = upload(s3, tmp_path / "a", 5)[5]
    stored = s3.head_object(Bucket=BUCKET, Key=f"{PREFIX}/step-5/state.bin", ChecksumMode="ENABLED")
    digest = hashlib.sha256(data).digest()
    assert stored.get("ChecksumSHA256") == base64.b64encode(digest).decode()


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
    assert len(said) == 1 and "ServiceUnavailable" in said[0]["error"]
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
    """S3 that takes the files but never answers the manifest's write (a request blackholed mid-upload)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def put_object(self, **kwargs: Any) -> Any:
        if kwargs["Key"].endswith("/manifest.json"):
            self.release.wait(10)
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
    for step in (1, 2):
        commit_step(local, step)
        assert owner.persist_newest(soon()) == step
    assert len(owner.upload_seconds) == 2 and all(s > 0 for s in owner.upload_seconds)
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


def test_a_prefix_written_with_slashes_around_it_gives_the_same_keys(s3: Any, tmp_path: Path) -> None:
    local = tmp_path / "a"
    commit_step(local, 1)
    owner = CheckpointPersister(s3, BUCKET, f"/{PREFIX}/", local, Events())
    assert owner.persist_newest(soon()) == 1
    assert owner.uri == f"s3://{BUCKET}/{PREFIX}"
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"]}
    assert keys == {f"{PREFIX}/step-1/state.bin", f"{PREFIX}/step-1/manifest.json", LATEST_KEY}


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

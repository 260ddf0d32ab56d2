"""Fenced checkpoint writes (bootstrap/persist.py with bootstrap/lease.py) against the moto server: only the
lease's holder writes the job's checkpoints; a holder that lost the lease stops writing at once, says so
once and reports its checkpoint as not confirmed; `latest.json` never moves to a lower token, and its
conditional write is what keeps a racing stale writer out. Lease times are injected: no test waits for an
expiry."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from bootstrap.lease import DRIFT_SECONDS, JobLease, LeaseLostError
from bootstrap.persist import CheckpointPersister, Fence
from tests.checkpoints import commit_step
from tests.conftest import MotoServer
from trainstack_job.records import is_conflict

BUCKET = "trainstack-fence"
JOB = "jobs/demo-1a2b3c4d/"
PREFIX = f"{JOB}checkpoints"
LATEST_KEY = f"{PREFIX}/latest.json"
LEASE_KEY = f"{JOB}state/lease.json"
STALE = 60.0
T0 = 1_800_000_000.0
LOST = "this instance no longer writes the job's checkpoints"


class Events:
    """The persister's event sink, kept for assertions."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict[str, Any]]] = []

    def event(self, stage: str, message: str, **fields: Any) -> None:
        self.records.append((stage, message, fields))

    def messages(self, containing: str) -> list[str]:
        return [message for _, message, _ in self.records if containing in message]


class StubFence:
    """A fence with a fixed answer: passes (a holder whose view is stale: its check came just before it lost
    the lease), or raises `error`."""

    def __init__(self, token: int, error: Exception | None = None) -> None:
        self.token = token
        self.error = error
        self.checks = 0

    def check(self) -> None:
        self.checks += 1
        if self.error is not None:
            raise self.error


@pytest.fixture()
def s3(aws: MotoServer) -> Any:
    client = boto3.client("s3", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    return client


def persister(
    s3: Any,
    root: Path,
    fence: Fence | None = None,
    events: Events | None = None,
    on_lease_lost: Callable[[LeaseLostError], None] | None = None,
) -> CheckpointPersister:
    root.mkdir(parents=True, exist_ok=True)
    return CheckpointPersister(
        s3,
        BUCKET,
        PREFIX,
        root,
        events or Events(),
        poll_seconds=0.05,
        fence=fence,
        on_lease_lost=on_lease_lost,
    )


def lease(s3: Any, holder: str) -> JobLease:
    return JobLease(s3, BUCKET, LEASE_KEY, holder=holder, life_id=f"{holder}@life", stale_seconds=STALE)


def keys(s3: Any, under: str = PREFIX) -> set[str]:
    return {item["Key"] for item in s3.list_objects_v2(Bucket=BUCKET, Prefix=under).get("Contents", [])}


def latest(s3: Any) -> dict[str, Any]:
    return dict(json.loads(s3.get_object(Bucket=BUCKET, Key=LATEST_KEY)["Body"].read()))


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def soon() -> float:
    return time.monotonic() + 20


def test_a_fenced_holder_checks_before_the_files_the_manifest_and_latest_which_carries_its_token(
    s3: Any, tmp_path: Path
) -> None:
    holder = lease(s3, "i-a")
    assert holder.try_acquire(T0) == 1
    seen: list[set[str]] = []

    class Recording:
        token = 1

        def check(self) -> None:
            holder.check()
            seen.append(keys(s3))  # what S3 held at each check

    owner = persister(s3, tmp_path / "a", Recording())
    commit_step(tmp_path / "a", 3)
    assert owner.persist_newest(soon()) == 3
    step = f"{PREFIX}/step-3"
    assert seen == [
        set(),  # before the step's first file
        {f"{step}/state.bin"},  # before its manifest
        {f"{step}/state.bin", f"{step}/manifest.json"},  # before latest.json
    ]
    assert latest(s3)["step"] == 3 and latest(s3)["token"] == 1
    assert owner.latest_token() == 1
    assert json.loads((tmp_path / "a" / "latest.json").read_text())["token"] == 1


def test_without_a_fence_latest_carries_no_token_and_nothing_checks(s3: Any, tmp_path: Path) -> None:
    owner = persister(s3, tmp_path / "a")
    commit_step(tmp_path / "a", 2)
    owner.persist_newest(soon())
    assert set(latest(s3)) == {"step", "epoch", "dir", "written_at"}
    assert owner.latest_token() is None
    result = owner.finish(soon())
    assert result.confirmed and not result.lease_lost


def test_a_holder_that_lost_the_lease_stops_writing_for_good_says_so_once_and_is_not_confirmed(
    s3: Any, tmp_path: Path
) -> None:
    old_lease, new_lease = lease(s3, "i-a"), lease(s3, "i-b")
    assert old_lease.try_acquire(T0) == 1
    events, lost_calls = Events(), list[LeaseLostError]()
    old = persister(s3, tmp_path / "a", old_lease, events, on_lease_lost=lost_calls.append)
    old.start()
    commit_step(tmp_path / "a", 3)
    wait_until(lambda: old.confirmed_step == 3, "step 3 confirmed")
    # The old holder stalled past the stale limit; a standby took the lease and resumed from step 3.
    assert new_lease.try_acquire(T0 + STALE + DRIFT_SECONDS) == 2
    new = persister(s3, tmp_path / "b", new_lease)
    assert new.restore() == 3
    before = keys(s3)
    commit_step(tmp_path / "a", 4)
    wait_until(lambda: old.lease_lost is not None, "the old holder to find out")
    assert old._thread is not None
    wait_until(lambda: not old._thread.is_alive(), "the background uploads to end")  # type: ignore[union-attr]
    commit_step(tmp_path / "a", 5)
    time.sleep(0.3)  # six polls' worth: an upload still running would have written by now
    assert keys(s3) == before, "a step file of the old holder reached S3 after it lost the lease"
    result = old.finish(soon())
    assert result.lease_lost and not result.confirmed
    assert (result.newest_local_step, result.confirmed_step) == (5, 3)
    assert keys(s3) == before, "the final flush wrote after the lease was lost"
    assert events.messages(LOST) == [f"lease lost to i-b (token 2): {LOST}"]
    assert len(lost_calls) == 1 and (lost_calls[0].holder, lost_calls[0].token) == ("i-b", 2)
    with pytest.raises(LeaseLostError):
        old.persist_newest(soon())
    # The new holder goes on from the checkpoint it restored, under its own token.
    commit_step(tmp_path / "b", 4)
    assert new.persist_newest(soon()) == 4
    assert (latest(s3)["step"], latest(s3)["token"]) == (4, 2)


def test_losing_the_lease_between_the_manifest_and_latest_keeps_latest_with_the_new_holder(
    s3: Any, tmp_path: Path
) -> None:
    old_lease, new_lease = lease(s3, "i-a"), lease(s3, "i-b")
    old_lease.try_acquire(T0)
    commit_step(tmp_path / "shared", 3)
    persister(s3, tmp_path / "shared", old_lease).persist_newest(soon())
    checks = 0

    class TakenOverAfterTheManifestCheck:
        token = 1

        def check(self) -> None:
            nonlocal checks
            checks += 1
            old_lease.check()
            if checks == 2:  # the old holder's manifest check passed; then it stalled, and lost
                assert new_lease.try_acquire(T0 + STALE + DRIFT_SECONDS) == 2
                new = persister(s3, tmp_path / "b", new_lease)
                assert new.restore() == 3
                commit_step(tmp_path / "b", 4)
                assert new.persist_newest(soon()) == 4

    events = Events()
    old = persister(s3, tmp_path / "a", TakenOverAfterTheManifestCheck(), events)
    commit_step(tmp_path / "a", 9)
    with pytest.raises(LeaseLostError):
        old.persist_newest(soon())
    assert (latest(s3)["step"], latest(s3)["token"]) == (4, 2), "the old holder moved latest.json"
    assert old.confirmed_step is None
    assert events.messages(LOST) == [f"lease lost to i-b (token 2): {LOST}"]


def test_latest_with_a_higher_token_is_never_overwritten_even_when_the_fence_looks_fine(
    s3: Any, tmp_path: Path
) -> None:
    newer = persister(s3, tmp_path / "b", StubFence(token=2))
    commit_step(tmp_path / "b", 4)
    newer.persist_newest(soon())
    events, stale_fence = Events(), StubFence(token=1)
    stale = persister(s3, tmp_path / "a", stale_fence, events)
    commit_step(tmp_path / "a", 9)
    with pytest.raises(LeaseLostError):
        stale.persist_newest(soon())
    assert (latest(s3)["step"], latest(s3)["token"]) == (4, 2)
    assert events.messages(LOST) == [f"lease lost to the writer of latest.json (token 2): {LOST}"]
    checks = stale_fence.checks
    commit_step(tmp_path / "a", 10)
    with pytest.raises(LeaseLostError):
        stale.persist_newest(soon())
    assert stale_fence.checks == checks and f"{PREFIX}/step-10/state.bin" not in keys(s3), "stopped for good"
    assert stale.finish(soon()).lease_lost


def test_a_higher_token_replaces_a_superseded_holders_latest_but_a_token_never_moves_its_step_back(
    s3: Any, tmp_path: Path
) -> None:
    superseded = persister(s3, tmp_path / "a", StubFence(token=1))
    commit_step(tmp_path / "a", 5)  # written after its last check, once the new holder had restored step 3
    superseded.persist_newest(soon())
    holder = persister(s3, tmp_path / "b", StubFence(token=2))
    commit_step(tmp_path / "b", 4)
    assert holder.persist_newest(soon()) == 4
    assert (latest(s3)["step"], latest(s3)["token"]) == (4, 2), "the new holder's line is the job's"
    # Within one token latest.json only moves forward (an upload that finished late never moves it back).
    late = persister(s3, tmp_path / "c", StubFence(token=2))
    commit_step(tmp_path / "c", 3)
    late.persist_newest(soon())
    assert (latest(s3)["step"], latest(s3)["token"]) == (4, 2)


class OrderedLatest:
    """One racer's S3 client: reads latest.json once with the other racer (a barrier), then puts it only
    after `after` is set (if given), and sets `done` once its own put is answered. Puts of latest.json hold
    one lock shared by both racers: moto's conditional put is not atomic across its request threads."""

    def __init__(
        self,
        client: Any,
        read_together: threading.Barrier,
        put_lock: threading.Lock,
        done: threading.Event,
        after: threading.Event | None = None,
    ) -> None:
        self._client = client
        self._barrier = read_together
        self._lock = put_lock
        self._done = done
        self._after = after
        self._read = False
        self.conflicts = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def get_object(self, **kwargs: Any) -> Any:
        try:
            return self._client.get_object(**kwargs)
        finally:
            if kwargs["Key"] == LATEST_KEY and not self._read:
                self._read = True
                self._barrier.wait(timeout=10)

    def put_object(self, **kwargs: Any) -> Any:
        if kwargs["Key"] != LATEST_KEY:
            return self._client.put_object(**kwargs)
        if self._after is not None:
            assert self._after.wait(timeout=10)
        try:
            with self._lock:
                return self._client.put_object(**kwargs)
        except ClientError as exc:
            if is_conflict(exc):
                self.conflicts += 1
            raise
        finally:
            self._done.set()


@pytest.mark.parametrize("existing", [False, True], ids=["first-latest", "latest-exists"])
@pytest.mark.parametrize("fenced", [True, False], ids=["tokens", "steps"])
def test_the_conditional_write_of_latest_keeps_out_a_writer_that_read_it_before_another_wrote(
    s3: Any, tmp_path: Path, fenced: bool, existing: bool
) -> None:
    """Both writers read latest.json, then the newer one writes, then the stale one: only S3's If-Match /
    If-None-Match refuses the stale put (its read and its fence check were fine when made). With no
    latest.json yet, If-None-Match is what refuses it; with one already there (an earlier holder's step 4),
    If-Match on the ETag both read."""
    if existing:
        earlier = persister(s3, tmp_path / "earlier", StubFence(1) if fenced else None)
        commit_step(tmp_path / "earlier", 4)
        assert earlier.persist_newest(soon()) == 4
    together, lock = threading.Barrier(2, timeout=30), threading.Lock()
    newer_done, stale_done = threading.Event(), threading.Event()
    newer_s3 = OrderedLatest(s3, together, lock, newer_done)
    stale_s3 = OrderedLatest(s3, together, lock, stale_done, after=newer_done)
    newer = persister(newer_s3, tmp_path / "new", StubFence(2) if fenced else None)
    stale = persister(stale_s3, tmp_path / "old", StubFence(1) if fenced else None)
    commit_step(tmp_path / "new", 6)
    commit_step(tmp_path / "old", 5)
    if fenced:  # a holder that lost the lease may even have the newer step locally
        commit_step(tmp_path / "old", 7)

    def persist(writer: CheckpointPersister) -> int | Exception | None:
        try:
            return writer.persist_newest(soon())
        except LeaseLostError as exc:
            return exc

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(persist, [newer, stale]))
    assert newer_s3.conflicts == 0 and stale_s3.conflicts == 1, "the stale put was not refused by S3"
    assert (latest(s3)["step"], latest(s3).get("token")) == ((6, 2) if fenced else (6, None))
    assert results[0] == 6
    if fenced:
        assert isinstance(results[1], LeaseLostError) and stale.lease_lost is not None
    else:
        assert results[1] == 5 and stale.lease_lost is None, "an older step: confirmed, not moved back"


def test_restore_reads_without_the_fence(s3: Any, tmp_path: Path) -> None:
    commit_step(tmp_path / "a", 3)
    persister(s3, tmp_path / "a").persist_newest(soon())
    refusing = StubFence(1, error=LeaseLostError("i-b", 2))
    standby = persister(s3, tmp_path / "b", refusing)
    assert standby.restore() == 3
    assert refusing.checks == 0 and standby.lease_lost is None


def test_a_fence_that_cannot_read_the_lease_blocks_the_write_and_is_retried_not_taken_for_lost(
    s3: Any, tmp_path: Path
) -> None:
    response: Any = {"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}
    unreachable = ClientError(response, "GetObject")
    fence = StubFence(1, error=unreachable)
    owner = persister(s3, tmp_path / "a", fence)
    commit_step(tmp_path / "a", 3)
    with pytest.raises(ClientError):
        owner.persist_newest(soon())
    assert keys(s3) == set() and owner.lease_lost is None, "nothing written unchecked"
    fence.error = None  # S3 answers again
    assert owner.persist_newest(soon()) == 3
    assert latest(s3)["token"] == 1


def test_a_stop_between_files_makes_the_final_flush_upload_only_what_is_missing(
    s3: Any, tmp_path: Path
) -> None:
    """The stop arrives while the background upload is between two files of a step: the final flush must
    not upload the first (multi-GB in real life, in the middle of a two-minute notice) a second time."""
    s3.put_bucket_versioning(Bucket=BUCKET, VersioningConfiguration={"Status": "Enabled"})
    root = tmp_path / "ckpt"
    staging = root / ".step-5.tmp"
    staging.mkdir(parents=True)
    files = {}
    for name in ("model.bin", "optimizer.bin"):
        data = os.urandom(2000)
        (staging / name).write_bytes(data)
        files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (staging / "manifest.json").write_text(json.dumps({"step": 5, "epoch": 0, "files": files}))
    staging.rename(root / "step-5")
    persister = CheckpointPersister(s3, BUCKET, PREFIX, root, Events())
    uploads: list[str] = []
    real_upload = persister._upload_file

    def upload_then_stop(path: Path, relative: str, step: int, deadline: Any, background: bool) -> None:
        real_upload(path, relative, step, deadline, background)
        uploads.append(relative)
        if background and len(uploads) == 1:
            persister._stopping.set()  # the stop begins right after the first file is in S3

    persister._upload_file = upload_then_stop  # type: ignore[method-assign]
    with pytest.raises(Exception, match="a stop began"):
        persister.persist_newest(deadline=None, background=True)
    result = persister.finish(time.monotonic() + 30)
    persister.close()
    assert result.confirmed_step == 5
    assert uploads == ["step-5/model.bin", "step-5/optimizer.bin"], "the first file was uploaded twice"
    versions = s3.list_object_versions(Bucket=BUCKET, Prefix=f"{PREFIX}/step-5/model.bin")["Versions"]
    assert len(versions) == 1


@pytest.mark.parametrize("trick", ["link", "traversal", "linked-folder"])
def test_a_checkpoint_that_points_outside_its_folder_is_never_uploaded(
    s3: Any, tmp_path: Path, trick: str
) -> None:
    """The job (another user) writes the step folder and its manifest; the agent uploads it, maybe as
    root. A link to a file the job cannot read, or a manifest name that leaves the folder, must never carry
    that file into the job's prefix, where the job could read it back."""
    secret = tmp_path / "agent-only.txt"
    secret.write_text("the agent's secret")
    root = tmp_path / "ckpt"
    step = root / "step-7"
    if trick == "linked-folder":
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (elsewhere / "state.bin").symlink_to(secret)
        root.mkdir()
        step.symlink_to(elsewhere)
        name = "state.bin"
    else:
        step.mkdir(parents=True)
        if trick == "link":
            (step / "state.bin").symlink_to(secret)
            name = "state.bin"
        else:
            name = "../../agent-only.txt"
    digest = hashlib.sha256(secret.read_bytes()).hexdigest()
    files = {name: {"sha256": digest, "size": secret.stat().st_size}}
    (step / "manifest.json").write_text(json.dumps({"step": 7, "epoch": 0, "files": files}))
    persister = CheckpointPersister(s3, BUCKET, PREFIX, root, Events())
    result = persister.finish(time.monotonic() + 10)
    persister.close()
    assert not result.confirmed
    listed = s3.list_objects_v2(Bucket=BUCKET).get("Contents", [])
    assert listed == [], [o["Key"] for o in listed]

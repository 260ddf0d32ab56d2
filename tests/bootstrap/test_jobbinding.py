"""Which job a life serves: the stack's pointer, a second definition after the first ended, a running job
kept on its own code, the legacy layout, and two lives racing to define the stack's job."""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from bootstrap.agent_config import AgentConfig
from bootstrap.eventlog import EventLog
from bootstrap.jobbinding import JobBinding, JobDirectory, bind_job
from bootstrap.pinned import PinnedCodeError, pinned_config, reexec_argv, unpack_bundle
from demo.stack import LocalStack, create_stack
from trainstack_job.queue import list_entries

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)


@pytest.fixture()
def stack(aws: Any) -> LocalStack:
    return create_stack(name="trainstack-binding")


def _config(stack: LocalStack, job_id: str, **more: Any) -> AgentConfig:
    """An agent config defining `job_id`, rendered with that job's own code bundle."""
    return stack.agent_config(
        job_id=job_id,
        job_name=job_id.rsplit("-", 1)[0],
        bundle_key=f"code/{job_id}/bundle.tar.gz",
        bundle_sha256=hashlib.sha256(job_id.encode()).hexdigest(),
        job={"train": {"epochs": 1}, "model": job_id},
        **more,
    )


def _bind(s3: Any, config: AgentConfig) -> JobBinding:
    """The binding of a life whose config defines a job (so there always is one)."""
    binding = bind_job(s3, config, NOW)
    assert binding is not None
    return binding


def _put(stack: LocalStack, key: str, value: dict[str, Any]) -> None:
    stack.client("s3").put_object(Bucket=stack.bucket, Key=key, Body=json.dumps(value).encode())


def _get(stack: LocalStack, key: str) -> dict[str, Any]:
    body = stack.client("s3").get_object(Bucket=stack.bucket, Key=key)["Body"].read()
    value: dict[str, Any] = json.loads(body)
    return value


def test_first_job_becomes_current_and_records_its_definition(stack: LocalStack) -> None:
    s3 = stack.client("s3")
    binding = _bind(s3, _config(stack, "resnet-11111111"))
    assert (binding.job_id, binding.pinned) == ("resnet-11111111", None)
    assert binding.prefixes.checkpoints == "jobs/resnet-11111111/checkpoints/"
    assert _get(stack, "state/current-job.json")["job_id"] == "resnet-11111111"
    record = _get(stack, "jobs/resnet-11111111/job.json")
    assert record["bundle_key"] == "code/resnet-11111111/bundle.tar.gz"
    assert record["agent"]["job"]["model"] == "resnet-11111111"
    # The same definition again (a replacement, a resume): the same job.
    assert _bind(s3, _config(stack, "resnet-11111111")).job_id == "resnet-11111111"


def test_a_new_definition_waits_for_the_running_job_and_takes_over_once_it_ended(stack: LocalStack) -> None:
    s3 = stack.client("s3")
    _bind(s3, _config(stack, "resnet-11111111"))
    _put(stack, "jobs/resnet-11111111/state/ledger.json", {"status": "running", "lives": []})
    # A replacement launched after a `pulumi up` that defined another job: the running job goes on, with
    # the code and definition it started with.
    binding = _bind(s3, _config(stack, "vit-22222222"))
    assert binding.job_id == "resnet-11111111"
    assert binding.pinned is not None and binding.pinned["bundle_key"] == "code/resnet-11111111/bundle.tar.gz"
    merged = pinned_config(_config(stack, "vit-22222222"), binding.pinned)
    assert (merged["job_id"], merged["job"]["model"]) == ("resnet-11111111", "resnet-11111111")
    assert merged["bucket"] == stack.bucket
    # The job's code may predate keys this agent knows: those at their defaults are left out, so an older
    # agent's config loader (which refuses unknown keys) reads what it wrote, and the defaults stay its own.
    assert "dataset_version" not in merged and "allow_data_change" not in merged
    assert AgentConfig.from_mapping(merged).job_id == "resnet-11111111"
    assert _get(stack, "state/current-job.json")["job_id"] == "resnet-11111111"
    # Once it completed, the next definition is the stack's job: under its own prefix, from step 0.
    _put(stack, "jobs/resnet-11111111/state/ledger.json", {"status": "completed", "lives": []})
    binding = _bind(s3, _config(stack, "vit-22222222"))
    assert (binding.job_id, binding.pinned, binding.switched_from) == (
        "vit-22222222",
        None,
        "resnet-11111111",
    )
    assert binding.prefixes.results == "jobs/vit-22222222/results/"
    assert _get(stack, "state/current-job.json") | {"since": None} == {
        "job_id": "vit-22222222",
        "since": None,
        "previous": "resnet-11111111",
    }


def test_a_stopped_job_is_resumed_by_a_new_boot_once_its_stop_request_is_withdrawn(stack: LocalStack) -> None:
    """`trainstack stop` then `trainstack run`: the next queued job runs; `trainstack resume` (the stop
    request deleted): the stopped job goes on. A life that just ended it on this instance moves on."""
    s3 = stack.client("s3")
    _bind(s3, _config(stack, "resnet-11111111"))
    _put(stack, "jobs/resnet-11111111/state/ledger.json", {"status": "stopped", "lives": []})
    _put(stack, "jobs/resnet-11111111/state/control.json", {"action": "stop"})
    defines_none = stack.agent_config(job_id="")
    assert bind_job(s3, defines_none, NOW) is None, "a stopped job, nothing else queued: no job"
    s3.delete_object(Bucket=stack.bucket, Key="jobs/resnet-11111111/state/control.json")
    resumed = bind_job(s3, defines_none, NOW)
    assert resumed is not None and (resumed.job_id, resumed.switched_from) == ("resnet-11111111", None)
    assert resumed.config is not None and resumed.config.job["model"] == "resnet-11111111"
    assert bind_job(s3, defines_none, NOW, after="resnet-11111111") is None


def test_a_running_stack_from_before_jobs_keeps_its_objects_as_the_legacy_job(stack: LocalStack) -> None:
    s3 = stack.client("s3")
    _put(stack, "state/ledger.json", {"status": "running", "lives": []})
    binding = _bind(s3, _config(stack, "resnet-11111111"))
    assert binding.job_id == "legacy"
    assert (binding.prefixes.checkpoints, binding.prefixes.results, binding.prefixes.state) == (
        "checkpoints/",
        "results/",
        "state/",
    )
    # Once the legacy job ended, the defined job takes the stack.
    _put(stack, "state/ledger.json", {"status": "completed", "lives": []})
    assert _bind(s3, _config(stack, "resnet-11111111")).job_id == "resnet-11111111"


def test_two_definitions_booting_at_once_agree_on_one_job(stack: LocalStack) -> None:
    results: dict[str, str] = {}
    barrier = threading.Barrier(2)

    def boot(job_id: str) -> None:
        s3 = stack.client("s3")
        barrier.wait()
        results[job_id] = _bind(s3, _config(stack, job_id)).job_id

    threads = [threading.Thread(target=boot, args=(j,)) for j in ("resnet-11111111", "vit-22222222")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winner = _get(stack, "state/current-job.json")["job_id"]
    assert set(results.values()) == {winner}


def test_two_nodes_of_a_config_from_before_jobs_booting_together_both_serve_it(stack: LocalStack) -> None:
    """The first node points the stack at the legacy job; the second binds before the first has begun its
    life (no ledger yet) and must serve the same job, never read it as "no job" and scale the group to 0."""
    s3 = stack.client("s3")
    legacy = stack.agent_config(instance_count=2)
    assert legacy.job_id == "legacy"
    first = bind_job(s3, legacy, NOW)
    assert first is not None and first.job_id == "legacy"
    second = bind_job(s3, legacy, NOW)
    assert second is not None and second.job_id == "legacy"
    # A config that defines a job of its own does not continue a legacy pointer with nothing behind it.
    mine = bind_job(s3, _config(stack, "resnet-11111111"), NOW)
    assert mine is not None and mine.job_id == "resnet-11111111"


@pytest.mark.parametrize(
    "body",
    [
        b"[]",
        b"{}",
        b'{"job_id": 7}',
        b'{"job_id": "../x"}',
        b"\xff\xfe",
        b"[" * 200_000,
        b" " * (1024 * 1024 + 1),
    ],
    ids=["list", "empty", "number", "bad-id", "not-utf8", "nested", "huge"],
)
def test_a_damaged_pointer_is_named_once_and_replaced_by_the_queues_head(
    stack: LocalStack, body: bytes
) -> None:
    """One damaged object must not stop the stack: the pointer is replaced (conditionally, against the
    damaged object's ETag) by the oldest queued job, and the damage is one line for the whole life."""
    s3 = stack.client("s3")
    s3.put_object(Bucket=stack.bucket, Key="state/current-job.json", Body=body)
    events = io.StringIO()
    log = EventLog(stream=events)
    reported: set[str] = set()
    config = _config(stack, "resnet-11111111")
    for _ in range(3):
        binding = bind_job(s3, config, NOW, log=log, reported=reported)
        assert binding is not None and binding.job_id == "resnet-11111111"
    assert _get(stack, "state/current-job.json")["job_id"] == "resnet-11111111"
    lines = [json.loads(line) for line in events.getvalue().splitlines()]
    damaged = [
        line
        for line in lines
        if "is not a job pointer" in line["message"] or "bytes: not read" in line["message"]
    ]
    assert len(damaged) == 1 and len(damaged[0]["message"]) < 300, damaged
    assert "current-job.json" in damaged[0]["message"]


def _bundle(files: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_pinned_code_is_checked_before_it_is_unpacked(stack: LocalStack, tmp_path: Path) -> None:
    s3 = stack.client("s3")
    data = _bundle({"bootstrap/agent.py": "print('old code')\n"})
    sha = hashlib.sha256(data).hexdigest()
    s3.put_object(Bucket=stack.bucket, Key="code/x/bundle.tar.gz", Body=data)
    record = {"job_id": "resnet-11111111", "bundle_key": "code/x/bundle.tar.gz", "bundle_sha256": sha}
    code = unpack_bundle(s3, stack.bucket, record, tmp_path / "code")
    assert (code / "bootstrap" / "agent.py").read_text() == "print('old code')\n"
    assert code == tmp_path / "code" / sha
    # The object replaced after the job started: refused, naming the object.
    with pytest.raises(PinnedCodeError, match=r"code/x/bundle.tar.gz: sha256 .* is not job resnet-11111111"):
        unpack_bundle(s3, stack.bucket, record | {"bundle_sha256": "f" * 64}, tmp_path / "other")
    # Missing, not a gzipped tar, without the agent, a sha256 that is not one: each refused in one line.
    record = {"job_id": "resnet-11111111", "bundle_key": "code/gone/bundle.tar.gz", "bundle_sha256": "e" * 64}
    with pytest.raises(
        PinnedCodeError,
        match=r"code/gone/bundle.tar.gz: job resnet-11111111's code bundle is missing; submit",
    ):
        unpack_bundle(s3, stack.bucket, record, tmp_path / "gone")
    for name, body, why in [
        ("corrupt", b"not a tar at all", "cannot be unpacked"),
        ("empty", _bundle({"README": "hi"}), "holds no bootstrap/agent.py"),
    ]:
        s3.put_object(Bucket=stack.bucket, Key=f"code/{name}/bundle.tar.gz", Body=body)
        bad = {
            **record,
            "bundle_key": f"code/{name}/bundle.tar.gz",
            "bundle_sha256": hashlib.sha256(body).hexdigest(),
        }
        with pytest.raises(PinnedCodeError, match=why):
            unpack_bundle(s3, stack.bucket, bad, tmp_path / name)
        assert not list((tmp_path / name).glob("*")), "nothing half-unpacked is left"
    with pytest.raises(PinnedCodeError, match="bundle_sha256 is not a sha256"):
        unpack_bundle(s3, stack.bucket, {**record, "bundle_sha256": "../../etc"}, tmp_path / "x")
    argv = reexec_argv(["-m", "bootstrap.agent", "--config", "/etc/trainstack/agent.yaml"], code / "a.yaml")
    assert argv == [sys.executable, "-m", "bootstrap.agent", "--config", str(code / "a.yaml")]


def test_the_queue_is_fifo_by_s3s_clock_not_the_submitters(stack: LocalStack) -> None:
    """A laptop whose clock runs an hour ahead submits first: its job still runs first. Entries S3 stored in
    the same second keep the order of their `submitted_at` (a sweep writes its grid in order)."""
    ahead = "2026-12-01T13:00:00+00:00"  # the skewed submitter: an hour ahead of the one after it
    _put(stack, "queue/early-skewed-a1.json", {"job_id": "early-skewed-a1", "submitted_at": ahead})
    time.sleep(1.1)  # the next entry lands in a later second of S3's clock (LastModified: 1 s resolution)
    _put(stack, "queue/later-b2.json", {"job_id": "later-b2", "submitted_at": "2026-12-01T12:00:00+00:00"})
    # The sweep's two entries in one second of S3's clock (moto's runs on this machine): written at the
    # start of a fresh second, whatever the write order, submitted_at decides.
    s3 = stack.client("s3")
    for _ in range(5):
        time.sleep(1.05 - time.time() % 1)
        for point in ("c4", "c3"):
            at = "2026-12-01T12:00:0" + point[-1] + "+00:00"
            _put(stack, f"queue/sweep-{point}.json", {"job_id": f"sweep-{point}", "submitted_at": at})
        keys = ("queue/sweep-c4.json", "queue/sweep-c3.json")
        stored = {s3.head_object(Bucket=stack.bucket, Key=key)["LastModified"] for key in keys}
        # Two puts can straddle a second on a loaded machine: then they are written again, in a fresh one.
        if len(stored) == 1:
            break
    else:
        raise AssertionError("five tries could not write the sweep's two entries in one second of S3's clock")

    agent_order = [e.job_id for e in JobDirectory(s3, _config(stack, "unused-x1")).entries()]
    cli_order = [e.job_id for e in list_entries(s3, stack.bucket)]

    assert agent_order == cli_order == ["early-skewed-a1", "later-b2", "sweep-c3", "sweep-c4"]

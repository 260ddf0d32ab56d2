"""The job is contained (issue 34), in what the agent (root on an instance) reads from the job's folders:

- `output/` is uploaded to the job's results prefix, which the job can read back: a link there (to
  /etc/shadow, to a folder of root's) is never followed, each is named in one line, and a file swapped for a
  link after the walk saw it is still read from the descriptor the walk opened, never through the link;
- `output/progress.json` is polled every tick: a FIFO there never blocks the agent's loop, a link (to
  /dev/zero, to a file of root's) is never followed, a huge or deeply nested file is no progress;
- a link the job plants at a signal file is named in the agent's log, not in the job's own output.

Each stand-in for a file only root may read (/etc/shadow) lives in tmp_path. The reads that would hang or
exhaust memory on a regression run in a child process with a deadline and a memory cap, so a regression
fails the test instead of the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import boto3
import pytest
from boto3.exceptions import S3UploadFailedError

from bootstrap.results import upload_results
from bootstrap.safefiles import PlantedLinkError
from bootstrap.trainer import TrainerPaths
from bootstrap.watchdog import MAX_PROGRESS_BYTES, read_progress
from tests.bootstrap.test_secrets import _supervisor
from tests.conftest import MotoServer
from trainstack_job.jobfile import JobSpec

BUCKET = "trainstack-contained-outputs"
PREFIX = "jobs/demo-1a2b3c4d/results/"
SHADOW = b"root:$6$not-for-the-job:19000:0:99999:7:::\n"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def s3(aws: MotoServer) -> Any:
    client = boto3.client("s3", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    return client


def _shadow(tmp_path: Path) -> Path:
    """A stand-in for /etc/shadow: a file outside the job's folders, which only root may read."""
    secret = tmp_path / "etc" / "shadow"
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_bytes(SHADOW)
    return secret


def _uploaded(s3: Any) -> dict[str, bytes]:
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=PREFIX).get("Contents", [])
    return {item["Key"]: s3.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read() for item in listed}


# --- results: output/ ---------------------------------------------------------------------------------------


def test_a_link_in_output_is_never_uploaded_and_each_is_named_once(s3: Any, tmp_path: Path) -> None:
    secret = _shadow(tmp_path)
    output = tmp_path / "scratch" / "output"
    (output / "nested").mkdir(parents=True)
    (output / "model.pt").write_bytes(b"weights")
    (output / "nested" / "metrics.json").write_text('{"loss": 1.0}')
    (output / "shadow").symlink_to(secret)
    (output / "nested" / "shadow").symlink_to(secret)
    (output / "etc").symlink_to(secret.parent, target_is_directory=True)  # a linked folder: not walked
    (output / ".hidden").write_text("editor dropping")
    said: list[str] = []
    keys = upload_results(s3, BUCKET, PREFIX, output, say=said.append)
    assert keys == [PREFIX + "model.pt", PREFIX + "nested/metrics.json"]
    uploaded = _uploaded(s3)
    assert uploaded == {PREFIX + "model.pt": b"weights", PREFIX + "nested/metrics.json": b'{"loss": 1.0}'}
    assert not any(SHADOW in body for body in uploaded.values())
    assert said == [
        f"{output / 'etc'}: a link (to {secret.parent}); not followed, left out",
        f"{output / 'nested' / 'shadow'}: a link (to {secret}); not followed, left out",
        f"{output / 'shadow'}: a link (to {secret}); not followed, left out",
    ]


def test_a_file_swapped_for_a_link_after_the_walk_saw_it_is_uploaded_as_it_was(
    s3: Any, tmp_path: Path
) -> None:
    secret = _shadow(tmp_path)
    output = tmp_path / "scratch" / "output"
    output.mkdir(parents=True)
    (output / "model.pt").write_bytes(b"weights")

    class Swapping:
        """The job swaps the file for a link between the agent's look at it and the transfer's open."""

        def upload_file(self, filename: str, *args: Any, **kwargs: Any) -> None:
            (output / "model.pt").unlink()
            (output / "model.pt").symlink_to(secret)
            s3.upload_file(filename, *args, **kwargs)

    upload_results(Swapping(), BUCKET, PREFIX, output, say=lambda line: None)
    assert _uploaded(s3) == {PREFIX + "model.pt": b"weights"}


def test_a_fifo_in_output_is_left_out_without_blocking(s3: Any, tmp_path: Path) -> None:
    output = tmp_path / "scratch" / "output"
    output.mkdir(parents=True)
    os.mkfifo(output / "pipe")
    (output / "model.pt").write_bytes(b"weights")
    said: list[str] = []
    assert upload_results(s3, BUCKET, PREFIX, output, say=said.append) == [PREFIX + "model.pt"]
    assert said == [f"{output / 'pipe'}: not a regular file or folder; left out"]


def test_an_output_folder_that_is_a_link_is_refused_and_a_missing_one_holds_nothing(
    s3: Any, tmp_path: Path
) -> None:
    secret = _shadow(tmp_path)
    output = tmp_path / "scratch" / "output"
    output.parent.mkdir(parents=True)
    assert upload_results(s3, BUCKET, PREFIX, output) == []
    output.symlink_to(secret.parent, target_is_directory=True)
    with pytest.raises(PlantedLinkError, match="not followed"):
        upload_results(s3, BUCKET, PREFIX, output)
    assert _uploaded(s3) == {}


def test_a_failed_upload_names_the_file_as_the_job_wrote_it(aws: MotoServer, tmp_path: Path) -> None:
    output = tmp_path / "scratch" / "output"
    output.mkdir(parents=True)
    (output / "model.pt").write_bytes(b"weights")
    client = boto3.client("s3", region_name="us-east-1")  # no bucket: the upload fails
    with pytest.raises(S3UploadFailedError) as failed:
        upload_results(client, BUCKET, PREFIX, output)
    assert str(output / "model.pt") in str(failed.value)
    assert "/proc/self/fd" not in str(failed.value)


# --- progress.json ------------------------------------------------------------------------------------------

_CHILD = """
import resource, sys
from pathlib import Path
limit = 512 * 2**20
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from bootstrap.watchdog import read_progress
print(repr(read_progress(Path(sys.argv[1]))))
"""


def _read_in_child(path: Path, seconds: float = 20) -> str:
    """read_progress(path) in a child with a deadline and a memory cap: a regression that blocks on a FIFO or
    reads /dev/zero forever fails here, killed, instead of hanging or exhausting the test run."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, str(path)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=seconds,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"read_progress({path}) still blocked after {seconds}s")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_fifo_at_progress_json_returns_no_progress_promptly(tmp_path: Path) -> None:
    progress = tmp_path / "output" / "progress.json"
    progress.parent.mkdir()
    os.mkfifo(progress)
    assert _read_in_child(progress) == "None"


def test_a_link_to_dev_zero_at_progress_json_is_not_followed(tmp_path: Path) -> None:
    progress = tmp_path / "output" / "progress.json"
    progress.parent.mkdir()
    progress.symlink_to("/dev/zero")
    assert _read_in_child(progress) == "None"


def test_a_link_to_a_file_outside_is_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "etc" / "root-only.json"
    outside.parent.mkdir()
    outside.write_text(json.dumps({"step": 7, "secret": "root's"}))
    progress = tmp_path / "output" / "progress.json"
    progress.parent.mkdir()
    progress.symlink_to(outside)
    assert read_progress(progress) is None


def test_an_oversized_or_deeply_nested_file_is_no_progress(tmp_path: Path) -> None:
    progress = tmp_path / "output" / "progress.json"
    progress.parent.mkdir()
    progress.write_text(json.dumps({"step": 3, "pad": "x" * MAX_PROGRESS_BYTES}))
    assert read_progress(progress) is None
    progress.write_text("[" * 100_000 + "]" * 100_000)
    assert read_progress(progress) is None


def test_a_regular_progress_file_is_still_read(tmp_path: Path) -> None:
    progress = tmp_path / "output" / "progress.json"
    assert read_progress(progress) is None, "missing: no progress yet"
    progress.parent.mkdir()
    progress.write_text(json.dumps({"step": 12, "loss": 0.5}))
    assert read_progress(progress) == {"step": 12, "loss": 0.5}
    progress.write_text('{"step": 1')  # mid-write
    assert read_progress(progress) is None
    progress.write_bytes(b"\xff\xfe{")  # not UTF-8
    assert read_progress(progress) is None


# --- the supervisor: planted links are the agent's to say -------------------------------------------------


def _user_job(tmp_path: Path) -> JobSpec:
    root = tmp_path / "jobroot"
    root.mkdir(exist_ok=True)
    (root / "job.py").write_text("print('training')\n")
    raw = {"name": "planted", "command": ["python", "job.py"]}
    return JobSpec.from_mapping(raw, "job.yaml", base_dir=root)


@pytest.mark.parametrize("kind", ["built-in trainer", "user job"])
def test_a_link_planted_at_a_signal_file_is_named_in_the_agents_log_not_the_jobs_output(
    tmp_path: Path, kind: str
) -> None:
    user_job = _user_job(tmp_path) if kind == "user job" else None
    supervisor, stream = _supervisor(tmp_path, user_job=user_job)
    shipped: list[str] = []
    paths = TrainerPaths(scratch=tmp_path / "scratch")
    trainer = supervisor.job_process(
        paths, 0, None, identity=None, spot_interruptions=(0, 0.0), log_sink=lambda: shipped.append
    )
    secret = _shadow(tmp_path)
    paths.control_dir.mkdir(parents=True)
    planted = paths.control_dir / "STOP"
    planted.symlink_to(secret)
    trainer.request_stop()
    assert secret.read_bytes() == SHADOW
    line = f"{planted}: the job had put a link here (to {secret}); replaced by a regular file, not followed"
    records = [json.loads(entry) for entry in stream.getvalue().splitlines()]
    said = [{k: v for k, v in r.items() if k != "time"} for r in records if r["message"] == line]
    assert said == [{"stage": "job", "message": line, "level": "warning"}]
    assert not [entry for entry in shipped if "put a link" in entry], "the job's output holds no agent line"


def test_the_final_metrics_are_never_read_through_a_link_or_a_fifo(tmp_path: Path) -> None:
    """The completion e-mail and the ledger quote output/metrics.json: a link the job planted to a root-only
    JSON file is not read, nor is a FIFO (it would hang the job's end); the job's own file still is."""
    from bootstrap.outcomes import _metrics

    output = tmp_path / "output"
    output.mkdir()
    secret = tmp_path / "root-only.json"
    secret.write_text('{"aws_secret": "stand-in"}')
    (output / "metrics.json").symlink_to(secret)
    assert _metrics(output) is None
    (output / "metrics.json").unlink()
    os.mkfifo(output / "metrics.json")
    started = time.monotonic()
    assert _metrics(output) is None and time.monotonic() - started < 5
    (output / "metrics.json").unlink()
    (output / "metrics.json").write_text('{"val_acc": 0.9}')
    assert _metrics(output) == {"val_acc": 0.9}

"""The recorder: one JSON line per call, as the caller named it, only when TRAINSTACK_IAM_RECORD is set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from botocore.stub import Stubber

from bootstrap import aws


def test_the_agents_clients_record_each_call_without_its_body(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(aws.IAM_RECORD_ENV, str(tmp_path))
    s3 = aws.client("s3", "us-east-1")
    with Stubber(s3) as stub:
        stub.add_response(
            "put_object", {}, {"Bucket": "b-data", "Key": "jobs/a", "Body": b"x", "IfNoneMatch": "*"}
        )
        s3.put_object(Bucket="b-data", Key="jobs/a", Body=b"x", IfNoneMatch="*")
    (recording,) = tmp_path.glob("instance-role-*.jsonl")
    (line,) = recording.read_text().splitlines()
    call = json.loads(line)
    assert {k: call[k] for k in ("principal", "service", "operation", "region", "params")} == {
        "principal": "instance-role",
        "service": "s3",
        "operation": "PutObject",
        "region": "us-east-1",
        "params": {"Bucket": "b-data", "Key": "jobs/a", "IfNoneMatch": "*"},
    }


def test_nothing_is_recorded_unless_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(aws.IAM_RECORD_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    s3 = aws.client("s3", "us-east-1")
    with Stubber(s3) as stub:
        stub.add_response("get_bucket_location", {}, {"Bucket": "b-data"})
        s3.get_bucket_location(Bucket="b-data")
    assert not list(tmp_path.rglob("*.jsonl"))

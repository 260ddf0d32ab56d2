"""The generation fence's own promises, in memory (bootstrap/generation_fence.py; `make mutate fence`): what a
superseded node is told and where, what a record S3 cannot find or cannot hand over means, and the token
before a node's first join. The fence against moto and real persisters: test_generation_fence.py."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from botocore.exceptions import ClientError

from bootstrap.generation_fence import LATEST_KEY, GenerationFence, GenerationSupersededError
from bootstrap.lease import LeaseLostError
from bootstrap.rendezvous import RECORD, Generation

BUCKET = "trainstack-fence"
STATE = "jobs/multi-1a2b3c4d/state/"
URI = f"s3://{BUCKET}/{STATE}{RECORD}"
ME = "i-0aaaaaaaaaaaaaaaa"
OTHER = "i-0bbbbbbbbbbbbbbbb"


class RecordStore:
    """S3's GetObject of the generation record: a record, nothing (an S3 error code), or a refusal."""

    def __init__(self) -> None:
        self.body: bytes | None = None
        self.error: dict[str, Any] | None = None
        self.reads: list[tuple[str, str]] = []

    def put(self, number: int, host: str) -> None:
        generation = Generation(number, host, "10.0.0.1:29400", f"job-g{number}", 1_800_000_000.0, 1, 3)
        self.body = json.dumps(generation.to_record()).encode()

    def get_object(self, *, Bucket: str, Key: str) -> dict[str, Any]:  # noqa: N803 (boto3's names)
        self.reads.append((Bucket, Key))
        if self.error is not None:
            raise ClientError(self.error, "GetObject")  # type: ignore[arg-type]
        if self.body is None:
            raise ClientError({"Error": {"Code": "NoSuchKey"}}, "GetObject")
        return {"Body": io.BytesIO(self.body)}


@pytest.fixture()
def store() -> RecordStore:
    return RecordStore()


def fence(store: RecordStore) -> GenerationFence:
    return GenerationFence(store, BUCKET, STATE, instance_id=ME)


def test_a_superseded_node_is_told_which_generation_owns_the_job_where_and_that_it_stopped_writing(
    store: RecordStore,
) -> None:
    mine = fence(store)
    mine.enter(2)
    store.put(3, OTHER)
    with pytest.raises(GenerationSupersededError) as raised:
        mine.check()
    error = raised.value
    assert store.reads == [(BUCKET, f"{STATE}{RECORD}")]
    assert str(error) == (
        f"{URI}: generation 3 owns the job (this node trained in generation 2): "
        "this node no longer writes the job's checkpoints"
    )
    assert (error.generation, error.newer) == (2, 3)
    # The lease's fields, which the persister's log and the stop request read for any lost fence.
    assert isinstance(error, LeaseLostError)
    assert (error.holder, error.token, error.uri) == ("generation 3", 3, URI)
    assert error.lost_line == (
        "generation 3 owns the job (this node trained in generation 2): "
        "this node no longer writes the job's checkpoints"
    )
    assert "NOT confirmed" in error.not_confirmed_line and "declared lost" in error.not_confirmed_line


def test_an_error_made_without_a_place_names_none() -> None:
    error = GenerationSupersededError(4, 6)
    assert str(error) == (
        "generation 6 owns the job (this node trained in generation 4): "
        "this node no longer writes the job's checkpoints"
    )
    assert error.uri == ""


def test_a_newer_generation_in_latest_json_is_reported_with_this_nodes_generation_and_the_place(
    store: RecordStore,
) -> None:
    mine = fence(store)
    mine.enter(5)
    latest = f"s3://{BUCKET}/jobs/multi-1a2b3c4d/checkpoints/latest.json"
    error = mine.superseded(7, latest)
    assert isinstance(error, GenerationSupersededError)
    assert (error.generation, error.newer, error.token, error.uri) == (5, 7, 7, latest)
    assert str(error).startswith(f"{latest}: generation 7 owns the job (this node trained in generation 5)")
    assert mine.latest_key == LATEST_KEY == "generation"


@pytest.mark.parametrize("code", ["NoSuchKey", "404", "NotFound"])
def test_a_record_s3_does_not_have_names_no_generation(store: RecordStore, code: str) -> None:
    store.error = {"Error": {"Code": code}}
    assert fence(store).current() is None


def test_an_answer_without_an_error_code_is_not_absent_and_is_raised() -> None:
    """(A refusal or a throttle with its code: test_generation_fence.py, against moto.) An answer without
    one (as a proxy may give) names no "not found" either: unknown, raised as S3 said."""
    store = RecordStore()
    store.error = {}
    with pytest.raises(ClientError):
        fence(store).current()
    with pytest.raises(ClientError):
        fence(store).check()


def test_before_its_first_join_a_node_without_a_record_has_no_generation_until_one_is_written(
    store: RecordStore,
) -> None:
    mine = fence(store)
    assert mine.check() is None and mine.token == 0
    store.put(4, OTHER)
    # Still before its first join: the generation the record names now is the one it will join.
    checked = mine.check()
    assert checked is not None and checked.number == 4 and mine.token == 4
    store.put(5, OTHER)
    with pytest.raises(GenerationSupersededError):
        mine.check()


def test_a_lower_or_equal_generation_entered_changes_nothing_and_a_higher_one_raises_the_token(
    store: RecordStore,
) -> None:
    mine = fence(store)
    mine.enter(3)
    mine.enter(2)
    assert mine.token == 3
    mine.enter(3)
    assert mine.token == 3
    mine.enter(4)
    assert mine.token == 4

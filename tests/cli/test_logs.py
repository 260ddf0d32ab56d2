"""`trainstack logs [-f]`: the log group's streams in time order, followed without repeats."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone

import boto3
import pytest
from botocore.stub import ANY, Stubber

from trainstack.aws import Clients
from trainstack.errors import CliError
from trainstack.logs import LogReader, follow, parse_since

from .conftest import LOG_GROUP, REGION, Deployed


def _put(stream: str, *events: tuple[int, str]) -> None:
    logs = boto3.client("logs", region_name=REGION)
    if not logs.describe_log_streams(logGroupName=LOG_GROUP, logStreamNamePrefix=stream)["logStreams"]:
        logs.create_log_stream(logGroupName=LOG_GROUP, logStreamName=stream)
    logs.put_log_events(
        logGroupName=LOG_GROUP,
        logStreamName=stream,
        logEvents=[{"timestamp": ts, "message": message} for ts, message in events],
    )


def _now_ms() -> int:
    return int(time.time() * 1000)


def test_logs_merge_the_streams_in_time_order(deployed: Deployed):
    now = _now_ms()
    _put("i-aaa/agent", (now - 3000, "agent: preflight ok"), (now - 1000, "agent: trainer started"))
    _put("i-aaa/trainer", (now - 2000, "trainer: restored step 1000"))

    result = deployed.run("logs", "--since", "5m")

    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert [line.split(" ", 2)[1:] for line in lines] == [
        ["i-aaa/agent", "agent: preflight ok"],
        ["i-aaa/trainer", "trainer: restored step 1000"],
        ["i-aaa/agent", "agent: trainer started"],
    ]


def test_logs_json_is_one_object_per_line(deployed: Deployed):
    now = _now_ms()
    _put("i-aaa/agent", (now - 1000, "from a"))
    _put("i-bbb/agent", (now - 500, "from b"))

    result = deployed.run("logs", "--json")

    assert result.code == 0, result.err
    events = [json.loads(line) for line in result.out.splitlines()]
    assert [(e["stream"], e["message"]) for e in events] == [
        ("i-aaa/agent", "from a"),
        ("i-bbb/agent", "from b"),
    ]
    assert datetime.fromisoformat(events[0]["timestamp"]).tzinfo is not None


def test_stream_option_asks_cloudwatch_for_that_prefix_only(deployed: Deployed):
    # FAKE at the client boundary: moto ignores logStreamNamePrefix, so a stubbed client checks the
    # request the CLI builds and answers as CloudWatch Logs would.
    logs = boto3.client("logs", region_name=REGION)
    stub = Stubber(logs)
    stub.add_response(
        "filter_log_events",
        {
            "events": [
                {
                    "logStreamName": "i-bbb/agent",
                    "timestamp": 1_700_000_000_000,
                    "message": "from b\n",
                    "eventId": "1",
                    "ingestionTime": 1_700_000_000_001,
                }
            ]
        },
        {"logGroupName": LOG_GROUP, "startTime": ANY, "logStreamNamePrefix": "i-bbb"},
    )
    stub.activate()

    result = deployed.run("logs", "--stream", "i-bbb", clients=Clients(None, overrides={"logs": logs}))

    assert result.code == 0, result.err
    assert result.out == "2023-11-14T22:13:20.000+00:00 i-bbb/agent from b\n"
    stub.assert_no_pending_responses()


def test_logs_older_than_since_are_left_out(deployed: Deployed):
    now = _now_ms()
    _put("i-aaa/agent", (now - 2 * 3600 * 1000, "old"), (now - 1000, "new"))
    result = deployed.run("logs", "--since", "1h")
    assert "new" in result.out and "old" not in result.out


def test_follow_prints_each_new_event_once(aws, deployed: Deployed, capsys: pytest.CaptureFixture[str]):
    start = _now_ms()
    _put("i-aaa/agent", (start - 1000, "first"))
    later = iter([[(start, "second"), (start, "second twin")], [(start + 1000, "third")]])

    def sleep(_: float) -> None:
        # Between polls the instance writes more, including one with the same timestamp as the last seen.
        batch = next(later, None)
        if batch:
            _put("i-aaa/agent", *batch)

    reader = LogReader(Clients(REGION), LOG_GROUP, datetime.now(timezone.utc) - timedelta(minutes=1))
    capsys.readouterr()
    follow(reader, as_json=False, poll_seconds=0, sleep=sleep, polls=4)

    messages = [line.split(" ", 2)[2] for line in capsys.readouterr().out.splitlines()]
    assert messages == ["first", "second", "second twin", "third"]


def test_follow_returns_an_event_another_stream_shipped_late(aws, deployed: Deployed):
    """Each instance ships its agent and trainer streams in batches of its own: the trainer's newer lines can
    be searchable before the agent's older "trainer starting". The reader still returns that line, once."""
    now = _now_ms()
    reader = LogReader(Clients(REGION), LOG_GROUP, datetime.now(timezone.utc) - timedelta(minutes=5))
    _put("job/i-bbb/trainer", (now - 2000, "trainer: resuming at step 21"), (now, "trainer: step 22"))
    assert [e.message for e in reader.read()] == ["trainer: resuming at step 21", "trainer: step 22"]

    _put("job/i-bbb/agent", (now - 3000, "agent: trainer starting"))
    assert [e.message for e in reader.read()] == ["agent: trainer starting"]
    assert reader.read() == []

    # Older than the look-back behind the newest event: left out, not returned again when its id is forgotten.
    far = now + int(LogReader.LOOKBACK.total_seconds() * 1000) + 5000
    _put("job/i-bbb/trainer", (far, "trainer: step 99"))
    assert [e.message for e in reader.read()] == ["trainer: step 99"]
    _put("job/i-bbb/agent", (now - 1000, "agent: too late to follow"))
    assert reader.read() == []


def test_logs_of_a_missing_log_group_is_one_line(deployed: Deployed):
    boto3.client("logs", region_name=REGION).delete_log_group(logGroupName=LOG_GROUP)
    result = deployed.run("logs")
    assert result.code == 1
    assert result.err.count("\n") == 1
    assert f"log group {LOG_GROUP} not found" in result.err


@pytest.mark.parametrize(("text", "seconds"), [("30s", 30), ("10m", 600), ("2h", 7200), ("1d", 86400)])
def test_since_accepts_a_number_and_a_unit(text: str, seconds: int):
    assert parse_since(text).total_seconds() == seconds


def test_since_rejects_anything_else_with_an_example():
    with pytest.raises(CliError, match=r"--since '1 week'.*e\.g\. --since 30m"):
        parse_since("1 week")

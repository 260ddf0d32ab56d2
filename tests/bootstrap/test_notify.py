"""Notifications a person reads: SNS's subject limit never hides that something was cut, and a publish that
fails never takes the instance's life down with it."""

from __future__ import annotations

import io
import json
from typing import Any

from bootstrap.eventlog import EventLog
from bootstrap.notify import Notifier


class Topic:
    """SNS as it behaves: a subject over 100 characters is refused."""

    def __init__(self, fail: bool = False) -> None:
        self.sent: list[dict[str, Any]] = []
        self.fail = fail

    def publish(self, **request: Any) -> None:
        if self.fail:
            raise ConnectionError("sns.us-east-1.amazonaws.com unreachable")
        if len(request["Subject"]) > 100:
            raise ValueError("Invalid parameter: Subject")
        self.sent.append(request)


def test_a_long_subject_is_cut_visibly_and_the_message_keeps_every_word() -> None:
    topic, out = Topic(), io.StringIO()
    notifier = Notifier(topic, "arn:aws:sns:us-east-1:123456789012:t", "research-stack", EventLog(out))
    next_job = "sweep-resnet50-imagenet-lr0.1-bs256-wd0.0001-20261201-1912"
    subject = f"job sweep-resnet50-imagenet-lr0.03-bs256-wd0.0001: training completed; next: {next_job}"

    assert notifier.publish(subject, [f"The next queued job, {next_job}, runs on this instance now."])

    (sent,) = topic.sent
    assert len(sent["Subject"]) == 100 and sent["Subject"].endswith("…")
    assert sent["Subject"].startswith("trainstack [research-stack]: job sweep-resnet50")
    assert next_job in sent["Message"]
    short = "job a: training completed"
    assert notifier.publish(short, ["done"])
    assert topic.sent[-1]["Subject"] == f"trainstack [research-stack]: {short}"


def test_a_failed_publish_is_logged_with_the_topic_and_never_raised() -> None:
    out = io.StringIO()
    notifier = Notifier(Topic(fail=True), "arn:aws:sns:us-east-1:123456789012:t", "s", EventLog(out))

    assert notifier.publish("training completed", ["done"]) is False

    (event,) = [json.loads(line) for line in out.getvalue().splitlines()]
    assert event["message"] == "SNS publish failed" and event["topic"].endswith(":t")
    assert "unreachable" in event["error"]

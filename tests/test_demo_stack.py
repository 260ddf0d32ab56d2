"""demo/stack.py: a process that creates many stacks makes each client once per endpoint."""

from __future__ import annotations

from typing import Any

import boto3
import pytest

from demo import stack as demo_stack
from tests.conftest import MotoServer


def test_stacks_share_their_clients_per_endpoint_and_each_stack_works(
    aws: MotoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[str] = []
    client = boto3.client

    def counted(service: str, *args: Any, **kwargs: Any) -> Any:
        made.append(service)
        return client(service, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(demo_stack, "_made", {})
    monkeypatch.setattr(boto3, "client", counted)
    first = demo_stack.create_stack("trainstack-first")
    once = sorted(made)
    assert once == ["autoscaling", "ec2", "kms", "logs", "s3", "sns", "sqs"]
    second = demo_stack.create_stack("trainstack-second")
    assert sorted(made) == once, "the second stack made its clients again"
    assert second.client("s3") is first.client("s3")
    assert second.group()["AutoScalingGroupName"] != first.group()["AutoScalingGroupName"]

    # Another endpoint (a test's fault proxy, another server): clients of its own, pointing there.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    elsewhere = demo_stack._client("s3", first.region)
    assert elsewhere is not first.client("s3")
    assert elsewhere.meta.endpoint_url == "http://127.0.0.1:9"

"""The embedded AWS endpoint (demo/moto_server.py): moto still routes with its service list cached."""

from __future__ import annotations

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import EndpointConnectionError

from demo.moto_server import cache_moto_service_list, moto_server


def test_the_cached_service_list_is_the_one_moto_computes() -> None:
    from moto import backends

    cache_moto_service_list()
    cached = list(backends.list_of_moto_modules())
    original = backends.list_of_moto_modules.__wrapped__
    computed = list(original())  # moto's own function, asked now
    assert cached == computed
    assert {"s3", "ec2", "autoscaling", "sns", "kms"} <= set(cached)
    # Asked again and again (twice per request), the answer is the same whole list, not a spent iterator.
    assert list(backends.list_of_moto_modules()) == cached


def test_a_server_with_the_cached_list_routes_each_service_and_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    with moto_server() as endpoint:
        assert endpoint.startswith("http://127.0.0.1:")
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="routed")
        assert [b["Name"] for b in s3.list_buckets()["Buckets"]] == ["routed"]
        topic = boto3.client("sns", region_name="us-east-1").create_topic(Name="routed")["TopicArn"]
        assert topic.endswith(":routed")
        groups = boto3.client("autoscaling", region_name="us-east-1").describe_auto_scaling_groups()
        assert groups["AutoScalingGroups"] == []
    once = Config(retries={"total_max_attempts": 1})
    with pytest.raises(EndpointConnectionError):  # stopped: nothing listens there any more
        boto3.client("s3", region_name="us-east-1", config=once).list_buckets()

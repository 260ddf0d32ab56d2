"""boto3 clients for the agent: the stack's region, standard retry mode, endpoints from the environment."""

from __future__ import annotations

from typing import Any

import boto3
from botocore.config import Config

# Standard mode retries throttling and 5xx (S3 SlowDown included) with backoff; 8 attempts ride out a
# short S3 or API brown-out without the instance life failing over it.
RETRY_CONFIG = Config(retries={"mode": "standard", "max_attempts": 8}, connect_timeout=10, read_timeout=60)


def client(service: str, region: str) -> Any:
    """A client honouring AWS_ENDPOINT_URL (boto3 does natively): the agent runs against moto unchanged."""
    return boto3.session.Session().client(service, region_name=region, config=RETRY_CONFIG)  # type: ignore[call-overload]

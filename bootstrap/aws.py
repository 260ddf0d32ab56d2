"""boto3 clients for the agent: the stack's region, standard retry mode, endpoints from the environment."""

from __future__ import annotations

import threading
from typing import Any

import boto3
from botocore.config import Config

# Every AWS call of the agent is bounded: standard mode retries throttling and 5xx (S3 SlowDown included)
# with backoff, 4 attempts of at most 5 s to connect and 20 s per read ride out a short brown-out, and a
# blackholed endpoint costs at most about 100 s per call — never on the stop path, which makes no calls.
RETRY_CONFIG = Config(retries={"mode": "standard", "max_attempts": 4}, connect_timeout=5, read_timeout=20)

# One session for every client of the process: a new session parses botocore's endpoint and service
# models again, about 70 ms of CPU per client (a life makes eight). Sessions are not thread-safe, so clients
# are made under a lock; the clients themselves are safe to share between threads.
_session: boto3.session.Session | None = None
_session_lock = threading.Lock()


def client(service: str, region: str, config: Config = RETRY_CONFIG) -> Any:
    """A client honouring AWS_ENDPOINT_URL (boto3 does natively): the agent runs against moto unchanged."""
    global _session
    with _session_lock:
        if _session is None:
            _session = boto3.session.Session()
        return _session.client(service, region_name=region, config=config)  # type: ignore[call-overload]

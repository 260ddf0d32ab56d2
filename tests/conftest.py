"""Shared fixtures: an isolated AWS environment that can only ever reach 127.0.0.1."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

# Set before any test imports boto3: no test may find real credentials or reach a real endpoint.
_ISOLATED_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    # No instance-metadata credential lookups unless a test points IMDS at its own simulator.
    "AWS_EC2_METADATA_DISABLED": "true",
}
for _key, _value in _ISOLATED_ENV.items():
    os.environ[_key] = _value
os.environ.pop("AWS_PROFILE", None)
os.environ.pop("AWS_ENDPOINT_URL", None)
# `make test` runs one xdist worker per core, and the trainers the tests start are tiny: one intra-op
# thread per process is faster than two fighting over the cores (a test life: 7 s vs 8 s alone, 19 s loaded).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@dataclass(frozen=True)
class MotoServer:
    """A moto server on 127.0.0.1 with a port the OS picked."""

    endpoint_url: str

    def env(self) -> dict[str, str]:
        """Environment for a subprocess that must talk to this server only."""
        return {**_ISOLATED_ENV, "AWS_ENDPOINT_URL": self.endpoint_url}


_IMAGE_ID: list[str] = []


def moto_image_id(ec2: Any) -> str:
    """An AMI id moto knows. Its catalogue is the same after every reset, and describing all 1,300 of its
    Amazon images costs about a second of CPU per call: ask once per test process."""
    if not _IMAGE_ID:
        _IMAGE_ID.append(str(ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]))
    return _IMAGE_ID[0]


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    """One moto server per test session, started on port 0 and stopped at the end."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield MotoServer(endpoint_url=f"http://{host}:{port}")
    finally:
        server.stop()


@pytest.fixture()
def aws(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoServer]:
    """Point boto3 in this process at the moto server, and reset moto's state afterwards."""
    import requests

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint_url)
    yield moto_server
    requests.post(f"{moto_server.endpoint_url}/moto-api/reset", timeout=10)

"""Fixtures that put an S3FaultProxy in front of the session's moto server.

Another test package gets them by importing them into its conftest.py:

    from tests.faults.fixtures import aws_via_proxy, s3_proxy

    __all__ = ["aws_via_proxy", "s3_proxy"]
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from demo.fault_proxy import Pass, S3FaultProxy
from tests.conftest import MotoServer


@pytest.fixture()
def s3_proxy(moto_server: MotoServer) -> Iterator[S3FaultProxy]:
    """A started proxy in `pass` mode in front of the moto server, stopped (threads joined) after the test."""
    with S3FaultProxy(moto_server.endpoint_url) as proxy:
        yield proxy


@pytest.fixture()
def aws_via_proxy(
    s3_proxy: S3FaultProxy, moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[S3FaultProxy]:
    """Like `aws`, but boto3 in this process reaches moto through `s3_proxy`; moto is reset afterwards."""
    import requests

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_proxy.endpoint_url)
    yield s3_proxy
    s3_proxy.set_mode(Pass())
    # Straight to moto, so the reset works whatever mode the test left the proxy in.
    requests.post(f"{moto_server.endpoint_url}/moto-api/reset", timeout=10)

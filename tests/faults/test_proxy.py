"""Each fault mode of S3FaultProxy, seen by boto3 talking to moto through it with short timeouts."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import (
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
)

from demo.fault_proxy import Blackhole, Cut, CutRequests, Pass, S3FaultProxy, Slow

BUCKET = "faults"
# botocore's legacy `max_attempts` counts retries (1 means two tries); `total_max_attempts` is the real cap.
FAST_FAIL = Config(
    connect_timeout=1, read_timeout=1, retries={"total_max_attempts": 1}, s3={"addressing_style": "path"}
)
CONNECTION_LOST = (EndpointConnectionError, ConnectionClosedError)


@pytest.fixture()
def s3(aws_via_proxy: S3FaultProxy) -> Any:
    client = boto3.client("s3", config=FAST_FAIL)
    client.create_bucket(Bucket=BUCKET)
    return client


def proxy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("s3-fault-proxy")]


def raw_request(proxy: S3FaultProxy) -> socket.socket:
    host, port = proxy.endpoint_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=1)
    sock.sendall(f"GET /{BUCKET} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    return sock


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 20) -> None:
    """Waits for the proxy's threads; the bound only says when to give up (a loaded 2-core machine can stall
    a thread for seconds, more than the 2 s this once allowed)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.01)


def read_until_closed(sock: socket.socket) -> None:
    """Drain `sock` until the proxy closes it (FIN or RST); a socket left open fails with TimeoutError."""
    sock.settimeout(1)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass


def test_pass_mode_forwards_put_and_get(s3: Any, aws_via_proxy: S3FaultProxy) -> None:
    s3.put_object(Bucket=BUCKET, Key="a.txt", Body=b"hello")

    assert s3.get_object(Bucket=BUCKET, Key="a.txt")["Body"].read() == b"hello"
    assert aws_via_proxy.connections_accepted >= 1
    assert aws_via_proxy.bytes_forwarded > 0


def test_cut_fails_fast_and_pass_recovers(s3: Any, aws_via_proxy: S3FaultProxy) -> None:
    s3.put_object(Bucket=BUCKET, Key="a.txt", Body=b"hello")
    aws_via_proxy.set_mode(Cut())

    with pytest.raises(CONNECTION_LOST) as raised:
        s3.get_object(Bucket=BUCKET, Key="a.txt")
    # Fast means: the connection was cut, not waited out (that would be a timeout error), whatever the
    # wall clock of a loaded machine says.
    assert not isinstance(raised.value, ConnectTimeoutError | ReadTimeoutError)

    aws_via_proxy.set_mode(Pass())
    assert s3.get_object(Bucket=BUCKET, Key="a.txt")["Body"].read() == b"hello"


def test_cut_resets_open_connections(s3: Any, aws_via_proxy: S3FaultProxy) -> None:
    host, port = aws_via_proxy.endpoint_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=1) as sock:
        sock.sendall(b"GET /faults HTTP/1.1\r\n")  # an unfinished request keeps the connection open
        time.sleep(0.1)
        aws_via_proxy.set_mode(Cut())
        with pytest.raises(ConnectionResetError):
            sock.recv(1)


def test_blackhole_times_out_the_client_and_still_stops_promptly(
    s3: Any, aws_via_proxy: S3FaultProxy
) -> None:
    aws_via_proxy.set_mode(Blackhole())

    started = time.monotonic()
    with pytest.raises(ReadTimeoutError):
        s3.list_objects_v2(Bucket=BUCKET)
    # At least the client's 1 s read timeout (the blackhole answered nothing); the upper bound only says
    # it did not hang, generous for a loaded machine.
    assert 0.9 <= time.monotonic() - started < 15

    sock = raw_request(aws_via_proxy)
    with sock:
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(1)  # neither an answer nor a close
        started = time.monotonic()
        aws_via_proxy.stop()  # raises if a thread is still alive after its stop_timeout_s (5 s)
        # Promptly: not by waiting out its own join timeout for a blackholed connection's thread.
        assert time.monotonic() - started < aws_via_proxy.stop_timeout_s
    assert proxy_threads() == []


def test_blackholed_connections_stay_dark_after_pass_but_new_ones_recover(
    s3: Any, aws_via_proxy: S3FaultProxy
) -> None:
    accepted = aws_via_proxy.connections_accepted
    aws_via_proxy.set_mode(Blackhole())
    sock = raw_request(aws_via_proxy)
    with sock:
        wait_until(
            lambda: aws_via_proxy.connections_accepted == accepted + 1, "the proxy accepting the request"
        )
        aws_via_proxy.set_mode(Pass())
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(1)

    assert s3.list_objects_v2(Bucket=BUCKET)["KeyCount"] == 0


def test_slow_caps_the_upload_bandwidth(s3: Any, aws_via_proxy: S3FaultProxy) -> None:
    aws_via_proxy.set_mode(Slow(bytes_per_second=2 * 1024 * 1024))

    started = time.monotonic()
    s3.put_object(Bucket=BUCKET, Key="big.bin", Body=b"x" * 1024 * 1024)
    elapsed = time.monotonic() - started

    assert 0.4 <= elapsed < 5
    aws_via_proxy.set_mode(Pass())
    assert s3.head_object(Bucket=BUCKET, Key="big.bin")["ContentLength"] == 1024 * 1024


def test_slow_adds_latency_per_chunk(s3: Any, aws_via_proxy: S3FaultProxy) -> None:
    aws_via_proxy.set_mode(Slow(bytes_per_second=100 * 1024 * 1024, latency_s=0.2))

    started = time.monotonic()
    s3.list_objects_v2(Bucket=BUCKET)

    assert time.monotonic() - started >= 0.4  # one chunk each way


def test_cut_requests_cuts_only_matching_requests(s3: Any, aws_via_proxy: S3FaultProxy) -> None:
    aws_via_proxy.set_mode(
        CutRequests(match=lambda request: request.method == "PUT" and "latest.json" in request.path)
    )

    s3.put_object(Bucket=BUCKET, Key="ckpt/step-1.pt", Body=b"weights")
    with pytest.raises(CONNECTION_LOST):
        s3.put_object(Bucket=BUCKET, Key="ckpt/latest.json", Body=b"{}")
    s3.put_object(Bucket=BUCKET, Key="ckpt/other.json", Body=b"{}")

    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"]]
    assert keys == ["ckpt/other.json", "ckpt/step-1.pt"]
    assert aws_via_proxy.requests_cut == 1


def test_cut_requests_after_n_fails_every_later_request(s3: Any, aws_via_proxy: S3FaultProxy) -> None:
    aws_via_proxy.set_mode(CutRequests(after=2))

    s3.put_object(Bucket=BUCKET, Key="one", Body=b"1")
    s3.put_object(Bucket=BUCKET, Key="two", Body=b"2")
    for key in ("three", "four"):
        with pytest.raises(CONNECTION_LOST):
            s3.put_object(Bucket=BUCKET, Key=key, Body=b"3")

    aws_via_proxy.set_mode(Pass())
    assert s3.list_objects_v2(Bucket=BUCKET)["KeyCount"] == 2
    assert aws_via_proxy.requests_cut == 2


def test_stop_closes_every_connection_and_joins_every_thread(moto_server: Any) -> None:
    with S3FaultProxy(moto_server.endpoint_url) as proxy:
        socks = [raw_request(proxy) for _ in range(3)]
        proxy.set_mode(Blackhole())
        socks.append(raw_request(proxy))
        wait_until(lambda: proxy.connections_accepted == 4, "the proxy accepting all four connections")
    try:
        assert proxy_threads() == []
        for sock in socks:
            read_until_closed(sock)
    finally:
        for sock in socks:
            sock.close()

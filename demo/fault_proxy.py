"""A TCP proxy in front of the moto server that injects network faults (cut, blackhole, slow) on demand.

Part of the simulated world (with the moto server and the IMDS simulator): the fault tests put it between
boto3 and moto, and `python -m bench.streaming --throttle-mbps N` uses its Slow mode as a network limited
per connection. It lives in demo/, not tests/, because bench/ uses it and tests import bench/."""

from __future__ import annotations

import contextlib
import re
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import cast
from urllib.parse import urlsplit

_CHUNK = 64 * 1024
# How often a connection thread looks at the mode and the stop flag while its sockets are idle.
_TICK_SECONDS = 0.02
_REQUEST_LINE = re.compile(rb"^([A-Z]+) (\S+) HTTP/1\.[01]\r\n")


@dataclass(frozen=True)
class RequestLine:
    """The first line of one HTTP request seen by the proxy."""

    method: str
    path: str


@dataclass(frozen=True)
class Pass:
    """Forward every byte unchanged."""


@dataclass(frozen=True)
class Cut:
    """Refuse: new connections are reset on accept, open ones are reset at once."""


@dataclass(frozen=True)
class Blackhole:
    """Accept and read, never answer nor close; open connections stop forwarding for good."""


@dataclass(frozen=True)
class Slow:
    """Forward each chunk after `latency_s`, at most `bytes_per_second` per connection and direction."""

    bytes_per_second: int
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.bytes_per_second <= 0 or self.latency_s < 0:
            raise ValueError(f"Slow needs bytes_per_second > 0 and latency_s >= 0, got {self}")


@dataclass(frozen=True)
class CutRequests:
    """Forward, but reset the connection on each matching request once `after` of them went through.

    `match=None` matches every request, so `CutRequests(after=3)` fails every request after the third.
    A request is recognised by its request line at the start of a chunk the client sends after the
    previous response started (HTTP/1.1 without pipelining, which is what botocore does); a client
    that pipelines requests on one connection would have only its first request checked.
    """

    after: int = 0
    match: Callable[[RequestLine], bool] | None = None


Mode = Pass | Cut | Blackhole | Slow | CutRequests


def _slow_chunk(mode: Slow) -> int:
    """A twentieth of a second's worth of bytes, so capped transfers are paced smoothly, not in bursts."""
    return min(_CHUNK, max(1, mode.bytes_per_second // 20))


def _reset(sock: socket.socket) -> None:
    """Close with RST rather than FIN, the way a crashed peer or a dropped route looks to the client."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _shutdown(sock: socket.socket) -> None:
    """Wake any thread blocked on this socket; its owner closes it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class _Connection:
    """One client connection and its upstream connection, served by one thread."""

    def __init__(self, proxy: S3FaultProxy, client: socket.socket, black: bool) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream: socket.socket | None = None
        self.thread = threading.Thread(target=self._serve, name="s3-fault-proxy-conn", daemon=True)
        # Once a byte was dropped the HTTP stream is corrupt, so this connection never forwards again.
        self.black = black
        self.at_request_boundary = True

    def abort(self) -> None:
        _shutdown(self.client)
        if self.upstream is not None:
            _shutdown(self.upstream)

    def _serve(self) -> None:
        reset = False
        try:
            reset = self._pump()
        except OSError:
            pass
        finally:
            for sock in (self.client, self.upstream):
                if sock is None:
                    continue
                if reset:
                    _reset(sock)
                else:
                    sock.close()

    def _pump(self) -> bool:
        """Forward until either side closes or the proxy stops; True when the connection must be reset."""
        proxy = self.proxy
        if not self.black:
            self.upstream = socket.create_connection(proxy.upstream_address, timeout=5)
            self.upstream.settimeout(None)
        with selectors.DefaultSelector() as selector:
            selector.register(self.client, selectors.EVENT_READ)
            if self.upstream is not None:
                selector.register(self.upstream, selectors.EVENT_READ)
            while not proxy._stopping.is_set():
                mode = proxy.mode
                if isinstance(mode, Cut):
                    return True
                if isinstance(mode, Blackhole):
                    self.black = True
                chunk = _slow_chunk(mode) if isinstance(mode, Slow) else _CHUNK
                for key, _ in selector.select(timeout=_TICK_SECONDS):
                    source = cast(socket.socket, key.fileobj)
                    data = source.recv(chunk)
                    if source is self.client:
                        if not data:
                            return False
                        if not self._to_upstream(data, mode):
                            return True
                    elif not data:
                        if not self.black:
                            return False
                        # A blackholed client must not see the upstream's close either.
                        selector.unregister(source)
                    else:
                        self._to_client(data, mode)
        return False

    def _to_upstream(self, data: bytes, mode: Mode) -> bool:
        """Forward client bytes; False when this request must be cut."""
        if self.black or self.upstream is None:
            return True
        if self.at_request_boundary:
            self.at_request_boundary = False
            found = _REQUEST_LINE.match(data)
            if found and isinstance(mode, CutRequests):
                request = RequestLine(found[1].decode("ascii"), found[2].decode("ascii", "replace"))
                if self.proxy._should_cut(mode, request):
                    return False
        self._send(self.upstream, data, mode)
        return True

    def _to_client(self, data: bytes, mode: Mode) -> None:
        if self.black:
            return
        self.at_request_boundary = True
        self._send(self.client, data, mode)

    def _send(self, target: socket.socket, data: bytes, mode: Mode) -> None:
        if isinstance(mode, Slow):
            # The wait returns early when the proxy stops, so a slow transfer never delays stop().
            self.proxy._stopping.wait(mode.latency_s + len(data) / mode.bytes_per_second)
        target.sendall(data)
        self.proxy._count_forwarded(len(data))


class S3FaultProxy:
    """A TCP proxy on 127.0.0.1 (port picked by the OS) in front of `upstream_url`, switchable at runtime.

    Use as a context manager, or call start() and stop(). set_mode() takes effect within a few
    milliseconds on new and open connections alike.
    """

    def __init__(self, upstream_url: str, stop_timeout_s: float = 5.0) -> None:
        parts = urlsplit(upstream_url)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"upstream_url needs a host and a port, got {upstream_url!r}")
        self.upstream_address = (parts.hostname, parts.port)
        self.stop_timeout_s = stop_timeout_s
        self._stopping = threading.Event()
        self._mode: Mode = Pass()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._connections: list[_Connection] = []
        self._connections_accepted = 0
        self._bytes_forwarded = 0
        self._requests_matched = 0
        self._requests_cut = 0

    @property
    def endpoint_url(self) -> str:
        if self._listener is None:
            raise RuntimeError("S3FaultProxy has no endpoint until start() is called")
        host, port = self._listener.getsockname()[:2]
        return f"http://{host}:{port}"

    @property
    def mode(self) -> Mode:
        return self._mode

    def set_mode(self, mode: Mode) -> None:
        with self._lock:
            self._mode = mode
            self._requests_matched = 0

    @property
    def connections_accepted(self) -> int:
        return self._connections_accepted

    @property
    def bytes_forwarded(self) -> int:
        """Bytes forwarded in both directions together."""
        return self._bytes_forwarded

    @property
    def requests_cut(self) -> int:
        return self._requests_cut

    def start(self) -> S3FaultProxy:
        if self._listener is not None:
            raise RuntimeError("S3FaultProxy is already started")
        self._stopping.clear()
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(_TICK_SECONDS)
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept_loop, name="s3-fault-proxy-accept", daemon=True)
        self._acceptor.start()
        return self

    def stop(self) -> None:
        """Close every socket and join every thread; raise if one is still running after stop_timeout_s."""
        if self._listener is None or self._acceptor is None:
            return
        self._stopping.set()
        deadline = time.monotonic() + self.stop_timeout_s
        self._acceptor.join(self.stop_timeout_s)
        self._listener.close()
        with self._lock:
            connections = list(self._connections)
            self._connections.clear()
        for connection in connections:
            connection.abort()
        for connection in connections:
            connection.thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in (self._acceptor, *(c.thread for c in connections)) if t.is_alive()]
        self._listener = None
        self._acceptor = None
        if stuck:
            raise RuntimeError(
                f"S3FaultProxy threads still alive {self.stop_timeout_s} s after stop: {stuck}"
            )

    def __enter__(self) -> S3FaultProxy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _should_cut(self, mode: CutRequests, request: RequestLine) -> bool:
        """Count a request against `mode`; True when it is one to cut."""
        if mode.match is not None and not mode.match(request):
            return False
        with self._lock:
            if self._mode is not mode:
                return False
            self._requests_matched += 1
            cut = self._requests_matched > mode.after
            self._requests_cut += cut
        return cut

    def _count_forwarded(self, n: int) -> None:
        with self._lock:
            self._bytes_forwarded += n

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            with self._lock:
                self._connections_accepted += 1
                self._connections = [c for c in self._connections if c.thread.is_alive()]
                if isinstance(self._mode, Cut):
                    _reset(client)
                    continue
                connection = _Connection(self, client, black=isinstance(self._mode, Blackhole))
                self._connections.append(connection)
            connection.thread.start()

"""A simulated EC2 instance metadata service (IMDSv2) on 127.0.0.1, with controls to inject events."""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TOKEN_PATH = "/latest/api/token"
META_PREFIX = "/latest/meta-data/"
_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
_TOKEN_HEADER = "X-aws-ec2-metadata-token"


def _iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class SimulatedInstance:
    """What the simulated IMDS says about "this" instance."""

    instance_id: str = "i-0123456789abcdef0"
    instance_type: str = "g6.xlarge"
    availability_zone: str = "us-east-1a"
    region: str = "us-east-1"
    lifecycle: str = "spot"
    # What the other nodes of a multi-node job reach this one by.
    local_ipv4: str = "127.0.0.1"
    extra: dict[str, str] = field(default_factory=dict)


# Real IMDS shows the group's decision in `autoscaling/target-lifecycle-state` within seconds, not at once;
# asking the simulated group at every poll had moto answer five describe calls a second per agent.
LIFECYCLE_REFRESH_S = 1.0


class ImdsSimulator:
    """Threaded HTTP server implementing the IMDSv2 paths the agent reads.

    `lifecycle_state` (optional) answers `autoscaling/target-lifecycle-state`, e.g. by asking moto
    whether the group still holds this instance; its answer is reused for LIFECYCLE_REFRESH_S.
    """

    def __init__(
        self,
        instance: SimulatedInstance | None = None,
        lifecycle_state: Callable[[str], str] | None = None,
    ) -> None:
        self.instance = instance or SimulatedInstance()
        self._lifecycle_state = lifecycle_state
        self._lifecycle_seen: tuple[str, float, str] | None = None  # (instance id, asked at, answer)
        self._tokens: dict[str, float] = {}
        self._spot_action: dict[str, str] | None = None
        self._rebalance: dict[str, str] | None = None
        self._failing = False
        self._lock = threading.Lock()
        self.requests: list[tuple[str, str, int]] = []
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    # -- server lifecycle ---------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ImdsSimulator:
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler_class())
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="imds-sim", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> ImdsSimulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- controls -----------------------------------------------------------------------------------

    def inject_spot_notice(self, action: str = "terminate", seconds_ahead: int = 120) -> None:
        when = datetime.now(timezone.utc) + timedelta(seconds=seconds_ahead)
        with self._lock:
            self._spot_action = {"action": action, "time": _iso(when)}

    def inject_rebalance(self) -> None:
        with self._lock:
            self._rebalance = {"noticeTime": _iso(datetime.now(timezone.utc))}

    def clear_events(self) -> None:
        with self._lock:
            self._spot_action = None
            self._rebalance = None

    def go_down(self, mode: str = "refuse") -> None:
        """`refuse`: nothing listens on the port any more; `error`: every request gets HTTP 500."""
        if mode == "refuse":
            self.stop()
        elif mode == "error":
            self._failing = True
        else:
            raise ValueError(f"go_down mode must be 'refuse' or 'error', not {mode!r}")

    def come_back(self) -> None:
        self._failing = False
        if self._server is None:
            self.start()

    def expire_tokens(self) -> None:
        with self._lock:
            self._tokens.clear()

    def paths_requested(self) -> list[str]:
        with self._lock:
            return [path for _method, path, _status in self.requests]

    # -- request handling ---------------------------------------------------------------------------

    def _metadata(self, path: str) -> str | None:
        inst = self.instance
        with self._lock:
            spot, rebalance = self._spot_action, self._rebalance
        values: dict[str, Any] = {
            "instance-id": inst.instance_id,
            "instance-type": inst.instance_type,
            "placement/availability-zone": inst.availability_zone,
            "placement/region": inst.region,
            "instance-life-cycle": inst.lifecycle,
            "local-ipv4": inst.local_ipv4,
            "spot/instance-action": json.dumps(spot) if spot else None,
            "events/recommendations/rebalance": json.dumps(rebalance) if rebalance else None,
            **inst.extra,
        }
        if path == "autoscaling/target-lifecycle-state":
            # Asked only for this path: the callback may call the (simulated) group, which can be slow.
            return self._target_lifecycle_state(inst.instance_id)
        value = values.get(path)
        return None if value is None else str(value)

    def _target_lifecycle_state(self, instance_id: str) -> str:
        if self._lifecycle_state is None:
            return "InService"
        with self._lock:
            seen = self._lifecycle_seen
        if seen and seen[0] == instance_id and time.monotonic() - seen[1] < LIFECYCLE_REFRESH_S:
            return seen[2]
        state = self._lifecycle_state(instance_id)
        with self._lock:
            self._lifecycle_seen = (instance_id, time.monotonic(), state)
        return state

    def _handle(self, method: str, path: str, headers: Any) -> tuple[int, str]:
        if self._failing:
            return 500, "simulated IMDS failure"
        if method == "PUT" and path == TOKEN_PATH:
            try:
                ttl = int(headers.get(_TTL_HEADER, ""))
            except ValueError:
                return 400, "missing or bad token TTL"
            if not 1 <= ttl <= 21600:
                return 400, "token TTL out of range"
            token = secrets.token_urlsafe(24)
            with self._lock:
                self._tokens[token] = time.monotonic() + ttl
            return 200, token
        if method != "GET" or not path.startswith(META_PREFIX):
            return 404, "not found"
        token = headers.get(_TOKEN_HEADER)
        with self._lock:
            expires = self._tokens.get(token or "")
        if expires is None or expires < time.monotonic():
            return 401, "unauthorized"
        value = self._metadata(path[len(META_PREFIX) :])
        return (404, "not found") if value is None else (200, value)

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        simulator = self

        class Handler(BaseHTTPRequestHandler):
            def _respond(self, method: str) -> None:
                status, body = simulator._handle(method, self.path, self.headers)
                with simulator._lock:
                    simulator.requests.append((method, self.path, status))
                data = body.encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    # The agent gave up on this request (its 2 s timeout, on a loaded machine) and asks again
                    # at its next poll, as it would of the real IMDS: nothing to report.
                    return

            def do_GET(self) -> None:
                self._respond("GET")

            def do_PUT(self) -> None:
                self._respond("PUT")

            def log_message(self, format: str, *args: Any) -> None:
                return  # the agent's own log says what it asked for

        return Handler

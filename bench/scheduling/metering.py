"""The scheduling bench's request counting: every S3 and Auto Scaling call, by kind, in total and per
scheduling decision."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

# S3 Standard request prices, us-east-1 (https://aws.amazon.com/s3/pricing/, "Requests & data
# retrievals"), as read on 2026-12-06: PUT, COPY, POST, LIST $0.005 per 1,000; GET, SELECT and all other
# requests $0.0004 per 1,000; DELETE free.
PRICE_NOTE = (
    "S3 Standard request prices, us-east-1, https://aws.amazon.com/s3/pricing/ as of 2026-12-06: "
    "PUT/COPY/POST/LIST $0.005 per 1,000, GET and other requests $0.0004 per 1,000, DELETE free"
)
PUT_LIST_USD = 0.005 / 1000
GET_USD = 0.0004 / 1000
GET_OPS = frozenset({"GetObject", "HeadObject"})
LIST_OPS = frozenset({"ListObjectsV2", "ListObjects"})
PUT_OPS = frozenset({"PutObject", "CopyObject", "PostObject", "CreateMultipartUpload"})
FREE_OPS = frozenset({"DeleteObject"})


@dataclass
class Tally:
    """Requests by kind: S3 GET/LIST/PUT/other (DELETE is free) and Auto Scaling calls by operation."""

    s3: Counter[str] = field(default_factory=Counter)
    autoscaling: Counter[str] = field(default_factory=Counter)
    conflicts: int = 0

    def add(self, service: str, operation: str) -> None:
        (self.s3 if service == "s3" else self.autoscaling)[operation] += 1

    def kinds(self) -> dict[str, int]:
        found = {"GET": 0, "LIST": 0, "PUT": 0, "DELETE": 0, "other": 0}
        for operation, count in self.s3.items():
            kind = (
                "GET"
                if operation in GET_OPS
                else "LIST"
                if operation in LIST_OPS
                else "PUT"
                if operation in PUT_OPS
                else "DELETE"
                if operation in FREE_OPS
                else "other"
            )
            found[kind] += count
        return found

    def usd(self) -> float:
        kinds = self.kinds()
        return (kinds["PUT"] + kinds["LIST"]) * PUT_LIST_USD + (kinds["GET"] + kinds["other"]) * GET_USD


class Meter:
    """Counts every API call made through the clients it is attached to: in total, and for the thread's open
    decision (`decision()`), so each scheduling decision's own requests are known."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = Tally()
        self._local = threading.local()

    def attach(self, client: Any, service: str) -> None:
        events = client.meta.events
        service_id = client.meta.service_model.service_id.hyphenize()
        events.register(f"before-call.{service_id}", self._before(service))
        events.register(f"after-call.{service_id}", self._after)

    def _before(self, service: str) -> Callable[..., None]:
        def count(event_name: str, **_: Any) -> None:
            operation = event_name.rsplit(".", 1)[-1]
            with self._lock:
                self.total.add(service, operation)
            open_tally: Tally | None = getattr(self._local, "tally", None)
            if open_tally is not None:
                open_tally.add(service, operation)

        return count

    def _after(self, http_response: Any = None, **_: Any) -> None:
        if http_response is not None and http_response.status_code in (409, 412):
            with self._lock:
                self.total.conflicts += 1
            open_tally: Tally | None = getattr(self._local, "tally", None)
            if open_tally is not None:
                open_tally.conflicts += 1

    @contextlib.contextmanager
    def decision(self) -> Iterator[Tally]:
        tally = Tally()
        self._local.tally = tally
        try:
            yield tally
        finally:
            self._local.tally = None

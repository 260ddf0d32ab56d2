"""IMDSv2 client: session token refreshed before expiry, 401 → new token, 404 → no such item."""

from __future__ import annotations

import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

DEFAULT_ENDPOINT = "http://169.254.169.254"
TOKEN_TTL_SECONDS = 21600
# Renew this long before the token expires so that a poll never goes out with a stale one.
TOKEN_REFRESH_MARGIN_SECONDS = 60


class ImdsUnavailableError(RuntimeError):
    """IMDS could not be reached or answered with a server error; callers retry on their next tick."""


@dataclass(frozen=True)
class InstanceIdentity:
    """Who this instance is, as the ledger and the cost estimate need it."""

    instance_id: str
    instance_type: str
    az: str
    region: str
    lifecycle: str  # "spot" or "on-demand"


class ImdsClient:
    """A minimal IMDSv2 client that honours AWS_EC2_METADATA_SERVICE_ENDPOINT, like botocore."""

    def __init__(
        self, endpoint: str | None = None, timeout: float = 2.0, token_ttl: int = TOKEN_TTL_SECONDS
    ) -> None:
        configured = endpoint or os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT") or DEFAULT_ENDPOINT
        self.endpoint = configured.rstrip("/")
        self._timeout = timeout
        self._token_ttl = token_ttl
        self._token: str | None = None
        self._token_expires = 0.0
        self._lock = threading.Lock()

    def _fetch_token(self) -> str:
        request = urllib.request.Request(
            f"{self.endpoint}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self._token_ttl)},
        )
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as response:
                token: str = response.read().decode()
        except (urllib.error.URLError, OSError) as exc:
            raise ImdsUnavailableError(f"IMDS token request to {self.endpoint} failed: {exc}") from exc
        self._token = token
        self._token_expires = time.monotonic() + self._token_ttl
        return token

    def _current_token(self) -> str:
        with self._lock:
            if self._token is None or time.monotonic() > self._token_expires - TOKEN_REFRESH_MARGIN_SECONDS:
                return self._fetch_token()
            return self._token

    def _invalidate(self) -> None:
        with self._lock:
            self._token = None

    def get(self, path: str) -> str | None:
        """The text at `/latest/meta-data/<path>`, or None when IMDS says 404 (e.g. no spot notice yet)."""
        for attempt in range(2):
            request = urllib.request.Request(
                f"{self.endpoint}/latest/meta-data/{path}",
                headers={"X-aws-ec2-metadata-token": self._current_token()},
            )
            try:
                with urllib.request.urlopen(request, timeout=self._timeout) as response:
                    text: str = response.read().decode()
                    return text
            except urllib.error.HTTPError as exc:
                if exc.code == 404:
                    return None
                if exc.code == 401 and attempt == 0:
                    self._invalidate()
                    continue
                raise ImdsUnavailableError(f"IMDS {path}: HTTP {exc.code}") from exc
            except (urllib.error.URLError, OSError) as exc:
                raise ImdsUnavailableError(f"IMDS {path} unreachable: {exc}") from exc
        raise ImdsUnavailableError(f"IMDS {path}: token refused twice")

    def identity(self, fallback_region: str) -> InstanceIdentity:
        def required(path: str) -> str:
            value = self.get(path)
            if value is None:
                raise ImdsUnavailableError(f"IMDS has no {path}")
            return value

        az = required("placement/availability-zone")
        return InstanceIdentity(
            instance_id=required("instance-id"),
            instance_type=required("instance-type"),
            az=az,
            region=self.get("placement/region") or fallback_region,
            lifecycle="spot" if self.get("instance-life-cycle") == "spot" else "on-demand",
        )

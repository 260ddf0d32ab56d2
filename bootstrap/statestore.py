"""The job's shared state in S3 under `state/`: ledger, progress, control (see docs/internals.md)."""

from __future__ import annotations

import json
from typing import Any

from trainstack_job.contract import CONTROL


class StateStore:
    """Reads and writes small JSON documents at `s3://<bucket>/<state prefix><name>`."""

    def __init__(self, s3: Any, bucket: str, prefix: str) -> None:
        self._s3 = s3
        self.bucket = bucket
        self.prefix = prefix

    def uri(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}{name}"

    def read(self, name: str) -> dict[str, Any] | None:
        try:
            body = self._s3.get_object(Bucket=self.bucket, Key=self.prefix + name)["Body"].read()
        except self._s3.exceptions.NoSuchKey:
            return None
        value = json.loads(body)
        return value if isinstance(value, dict) else None

    def write(self, name: str, value: dict[str, Any]) -> None:
        self._s3.put_object(
            Bucket=self.bucket,
            Key=self.prefix + name,
            Body=json.dumps(value, indent=2, default=str).encode(),
            ContentType="application/json",
        )

    def stop_requested(self) -> bool:
        """True when `trainstack stop` has asked the job to checkpoint and scale to zero."""
        control = self.read(CONTROL)
        return control is not None and control.get("action") == "stop"

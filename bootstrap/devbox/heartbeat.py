"""`dev/status.json`: what the dev box's idle watcher last saw; `trainstack dev status` reads it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

# The dev box's own folder in the bucket (infra/iam/machine_roles.py dev_role_policy): the one prefix it may
# write besides job submissions; its idle watcher's heartbeat and whatever its user keeps there.
DEV_PREFIX = "dev/"
HEARTBEAT_KEY = f"{DEV_PREFIX}status.json"


@dataclass(frozen=True)
class Heartbeat:
    """One sample's verdict. `idle_seconds` counts from the last busy sample; `idle_limit_minutes` 0 = never
    stops. `state`: watching | shutting-down (idle limit reached) | interrupted (spot notice seen)."""

    instance_id: str
    sampled_at: datetime
    idle_seconds: float
    idle_limit_minutes: int
    busy: list[str] = field(default_factory=list)
    state: str = "watching"

    def idle_left_seconds(self, now: datetime) -> float | None:
        """Seconds until the watcher stops the box, counted on from the sample; None = it never will."""
        if self.idle_limit_minutes <= 0:
            return None
        since_sample = 0.0 if self.busy else max(0.0, (now - self.sampled_at).total_seconds())
        return max(0.0, self.idle_limit_minutes * 60 - self.idle_seconds - since_sample)

    def to_json(self) -> str:
        document = asdict(self)
        document["sampled_at"] = self.sampled_at.astimezone(timezone.utc).isoformat()
        return json.dumps(document, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Heartbeat:
        """Raises ValueError naming what is wrong: the object is written by the box, read by the CLI."""
        try:
            document: Any = json.loads(text)
            sampled = datetime.fromisoformat(str(document["sampled_at"]))
            return cls(
                instance_id=str(document["instance_id"]),
                sampled_at=sampled if sampled.tzinfo else sampled.replace(tzinfo=timezone.utc),
                idle_seconds=float(document["idle_seconds"]),
                idle_limit_minutes=int(document["idle_limit_minutes"]),
                busy=[str(reason) for reason in document.get("busy", [])],
                state=str(document.get("state", "watching")),
            )
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{HEARTBEAT_KEY} is not a dev box heartbeat ({error!r})") from None

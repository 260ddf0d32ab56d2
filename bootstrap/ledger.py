"""The job ledger (`state/ledger.json`): instance lives, interruptions, crash counter, cost so far."""

from __future__ import annotations

import copy
from datetime import datetime
from typing import Any

from bootstrap.eventlog import iso
from bootstrap.imds import InstanceIdentity

TERMINAL_STATUSES = {"completed", "failed", "stopped", "cost_cap", "no_data"}
FAILED_OUTCOMES = {"failed", "stalled"}


def _parse(moment: str) -> datetime:
    return datetime.fromisoformat(moment.replace("Z", "+00:00"))


class JobLedger:
    """In-memory view of the ledger; the agent saves it through StateStore after every change."""

    def __init__(self, raw: dict[str, Any] | None = None) -> None:
        self.data: dict[str, Any] = copy.deepcopy(raw) if raw else {}
        self.data.setdefault("status", "running")
        self.data.setdefault("lives", [])
        self.data.setdefault("interruptions", 0)
        self.data.setdefault("consecutive_failures", 0)
        self.data.setdefault("total_cost_usd", 0.0)
        self._current: dict[str, Any] | None = None

    @property
    def status(self) -> str:
        return str(self.data["status"])

    @property
    def consecutive_failures(self) -> int:
        return int(self.data["consecutive_failures"])

    @property
    def interruptions(self) -> int:
        return int(self.data["interruptions"])

    @property
    def total_cost_usd(self) -> float:
        return float(self.data["total_cost_usd"])

    @property
    def lives(self) -> list[dict[str, Any]]:
        return list(self.data["lives"])

    def begin_life(self, identity: InstanceIdentity, price_usd_per_hour: float | None, now: datetime) -> None:
        """Open this life. A life of this same instance still marked running is one the agent died in:
        it counts as a failure, so that a systemd restart loop trips the crash-loop guard too."""
        for earlier in self.data["lives"]:
            if earlier["instance_id"] == identity.instance_id and earlier["outcome"] == "running":
                earlier["outcome"] = "failed"
                earlier["ended_at"] = earlier.get("ended_at") or iso(now)
                self.data["consecutive_failures"] += 1
        if self.status in TERMINAL_STATUSES:
            # Someone scaled the group up again after the job ended: a new run with a fresh crash counter.
            if self.status == "failed":
                self.data["consecutive_failures"] = 0
            self.data["status"] = "running"
        life: dict[str, Any] = {
            "instance_id": identity.instance_id,
            "instance_type": identity.instance_type,
            "az": identity.az,
            "lifecycle": identity.lifecycle,
            "started_at": iso(now),
            "ended_at": None,
            "price_usd_per_hour": price_usd_per_hour,
            "cost_usd": 0.0,
            "outcome": "running",
        }
        if identity.lifecycle != "spot":
            life["price_note"] = (
                "on-demand instance: the estimate uses the spot price, the bill will be higher"
            )
        self.data["lives"].append(life)
        self._current = life
        self.update_cost(now)

    def update_cost(self, now: datetime) -> float:
        """Recompute this life's cost (time so far × price) and the job total; returns the total."""
        life = self._current
        if life is not None and life["price_usd_per_hour"] is not None:
            end = _parse(life["ended_at"]) if life["ended_at"] else now
            hours = max(0.0, (end - _parse(life["started_at"])).total_seconds() / 3600)
            life["cost_usd"] = round(hours * float(life["price_usd_per_hour"]), 6)
        self.data["total_cost_usd"] = round(
            sum(float(x.get("cost_usd") or 0.0) for x in self.data["lives"]), 6
        )
        self.data["updated_at"] = iso(now)
        return self.total_cost_usd

    def end_life(self, outcome: str, now: datetime) -> None:
        life = self._current
        if life is None:
            raise RuntimeError("end_life() before begin_life()")
        life["outcome"] = outcome
        life["ended_at"] = iso(now)
        self.update_cost(now)
        if outcome == "preempted":
            self.data["interruptions"] += 1
        if outcome in FAILED_OUTCOMES:
            self.data["consecutive_failures"] += 1
        else:
            self.data["consecutive_failures"] = 0

    def set_status(self, status: str) -> None:
        self.data["status"] = status

    def current_life(self) -> dict[str, Any] | None:
        return self._current

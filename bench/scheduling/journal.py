"""What happened in a scheduling bench run: its decisions, its lease holds, its journal."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Decision:
    kind: str  # "bind" (bind_job) or "look" (work_in_lanes, after a job's end)
    pool: str
    instance: str
    started: float
    seconds: float
    job: str | None
    queue_entries: int  # entries in the queue listing when it ran (nothing deletes an entry)
    get: int
    list: int
    put: int
    conflicts: int


@dataclass(frozen=True)
class Holding:
    """One life's hold of a job's lease: from after its acquiring write returned to before its releasing
    write was sent. `trained`: it trained the job (the holder); else a standby that took the lease of a job
    that had ended and let it go."""

    job: str
    instance: str
    start: float
    end: float
    trained: bool
    completed: bool
    # The job's ledger status when this life began (read by the bench, uncounted): "completed" here means the
    # life bound a job that ended meanwhile, and `begin_life` set it back to running.
    status_at_begin: str | None = None
    # A completed job: before its end was written to its ledger, which frees its run slot (maxConcurrentJobs);
    # the holder keeps the lease a little longer while it looks for its next job.
    ran_until: float | None = None


@dataclass
class Journal:
    """Everything the simulated instances report, under one lock, on the bench's monotonic clock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    submitted: dict[str, float] = field(default_factory=dict)
    decisions: list[Decision] = field(default_factory=list)
    holdings: list[Holding] = field(default_factory=list)
    roles: Counter[str] = field(default_factory=Counter)
    # Instance → (when it started looking, when it got the lease): the dispatch latency of each trained job.
    dispatch: list[tuple[str, float]] = field(default_factory=list)  # (job, seconds)
    queue_wait: list[tuple[str, float]] = field(default_factory=list)  # (job, submit → lease)
    busy: Counter[str] = field(default_factory=Counter)  # instance → seconds training
    alive: dict[str, tuple[float, float | None]] = field(default_factory=dict)  # instance → (start, left)
    protected: dict[str, bool] = field(default_factory=dict)
    lease_problems: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    scaled_in: list[tuple[str, bool]] = field(default_factory=list)  # (instance, busy when it went)
    left: set[str] = field(default_factory=set)  # instances that left on their own
    holding_now: set[str] = field(default_factory=set)  # instances holding a lease right now
    notes: list[str] = field(default_factory=list)

    def note(self, action: Callable[[Journal], None]) -> None:
        with self.lock:
            action(self)

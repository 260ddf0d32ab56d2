"""The one small interface every phase of an instance life implements (as Nomad's task-runner hooks).

A life, once bound to a job and written into its ledger, runs its phases in order (bootstrap/phases/
__init__.py lists them): each either lets the life go on (None) or ends it with an outcome, which the life
then acts on (bootstrap/outcomes.py). A phase reads and writes the life only through `Life`, so a new phase
is a new file and one entry in the list, never an edit of the life's class (bootstrap/lifecycle.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from bootstrap.agent_config import AgentConfig
from bootstrap.boot import AwsClients, Boot
from bootstrap.eventlog import EventLog
from bootstrap.fleet import Fleet
from bootstrap.generation_fence import GenerationFence
from bootstrap.generations import Generations
from bootstrap.imds import ImdsClient, InstanceIdentity
from bootstrap.jobstate import JobState
from bootstrap.ledger import JobLedger
from bootstrap.outcomes import Failure, LifeEnd
from bootstrap.persist import CheckpointPersister
from bootstrap.standby import OneWriter
from bootstrap.stops import StopRequests
from bootstrap.supervisor import Supervisor
from bootstrap.trainer import TrainerPaths
from trainstack_job.jobfile import JobSpec

# How a phase ends a life: a plain end (completed, preempted, surplus, ...) or a failure with its reason.
Ended = LifeEnd | Failure


class Life(Protocol):
    """What the phases share of one instance life: its job, collaborators and what earlier phases set up."""

    # The bound job's agent config (its own prefixes) and the stack's (the queue, the dataset's source).
    config: AgentConfig
    stack_config: AgentConfig
    log: EventLog
    clients: AwsClients
    boot: Boot
    fleet: Fleet
    imds: ImdsClient
    stops: StopRequests
    job: JobState
    supervisor: Supervisor
    user_job: JobSpec | None
    multi_node: bool
    state_poll_seconds: float
    drift_seconds: float
    background_stop: threading.Event
    # Set by the phases, in this order: the GPUs counted, the scratch paths, the job's one writer (holder or
    # standby), the checkpoint persister, a multi-node job's fence and generations.
    gpu_count: int
    paths: TrainerPaths | None
    writer: OneWriter | None
    persister: CheckpointPersister | None
    generation_fence: GenerationFence | None
    generations: Generations | None

    @property
    def identity(self) -> InstanceIdentity | None: ...

    @property
    def phase(self) -> str:
        """The phase a stop and the ledger name (bootstrap/stops.py): each phase sets its own."""
        ...

    @phase.setter
    def phase(self, phase: str) -> None: ...

    @property
    def ledger(self) -> JobLedger: ...

    @property
    def stale_seconds(self) -> float: ...

    def spawn(self, name: str, target: Callable[[], None]) -> None:
        """A thread that runs until the life's outcome is decided (`background_stop`)."""
        ...

    def trainer_log_sink(self) -> Callable[[str], None]: ...


class Phase(Protocol):
    """One step of a life between its binding and its outcome."""

    # How the phase is known in the life's list (the phase a stop names is `Life.phase`, set by the phase).
    name: str

    def run(self, life: Life) -> Ended | None:
        """None: the life goes on to the next phase; else the end this life has come to."""
        ...


def run_phases(life: Life, phases: Sequence[Phase]) -> Ended:
    """Each phase in order until one ends the life; the last one (training) always does."""
    for phase in phases:
        ended = phase.run(life)
        if ended is not None:
            return ended
    names = ", ".join(phase.name for phase in phases)
    raise RuntimeError(f"no phase ended the life ({names}): the last phase must return its end")

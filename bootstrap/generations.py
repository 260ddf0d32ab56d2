"""Several nodes, one job (docs/multi-node.md): this node's generations, from joining one to the last.

A generation ends for everyone when any node stops (its notice stops all ranks at one step, with one
checkpoint): the others then join the next generation and go on with the nodes that remain; a node that
arrives while a generation trains is absorbed by torch's own restart. Global rank 0's node owns the job's
results and its completion.

A node can also vanish without a word (killed, powered off, frozen; docs/multi-node.md, "Faults without a
word"). Every node watches the others' heartbeats at each state poll: one that stops changing for
`silent_after` is taken for gone, its life closed as interrupted, and a generation it was in is ended here.
A generation that trained and ended without a stop (that, or a peer's sockets closing under the ranks) is
lost, not failed: the survivors restore the newest confirmed checkpoint and regroup within their lives.

Commits are fenced by generation (bootstrap/generation_fence.py): the fence's token follows the generation
this node launches in. A node that finds its generation replaced while it holds a step S3 has not confirmed
(it was frozen or cut off, and the others went on from the confirmed step) ends its life `superseded`
rather than regroup: the next generation's ranks resume from the newest step any node holds, so regrouping
would bring the lost generation's step back into the job.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bootstrap.agent_config import AgentConfig
from bootstrap.errors import one_line
from bootstrap.eventlog import EventLog, iso, utc_now
from bootstrap.generation_fence import GenerationFence, GenerationSupersededError
from bootstrap.imds import ImdsClient, ImdsUnavailableError, InstanceIdentity
from bootstrap.jobstate import JobState
from bootstrap.ledger import JobLedger
from bootstrap.multinode import RENDEZVOUS_ATTEMPTS, NodeGroup, wait_until_confirmed
from bootstrap.outcomes import LifeEnd
from bootstrap.persist import CheckpointPersister, PersistResult
from bootstrap.rendezvous import Membership, Rendezvous
from bootstrap.stops import StopRequests
from bootstrap.supervisor import Supervisor, TrainerExit
from bootstrap.trainer import TrainerPaths, TrainerProcess
from training.launch import LISTEN_FD_ENV
from trainstack_job.contract import ExitCode, JobStatus, NodeExit

# A node whose heartbeat (its node file, rewritten at every state poll) has not changed for this many polls,
# plus a margin for one slow S3 write, vanished: killed, powered off or frozen. Judged on this node's own
# clock (how long the value stayed the same), never by comparing two instances' clocks.
SILENT_POLLS = 4
SILENT_MARGIN_SECONDS = 3.0
# Generations lost in a row (a peer vanished, the store lost, a rank killed) with no newer confirmed
# checkpoint to resume from between them, before the life gives up: the same crash again is not bad luck.
LOST_GENERATIONS = 3
# What a rank of the built-in trainer exits with when retrying cannot help (docs/job-contract.md).
_PERMANENT = (ExitCode.CONFIG_ERROR, ExitCode.DATA_ERROR)


def node_group(
    config: AgentConfig,
    s3: Any,
    imds: ImdsClient,
    identity: InstanceIdentity,
    paths: TrainerPaths,
    stale_seconds: float,
) -> NodeGroup:
    """This node's membership in the job's rendezvous (S3), reachable at its private address."""
    try:
        address = imds.get("local-ipv4") or socket.gethostbyname(socket.gethostname())
    except ImdsUnavailableError:
        address = socket.gethostbyname(socket.gethostname())
    rendezvous = Rendezvous(
        s3,
        config.bucket,
        config.prefixes.state,
        instance_id=identity.instance_id,
        address=address,
        stack=config.stack,
        min_nodes=config.min_nodes,
        max_nodes=config.instance_count,
        stale_seconds=stale_seconds,
    )
    return NodeGroup(
        rendezvous,
        min_nodes=config.min_nodes,
        max_nodes=config.instance_count,
        exit_file=paths.node_exit_file,
        address=address,
    )


class Generations:
    """Runs the trainer in one generation after another until the job completes, fails or this node stops."""

    def __init__(
        self,
        config: AgentConfig,
        log: EventLog,
        stops: StopRequests,
        job: JobState,
        supervisor: Supervisor,
        nodes: NodeGroup,
        *,
        poll_seconds: float,
        fence: GenerationFence | None = None,
    ) -> None:
        self.config = config
        self.log = log
        self.stops = stops
        self.job = job
        self.supervisor = supervisor
        self.nodes = nodes
        self._poll_seconds = poll_seconds
        # The persister's fence (None: commits unfenced): told each generation this node launches in.
        self.fence = fence
        # Set when this node's generation completed but global rank 0 (and the results) ran elsewhere.
        self.follower = False
        self._left = False
        # The peer watch (state poller thread): each other node's last heartbeat value and when (this node's
        # monotonic clock) it last changed; the silences already acted on; the trainer of the generation
        # running here, which a vanished member's silence ends, and that member.
        self.silent_after = SILENT_POLLS * poll_seconds + SILENT_MARGIN_SECONDS
        self._beats: dict[str, tuple[float, float]] = {}
        self._blind = False
        self._silenced: set[tuple[str, float]] = set()
        self._lock = threading.Lock()
        self._running: TrainerProcess | None = None
        self._lost_member: str | None = None

    @classmethod
    def for_node(
        cls,
        config: AgentConfig,
        log: EventLog,
        stops: StopRequests,
        job: JobState,
        supervisor: Supervisor,
        s3: Any,
        imds: ImdsClient,
        identity: InstanceIdentity,
        paths: TrainerPaths,
        *,
        poll_seconds: float,
        fence: GenerationFence | None = None,
    ) -> Generations:
        """This node's generations; a node is given up on once silent for three polls and 30 s."""
        nodes = node_group(config, s3, imds, identity, paths, stale_seconds=3 * poll_seconds + 30)
        return cls(config, log, stops, job, supervisor, nodes, poll_seconds=poll_seconds, fence=fence)

    def heartbeat(self) -> None:
        """This node's heartbeat in the rendezvous (the state poller's), until it left, and the other nodes'
        heartbeats watched."""
        if self._left:
            return
        try:
            self.nodes.heartbeat()
        except Exception:
            self._blind = True  # S3 unreachable from here: the poller says so and retries
            raise
        try:
            self._watch_peers()
        except Exception as exc:  # this poll's ledger heartbeat must still go out; the next poll looks
            if not self._blind:
                what = "cannot read the other nodes' heartbeats; will retry"
                self.log.event("rendezvous", what, error=one_line(exc))
            self._blind = True

    def _watch_peers(self) -> None:
        """A node whose heartbeat stopped changing for `silent_after` vanished without a word (a host that
        loses power sends nothing, and a frozen one keeps its sockets open, so no collective fails): its
        life is closed as interrupted at its last heartbeat, and if it is a member of the generation that
        trains here, that generation is ended so the survivors regroup."""
        nodes = self.nodes.rendezvous.other_nodes()
        now = time.monotonic()
        # This node could not reach S3 since its last look (for it alone, or for everyone): the others may
        # not have reached it either, so every clock starts again rather than take them all for dead. A look
        # that is only late (a busy poller) still measures a true silence: a heartbeat that changed would
        # show a new value.
        blind, self._blind = self._blind, False
        for gone in set(self._beats) - set(nodes):
            del self._beats[gone]  # it left (its file deleted): nothing to watch
        for instance_id, node in nodes.items():
            beat = float(node["heartbeat_at"])
            seen = self._beats.get(instance_id)
            if seen is None or seen[0] != beat or blind:
                self._beats[instance_id] = (beat, now)
            elif now - seen[1] >= self.silent_after and (instance_id, beat) not in self._silenced:
                self._silenced.add((instance_id, beat))
                self._peer_vanished(instance_id, node, now - seen[1])

    def _peer_vanished(self, instance_id: str, node: dict[str, Any], silent: float) -> None:
        generation = node.get("generation")
        with self._lock:
            trainer = self._running
            member = trainer is not None and generation == self.nodes.last_generation
        self.log.event(
            "rendezvous",
            "a node stopped beating; taken for vanished"
            + ("; ending this generation to regroup without it" if member else ""),
            level="warning",
            node=instance_id,
            last_heartbeat=iso(datetime.fromtimestamp(float(node["heartbeat_at"]), timezone.utc)),
            silent_s=round(silent, 1),
            generation=generation,
        )
        if member:
            with self._lock:
                # Its ranks wait in a collective (or on its store) for a peer that never answers: only
                # ending them frees this node; the newest confirmed checkpoint is restored before the next
                # generation. Under the lock, and only if that generation still runs here: the next one's
                # start (the same process object) waits, so the kill only ever hits the generation meant.
                if self._running is trainer and trainer is not None:
                    self._lost_member = instance_id
                    _kill_with_ranks(trainer)
        me = self.nodes.rendezvous.instance_id
        self.job.record(lambda ledger: ledger.close_silent_node(instance_id, me))

    def leave(self) -> None:
        """Take this node out of the rendezvous (its node file), so no one joins it as host; once."""
        if self._left:
            return
        self._left = True
        try:
            self.nodes.leave()
        except Exception as exc:  # its heartbeat goes stale instead; the others then stop counting on it
            self.log.event("rendezvous", "could not remove this node's file", error=one_line(exc))

    def train(
        self, trainer: TrainerProcess, persister: CheckpointPersister, restored: int | None
    ) -> TrainerExit:
        """Run the trainer in one generation after another until the job completes, fails or this node
        is stopped. A generation ends for everyone when any node stops (its notice stops all ranks at one
        step, with one checkpoint): the others then join the next generation and go on with the nodes
        that remain; a node that arrives while a generation trains is absorbed by torch's own restart."""
        nodes = self.nodes
        failed_rendezvous = 0
        # Generations lost in a row, and the step the last loss resumed from (progress between losses resets).
        lost_in_a_row, resumed_after_loss = 0, None
        while True:
            try:
                membership = nodes.join()
            except Exception as exc:  # S3 unreachable for now: the stop path never waits on this
                failed_rendezvous += 1
                self.log.event("rendezvous", "cannot join a generation; will retry", error=one_line(exc))
                if failed_rendezvous >= RENDEZVOUS_ATTEMPTS:
                    return int(ExitCode.FAILED)
                if self.stops.wait(min(30.0, 2.0 * failed_rendezvous)):
                    return int(ExitCode.STOPPED)
                continue
            generation = membership.generation
            if self.fence is not None:
                # Before the trainer saves a step in it: that step's commit carries this generation.
                self.fence.enter(generation.number)
            self.job.record(_in_generation(generation.number))
            try:
                trainer.update_env(nodes.trainer_env(membership))
                if not self.stops.launch(functools.partial(self._start, trainer, membership, restored)):
                    # The last generation ended with every rank's checkpoint committed: nothing new here.
                    return int(ExitCode.STOPPED)
                # Every start in this generation (the stall watchdog's restart included) passes the store's
                # socket on: the agent keeps its copy until the trainer is done with the generation.
                code = self.supervisor.supervise(trainer, persister, watch_silent=False)
            finally:
                # The generation is over here whichever way it ended: no socket outlives it, and no later
                # start can pass on an fd number the agent may have reused for something else.
                with self._lock:
                    self._running, lost_member, self._lost_member = None, self._lost_member, None
                nodes.end_generation()
                trainer.update_env({LISTEN_FD_ENV: ""})
            ended = nodes.node_exit()
            if (
                isinstance(code, int)
                and code < 0
                and lost_member is None
                and ended is not None
                and ended.exit_code in (ExitCode.COMPLETED, ExitCode.STOPPED)
            ):
                # The launcher wrote what its ranks did, then a signal ended it: the record is the truth.
                self.log.event(
                    "rendezvous",
                    "the launcher was ended by a signal after its ranks ended; going by their record",
                    level="warning",
                    signal=-code,
                    exit_code=ended.exit_code,
                )
                code = ended.exit_code
            if code == ExitCode.COMPLETED:
                # Global rank 0's node owns the results and the job's completion; the others end quietly
                # once it has said so (a scale-in it caused may already be stopping them: still completed).
                self.follower = ended is not None and not ended.rank0_here
                if not self.follower:
                    self._close_silent_lives()
                if not self.follower or self.stops.reason is not None or self._job_completed_elsewhere():
                    return code
                self.log.event(
                    "rendezvous", "the node with rank 0 did not complete the job; regrouping", level="warning"
                )
                continue
            if self.stops.reason is not None:
                return code
            if ended is not None and ended.rendezvous_failed:
                failed_rendezvous += 1
                self.log.event(
                    "rendezvous",
                    "generation did not form; trying the next one",
                    generation=generation.number,
                    attempt=failed_rendezvous,
                )
                if failed_rendezvous >= RENDEZVOUS_ATTEMPTS or self.stops.wait(2.0):
                    return code
                continue
            failed_rendezvous = 0
            lost = _lost(code, ended, lost_member)
            if lost is not None and self._superseded(persister):
                return code
            if lost is not None:
                # Nobody stopped it: a node vanished (killed, powered off, frozen) and took the ranks' peers
                # or the store with it. Not a failure of this life: the survivors regroup, each from the
                # newest checkpoint confirmed in S3, so a silent death costs at most the work since then.
                restored = self._catch_up(persister, None)
                if restored is not None and (resumed_after_loss is None or restored > resumed_after_loss):
                    lost_in_a_row = 0
                lost_in_a_row += 1
                resumed_after_loss = restored
                self.log.event(
                    "rendezvous",
                    "generation lost without a stop; regrouping from the newest confirmed checkpoint"
                    if lost_in_a_row < LOST_GENERATIONS
                    else "generation lost again with no newer confirmed checkpoint; giving up this life",
                    level="warning",
                    generation=generation.number,
                    ended_by=lost,
                    **({"vanished": lost_member} if lost_member else {}),
                    exit_code=code if isinstance(code, int) else str(code),
                    resume_step=restored,
                    lost_in_a_row=lost_in_a_row,
                )
                if lost_in_a_row >= LOST_GENERATIONS:
                    return code
                continue
            lost_in_a_row = 0
            if code != ExitCode.STOPPED:
                return code
            why = self._job_wide_stop()
            if why is not None:
                self.stops.request(why)
                return code
            self.log.event(
                "rendezvous",
                "another node left the job; every rank stopped at one step with its checkpoint, regrouping",
                generation=generation.number,
                stopped_step=ended.stopped_step if ended else None,
                world_size=ended.world_size if ended else None,
            )
            restored = self._catch_up(persister, ended)

    def _superseded(self, persister: CheckpointPersister) -> bool:
        """Before regrouping after a lost generation: does a newer generation own the job while this node
        holds a step S3 has not confirmed? Then the life ends (stop `generation_superseded`), as when the
        persister finds it first: the next generation's ranks would resume from that step, a lost
        generation's. A fence that cannot be read now is no finding: the persister's own checks still fence
        every commit."""
        if self.fence is None:
            return False
        if persister.lease_lost is not None:
            return True  # the persister found it first; its stop is already requested
        newest, confirmed = persister.newest_local_step(), persister.confirmed_step
        if newest is None or (confirmed is not None and newest <= confirmed):
            return False  # nothing of this node's own to carry over: it regroups like any survivor
        try:
            self.fence.check()
        except GenerationSupersededError as exc:
            self.log.event(
                "rendezvous",
                f"generation {exc.newer} owns the job: step {newest} saved here in generation "
                f"{exc.generation} is NOT confirmed and is not the job's; ending this life",
                level="warning",
                newest_local_step=newest,
                confirmed_step=confirmed,
            )
            self.stops.request("generation_superseded", generation=exc.generation, newer_generation=exc.newer)
            return True
        except Exception as exc:
            self.log.event("rendezvous", "cannot read the generation record; regrouping", error=one_line(exc))
        return False

    def _start(self, trainer: TrainerProcess, membership: Membership, restored: int | None) -> TrainerProcess:
        generation = membership.generation
        self.log.event(
            "rendezvous",
            "hosting generation" if membership.is_host else "joining generation",
            generation=generation.number,
            endpoint=generation.endpoint,
            nodes=f"{self.nodes.min_nodes}..{self.nodes.max_nodes}",
            restored_step=restored,
            **({"repaired": membership.repaired} if membership.repaired else {}),
        )
        trainer.start()
        with self._lock:
            self._running = trainer
        return trainer

    def _close_silent_lives(self) -> None:
        """The job completed here: every other life still running whose heartbeat stopped is closed as
        interrupted at that heartbeat (live followers beat and end their own lives completed)."""
        me = self.nodes.rendezvous.instance_id
        closed: list[str] = []

        def change(ledger: JobLedger) -> None:
            closed[:] = ledger.close_silent_lives(utc_now(), self.silent_after, me)

        if self.job.record(change) and closed:
            self.log.event("rendezvous", "lives of silent nodes closed as interrupted", nodes=closed)

    def _catch_up(self, persister: CheckpointPersister, ended: NodeExit | None) -> int | None:
        """Before the next generation: the job's newest checkpoint on this node too. The step every rank
        stopped at was committed by global rank 0, maybe on the node that just left: wait (up to the stop
        deadline) for its upload, then restore it from S3, so the next generation resumes there and not
        at an older step this node happens to hold."""
        if ended is not None and ended.stopped_step is not None and not ended.rank0_here:
            deadline = time.monotonic() + self.config.stop_deadline_seconds
            seen = wait_until_confirmed(
                persister.read_latest, ended.stopped_step, deadline, should_stop=self.stops.is_set
            )
            if seen is None or seen < ended.stopped_step:
                self.log.event(
                    "checkpoint",
                    "the step every rank stopped at was not confirmed in S3 in time; resuming from the "
                    "newest one that was",
                    level="warning",
                    stopped_step=ended.stopped_step,
                    confirmed_step=seen,
                )
        try:
            return persister.restore(should_abort=self.stops.is_set)
        except Exception as exc:  # the next generation still resumes from the newest step any node holds
            self.log.event("checkpoint", "could not restore from S3 before regrouping", error=one_line(exc))
            return None

    def _job_wide_stop(self) -> str | None:
        """A stop that every node must follow (`trainstack stop`, the cost cap), checked when a generation
        stopped without this node asking: another node may have seen it first."""
        try:
            wide = self.job.job_wide_stop(cost_usd=lambda: self.job.ledger_store.load().total_cost_usd)
        except Exception as exc:  # the state poller keeps asking; regrouping is the safe default
            self.log.event("state", "cannot read the job state; regrouping", error=one_line(exc))
            return None
        return wide.reason if wide is not None else None

    def _job_completed_elsewhere(self, wait_seconds: float = 300.0) -> bool:
        """Whether the node that ran global rank 0 marked the job completed (it uploads the results)."""
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                if self.job.ledger_store.load().status == JobStatus.COMPLETED:
                    return True
            except Exception as exc:
                self.log.event("state", "cannot read the ledger; will retry", error=one_line(exc))
            if time.monotonic() >= deadline:
                return False
            if self.stops.wait(min(5.0, self._poll_seconds)):
                return True  # stopping (the rank-0 node's scale to zero, most likely): the job did complete

    def job_checkpoint_confirmed(
        self, persisted: PersistResult, persister: CheckpointPersister, deadline: float
    ) -> PersistResult:
        """On a node whose ranks stopped without rank 0, the job's checkpoint is the rank-0 node's to
        upload: wait (to the stop deadline) for S3 latest.json to reach the step every rank stopped at."""
        ended = self.nodes.node_exit()
        if persisted.lease_lost or ended is None or ended.rank0_here or ended.stopped_step is None:
            return persisted
        if persisted.confirmed_step is not None and persisted.confirmed_step >= ended.stopped_step:
            return PersistResult(ended.stopped_step, persisted.confirmed_step)
        confirmed = wait_until_confirmed(persister.read_latest, ended.stopped_step, deadline)
        return PersistResult(ended.stopped_step, confirmed)


def _kill_with_ranks(trainer: TrainerProcess) -> None:
    """The launcher and its ranks: torch starts each rank in a session of its own, so killing the launcher's
    process group would leave them waiting in their collective (on an instance the job's cgroup goes too)."""
    ranks: list[int] = []
    todo = [trainer.pid] if trainer.pid is not None else []
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                found = [int(pid) for pid in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            ranks += found
            todo += found
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    trainer.kill()


def _lost(code: TrainerExit, ended: NodeExit | None, lost_member: str | None) -> str | None:
    """What lost the generation when it ended without a stop after training (None: it was not lost)."""
    if isinstance(code, LifeEnd) or code in (ExitCode.COMPLETED, ExitCode.STOPPED, *_PERMANENT):
        return None
    if lost_member is not None:
        return f"node {lost_member} stopped beating"
    if ended is None or not ended.trained or ended.exit_code in _PERMANENT:
        return None
    return ended.ended_by or f"this node's ranks failed (exit {code}): a peer or its store gone, most likely"


def _in_generation(number: int) -> Callable[[JobLedger], None]:
    def change(ledger: JobLedger) -> None:
        ledger.set_generation(number)

    return change

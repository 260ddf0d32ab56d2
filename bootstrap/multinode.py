"""This instance's part in a multi-node job: its generation, its trainer's rendezvous, what its node did.

The agent on every node restores, syncs and supervises as for one node; what is added (docs/multi-node.md):
- before each launch the node joins a generation through S3 (bootstrap/rendezvous.py) and hands the
  trainer that generation's c10d endpoint, run id and node bounds (trainstack_job.contract.JobEnv); on the
  node that hosts it, also the store's listening socket (LISTEN_FD_ENV), which the agent holds until the
  generation ends here (`end_generation`), so every start of the trainer in it gets the socket;
- training/launch.py writes what its ranks did into the node exit file (trainstack_job.contract.NodeExit):
  the agent reads the step they stopped at (to confirm that step in S3 before an interrupted node goes),
  whether global rank 0 ran here (that node owns the job's results and its completion), whether the
  rendezvous itself failed (then the next generation is tried, nothing is counted as a failure) and whether
  this node's ranks ran in it (`trained`: a generation that trained and then ended without a stop was lost
  to a vanished node, and is regrouped from the newest confirmed checkpoint: bootstrap/generations.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from bootstrap.rendezvous import Membership, Rendezvous
from training.launch import LISTEN_FD_ENV
from trainstack_job.contract import JobEnv, NodeExit

# How long a node waits in a rendezvous for `min_nodes` (a replacement's boot, sync and restore included).
JOIN_TIMEOUT_SECONDS = 900.0
# Generations in a row whose rendezvous failed (a host gone, a store refused) before the life gives up.
RENDEZVOUS_ATTEMPTS = 10


class NodeGroup:
    """The generations this node takes part in, and the trainer environment for each."""

    def __init__(
        self,
        rendezvous: Rendezvous,
        *,
        min_nodes: int,
        max_nodes: int,
        exit_file: Path,
        address: str,
        join_timeout_seconds: float = JOIN_TIMEOUT_SECONDS,
    ) -> None:
        self.rendezvous = rendezvous
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.exit_file = exit_file
        self.address = address
        self.join_timeout_seconds = join_timeout_seconds
        self.last_generation: int | None = None
        self.membership: Membership | None = None

    def join(self) -> Membership:
        """The generation to launch in next: the current one if it is newer than the last this node ran in
        and its host is alive, else a new one this node hosts (S3 conditional writes decide races)."""
        membership = self.rendezvous.join(self.last_generation)
        self.membership = membership
        self.last_generation = membership.generation.number
        # A stale record from the generation before must not be read as this one's.
        self.exit_file.unlink(missing_ok=True)
        return membership

    def trainer_env(self, membership: Membership) -> dict[str, str]:
        """The trainer's rendezvous variables for this generation (TrainerProcess.start passes the store's
        socket on with them). LISTEN_FD_ENV is always set, empty on a client, because a trainer's variables
        are updated, never cleared: a host of the generation before must not pass a closed fd on."""
        generation = membership.generation
        listen_fd = ""
        if membership.is_host:
            listener = self.rendezvous.listener(generation)
            if listener is None:  # `join` returns a hosted generation only with its socket held
                raise RuntimeError(f"generation {generation.number}: hosted here without its store's socket")
            listen_fd = str(listener.fileno())
        return {
            JobEnv.RDZV_ENDPOINT.value: generation.endpoint,
            JobEnv.RDZV_ID.value: generation.run_id,
            JobEnv.RDZV_HOST.value: "1" if membership.is_host else "0",
            JobEnv.NNODES.value: f"{self.min_nodes}:{self.max_nodes}",
            JobEnv.NODE_ADDR.value: self.address,
            JobEnv.NODE_EXIT_FILE.value: str(self.exit_file),
            JobEnv.RDZV_JOIN_TIMEOUT.value: f"{self.join_timeout_seconds:g}",
            LISTEN_FD_ENV: listen_fd,
        }

    def end_generation(self) -> None:
        """This node's trainer is done with the generation: close the store's socket it hosted (if any).

        Not at the trainer's start: the stall watchdog (bootstrap/supervisor.py) may start it again in the
        same generation, and that launcher needs the same socket: the endpoint the other nodes dial cannot
        change within a generation. torch elastic's own restarts need nothing here: they happen inside the
        launcher, whose store (and socket) lives on. Held past the trainer's exit, the socket would only let
        late dialers queue in its backlog instead of being refused, so it goes as the generation ends."""
        self.rendezvous.close_listener()

    def node_exit(self) -> NodeExit | None:
        return NodeExit.read(self.exit_file)

    def heartbeat(self) -> None:
        self.rendezvous.heartbeat(self.last_generation)

    def leave(self) -> None:
        """Out of the rendezvous: the node file, and the store's socket if this node still holds one."""
        self.rendezvous.leave()


def wait_until_confirmed(
    read_latest: Callable[[float | None], tuple[int | None, str | None]],
    step: int,
    deadline: float,
    should_stop: Callable[[], bool] = lambda: False,
    poll_seconds: float = 0.5,
) -> int | None:
    """The step S3 `latest.json` names once it reaches `step`, or the last one seen at `deadline`.

    An interrupted node whose ranks did not include global rank 0 has no new checkpoint of its own: the
    job's coordinated checkpoint is uploaded by the node that ran rank 0. This node still owes its notice
    the answer "was the job's state at the step we stopped at confirmed?", so it watches latest.json.
    """
    seen: int | None = None
    while True:
        # S3 unreachable now: the deadline decides, not one failed read.
        with contextlib.suppress(Exception):
            seen, _ = read_latest(deadline)
        if seen is not None and seen >= step:
            return seen
        if time.monotonic() + poll_seconds > deadline or should_stop():
            return seen
        time.sleep(poll_seconds)

"""Two nodes, one job, under the real agents (multinode_harness.py: each node's agent a process under a
systemd-like supervisor, the real launchers and trainer, gloo on 127.0.0.1, a tiny model): both nodes get
their spot notice in the same instant while stop signals rain on every launcher and rank (the race of two
notices at once: a stop reaching a rank after it stopped at the common step must never kill it). Nodes
that vanish without a notice, a node leaving mid-rendezvous and a survivor completing the job alone are
tests/bootstrap/test_multinode_faults.py's stories; `python -m demo --nodes 2`
(tests/bootstrap/test_demo_multinode.py) covers one node interrupted, a replacement joining and both nodes
of the last round completing. The store's socket, from the host's join to its trainer, is checked first
with a stand-in trainer (no training).

The simultaneous notices once failed 3 runs of 6; one run costs about 20 s of CPU, so `make test` runs it
once and `TRAINSTACK_REPEAT=10` runs it ten times in a row (bench/RESULTS.md, "Two notices in the same
instant", has the last such count)."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from bootstrap.multinode import NodeGroup
from bootstrap.rendezvous import Rendezvous
from bootstrap.trainer import TrainerPaths, TrainerProcess
from tests.bootstrap.multinode_harness import STORY_TIMEOUT_S, Job, Node, multinode_job
from tests.forkserver import ForkServer
from training.launch import LISTEN_FD_ENV

REPEAT_ENV = "TRAINSTACK_REPEAT"


def _repeat() -> int:
    """How many times the simultaneous-notice story runs in this session (REPEAT_ENV, default once)."""
    value = os.environ.get(REPEAT_ENV, "1").strip()
    if not value.isdigit() or int(value) < 1:
        raise pytest.UsageError(f"{REPEAT_ENV}={value!r}: expected how many runs, a whole number >= 1")
    return int(value)


# A stand-in for the host's launcher: serves one connection on the socket it was handed, as the c10d store
# does (training/launch.py), and says which process served it; says so when it was handed none.
SERVE_ON_INHERITED_SOCKET = f"""
import os, socket
fd = os.environ["{LISTEN_FD_ENV}"]
if not fd:
    print("no socket", flush=True)
    raise SystemExit(0)
with socket.socket(fileno=int(fd)) as store:
    conn, _ = store.accept()
    with conn:
        conn.sendall(str(os.getpid()).encode())
"""


def _node_group(s3: Any, instance_id: str, scratch: Path) -> NodeGroup:
    rendezvous = Rendezvous(
        s3,
        "trainstack-fd",
        "state/",
        instance_id=instance_id,
        address="127.0.0.1",
        stack="fd",
        min_nodes=1,
        max_nodes=2,
        stale_seconds=60,
    )
    return NodeGroup(
        rendezvous, min_nodes=1, max_nodes=2, exit_file=scratch / "node-exit.json", address="127.0.0.1"
    )


def _served_by(endpoint: str) -> int:
    host, _, port = endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.settimeout(30)
        return int(conn.recv(64).decode())


def test_the_host_trainer_serves_on_the_socket_published_at_every_start_of_its_generation(
    aws: Any, tmp_path: Path
) -> None:
    """The published port reaches the host's trainer as the socket itself (TRAINSTACK_RDZV_LISTEN_FD,
    passed with pass_fds), at the first start and at a restart in the same generation (the stall
    watchdog's): the agent holds it until the generation ends; a client node's trainer gets none."""
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket="trainstack-fd")
    host, client = _node_group(s3, "i-host", tmp_path), _node_group(s3, "i-client", tmp_path)
    hosted = host.join()  # not a wait: NodeGroup.join decides at once (a few S3 calls)
    env = host.trainer_env(hosted)
    listener = host.rendezvous.listener(hosted.generation)
    assert hosted.is_host and listener is not None and env[LISTEN_FD_ENV] == str(listener.fileno())
    assert not listener.get_inheritable(), "only the trainer may get the socket, not every child of the agent"
    lines: list[str] = []
    trainer = TrainerProcess(
        [sys.executable, "-c", SERVE_ON_INHERITED_SOCKET],
        TrainerPaths(tmp_path / "host"),
        {},
        lines.append,
        user_job=True,
        env=env,
    )
    for start in ("first start", "restart in the same generation"):
        trainer.start()
        assert _served_by(hosted.generation.endpoint) == trainer.pid, start
        assert trainer.wait(timeout=30) == 0, (start, lines)
    host.end_generation()
    assert listener.fileno() == -1 and host.rendezvous.listener(hosted.generation) is None

    joined = client.join()  # not a wait: NodeGroup.join decides at once (a few S3 calls)
    assert not joined.is_host and client.trainer_env(joined)[LISTEN_FD_ENV] == ""
    trainer.update_env(client.trainer_env(joined))
    trainer.start()
    assert trainer.wait(timeout=30) == 0 and lines[-1] == "no socket", lines


class StopStorm:
    """SIGTERM and SIGINT to every process under one node's agent (its launcher and ranks, never the agent)
    every few milliseconds until they have all exited: a second notice, another node's stop, the agent's own
    stop, arriving before, during and after each rank's stop at the common step, hundreds of times a run."""

    def __init__(self, node: Node) -> None:
        assert node.process is not None
        self.agent = node.process.pid
        self._node = node
        self.sent = 0
        self._thread = threading.Thread(target=self._rain, name=f"{node.name}-stops", daemon=True)
        self._thread.start()

    def _rain(self) -> None:
        deadline = time.monotonic() + STORY_TIMEOUT_S
        rounds = 0
        pids = self._node.under_agent()
        while pids and time.monotonic() < deadline:
            for pid in pids:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        continue
                    self.sent += 1
            time.sleep(0.005)
            rounds += 1
            if rounds % 10 == 0:  # reading /proc costs more than a round of signals
                pids = self._node.under_agent()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        # The storm rains until nothing is left under the agent: still raining, something outlived it.
        assert not self._thread.is_alive(), f"processes under agent {self.agent} still ran after {timeout} s"


# Epochs of 4 steps: more than the notices need, so the job never completes before they land.
EPOCHS = 6


@pytest.fixture()
def noticed_job(aws: Any, tmp_path: Path, fork_server: ForkServer) -> Iterator[Job]:
    with multinode_job(tmp_path, fork_server, name="trainstack-nodes", instances=2, epochs=EPOCHS) as job:
        yield job


@pytest.mark.slow(seconds=28)
@pytest.mark.parametrize("run", range(_repeat()))
def test_two_notices_in_the_same_instant_under_a_rain_of_stops_every_launcher_exits_75_at_one_step(
    noticed_job: Job, run: int
) -> None:
    job = noticed_job
    nodes, story = job.nodes, job.story
    for node in nodes:
        node.hold(job.hooks, entering=(1,))
    job.supervisor.start(*nodes)
    # One round with both from the first step, however far apart their launchers got ready.
    job.enter_together(1, *nodes)
    job.wait_for(
        lambda: any(n.progress().get("world_size") == 2 and n.progress().get("step", 0) >= 2 for n in nodes),
        150,
        "two-node training",
    )
    # Generation 1 formed with both nodes: one hosts it, the other joins it.
    first = [n.find("generation") for n in nodes]
    assert all(first) and {e["generation"] for _, e in filter(None, first)} == {1}, story()
    assert sorted(str(e["message"]) for _, e in filter(None, first)) == [
        "hosting generation",
        "joining generation",
    ]

    # The same instant: both notices set in one loop, nothing between them.
    for node in nodes:
        node.imds.inject_spot_notice()
    job.wait_for(lambda: all(n.find("stop requested") for n in nodes), 30, "both agents stopping")
    # Each agent has sent its stop; now every launcher and rank gets stops without end.
    storms = [StopStorm(node) for node in nodes]
    job.wait_for(lambda: all(job.supervisor.finished(n) for n in nodes), STORY_TIMEOUT_S, "both lives ending")
    for storm in storms:
        storm.join(timeout=5)
    # Each storm began while that node's launcher and ranks were stopping and rained until the last of them
    # had exited, so its stops reached them after their own (how many depends on the machine's speed).
    assert all(storm.sent > 0 for storm in storms), [storm.sent for storm in storms]

    # One step for everyone: the step S3 confirms is the one every rank of both nodes stopped at, and each
    # agent's stop line says so truthfully.
    common = job.confirmed_step()
    assert common is not None and common >= 2, story()
    for node in nodes:
        ended = node.node_exit()
        assert ended is not None and ended.exit_code == 75 and ended.stopped_step == common, (
            node.name,
            story(),
        )
        assert node.rank_codes() and set(node.rank_codes().values()) == {75}, node.rank_codes()
        stopped = node.find("trainer stopped")
        assert stopped is not None, story()
        assert stopped[1]["exit_code"] == 75 and stopped[1]["checkpoint_confirmed"], stopped
        assert stopped[1]["checkpoint_step"] == common, stopped
        # No rank or launcher killed by a stop that came after its own (that would be -15, a failed group,
        # the other launcher waiting in torch's exit barrier).
        assert not any("exitcode  : -15" in line or "Signal 15" in line for _, line in node.lines), story()
        assert node.find("ended by a signal") is None, "the launcher itself must outlive late stops too"
        # Each stopped for its own notice: neither took the other's stop for a node leaving, nor for a death.
        assert node.find("another node left") is None and node.find("stopped beating") is None, story()
        assert node.restarts == 0 and node.exit_codes == [0], story()
    ledger = job.ledger()
    assert sorted(life["outcome"] for life in ledger["lives"]) == ["preempted", "preempted"], story()
    assert ledger["interruptions"] == 2 and ledger["consecutive_failures"] == 0

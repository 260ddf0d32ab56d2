"""One data-parallel job over several "nodes": launcher processes on 127.0.0.1 that join one c10d rendezvous,
each with its own checkpoint and output folders, as on separate machines. The launchers are forked from the
fork server (tests/forkserver.py), without torch's imports each; their ranks are processes that torch's
engine starts, as always."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from tests.forkserver import ForkedLife, ForkServer
from tests.once import built_once
from tests.training.conftest import Dataset, MakeRun, Run, make_run_factory
from tests.training.lives import Lives
from training.launch import LISTEN_FD_ENV
from trainstack_job.contract import JobEnv

EXIT_STOPPED = 75
# 16 steps: the stop is sent after step 2 and lands within a step or two; the steps past it only cost CPU.
EPOCHS = 2
TOTAL = 16
GLOBAL_BATCH = 16  # conftest FAST: batch 16, micro-batch 8
# What a node launcher and its ranks must not inherit from the test process.
ENGINE_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TRAINSTACK_FAULT")


def store_listener() -> socket.socket:
    """A listening socket on a port the OS picked, handed to the host launcher for its store
    (TRAINSTACK_RDZV_LISTEN_FD): the port is never free between the test choosing it and the store serving
    it, as a port probed free and closed would be."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    return listener


def refusing_port() -> socket.socket:
    """A socket bound to a port the OS picked, not listening: while it stays open nobody else can take the
    port and every connection there is refused (a store nobody hosts)."""
    reserved = socket.socket()
    reserved.bind(("127.0.0.1", 0))
    return reserved


def port_of(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])


@dataclass(frozen=True, eq=False)  # a dict key by identity (its Run holds a list)
class Node:
    """One machine of the job: its own folders, the address the other nodes know it by."""

    run: Run
    addr: str

    @property
    def exit_file(self) -> Path:
        return self.run.root / "node-exit.json"

    @property
    def log(self) -> Path:
        return self.run.root / "launcher.log"

    def start(
        self,
        lives: Lives,
        port: int,
        run_id: str,
        *,
        host: bool,
        listener: socket.socket | None = None,
        nnodes: str = "2:2",
        join_timeout: float = 120,
    ) -> ForkedLife:
        """The node's launcher; the host's serves its store on `listener` (then closed here: the launcher
        holds it) when given one."""
        env = {key: value for key, value in os.environ.items() if key not in ENGINE_VARIABLES}
        env |= {
            "OMP_NUM_THREADS": "1",
            JobEnv.RDZV_ENDPOINT.value: f"127.0.0.1:{port}",
            JobEnv.RDZV_ID.value: run_id,
            JobEnv.RDZV_HOST.value: "1" if host else "0",
            JobEnv.NNODES.value: nnodes,
            JobEnv.NODE_ADDR.value: self.addr,
            JobEnv.NODE_EXIT_FILE.value: str(self.exit_file),
            JobEnv.RDZV_JOIN_TIMEOUT.value: f"{join_timeout:g}",
        }
        if listener is not None:
            env[LISTEN_FD_ENV] = str(listener.fileno())
        self.run.root.mkdir(parents=True, exist_ok=True)
        self.exit_file.unlink(missing_ok=True)
        # The log a file, not a pipe: nobody has to drain two nodes at once. `lives` kills the launcher if
        # the test ends first.
        process = lives.popen(self.run, env, exact_env=True, log=self.log, listener=listener)
        if listener is not None:
            listener.close()
        return process

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def exit_record(self) -> dict[str, Any]:
        record: dict[str, Any] = json.loads(self.exit_file.read_text())
        return record


def wait_for(processes: dict[Node, ForkedLife], timeout: float = 240) -> dict[Node, int]:
    """Every node's exit code; kills them all and fails (with their logs) past `timeout`."""
    deadline = time.monotonic() + timeout
    codes = {}
    for node, process in processes.items():
        try:
            codes[node] = process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in processes.values():
                other.kill()
                other.wait()
            logs = "\n".join(f"--- {n.run.root.name}\n{n.output()[-3000:]}" for n in processes)
            pytest.fail(f"the nodes ran past {timeout}s\n{logs}")
    return codes


def poll(process: ForkedLife, condition: Callable[[], bool], what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"exited {process.returncode} before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout}s"
        time.sleep(0.05)


def trained_steps(run: Run) -> int:
    try:
        return int(json.loads((run.output / "progress.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0


def latest_step(run: Run) -> int:
    return int(json.loads((run.checkpoints / "latest.json").read_text())["step"])


def copy_checkpoints(source: Run, target: Run) -> None:
    """What the agent does for a node: restore the job's checkpoint into its own checkpoint.dir."""
    shutil.copytree(source.checkpoints, target.checkpoints)


@dataclass(frozen=True, eq=False)
class StoppedPair:
    a: Node  # hosts the store, global rank 0 (its address sorts first)
    b: Node
    codes: dict[Node, int]
    step: int


@pytest.fixture(scope="module")
def stopped_pair(
    tmp_path_factory: pytest.TempPathFactory, image_folders: Dataset, fork_server: ForkServer
) -> StoppedPair:
    """Two nodes, one rank each, training; the non-host node's launcher gets SIGTERM mid-run. Run once per
    session (tests/once.py): both tests below only read what it left, and on two workers each would run it."""

    def nodes(folder: Path) -> tuple[Node, Node]:
        make = make_run_factory(folder, image_folders)
        a = Node(make("train.processes=1", f"train.epochs={EPOCHS}", name="a"), "127.0.0.1")
        return a, Node(make("train.processes=1", f"train.epochs={EPOCHS}", name="b"), "127.0.0.2")

    def build(folder: Path) -> None:
        a, b = nodes(folder)
        lives = Lives(fork_server)
        listener, run_id = store_listener(), "pair-1"
        port = port_of(listener)
        processes = {
            a: a.start(lives, port, run_id, host=True, listener=listener),
            b: b.start(lives, port, run_id, host=False),
        }
        try:
            poll(processes[a], lambda: trained_steps(a.run) >= 2, "two trained steps")
            processes[b].send_signal(signal.SIGTERM)
            codes = wait_for(processes)
        finally:
            lives.reap()
        (folder / "codes.json").write_text(json.dumps({"a": codes[a], "b": codes[b]}))

    folder = built_once(tmp_path_factory, "multinode-pair", build)
    a, b = nodes(folder)
    codes = json.loads((folder / "codes.json").read_text())
    saved = a.run.checkpoints / "latest.json"
    return StoppedPair(a, b, {a: codes["a"], b: codes["b"]}, latest_step(a.run) if saved.exists() else -1)


@pytest.mark.slow(seconds=9)
def test_sigterm_to_one_node_stops_every_rank_of_both_at_the_same_step(stopped_pair: StoppedPair) -> None:
    a, b = stopped_pair.a, stopped_pair.b
    logs = f"{a.output()[-3000:]}\n---\n{b.output()[-3000:]}"
    assert stopped_pair.codes == {a: EXIT_STOPPED, b: EXIT_STOPPED}, logs
    assert "Traceback" not in a.output() + b.output(), logs
    on_a, on_b = a.exit_record(), b.exit_record()
    step = stopped_pair.step
    assert 2 <= step < TOTAL
    assert on_a == {
        "exit_code": EXIT_STOPPED,
        "ranks": {"0": EXIT_STOPPED},
        "stopped_step": step,
        "rank0_here": True,
        "rendezvous_failed": False,
        "world_size": 2,
        "trained": True,
        "ended_by": None,
    }
    assert on_b == on_a | {"ranks": {"1": EXIT_STOPPED}, "rank0_here": False}
    # Only the main rank writes checkpoints: the step is on the rank-0 machine, nowhere else.
    manifest = json.loads((a.run.checkpoints / f"step-{step}" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert not list(b.run.checkpoints.glob("step-*"))
    # What a later round with another world size needs to keep the optimisation: the global batch. One node
    # resuming it alone (2 accumulation steps, not 1) is tests/bootstrap/test_multinode_faults.py's survivor.
    saved = torch.load(a.run.checkpoints / f"step-{step}" / "state.pt", weights_only=True)["batch"]
    assert saved == {"global_batch": GLOBAL_BATCH, "micro_batch": 8, "accumulation": 1, "world_size": 2}


@pytest.mark.slow(seconds=10)
def test_a_node_without_the_checkpoint_gets_it_over_the_process_group_and_both_complete(
    stopped_pair: StoppedPair, make_run: MakeRun, lives: Lives
) -> None:
    """Relaunched in a new generation, the node that has no checkpoint becomes global rank 0 (its address
    sorts first now): it resumes at the other node's step, so the state came over the process group."""
    step = stopped_pair.step
    assert step > 0
    holder = Node(make_run("train.processes=1", f"train.epochs={EPOCHS}", name="holder"), "127.0.0.2")
    empty = Node(make_run("train.processes=1", f"train.epochs={EPOCHS}", name="empty"), "127.0.0.1")
    copy_checkpoints(stopped_pair.a.run, holder.run)
    listener = store_listener()
    port = port_of(listener)
    codes = wait_for(
        {
            holder: holder.start(lives, port, "pair-2", host=True, listener=listener),
            empty: empty.start(lives, port, "pair-2", host=False),
        }
    )
    logs = f"{holder.output()[-3000:]}\n---\n{empty.output()[-3000:]}"
    assert codes == {holder: 0, empty: 0}, logs
    main = empty.output()
    assert f"resuming at step {step} " in main, logs
    assert f"checkpoint step {step} is not in this machine's {empty.run.checkpoints}" in main
    assert "rank 1 sent it over the process group" in main
    records = {node: node.exit_record() for node in (holder, empty)}
    assert [node for node, record in records.items() if record["rank0_here"]] == [empty]
    assert records[empty]["ranks"] == {"0": 0} and records[holder]["ranks"] == {"1": 0}
    for record in records.values():
        assert record["exit_code"] == 0 and record["stopped_step"] == TOTAL and record["world_size"] == 2
        assert record["rendezvous_failed"] is False
    # Results and new checkpoints on the rank-0 machine only.
    assert empty.run.model.exists() and not holder.run.output.exists()
    metrics = json.loads((empty.run.output / "metrics.json").read_text())
    assert metrics["steps"] == TOTAL and metrics["world_size"] == 2
    assert json.loads((empty.run.output / "progress.json").read_text())["world_size"] == 2
    assert latest_step(empty.run) == TOTAL and latest_step(holder.run) == step


def in_rendezvous(node: Node) -> Callable[[], bool]:
    return lambda: "joining rendezvous" in node.output()


@pytest.mark.slow(seconds=4)
def test_sigterm_while_waiting_for_the_other_nodes_exits_75_at_once(make_run: MakeRun, lives: Lives) -> None:
    """No rank has run: nothing to save, no reason to wait out the join timeout. The host waits in torch's
    rendezvous, the other node for a store host that never comes."""
    host = Node(make_run("train.processes=1", name="host"), "127.0.0.1")
    guest = Node(make_run("train.processes=1", name="guest"), "127.0.0.1")
    listener, nobody = store_listener(), refusing_port()
    processes = {
        host: host.start(lives, port_of(listener), "lonely", host=True, listener=listener, join_timeout=300),
        guest: guest.start(lives, port_of(nobody), "lonely-guest", host=False, join_timeout=300),
    }
    with nobody:
        for node, process in processes.items():
            poll(process, in_rendezvous(node), "rendezvous")
        time.sleep(1.0)  # well inside the wait
        signalled = time.monotonic()
        for process in processes.values():
            process.send_signal(signal.SIGTERM)
        codes = wait_for(processes, timeout=60)
        took = time.monotonic() - signalled
    for node in processes:
        assert codes[node] == EXIT_STOPPED, node.output()[-3000:]
        assert "SIGTERM received while waiting for the other nodes" in node.output()
        assert node.exit_record() == {
            "exit_code": EXIT_STOPPED,
            "ranks": {},
            "stopped_step": None,
            "rank0_here": False,
            "rendezvous_failed": False,
            "world_size": None,
            "trained": False,
            "ended_by": None,
        }
    assert took < 30, f"the launchers took {took:.0f}s to stop"


@pytest.mark.slow(seconds=4)
def test_a_rendezvous_that_cannot_form_fails_as_a_rendezvous_failure(make_run: MakeRun, lives: Lives) -> None:
    """A store nobody hosts, and a host whose second node never comes: exit 1, and the node exit file tells
    the agent to try a new generation rather than count a failure."""
    unreachable = Node(make_run("train.processes=1", name="unreachable"), "127.0.0.1")
    alone = Node(make_run("train.processes=1", name="alone"), "127.0.0.1")
    listener, nobody = store_listener(), refusing_port()
    processes = {
        unreachable: unreachable.start(lives, port_of(nobody), "nobody", host=False, join_timeout=2),
        alone: alone.start(lives, port_of(listener), "too-few", host=True, listener=listener, join_timeout=2),
    }
    with nobody:
        codes = wait_for(processes, timeout=120)
    for node in processes:
        assert codes[node] == 1, node.output()[-3000:]
        record = node.exit_record()
        assert record["rendezvous_failed"] is True and record["exit_code"] == 1 and record["ranks"] == {}
        assert record["trained"] is False and record["ended_by"]
        assert "the rendezvous" in node.output() and "failed" in node.output()
    assert "did not answer within 2 s" in unreachable.output()
    assert "RendezvousTimeoutError" in alone.output()


# -- the pieces, without processes ------------------------------------------------------------------------


def rendezvous_env(**overrides: str) -> dict[str, str]:
    env = {
        JobEnv.RDZV_ENDPOINT.value: "10.0.1.5:29400",
        JobEnv.RDZV_ID.value: "job-gen-3",
        JobEnv.RDZV_HOST.value: "0",
        JobEnv.NNODES.value: "2:4",
        JobEnv.NODE_ADDR.value: "10.0.1.7",
        JobEnv.NODE_EXIT_FILE.value: "/tmp/node-exit.json",
    }
    return {key: value for key, value in (env | overrides).items() if value != "-"}


def test_the_node_rendezvous_comes_from_the_agents_variables() -> None:
    from training.launch import JOIN_TIMEOUT_SECONDS, NodeRendezvous

    assert NodeRendezvous.from_env({}) is None
    nodes = NodeRendezvous.from_env(rendezvous_env())
    assert nodes is not None
    assert (nodes.endpoint, nodes.host_port, nodes.run_id) == (
        "10.0.1.5:29400",
        ("10.0.1.5", 29400),
        "job-gen-3",
    )
    assert (nodes.min_nodes, nodes.max_nodes, nodes.is_host, nodes.local_addr) == (2, 4, False, "10.0.1.7")
    assert nodes.join_timeout == JOIN_TIMEOUT_SECONDS and nodes.exit_file == Path("/tmp/node-exit.json")
    nodes = NodeRendezvous.from_env(rendezvous_env(TRAINSTACK_NNODES="3", TRAINSTACK_RDZV_HOST="1"))
    assert nodes is not None and (nodes.min_nodes, nodes.max_nodes, nodes.is_host) == (3, 3, True)
    nodes = NodeRendezvous.from_env(rendezvous_env(TRAINSTACK_RDZV_JOIN_TIMEOUT="2.5"))
    assert nodes is not None and nodes.join_timeout == 2.5 and nodes.listen_fd is None
    nodes = NodeRendezvous.from_env(rendezvous_env(TRAINSTACK_RDZV_HOST="1", TRAINSTACK_RDZV_LISTEN_FD="7"))
    assert nodes is not None and nodes.listen_fd == 7


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("TRAINSTACK_RDZV_ENDPOINT", "10.0.1.5"),
        ("TRAINSTACK_RDZV_ENDPOINT", "10.0.1.5:http"),
        ("TRAINSTACK_RDZV_ID", "-"),
        ("TRAINSTACK_RDZV_HOST", "yes"),
        ("TRAINSTACK_NNODES", "4:2"),
        ("TRAINSTACK_NNODES", "0:2"),
        ("TRAINSTACK_RDZV_JOIN_TIMEOUT", "soon"),
        ("TRAINSTACK_RDZV_JOIN_TIMEOUT", "0"),
        ("TRAINSTACK_RDZV_LISTEN_FD", "three"),
        ("TRAINSTACK_RDZV_LISTEN_FD", "7"),  # a listener on a node that does not host the store
    ],
)
def test_a_malformed_rendezvous_variable_is_one_line_naming_it(variable: str, value: str) -> None:
    from training.launch import NodeRendezvous

    with pytest.raises(ValueError, match=variable) as raised:
        NodeRendezvous.from_env(rendezvous_env(**{variable: value}))
    assert "\n" not in str(raised.value)


def test_a_rank_records_its_code_and_step_and_the_launcher_reads_every_global_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from training.launch import RANK_STATUS_DIR, RankRecord, _recorded, note_step, rank_exit

    monkeypatch.setenv(RANK_STATUS_DIR, str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "8")
    note_step(12)
    for rank, code in ((5, EXIT_STOPPED), (6, 0)):
        monkeypatch.setenv("RANK", str(rank))
        rank_exit(code)
    (tmp_path / "rank-7").write_text('{"code": 7')  # a rank killed mid-write: the engine's view counts
    assert _recorded(tmp_path) == {5: RankRecord(EXIT_STOPPED, 12, 8), 6: RankRecord(0, 12, 8)}


def test_ranks_across_machines_give_up_on_a_silent_peer_within_minutes() -> None:
    from datetime import timedelta

    from training.distributed import collective_timeout

    assert collective_timeout({}) == timedelta(minutes=30), "one machine: room for an S3 restore by rank 0"
    assert collective_timeout({JobEnv.RDZV_ENDPOINT.value: "10.0.0.1:29400"}) == timedelta(minutes=10)


def test_cpu_ranks_share_the_cores_unless_the_user_chose_the_threads() -> None:
    from training.launch import rank_threads

    assert rank_threads(2, {}, 2) == {"OMP_NUM_THREADS": "1"}, "two ranks on two cores: one thread each"
    assert rank_threads(4, {}, 16) == {"OMP_NUM_THREADS": "4"}
    assert rank_threads(3, {}, 2) == {"OMP_NUM_THREADS": "1"}
    assert rank_threads(2, {"OMP_NUM_THREADS": "3"}, 2) == {}, "the user's own setting wins"
    assert rank_threads(1, {}, 8) == {}, "one process keeps torch's default"


def test_rendezvous_events_keep_torchs_names_without_reading_the_stack(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The launcher replaces torch's `get_method_name` (inspect.stack() twice per event) with a frame read:
    each event torch's rendezvous records is still named after the method that records it."""
    from types import SimpleNamespace

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from training.launch import _register_tracked_backend, event_method_name

    named: list[str] = []
    monkeypatch.setattr(
        dynamic_rendezvous, "construct_and_record_rdzv_event", lambda **e: named.append(e["name"])
    )

    class Handler:
        """What torch's `_record` reads of its handler."""

        _settings = SimpleNamespace(run_id="r")
        _this_node = SimpleNamespace(addr="a", pid=1, local_id=0)

        def next_rendezvous(self) -> None:
            dynamic_rendezvous.DynamicRendezvousHandler._record(cast(Any, self), message="joined")

    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", dynamic_rendezvous.get_method_name)
    Handler().next_rendezvous()
    _register_tracked_backend()
    assert dynamic_rendezvous.get_method_name is event_method_name
    Handler().next_rendezvous()
    assert named == ["Handler.next_rendezvous", "Handler.next_rendezvous"]
    assert event_method_name(10_000) == "no_method_name", "as torch's for a stack shorter than asked"

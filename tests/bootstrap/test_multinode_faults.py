"""Multi-node under faults (docs/multi-node.md, "Faults without a word"): nodes that vanish without a notice.

The two-node story runs the real agents as processes (each with its own simulated IMDS and scratch disk, the
real launchers and trainer, gloo on 127.0.0.1) under a systemd-like supervisor that restarts an agent that
exits with a failure. The rendezvous host is frozen (SIGSTOP on its agent and trainer: a host that loses
power sends nothing, and a frozen one keeps its sockets open, so no collective of the other node fails): the
other node must see its heartbeat stop within the documented bound, end its generation, close the frozen
node's life as interrupted at its last heartbeat, regroup alone within its own life from the newest
checkpoint confirmed in S3, and complete the job. The cheaper checks below pin the pieces it relies on and
the paths it does not take: a stop signal after a rank's work is done never kills it, the launcher never
calls a generation that trained "never formed", a generation lost because a peer's sockets closed (a kill
on one machine) is regrouped from the confirmed checkpoint, the same loss again and again fails the life,
and the watch takes a node for gone only once and never while it cannot look. The ledger's side is in
test_multinode_ledger.py; the notice case with stops raining on the other node in test_multinode_agent.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from bootstrap.generations import SILENT_MARGIN_SECONDS, SILENT_POLLS
from bootstrap.imds import InstanceIdentity
from bootstrap.ledger import JobLedger
from demo.imds import ImdsSimulator, SimulatedInstance
from demo.instance import descendants
from demo.stack import LocalStack, create_stack
from training.launch import _finish, _Rounds
from training.sample_data import write_dataset
from trainstack_job.contract import NodeExit

REPO = Path(__file__).resolve().parents[2]
POLL_S = 0.5
# The documented detection bound (bootstrap/generations.py): the heartbeat unchanged for SILENT_POLLS polls
# plus a margin, noticed at the next poll of the survivor's watch.
SILENT_AFTER_S = SILENT_POLLS * POLL_S + SILENT_MARGIN_SECONDS
# What the survivor may take beyond the bound on a loaded 2-core machine: its poller shares the CPU with
# four training processes, and a look that comes late detects late (seen up to 5 s late under load).
DETECTION_SLACK_S = 8.0
STORY_TIMEOUT_S = 180
CHECKPOINT_EVERY = 3
# 64 images, global batch 16: 4 steps an epoch.
EPOCHS = 3
TOTAL_STEPS = EPOCHS * 4
# The agent as systemd runs it, with the test's quick polls (python -m demo.agent does the same for prices).
AGENT_MAIN = f"""
import sys
from functools import partial
from bootstrap import agent
from bootstrap.lifecycle import InstanceLife
agent.InstanceLife = partial(
    InstanceLife, identity_wait_seconds=2, release_wait_seconds=0, state_poll_seconds={POLL_S},
    tick_seconds=0.1,
)
sys.exit(agent.main(sys.argv[1:]))
"""


@dataclass
class Node:
    """One simulated instance: its IMDS, its agent process (restarted on failure), what it said."""

    name: str
    instance_id: str
    imds: ImdsSimulator
    config_file: Path
    scratch: Path
    process: subprocess.Popen[str] | None = None
    events: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    lines: list[tuple[float, str]] = field(default_factory=list)
    exit_codes: list[int] = field(default_factory=list)
    restarts: int = 0
    # Frozen or killed by the test: the supervisor leaves it alone (its host is gone).
    gone: bool = False

    def find(self, part: str) -> tuple[float, dict[str, Any]] | None:
        return next(((t, e) for t, e in list(self.events) if part in str(e.get("message", ""))), None)

    def progress(self) -> dict[str, Any]:
        try:
            value = json.loads((self.scratch / "output" / "progress.json").read_text())
        except (OSError, ValueError):
            return {}
        return value if isinstance(value, dict) else {}

    def tree(self) -> list[int]:
        """The agent and everything it started (launcher, ranks)."""
        if self.process is None or self.process.poll() is not None:
            return []
        return [self.process.pid, *descendants(self.process.pid)]


def _start_agent(node: Node, env: dict[str, str]) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", AGENT_MAIN, "--config", str(node.config_file)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,  # the test signals its tree, never its own process group
    )
    node.process = process

    def pump() -> None:
        assert process.stdout is not None
        for raw in process.stdout:
            line, now = raw.rstrip("\n"), time.time()
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if isinstance(event, dict) and "stage" in event:
                node.events.append((now, event))
            else:
                node.lines.append((now, line))

    threading.Thread(target=pump, name=f"{node.name}-output", daemon=True).start()


class Supervisor:
    """systemd's Restart=on-failure for each node's agent: an agent that exits with a failure is started
    again (its next life); one that exits 0 has nothing left to do there."""

    def __init__(self, nodes: list[Node], env: Callable[[Node], dict[str, str]]) -> None:
        self.nodes = nodes
        self._env = env
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)

    def start(self) -> None:
        # Both at once, as a real fleet boots (two lives binding the same job in the same instant must agree).
        for node in self.nodes:
            _start_agent(node, self._env(node))
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(0.2):
            for node in self.nodes:
                process = node.process
                if node.gone or process is None or process.poll() is None:
                    continue
                if len(node.exit_codes) < node.restarts + 1:
                    node.exit_codes.append(process.returncode)
                    if process.returncode != 0:
                        node.restarts += 1
                        _start_agent(node, self._env(node))

    def finished(self, node: Node) -> bool:
        return bool(node.exit_codes) and node.exit_codes[-1] == 0

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)
        for node in self.nodes:
            for pid in node.tree():
                _signal(pid, signal.SIGKILL)
            if node.process is not None:
                node.process.wait(timeout=30)


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie waiting for its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_for(condition: Callable[[], Any], timeout: float, what: str, story: Callable[[], str]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}\n{story()}")


def _story(nodes: list[Node]) -> str:
    """What each agent said, for a failing assertion's message."""
    lines = []
    for node in nodes:
        for moment, event in list(node.events):
            extra = {k: v for k, v in event.items() if k not in ("time", "stage", "message", "argv")}
            lines.append(f"{moment:.1f} {node.name} {event.get('stage')}: {event.get('message')} {extra}")
        lines += [f"{t:.1f} {node.name} trainer: {line}" for t, line in list(node.lines)[-12:]]
    return "\n".join(lines)


@pytest.fixture()
def two_nodes(aws: Any, tmp_path: Path) -> Iterator[tuple[LocalStack, list[Node], Supervisor]]:
    stack = create_stack(name="trainstack-faults", desired=2)
    dataset = tmp_path / "dataset"
    write_dataset(dataset, classes=2, train_per_class=32, val_per_class=4, size=32)
    s3 = stack.client("s3")
    for path in sorted(p for p in dataset.rglob("*") if p.is_file()):
        s3.upload_file(str(path), stack.bucket, "data/" + path.relative_to(dataset).as_posix())
    job: dict[str, Any] = yaml.safe_load((REPO / "training" / "configs" / "tiny.yaml").read_text())
    job["model"]["name"] = "shufflenet_v2_x0_5"  # the demo's: a third of mobilenet's step time on 2 cores
    job["train"].update(epochs=EPOCHS, batch_size=16, micro_batch_size=8, log_every_steps=1)
    job["checkpoint"].update(every_steps=CHECKPOINT_EVERY, every_minutes=10, keep=2)
    nodes = []
    for index, instance_id in enumerate(stack.instance_ids()[:2], start=1):
        imds = ImdsSimulator(
            SimulatedInstance(instance_id=instance_id, local_ipv4="127.0.0.1"),
            lifecycle_state=stack.lifecycle_state,
        ).start()
        scratch = tmp_path / f"node-{index}"
        config = stack.agent_config(
            job=job,
            instance_count=2,
            min_nodes=1,
            poll_seconds=0.2,
            stop_deadline_seconds=60.0,
            gpu_required=False,
            scratch_dir=str(scratch),
        )
        config_file = tmp_path / f"node-{index}-agent.yaml"
        config_file.write_text(config.to_yaml())
        nodes.append(Node(f"node-{index}", instance_id, imds, config_file, scratch))

    def env(node: Node) -> dict[str, str]:
        return {
            **os.environ,
            "AWS_EC2_METADATA_SERVICE_ENDPOINT": node.imds.endpoint,
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
            # Two simulated instances share 2 cores: one thread per rank.
            "OMP_NUM_THREADS": "1",
        }

    supervisor = Supervisor(nodes, env)
    yield stack, nodes, supervisor
    supervisor.stop()
    for node in nodes:
        node.imds.stop()


def _confirmed_step(stack: LocalStack) -> int | None:
    latest = stack.read_json("checkpoints/latest.json") or {}
    step = latest.get("step")
    return step if isinstance(step, int) else None


@pytest.mark.slow(seconds=18)
def test_a_frozen_rendezvous_host_is_detected_and_the_other_node_regroups_and_completes_in_its_life(
    two_nodes: tuple[LocalStack, list[Node], Supervisor],
) -> None:
    stack, nodes, supervisor = two_nodes
    supervisor.start()

    def story() -> str:
        return _story(nodes)

    host = _wait_for(
        lambda: next((n for n in nodes if n.find("hosting generation")), None), 90, "a generation host", story
    )
    other = next(n for n in nodes if n is not host)
    # Both train in generation 1, at least one checkpoint confirmed in S3 and steps past it.
    _wait_for(
        lambda: (
            (_confirmed_step(stack) or 0) >= CHECKPOINT_EVERY
            and max(n.progress().get("step", 0) for n in nodes) >= CHECKPOINT_EVERY + 1
        ),
        120,
        "two-node training past a confirmed checkpoint",
        story,
    )
    assert max(n.progress().get("world_size") or 0 for n in nodes) == 2, story()

    # The host freezes: agent, launcher (the c10d store) and ranks. Nothing it holds is closed.
    frozen_at = time.time()
    host.gone = True
    for pid in host.tree():
        _signal(pid, signal.SIGSTOP)
    assert other.process is not None
    generation_1 = set(other.tree()) - {other.process.pid}  # the survivor's launcher and ranks
    confirmed = _confirmed_step(stack) or 0
    reached = max(n.progress().get("step", 0) for n in nodes)

    seen = _wait_for(
        lambda: other.find("a node stopped beating"), SILENT_AFTER_S + 30, "the frozen host detected", story
    )
    detected_at, detected = seen
    assert detected["node"] == host.instance_id and detected["generation"] == 1, story()
    assert not host.find("stopped beating"), "the host took the live node for gone before it froze"
    # Judged on the survivor's clock from the last change it saw (up to a poll before the freeze, more on a
    # loaded machine): not much sooner than the bound (a slow poll is not a death), no later than the
    # bound, one poll and the slack.
    assert SILENT_AFTER_S - 2.0 <= detected_at - frozen_at <= SILENT_AFTER_S + DETECTION_SLACK_S, story()
    # The survivor ended its generation: launcher and ranks (each rank in a session of its own), though the
    # frozen host still holds every socket open (it stays frozen to the end: its power never comes back).
    assert generation_1, story()
    _wait_for(lambda: not [pid for pid in generation_1 if _running(pid)], 30, "generation 1 gone", story)

    _wait_for(lambda: supervisor.finished(other), STORY_TIMEOUT_S, "the survivor completing", story)

    # Regrouped within its life: the generation lost, named, resumed from the confirmed checkpoint.
    lost = other.find("generation lost")
    assert lost is not None and lost[1]["vanished"] == host.instance_id and lost[1]["generation"] == 1, (
        story()
    )
    resumed = lost[1]["resume_step"]
    assert resumed is not None and confirmed <= resumed <= reached, story()
    assert reached - resumed <= CHECKPOINT_EVERY, f"lost {reached - resumed} steps\n{story()}"
    again = next(
        (t for t, line in other.lines if t > detected_at and f"resuming at step {resumed} " in line), None
    )
    assert again is not None, story()
    regroup = next(e for _, e in other.events if e.get("generation") == 2 and "generation" in e["message"])
    assert regroup["message"] == "hosting generation", story()
    # The figure docs/multi-node.md quotes (pytest -s shows it).
    detection, regrouped = detected_at - frozen_at, again - detected_at
    print(f"frozen host: detected after {detection:.1f} s, training again {regrouped:.1f} s later")

    assert len([e for _, e in other.events if "stopped beating" in e["message"]]) == 1, story()
    # No failed life, no reboot: the survivor's one agent run completed the job.
    assert other.restarts == 0 and other.exit_codes == [0], story()
    ledger = stack.read_json("state/ledger.json") or {}
    assert ledger["status"] == "completed", story()
    lives = {life["instance_id"]: life for life in ledger["lives"]}
    assert len(ledger["lives"]) == 2 and not [x for x in ledger["lives"] if x["outcome"] == "running"]
    assert lives[other.instance_id]["outcome"] == "completed"
    silent = lives[host.instance_id]
    assert silent["outcome"] == "interrupted" and silent["closed_by"] == other.instance_id, silent
    # Its cost up to its last heartbeat, which came before the freeze.
    ended = datetime.fromisoformat(silent["ended_at"].replace("Z", "+00:00"))
    assert ended == datetime.fromisoformat(silent["heartbeat_at"].replace("Z", "+00:00"))
    assert ended.timestamp() <= frozen_at + 0.5 and silent["priced_at"] == silent["ended_at"], silent
    assert ledger["interruptions"] == 1 and ledger["consecutive_failures"] == 0
    # Completed once, by the survivor: one notification, the group scaled to zero, the results in S3 from
    # the one-rank round on the two-rank checkpoint (the same global batch, twice the accumulation).
    assert len([a for a in stack.alerts() if "training completed" in a["Subject"]]) == 1, "one notification"
    assert stack.group()["DesiredCapacity"] == 0
    metrics = stack.read_json("results/metrics.json") or {}
    assert metrics.get("steps") == TOTAL_STEPS, story()
    assert (metrics["global_batch"], metrics["accumulation"], metrics["world_size"]) == (16, 2, 1)


# -- the pieces the story relies on, each cheap ---------------------------------------------------------

LATE_STOPS = """
import os, signal, sys, time
import training.__main__ as trainer
from training.launch import rank_exit
trainer._main = lambda *args: 75  # a rank that stopped at the common step with its checkpoint
code = trainer.main([], process_exit={process_exit})
for _ in range(20):  # the other node's notice, the agent's stop file, a second SIGTERM: all after the stop
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)
time.sleep(0.2)
sys.exit(rank_exit(code))
"""


@pytest.mark.parametrize("process_exit", [True, False])
def test_a_stop_signal_after_a_rank_stopped_never_kills_it(process_exit: bool) -> None:
    """The race of two notices within one second, made certain: every stop arrives after the rank's work is
    done. As `python -m training` (process_exit) the rank still exits 75; the in-process call hands the
    signals back to their default action, as a library call must, and the process dies by them."""
    done = subprocess.run(
        [sys.executable, "-c", LATE_STOPS.format(process_exit=process_exit)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    if process_exit:
        assert done.returncode == 75, done.stderr
    else:
        assert done.returncode == -signal.SIGTERM, done.stderr


def test_a_generation_whose_ranks_ran_is_never_reported_as_never_formed(tmp_path: Path) -> None:
    """The store lost mid-run (a rendezvous error after ranks started, no rank record left): the launcher
    says the generation trained and what ended it; only one whose ranks never ran is a failed rendezvous."""
    from training.launch import NodeRendezvous

    exit_file = tmp_path / "node-exit.json"
    nodes = NodeRendezvous("127.0.0.1:29400", "faults-g1", 1, 2, True, "127.0.0.1", exit_file=exit_file)
    status = tmp_path / "ranks"
    status.mkdir()
    trained = _Rounds(status)
    trained.current.group_rank, trained.current.nodes = 0, 2
    (status / "started-0").touch()
    assert _finish(trained, {}, 1, nodes, "DistNetworkError: connection reset by peer", False) == 1
    record = NodeExit.read(exit_file)
    assert record is not None and record.trained and not record.rendezvous_failed
    assert record.ended_by == "DistNetworkError: connection reset by peer"

    never = _Rounds(tmp_path / "empty")
    assert _finish(never, {}, 1, nodes, "RendezvousTimeoutError", False) == 1
    record = NodeExit.read(exit_file)
    assert record is not None and record.rendezvous_failed and not record.trained


T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _node(instance_id: str) -> InstanceIdentity:
    return InstanceIdentity(instance_id, "g6.xlarge", "us-east-1a", "us-east-1", "spot")


# -- the agent's side of a lost generation, with stand-ins for the launcher, S3 and the trainer ---------


class _Trainer:
    pid = None  # no process: nothing of its own to kill

    def __init__(self) -> None:
        self.starts = 0
        self.killed = 0

    def update_env(self, values: dict[str, str]) -> None:
        pass

    def start(self) -> None:
        self.starts += 1

    def kill(self) -> None:
        self.killed += 1


class _Rendezvous:
    instance_id = "i-survivor"

    def __init__(self) -> None:
        self.others: dict[str, dict[str, Any]] = {}
        self.unreachable = False  # S3 down for this node

    def other_nodes(self) -> dict[str, dict[str, Any]]:
        if self.unreachable:
            raise ConnectionError("S3 unreachable")
        return {k: dict(v) for k, v in self.others.items()}


class _Nodes:
    """NodeGroup as Generations uses it: each join a new generation, each end what the launcher wrote."""

    min_nodes, max_nodes = 1, 2

    def __init__(self, exits: list[NodeExit]) -> None:
        self.rendezvous = _Rendezvous()
        self.exits = exits
        self.ended: NodeExit | None = None
        self.last_generation: int | None = None

    def join(self) -> Any:
        from bootstrap.rendezvous import Generation, Membership

        number = (self.last_generation or 0) + 1
        self.last_generation = number
        generation = Generation(number, "i-survivor", "127.0.0.1:1", f"faults-g{number}", 0.0, 1, 2)
        return Membership(generation, True)

    def trainer_env(self, membership: Any) -> dict[str, str]:
        return {}

    def end_generation(self) -> None:
        pass

    def node_exit(self) -> NodeExit | None:
        return self.ended

    def heartbeat(self) -> None:
        pass


class _Supervisor:
    def __init__(self, nodes: _Nodes, during: Callable[[], None] = lambda: None) -> None:
        self.nodes = nodes
        self.during = during

    def supervise(self, trainer: Any, persister: Any, *, watch_silent: bool) -> int:
        killed = trainer.killed
        self.during()
        ended = self.nodes.exits.pop(0)
        self.nodes.ended = ended
        assert ended.exit_code is not None
        return -9 if trainer.killed > killed else ended.exit_code


class _Persister:
    def __init__(self, confirmed: list[int | None]) -> None:
        self.confirmed = confirmed
        self.restores = 0

    def restore(self, should_abort: Callable[[], bool] = lambda: False) -> int | None:
        self.restores += 1
        return self.confirmed[min(self.restores, len(self.confirmed)) - 1]


class _Job:
    def __init__(self) -> None:
        self.changes: list[JobLedger] = []
        self.ledger = JobLedger()
        self.ledger.begin_life(_node("i-frozen"), 1.0, T0)

    def record(self, change: Callable[[JobLedger], Any]) -> bool:
        change(self.ledger)
        self.changes.append(self.ledger)
        return True


def _generations(nodes: _Nodes, supervisor: _Supervisor) -> tuple[Any, list[dict[str, Any]]]:
    import io

    from bootstrap.agent_config import AgentConfig
    from bootstrap.eventlog import EventLog
    from bootstrap.generations import Generations
    from bootstrap.stops import StopRequests

    events: list[dict[str, Any]] = []
    log = EventLog(io.StringIO())
    log.add_sink(lambda line: events.append(json.loads(line)))
    config = AgentConfig(region="us-east-1", bucket="b", group_name="g", topic_arn="t", log_group="l")
    stops = StopRequests(log, 60.0)
    job, group = cast(Any, _Job()), cast(Any, nodes)
    generations = Generations(config, log, stops, job, cast(Any, supervisor), group, poll_seconds=0.01)
    return generations, events


LOST = NodeExit(1, trained=True, ended_by="DistNetworkError: the rendezvous store is gone")


def test_a_lost_generation_regroups_in_the_life_from_the_newest_confirmed_checkpoint() -> None:
    """The store host killed (its sockets closed at once): this node's launcher exits 1 with `trained`.
    The agent restores the confirmed checkpoint and joins the next generation, in the same life."""
    nodes = _Nodes([LOST, NodeExit(0, rank0_here=True, trained=True)])
    generations, events = _generations(nodes, _Supervisor(nodes))
    persister = _Persister([20])
    assert generations.train(_Trainer(), persister, restored=None) == 0
    lost = next(e for e in events if "generation lost" in e["message"])
    assert lost["generation"] == 1 and lost["resume_step"] == 20 and "store is gone" in lost["ended_by"]
    assert persister.restores == 1 and nodes.last_generation == 2


def test_the_same_crash_again_and_again_fails_the_life_and_permanent_errors_are_never_regrouped() -> None:
    nodes = _Nodes([LOST, LOST, LOST, LOST])
    generations, events = _generations(nodes, _Supervisor(nodes))
    assert generations.train(_Trainer(), _Persister([20]), restored=None) == 1
    assert nodes.last_generation == 3, "three losses at the same confirmed step, then the life fails"
    assert "giving up this life" in [e for e in events if "generation lost" in e["message"]][-1]["message"]

    # Progress between the losses (a newer confirmed step each time) keeps regrouping.
    nodes = _Nodes([LOST, LOST, LOST, NodeExit(0, rank0_here=True, trained=True)])
    generations, _ = _generations(nodes, _Supervisor(nodes))
    assert generations.train(_Trainer(), _Persister([20, 24, 28]), restored=None) == 0

    nodes = _Nodes([NodeExit(2, trained=True)])
    generations, _ = _generations(nodes, _Supervisor(nodes))
    assert generations.train(_Trainer(), _Persister([20]), restored=None) == 2


def test_a_member_that_stops_beating_ends_the_generation_and_its_life_is_closed() -> None:
    """Frozen, not killed: no socket closes, the collectives would wait. The watch sees its heartbeat
    unchanged for `silent_after` on this node's clock, kills this node's trainer and closes its life."""
    nodes = _Nodes([NodeExit(1, trained=True), NodeExit(0, rank0_here=True, trained=True)])
    frozen = {"instance_id": "i-frozen", "address": "127.0.0.1", "heartbeat_at": 1000.0, "generation": 1}
    nodes.rendezvous.others = {"i-frozen": frozen}
    trainer = _Trainer()

    def silences() -> list[str]:
        return [e["node"] for e in events if "stopped beating" in e["message"]]

    def watch(seconds: float, until: Callable[[], bool] = lambda: False) -> None:
        """The state poller's watch, every 10 ms for `seconds` or until `until()` (a loaded machine may
        take longer than the bound; a quick one stops early)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not until():
            generations.heartbeat()
            time.sleep(0.01)

    def frozen_during_generation_1() -> None:
        if nodes.last_generation == 1:
            # First sight starts the clock; unchanged since: vanished, and this generation ended.
            watch(10.0, until=lambda: trainer.killed > 0)

    generations, events = _generations(nodes, _Supervisor(nodes, frozen_during_generation_1))
    generations.silent_after = 0.05
    assert generations.train(trainer, _Persister([8]), restored=None) == 0
    seen = next(e for e in events if "stopped beating" in e["message"])
    assert silences() == ["i-frozen"] and seen["generation"] == 1
    assert trainer.killed == 1
    lost = next(e for e in events if "generation lost" in e["message"])
    assert lost["vanished"] == "i-frozen" and lost["resume_step"] == 8
    life = generations.job.ledger.lives[0]
    assert life["outcome"] == "interrupted" and life["closed_by"] == "i-survivor"
    # Once per silence.
    watch(0.15)
    assert silences() == ["i-frozen"]
    # A node that beats is never taken for gone, nor one this node could not watch for a while (S3
    # unreachable here, maybe for everyone): after such a gap every clock starts again.
    other = {"instance_id": "i-slow", "address": "127.0.0.1", "heartbeat_at": 5.0, "generation": 2}
    nodes.rendezvous.others = {"i-slow": other}
    for beat in range(10):
        other["heartbeat_at"] = 5.0 + beat
        nodes.rendezvous.others = {"i-slow": dict(other)}
        watch(0.02)
    assert silences() == ["i-frozen"], "it beat"
    nodes.rendezvous.unreachable = True
    watch(0.15)  # blind for three times the bound: said once, and no one taken for gone
    nodes.rendezvous.unreachable = False
    generations.heartbeat()
    assert silences() == ["i-frozen"], "not seen, not silent"
    assert len([e for e in events if "cannot read the other nodes' heartbeats" in e["message"]]) == 1
    # Watched and silent now: gone (in no generation of this node's: nothing killed).
    watch(10.0, until=lambda: len(silences()) == 2)
    assert silences() == ["i-frozen", "i-slow"]
    assert trainer.killed == 1


def test_the_rendezvous_store_answers_within_seconds_not_torchs_minute() -> None:
    """A node counted into a round that quits before writing its rank information holds the others for one
    store read, which the launcher sets to STORE_READ_TIMEOUT_SECONDS (docs/multi-node.md: why it is safe)."""
    from training.launch import STORE_READ_TIMEOUT_SECONDS, NodeRendezvous, _launch_config

    nodes = NodeRendezvous("127.0.0.1:29400", "faults-g1", 1, 2, False, "127.0.0.1")
    config = _launch_config(1, nodes, nodes.run_id)
    assert config.rdzv_configs["read_timeout"] == STORE_READ_TIMEOUT_SECONDS <= 15
    # The waits that must stay long keep their own timeouts.
    assert config.rdzv_configs["join_timeout"] == 900 and config.rdzv_configs["last_call_timeout"] == 3

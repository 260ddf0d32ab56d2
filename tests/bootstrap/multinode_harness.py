"""Simulated instances of one multi-node job under the real agents, for the two-node stories.

Each node has its own simulated IMDS and scratch disk; its agent runs as a process (`python -m
bootstrap.agent` with the tests' quick polls), restarted by a systemd-like supervisor when it exits with a
failure, and starts the real launcher and trainer (gloo on 127.0.0.1, a tiny model). Each of these processes
is forked from the worker's fork server (tests/forkserver.py: the agent is started through its stand-in for
`python`, and so are the launcher and the ranks), which runs the hooks' `sitecustomize` in each of them. A
story acts on a node (a notice through its IMDS, a signal to its processes, a moment of its launcher held by
`HOOKS`) and reads what each agent said. Used by test_multinode_faults.py and test_multinode_agent.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bootstrap.generations import SILENT_MARGIN_SECONDS, SILENT_POLLS
from demo.imds import ImdsSimulator, SimulatedInstance
from demo.instance import read_agent_output
from demo.stack import LocalStack, create_stack
from tests.forkserver import ForkServer
from training.sample_data import write_dataset
from trainstack_job.contract import NodeExit

REPO = Path(__file__).resolve().parents[2]
POLL_S = 0.5
# The documented detection bound (bootstrap/generations.py): the heartbeat unchanged for SILENT_POLLS polls
# plus a margin, noticed at the next poll of the survivor's watch.
SILENT_AFTER_S = SILENT_POLLS * POLL_S + SILENT_MARGIN_SECONDS
STORY_TIMEOUT_S = 180
CHECKPOINT_EVERY = 3
# The least a rank's step takes (HOOKS): a checkpoint interval of about a second, the confirmed step's
# upload (about 0.15 s) well within it, whatever the machine's speed.
STEP_SECONDS = 0.3
# 64 images, global batch 16.
STEPS_PER_EPOCH = 4
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
# Test-only moments of a node's launcher, installed as `sitecustomize` for the nodes a story hooks: a moment
# that lasts milliseconds in a real run is held until the story has acted in it. A marker file in the hooks
# folder says a node reached it; the launcher's stop handling still runs meanwhile.
# - MULTINODE_HOLD_ENTERING (generation numbers, "1,2"): the launcher's first entry into that generation's
#   rendezvous waits for the file `go.g<number>`, so nodes that boot apart enter the same round.
# - MULTINODE_HOLD_COUNTED: once counted into its first formed round, before the engine writes this node's
#   rank information, the launcher waits (until a stop reaches it): a node leaving mid-rendezvous.
# - MULTINODE_STEP_SECONDS (every node): each rank's step takes at least this long. On an idle machine the
#   small model trains a step in a few hundredths of a second and the persister skips superseded uploads, so
#   "killed within one checkpoint interval of the confirmed step" was a window a 0.1 s poll could miss.
HOOKS = """
import os
import sys
import time
from pathlib import Path

if os.environ.get("MULTINODE_STEP_SECONDS"):
    from training import faults

    _pace, _fault_point = float(os.environ["MULTINODE_STEP_SECONDS"]), faults.fault_point

    def _paced(point, **context):
        if point == "micro-batch" and context.get("micro") == 0:
            time.sleep(_pace)
        _fault_point(point, **context)

    # A forked life has imported the trainer already: the modules that bound the name get the hook too.
    for _module in list(sys.modules.values()):
        if getattr(_module, "__dict__", {}).get("fault_point") is _fault_point:  # an entry may be None
            _module.fault_point = _paced

if os.environ.get("MULTINODE_HOOKS"):
    from training import launch

    _folder, _name = Path(os.environ["MULTINODE_HOOKS"]), os.environ["MULTINODE_NODE"]
    _entering, _formed = launch._Rounds.entering, launch._Rounds.formed

    def _first(moment):
        marker = _folder / f"{_name}.{moment}"
        if marker.exists():
            return False
        marker.touch()
        return True

    def _held_entering(self):
        run_id = next((key for key, rounds in launch._LAUNCHES.items() if rounds is self), "")
        generation = run_id.rpartition("-g")[2]
        held = os.environ.get("MULTINODE_HOLD_ENTERING", "").split(",")
        if generation in held and _first(f"entering.g{generation}"):
            while not (_folder / f"go.g{generation}").exists():
                time.sleep(0.05)
        _entering(self)

    def _held_formed(self, info):
        if os.environ.get("MULTINODE_HOLD_COUNTED") and _first("counted"):
            time.sleep(600)
        _formed(self, info)

    launch._Rounds.entering = _held_entering
    launch._Rounds.formed = _held_formed
"""


@dataclass
class Node:
    """One simulated instance: its IMDS, its agent process (restarted on failure), what it said."""

    name: str
    instance_id: str
    imds: ImdsSimulator
    config_file: Path
    scratch: Path
    forked: ForkServer
    # Extra environment of this node's agent (and so of its launcher): the hooks it runs with.
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[str] | None = None
    events: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    lines: list[tuple[float, str]] = field(default_factory=list)
    exit_codes: list[int] = field(default_factory=list)
    restarts: int = 0
    # Frozen or killed by the test: the supervisor leaves it alone (its host is gone).
    gone: bool = False

    def find(self, part: str, after: float = 0.0) -> tuple[float, dict[str, Any]] | None:
        """The first event at or after `after` (time.time) whose message contains `part`."""
        return next(
            ((t, e) for t, e in list(self.events) if t >= after and part in str(e.get("message", ""))), None
        )

    def progress(self) -> dict[str, Any]:
        try:
            value = json.loads((self.scratch / "output" / "progress.json").read_text())
        except (OSError, ValueError):
            return {}
        return value if isinstance(value, dict) else {}

    def node_exit(self) -> NodeExit | None:
        """What this node's last launcher wrote about its ranks."""
        return NodeExit.read(self.exit_file)

    def rank_codes(self) -> dict[str, int]:
        """The exit code of each of this node's ranks (by global rank) in its last launcher's record."""
        try:
            ranks = json.loads(self.exit_file.read_text()).get("ranks")
        except (OSError, ValueError):
            return {}
        return ranks if isinstance(ranks, dict) else {}

    @property
    def exit_file(self) -> Path:
        return self.scratch / "control" / "node-exit.json"

    def tree(self) -> list[int]:
        """The agent and everything it started (launcher, ranks), each a stand-in and the life it stands
        for."""
        if self.process is None or self.process.poll() is not None:
            return []
        return self.forked.tree(self.process.pid)

    def under_agent(self) -> list[int]:
        """What the agent started (its launcher and ranks), never the agent itself."""
        if self.process is None:
            return []
        agent = {self.process.pid, self.forked.life_of(self.process.pid)}
        return [pid for pid in self.tree() if pid not in agent]

    def hold(self, folder: Path, *, entering: tuple[int, ...] = (), counted: bool = False) -> None:
        """Run this node's launchers with HOOKS: held at their entry into these generations' rendezvous, and
        (`counted`) once counted into a round."""
        self.env.update(
            {
                "PYTHONPATH": f"{REPO}{os.pathsep}{folder}",
                "MULTINODE_HOOKS": str(folder),
                "MULTINODE_NODE": self.name,
                "MULTINODE_HOLD_ENTERING": ",".join(str(number) for number in entering),
                **({"MULTINODE_HOLD_COUNTED": "1"} if counted else {}),
            }
        )


def _start_agent(node: Node, env: dict[str, str]) -> None:
    process = subprocess.Popen(
        [str(node.forked.python), "-c", AGENT_MAIN, "--config", str(node.config_file)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,  # the test signals its tree, never its own process group
    )
    node.process = process

    read_agent_output(
        process,
        node.name,
        lambda now, event: node.events.append((now, event)),
        lambda now, line: node.lines.append((now, line)),
    )


class Supervisor:
    """systemd's Restart=on-failure for each node's agent: an agent that exits with a failure is started
    again (its next life); one that exits 0 has nothing left to do there."""

    def __init__(self, env: Callable[[Node], dict[str, str]]) -> None:
        self.nodes: list[Node] = []
        self._env = env
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()

    def start(self, *nodes: Node) -> None:
        """Boot these nodes' agents, all in the same instant (as a fleet boots: two lives binding the same job
        at once must agree)."""
        with self._lock:
            for node in nodes:
                _start_agent(node, self._env(node))
                self.nodes.append(node)

    def _run(self) -> None:
        while not self._done.wait(0.2):
            with self._lock:
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
                signal_quietly(pid, signal.SIGKILL)
            if node.process is not None:
                node.process.wait(timeout=30)


@dataclass
class Job:
    """One multi-node job in moto: its stack, its nodes (booted by `supervisor.start`), the hooks folder."""

    stack: LocalStack
    nodes: list[Node]
    supervisor: Supervisor
    hooks: Path

    def story(self) -> str:
        return story(self.nodes)

    def confirmed_step(self) -> int | None:
        """The step S3 `latest.json` names (the newest checkpoint confirmed there)."""
        step = (self.stack.read_json("checkpoints/latest.json") or {}).get("step")
        return step if isinstance(step, int) else None

    def wait_for(self, condition: Callable[[], Any], timeout: float, what: str) -> Any:
        return wait_for(condition, timeout, what, self.story)

    def ledger(self) -> dict[str, Any]:
        return self.stack.read_json("state/ledger.json") or {}

    def enter_together(self, generation: int, *nodes: Node) -> None:
        """Once the launchers of `nodes` (held by `Node.hold`) are all at `generation`'s rendezvous, let them
        enter it together: one round with all of them, however far apart they booted."""
        self.wait_for(
            lambda: all((self.hooks / f"{n.name}.entering.g{generation}").exists() for n in nodes),
            120,
            f"{', '.join(n.name for n in nodes)} at generation {generation}'s rendezvous",
        )
        (self.hooks / f"go.g{generation}").touch()


@contextlib.contextmanager
def multinode_job(
    tmp_path: Path, forked: ForkServer, *, name: str, instances: int = 2, epochs: int = 3
) -> Iterator[Job]:
    """`instances` simulated instances of a two-node job (`instanceCount` 2, `minNodes` 1) in the reset moto
    server (the `aws` fixture), none booted yet, their processes forked from `forked`; every process of
    theirs killed at the end."""
    stack = create_stack(name=name, desired=instances)
    dataset = tmp_path / "dataset"
    write_dataset(dataset, classes=2, train_per_class=32, val_per_class=4, size=32)
    s3 = stack.client("s3")
    for path in sorted(p for p in dataset.rglob("*") if p.is_file()):
        s3.upload_file(str(path), stack.bucket, "data/" + path.relative_to(dataset).as_posix())
    job: dict[str, Any] = yaml.safe_load((REPO / "training" / "configs" / "tiny.yaml").read_text())
    job["model"]["name"] = "shufflenet_v2_x0_5"  # the demo's: a third of mobilenet's step time on 2 cores
    job["train"].update(epochs=epochs, batch_size=16, micro_batch_size=8, log_every_steps=1)
    job["checkpoint"].update(every_steps=CHECKPOINT_EVERY, every_minutes=10, keep=2)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(HOOKS)
    nodes = []
    for index, instance_id in enumerate(stack.instance_ids()[:instances], start=1):
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
        nodes.append(Node(f"node-{index}", instance_id, imds, config_file, scratch, forked))

    def env(node: Node) -> dict[str, str]:
        return {
            **os.environ,
            "AWS_EC2_METADATA_SERVICE_ENDPOINT": node.imds.endpoint,
            # The hooks folder's sitecustomize paces every rank's steps (HOOKS); `Node.hold` adds its moments.
            "PYTHONPATH": f"{REPO}{os.pathsep}{hooks}",
            "MULTINODE_STEP_SECONDS": str(STEP_SECONDS),
            "PYTHONUNBUFFERED": "1",
            # Two simulated instances share 2 cores: one thread per rank.
            "OMP_NUM_THREADS": "1",
            **node.env,
        }

    supervisor = Supervisor(env)
    try:
        yield Job(stack, nodes, supervisor, hooks)
    finally:
        supervisor.stop()
        for node in nodes:
            node.imds.stop()


def signal_quietly(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def running(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie waiting for its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_for(condition: Callable[[], Any], timeout: float, what: str, story: Callable[[], str]) -> Any:
    """`condition()`'s first truthy value, polled every 0.1 s; after `timeout`, AssertionError with the
    story."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}\n{story()}")


def story(nodes: list[Node]) -> str:
    """What each agent said, for a failing assertion's message."""
    lines = []
    for node in nodes:
        for moment, event in list(node.events):
            extra = {k: v for k, v in event.items() if k not in ("time", "stage", "message", "argv")}
            lines.append(f"{moment:.1f} {node.name} {event.get('stage')}: {event.get('message')} {extra}")
        lines += [f"{t:.1f} {node.name} trainer: {line}" for t, line in list(node.lines)[-12:]]
    return "\n".join(lines)


def resumed_at(node: Node, step: int, after: float) -> float | None:
    """When (time.time) this node's trainer said it resumes at `step`, after `after`."""
    return next(
        (t for t, line in list(node.lines) if t > after and f"resuming at step {step} " in line), None
    )

"""`python -m demo --nodes 2`: two simulated instances train one job over gloo on 127.0.0.1; a spot notice on
one of them mid-run, the other regroups alone, and the group's replacement joins the running job.

Each simulated instance is what the single-node demo boots (demo/instance.py): the rendered user-data, the
bundle verified and unpacked, the real agent as a subprocess. Here each one also has its own IMDS simulator
(its own instance id from the group, local-ipv4 127.0.0.1) and its own scratch folder, and they run at once.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from demo.environment import (
    MODEL,
    STEPS_PER_EPOCH,
    trainer_config,
    upload_bundle,
    upload_dataset,
    write_demo_dataset,
    write_user_data,
)
from demo.imds import ImdsSimulator, SimulatedInstance
from demo.instance import (
    AgentEcho,
    AgentRun,
    agent_config_from_user_data,
    boot_agent,
    install_bundle,
    kill_running,
)
from demo.run import ISOLATED_ENV
from demo.stack import LocalStack, create_stack, end_state

NODES = 2
# Long enough for the whole story to happen mid-run: rounds of two nodes, one, two again. Each round costs
# 10-25 s of start-up on 2 cores (the engine's rendezvous, every rank importing torch and restoring). The
# notice comes early, once the round of two has trained NOTICE_FROM_STEP steps (~15 by the stop): a step of
# two ranks costs twice one's CPU, and the round of two that matters is the one the replacement joins. The
# round of one then trains while the replacement boots and joins (38-45 steps in 13-20 s measured on a loaded
# 2-core machine, where steps and start-up slow down alike) and must still have steps left when it does:
# 172 steps leave ~157 to the round of one, three and a half times what it trains (the 240-step story, its
# notice at 40%, left 139).
EPOCHS = 43
NOTICE_FROM_STEP = 12
LOG_EVERY_STEPS = 4
CHECKPOINT_EVERY_STEPS = 40
# The notice goes to the second node: the first one's launcher is usually the rendezvous host, and
# interrupting the other shows the survivor regrouping (the host's own interruption is a unit test's job).
INTERRUPTED = "node-2"
# On EC2 a replacement takes minutes to boot; here it boots once the survivor trains alone (or this long
# after the interrupted node left), so the round of one shows before the replacement joins.
REPLACEMENT_WAIT_S = 60
# Bounds: the interrupted node must be gone within its 2-minute notice (plus the agent's own margin); the
# whole story must end well before the test's timeout, whatever an agent does.
STOP_TIMEOUT_S = 150
STORY_TIMEOUT_S = 240
POLL_S = 0.2

# What global rank 0 logs at the start of each round (training/loop.py): the world size and where it resumed.
ROUND_LINE = re.compile(r" on \w+ x(\d+), .*global batch \d+")
RESUMING_LINE = re.compile(r"resuming at step (\d+)")
STOPPED_LINE = re.compile(r"stopped at step (\d+)")
COMPLETE_LINE = re.compile(r"training complete: (\d+) steps")


@dataclass
class NodeSample:
    """Global rank 0's progress.json at one moment, read from the scratch of the node it runs on."""

    time: float
    node: str
    step: int
    world_size: int | None


@dataclass
class NodeEvent:
    """One agent event line, stamped with the time the demo read it."""

    time: float
    node: str
    stage: str
    message: str
    fields: dict[str, Any]


@dataclass
class Round:
    """One training round as global rank 0 announced it: a generation, or torch's restart within one."""

    time: float
    node: str
    world_size: int
    resumed_step: int  # 0 for a fresh start


@dataclass
class TrainerLine:
    time: float
    node: str
    line: str


@dataclass
class NodeLife:
    """One simulated instance: when it booted, when its agent exited and with what."""

    name: str
    instance_id: str
    booted_at: float
    exited_at: float = 0.0
    exit_code: int | None = None


@dataclass
class MultiNodeResult:
    """Everything the multi-node timeline and checks need."""

    started: float
    workdir: Path
    bucket: str = ""
    user_data_bytes: int = 0
    user_data_valid: str = ""
    nodes: list[NodeLife] = field(default_factory=list)
    samples: list[NodeSample] = field(default_factory=list)
    events: list[NodeEvent] = field(default_factory=list)
    lines: list[TrainerLine] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)
    total_steps: int = 0
    notice_at: float = 0.0
    notice_step: int = 0  # the newest step rank 0 had reported when the notice was injected
    notice_seen_at: float = 0.0
    # The step every rank stopped at (the survivor's regroup event: its launcher's record of the generation).
    stopped_step: int | None = None
    # The interrupted node's agent: the step S3 latest.json reached before it let its instance go.
    confirmed_step: int | None = None
    stop_confirmed: bool = False
    stop_confirmed_at: float = 0.0
    # The highest step any node reported before the next generation started, and where that one resumed.
    reached_before_stop: int | None = None
    resumed_at: float = 0.0
    resumed_step: int | None = None
    # The same across the restart torch makes when the replacement joins.
    replacement_joined_at: float = 0.0
    reached_before_join: int | None = None
    rejoined_at: float = 0.0
    rejoined_step: int | None = None
    world_sizes: list[tuple[float, int]] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    artifacts: list[str] = field(default_factory=list)
    desired_capacity: int | None = None
    alerts: list[dict[str, str]] = field(default_factory=list)
    ledger: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_codes(self) -> list[int | None]:
        return [node.exit_code for node in self.nodes]

    def node(self, name: str) -> NodeLife | None:
        return next((n for n in self.nodes if n.name == name), None)

    def find(self, node: str, message_part: str, after: float = 0.0) -> NodeEvent | None:
        return next(
            (e for e in self.events if e.node == node and message_part in e.message and e.time >= after), None
        )


@dataclass
class _Node:
    """A running simulated instance: its IMDS, its agent, the last progress the demo read from it."""

    life: NodeLife
    imds: ImdsSimulator
    scratch: Path
    run: AgentRun
    last: tuple[int, int | None] | None = None


def _progress(scratch: Path) -> tuple[int, int, int | None] | None:
    """(step, total_steps, world_size) from the node's progress.json; None while it has none."""
    try:
        progress = json.loads((scratch / "output" / "progress.json").read_text())
        world = progress.get("world_size")
        return (
            int(progress["step"]),
            int(progress.get("total_steps") or 0),
            int(world) if isinstance(world, int) else None,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _collapse(values: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """Each change of value once, with the time it was first seen."""
    changes: list[tuple[float, int]] = []
    for moment, value in sorted(values):
        if not changes or changes[-1][1] != value:
            changes.append((moment, value))
    return changes


class MultiNodeDemo:
    """Runs the multi-node story; prints each agent's stages (and its ranks' lines) as they happen."""

    def __init__(self, workdir: Path, console: Console) -> None:
        self.workdir = workdir
        self.console = console
        self.result = MultiNodeResult(started=time.time(), workdir=workdir)
        self._echo = AgentEcho(console, self.result.started)
        self._nodes: list[_Node] = []

    # -- output -------------------------------------------------------------------------------------

    # -- the story ----------------------------------------------------------------------------------

    def run(self) -> MultiNodeResult:
        result = self.result
        stack = create_stack("trainstack-demo", desired=NODES)
        result.bucket = stack.bucket
        self.console.print(
            f"[bold]stack[/] bucket s3://{stack.bucket} (SSE-KMS), topic, log group, "
            f"group {stack.group_name} (desired {NODES})"
        )
        count = upload_dataset(stack, write_demo_dataset(self.workdir))
        self.console.print(f"[bold]dataset[/] {count} generated images uploaded to s3://{stack.bucket}/data/")

        bundle = upload_bundle(stack)
        bundle_key = bundle.key()
        job = trainer_config(EPOCHS, processes=1, log_every_steps=LOG_EVERY_STEPS)
        job["checkpoint"]["every_steps"] = CHECKPOINT_EVERY_STEPS
        config = stack.agent_config(job=job, instance_count=NODES, min_nodes=1, stall_minutes=5.0)
        written = write_user_data(self.workdir, config, bundle)
        user_data = written.text
        result.user_data_bytes, result.user_data_valid = written.size, written.valid
        self.console.print(
            f"[bold]user-data[/] {written.path} ({result.user_data_bytes} bytes, {result.user_data_valid}); "
            f"instance_count {NODES}, min_nodes 1, {MODEL}, {EPOCHS} epochs of {STEPS_PER_EPOCH} steps"
        )

        try:
            for number, instance_id in enumerate(stack.instance_ids()[:NODES], start=1):
                self._boot(f"node-{number}", instance_id, stack, user_data, bundle_key, bundle.sha256)
            self._watch(stack, user_data, bundle_key, bundle.sha256)
        except BaseException:
            kill_running(node.run for node in self._nodes)
            raise
        finally:
            for node in self._nodes:
                node.imds.stop()
        time.sleep(0.3)  # let the output pumps drain the last lines
        for node in self._nodes:
            result.events += [
                NodeEvent(t, node.life.name, str(e.get("stage")), str(e.get("message")), e)
                for t, e in node.run.events
            ]
            result.lines += [TrainerLine(t, node.life.name, line) for t, line in node.run.trainer_lines]
        result.events.sort(key=lambda e: e.time)
        result.lines.sort(key=lambda x: x.time)
        self._summarise()

        end = end_state(stack)
        result.metrics, result.artifacts, result.ledger = end.metrics, end.artifacts, end.ledger
        result.desired_capacity, result.alerts = end.desired_capacity, end.alerts
        return result

    def _boot(
        self, name: str, instance_id: str, stack: LocalStack, user_data: str, bundle_key: str, sha256: str
    ) -> None:
        """One simulated instance: its own IMDS and scratch, the bundle unpacked, its agent started."""
        root = self.workdir / name
        imds = ImdsSimulator(
            SimulatedInstance(instance_id=instance_id, local_ipv4="127.0.0.1"),
            lifecycle_state=stack.lifecycle_state,
        ).start()
        env = {
            **ISOLATED_ENV,
            "AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"],
            "AWS_EC2_METADATA_SERVICE_ENDPOINT": imds.endpoint,
        }
        if "OMP_NUM_THREADS" not in os.environ:
            # The simulated nodes share this machine: each rank gets its share of the cores, not all of them.
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or NODES) // NODES))
        code_root = install_bundle(
            stack.client("s3"), stack.bucket, bundle_key, sha256, root / "opt-trainstack"
        )
        config = agent_config_from_user_data(user_data, root / "scratch", poll_seconds=1.0)
        life = NodeLife(name, instance_id, booted_at=time.time())
        self.console.print(
            f"[bold]{name}[/] boots as {instance_id} (IMDS {imds.endpoint}, local-ipv4 127.0.0.1): "
            f"bundle verified and unpacked to {code_root}"
        )
        run = boot_agent(name, code_root, config, env, self._echo.event, self._echo.trainer)
        self.result.nodes.append(life)
        self._nodes.append(_Node(life, imds, root / "scratch", run))

    def _watch(self, stack: LocalStack, user_data: str, bundle_key: str, sha256: str) -> None:
        """Sample every node's progress until every agent has exited; inject the notice into node 2 once the
        round of two has trained NOTICE_FROM_STEP steps, and boot the replacement once node 2's agent has let
        its instance go."""
        result = self.result
        deadline = time.monotonic() + STORY_TIMEOUT_S
        stop_deadline: float | None = None
        while any(node.life.exit_code is None for node in self._nodes):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the agents did not all finish within {STORY_TIMEOUT_S}s")
            for node in self._nodes:
                self._sample(node)
                if node.life.exit_code is None and node.run.process.poll() is not None:
                    node.life.exit_code = node.run.process.wait()
                    node.life.exited_at = time.time()
                    self.console.print(f"[bold]{node.life.name}[/] agent exited with {node.life.exit_code}")
            interrupted = next(n for n in self._nodes if n.life.name == INTERRUPTED)
            if not result.notice_at and interrupted.life.exit_code is None and self._due():
                self._interrupt(interrupted, stack)
                stop_deadline = time.monotonic() + STOP_TIMEOUT_S
            if (
                stop_deadline is not None
                and interrupted.life.exit_code is None
                and time.monotonic() > stop_deadline
            ):
                raise RuntimeError(
                    f"{INTERRUPTED}: its agent was still running {STOP_TIMEOUT_S}s after the spot notice"
                )
            if len(self._nodes) == NODES and self._replacement_due(interrupted):
                # The group launched the replacement when it let node 2 go (capacity rebalancing).
                known = {n.life.instance_id for n in self._nodes}
                replacement = next((i for i in stack.instance_ids() if i not in known), None)
                if replacement is None:
                    raise RuntimeError("the group launched no replacement for the interrupted instance")
                self._boot(f"node-{NODES + 1}", replacement, stack, user_data, bundle_key, sha256)
            time.sleep(POLL_S)

    def _replacement_due(self, interrupted: _Node) -> bool:
        """Once the interrupted node is gone and the survivor trains alone (or a minute after it went)."""
        if not self.result.notice_at or interrupted.life.exit_code is None:
            return False
        alone = any(s.time > self.result.notice_at and s.world_size == 1 for s in self.result.samples)
        return alone or time.time() > interrupted.life.exited_at + REPLACEMENT_WAIT_S

    def _sample(self, node: _Node) -> None:
        found = _progress(node.scratch)
        if found is None:
            return
        step, total, world = found
        if node.last != (step, world):
            node.last = (step, world)
            self.result.total_steps = total or self.result.total_steps
            self.result.samples.append(NodeSample(time.time(), node.life.name, step, world))

    def _due(self) -> bool:
        """The notice is due from NOTICE_FROM_STEP, once the job trains on both nodes."""
        if not self.result.samples or not self.result.total_steps:
            return False
        latest = max(self.result.samples, key=lambda s: s.time)
        both = latest.world_size in (None, NODES)  # a trainer that does not say its world size: by steps only
        return both and NOTICE_FROM_STEP <= latest.step < self.result.total_steps

    def _interrupt(self, node: _Node, stack: LocalStack) -> None:
        result = self.result
        result.notice_at = time.time()
        result.notice_step = max(s.step for s in result.samples)
        node.imds.inject_spot_notice()
        # What capacity rebalancing does on the notice: the group lets this instance go and launches a
        # replacement straight away (desired capacity stays at 2).
        stack.client("autoscaling").terminate_instance_in_auto_scaling_group(
            InstanceId=node.life.instance_id, ShouldDecrementDesiredCapacity=False
        )
        self.console.print(
            f"[bold red]>>> spot interruption notice injected into {node.life.name}'s IMDS "
            f"(rank 0 last reported step {result.notice_step}/{result.total_steps}; every rank stops at the "
            "next step boundary after its agent's poll finds the notice)[/]",
            highlight=False,
        )

    # -- what happened ------------------------------------------------------------------------------

    def _summarise(self) -> None:
        """The stop, the regroup and the join, from the agents' events and rank 0's own lines."""
        result = self.result
        pending: dict[str, int] = {}
        for entry in result.lines:
            resuming = RESUMING_LINE.search(entry.line)
            if resuming:
                pending[entry.node] = int(resuming.group(1))
            announced = ROUND_LINE.search(entry.line)
            if announced:
                result.rounds.append(
                    Round(entry.time, entry.node, int(announced.group(1)), pending.pop(entry.node, 0))
                )
        seen = result.find(INTERRUPTED, "termination notice")
        result.notice_seen_at = seen.time if seen else 0.0
        stopped = result.find(INTERRUPTED, "trainer stopped")
        if stopped:
            result.stop_confirmed = bool(stopped.fields.get("checkpoint_confirmed"))
            result.stop_confirmed_at = stopped.time
            confirmed = stopped.fields.get("checkpoint_step")
            result.confirmed_step = int(confirmed) if isinstance(confirmed, int) else None
        regroup = next((e for e in result.events if "left the job" in e.message), None)
        if regroup is not None and isinstance(regroup.fields.get("stopped_step"), int):
            result.stopped_step = int(regroup.fields["stopped_step"])
        elif stopped is not None and isinstance(stopped.fields.get("newest_local_step"), int):
            # No survivor said it (it failed first): the interrupted node's record of its ranks' stop.
            result.stopped_step = int(stopped.fields["newest_local_step"])

        after_notice = [r for r in result.rounds if result.notice_at and r.time > result.notice_at]
        if after_notice:
            first = after_notice[0]
            result.resumed_at, result.resumed_step = first.time, first.resumed_step
            result.reached_before_stop = self._reached_before(first.time, stopped)
        replacement = result.node(f"node-{NODES + 1}")
        joined = result.find(replacement.name, "generation") if replacement else None
        result.replacement_joined_at = joined.time if joined else 0.0
        later = [r for r in after_notice[1:] if replacement and r.time > replacement.booted_at]
        if later:
            result.rejoined_at, result.rejoined_step = later[0].time, later[0].resumed_step
            result.reached_before_join = self._reached_before(later[0].time, None)
        sizes = [(s.time, s.world_size) for s in result.samples if s.world_size is not None]
        # progress.json says its world size only on trainers that write it: else each round's own line.
        result.world_sizes = _collapse(sizes or [(r.time, r.world_size) for r in result.rounds])

    def _reached_before(self, moment: float, stop: NodeEvent | None) -> int | None:
        """The highest step any node reported before `moment` (progress, rank 0's stop line, stop event)."""
        steps = [s.step for s in self.result.samples if s.time < moment]
        steps += [
            int(m.group(1))
            for x in self.result.lines
            if x.time < moment and (m := STOPPED_LINE.search(x.line))
        ]
        if stop is not None:
            steps += [
                v
                for k, v in stop.fields.items()
                if k in ("reached_step", "newest_local_step") and isinstance(v, int)
            ]
        return max(steps) if steps else None

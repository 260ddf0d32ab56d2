"""`python -m bench handover`: how fast a job trains again after instance 1 is lost, warm standby vs cold.

Three scenarios, each the real agent and the real built-in trainer (training/configs/tiny.yaml: resnet18 on
generated 32 px images, 16 epochs = 128 steps, a log line every step) on two simulated instances against moto
and a simulated IMDS per instance: the machinery of `python -m demo --rebalance` (demo/rebalance.py), with
only the event that hits instance 1 changed.

- warm: instance 1 trains; once it has logged step 3 the group launches instance 2 beside it (as capacity
  rebalancing does), which finds the lease held and waits as the warm standby (data synced, newest
  checkpoint pulled, trainer gated with model built and first batch loaded). Once instance 2 says `standby
  ready` and instance 1 has passed step NOTICE_AFTER_STEP, a spot notice is injected into instance 1's IMDS
  and the group lets instance 1 go. Measured: notice → instance 2's first trained step.
- cold: the same job, no standby. At step NOTICE_AFTER_STEP the spot notice hits instance 1; instance 2 (the
  group's replacement) is booted only once instance 1's agent has exited (the simulated instance is gone):
  the bundle fetched and unpacked as user-data does, then agent start, data sync, restore, trainer start
  (imports, model build, first batch). Measured: notice → instance 2's first trained step, and its two
  parts. AWS adds the replacement's launch and the instance's boot on top (see bench/RESULTS.md).
- rebalance: `python -m demo --rebalance` as it is (a recommendation on instance 1; instance 2 launched at
  once, warm standby, hand-over at a step boundary); its own checks must all pass. Measured what the demo
  reports: recommendation → hand-over (instance 2 holds the lease) and the hand-over gap (instance 1's last
  step → instance 2's first step).

Every step time is the arrival of the trainer's own log line (stamped by the demo's output pump), every agent
moment the arrival of its event line: the same clock and the same latency for every scenario. Rounds are
interleaved (the order rotates each round) so that drift in the machine's load hits every scenario alike;
an untimed warm-up trial fills the page cache first. Before measuring, the bench waits for the 1-minute load
average to fall under `--calm-load` (or gives up waiting after `--max-wait` seconds and says so); the load
before and after every trial is recorded. A trial counts only if its run was right: every agent exited 0, the
job completed, no step was trained twice or lost, and the replacement started exactly one step after
instance 1's confirmed stop step (the rebalance trial: every check of the demo).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console

from demo.rebalance import (
    HOLDER,
    LEASE_ACQUIRED,
    LEASE_RELEASED,
    LEASE_TAKEN_OVER,
    REBALANCE_AFTER_STEP,
    STANDBY,
    STANDBY_READY,
    STANDBY_WAITING,
    AgentEvent,
    RebalanceDemo,
    RebalanceResult,
    StepSeen,
    _Instance,
    launch_replacement,
)
from demo.stack import LocalStack

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WORKDIR = REPO / "bench" / "out" / "handover"
SCENARIOS = ("warm", "cold", "rebalance")
# The step after which the spot notice may come (warm: and once the standby is ready), the same in both: a
# quarter into the 128-step job, after the first periodic checkpoint (every 32 steps), so both replacements
# restore a step instance 1 confirmed on the notice, not one from a periodic save.
NOTICE_AFTER_STEP = 40
# Warm: the standby said `standby ready` at least this long before the notice (its warm-up's last CPU done).
READY_SETTLE_S = 2.0
# The replacement is the type the rebalance demo's standby is (instance 1 boots as g6.xlarge in every
# scenario: RebalanceDemo.run): the agent's device profile sets the trainer's precision from the type, on CPU
# too, so every scenario's trainers do the same work per step.
REPLACEMENT_TYPE, REPLACEMENT_AZ = "g5.xlarge", "us-east-1b"
CALM_POLL_S = 10.0

# The agent's events the figures are read from (docs/internals.md names them).
INTERRUPTION = ("interruption", "")
# The dataset on the instance: synced, found already in sync, or (a stop during the sync aside) arrived.
DATA_READY = ("data", ("dataset synced", "dataset already in sync", "dataset arrived"))
RESTORED = ("checkpoint", "restored checkpoint from S3")
TRAINER_STARTING = ("train", "trainer starting")
GATE_OPENED = ("train", "start gate opened")

# What each scenario's headline and parts are called, in the order they are printed.
FIGURES: dict[str, tuple[tuple[str, str], ...]] = {
    "warm": (
        ("notice_to_first_step_s", "spot notice → standby's first trained step"),
        ("notice_to_release_s", "  notice → instance 1 released the lease (stop step confirmed)"),
        ("release_to_first_step_s", "  lease released → standby's first step (take-over, restore, gate)"),
        ("handover_gap_s", "instance 1's last step → standby's first step"),
        ("standby_seconds", "standby wait in the ledger (s)"),
        ("standby_cost_usd", "standby_cost_usd in the ledger (simulated spot price)"),
    ),
    "cold": (
        ("notice_to_first_step_s", "spot notice → cold replacement's first trained step (local part)"),
        ("notice_to_release_s", "  notice → instance 1 released the lease (stop step confirmed)"),
        ("notice_to_holder_gone_s", "  notice → instance 1's agent exited (instance gone)"),
        ("release_to_first_step_s", "  lease released → replacement's first step (exit, boot, start)"),
        ("boot_to_first_step_s", "  replacement boot → first step (bundle, agent, data, restore, trainer)"),
        ("boot_to_data_s", "    boot → dataset synced"),
        ("boot_to_trainer_start_s", "    boot → trainer starting (checkpoint restored)"),
        ("trainer_start_to_first_step_s", "    trainer starting → first step (imports, model, batch)"),
        ("handover_gap_s", "instance 1's last step → replacement's first step"),
    ),
    "rebalance": (
        ("rebalance_to_handover_s", "rebalance recommendation → hand-over (standby holds the lease)"),
        ("handover_gap_s", "hand-over gap: instance 1's last step → standby's first step"),
        ("rebalance_to_standby_ready_s", "  recommendation → standby ready (launch, boot, warm-up)"),
        ("rebalance_to_first_step_s", "recommendation → standby's first step"),
        ("standby_seconds", "standby wait in the ledger (s)"),
        ("standby_cost_usd", "standby_cost_usd in the ledger (simulated spot price)"),
    ),
}
HEADLINE = {"warm": "notice_to_first_step_s", "cold": "notice_to_first_step_s"}


# -- the figures: pure functions of a finished run ----------------------------------------------------


def _find(result: RebalanceResult, instance: str, what: tuple[str, str]) -> AgentEvent | None:
    return result.find(instance, what)


def _find_any(result: RebalanceResult, instance: str, what: tuple[str, tuple[str, ...]]) -> AgentEvent | None:
    stage, parts = what
    return next((e for p in parts if (e := _find(result, instance, (stage, p))) is not None), None)


def _first(steps: list[StepSeen]) -> StepSeen | None:
    return min(steps, key=lambda s: s.time) if steps else None


def _last(steps: list[StepSeen]) -> StepSeen | None:
    return max(steps, key=lambda s: s.time) if steps else None


def _since(later: float | None, earlier: float | None) -> float | None:
    return round(later - earlier, 3) if later is not None and earlier is not None else None


def _time(event: AgentEvent | None) -> float | None:
    return event.time if event is not None else None


def _ledger_life(result: RebalanceResult, instance: str) -> dict[str, Any]:
    life = result.life(instance)
    lives = result.ledger.get("lives") or []
    found = next((x for x in lives if life is not None and x.get("instance_id") == life.instance_id), None)
    return found if isinstance(found, dict) else {}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def warm_figures(result: RebalanceResult, notice_at: float) -> dict[str, float | None]:
    """A spot notice with the standby already waiting warm."""
    first = _first(result.trained(STANDBY))
    last = _last(result.trained(HOLDER))
    released = _time(_find(result, HOLDER, LEASE_RELEASED))
    standby = _ledger_life(result, STANDBY)
    return {
        "notice_to_first_step_s": _since(first.time if first else None, notice_at),
        "notice_to_release_s": _since(released, notice_at),
        "release_to_first_step_s": _since(first.time if first else None, released),
        "handover_gap_s": _since(first.time if first else None, last.time if last else None),
        "standby_seconds": _number(standby.get("standby_seconds")),
        "standby_cost_usd": _number(standby.get("standby_cost_usd")),
    }


def cold_figures(result: RebalanceResult, notice_at: float, boot_at: float) -> dict[str, float | None]:
    """A spot notice, and a replacement booted (at `boot_at`) once instance 1 was gone."""
    first = _first(result.trained(STANDBY))
    last = _last(result.trained(HOLDER))
    holder = result.life(HOLDER)
    gone = holder.exited_at if holder is not None and holder.exited_at else None
    starting = _time(_find(result, STANDBY, TRAINER_STARTING))
    released = _time(_find(result, HOLDER, LEASE_RELEASED))
    return {
        "notice_to_first_step_s": _since(first.time if first else None, notice_at),
        "notice_to_release_s": _since(released, notice_at),
        "notice_to_holder_gone_s": _since(gone, notice_at),
        "release_to_first_step_s": _since(first.time if first else None, released),
        "boot_to_first_step_s": _since(first.time if first else None, boot_at),
        "boot_to_data_s": _since(_time(_find_any(result, STANDBY, DATA_READY)), boot_at),
        "boot_to_trainer_start_s": _since(starting, boot_at),
        "trainer_start_to_first_step_s": _since(first.time if first else None, starting),
        "handover_gap_s": _since(first.time if first else None, last.time if last else None),
    }


def rebalance_figures(result: RebalanceResult) -> dict[str, float | None]:
    """What `python -m demo --rebalance` reports (demo/report_rebalance.figures), and the standby's cost."""
    from demo.report_rebalance import figures

    numbers = figures(result)
    first = _first(result.trained(STANDBY))
    standby = _ledger_life(result, STANDBY)
    return {
        "rebalance_to_handover_s": numbers.rebalance_to_handover_s,
        "handover_gap_s": numbers.handover_gap_s,
        "rebalance_to_standby_ready_s": numbers.rebalance_to_standby_ready_s,
        "rebalance_to_first_step_s": _since(first.time if first else None, result.rebalance_at or None),
        "standby_seconds": numbers.standby_seconds,
        "standby_cost_usd": _number(standby.get("standby_cost_usd")),
    }


def notice_problems(result: RebalanceResult, notice_at: float, *, warm: bool) -> list[str]:
    """Why a spot-notice trial does not count (empty: it does): the run must be right to be timed."""
    problems: list[str] = []
    codes = {life.name: life.exit_code for life in result.lives}
    if codes != {HOLDER: 0, STANDBY: 0}:
        problems.append(f"agents exited {codes}")
    if not notice_at:
        problems.append("no spot notice was injected")
    outcomes = {
        name: _ledger_life(result, name).get("outcome") for name in (HOLDER, STANDBY) if result.life(name)
    }
    if outcomes != {HOLDER: "preempted", STANDBY: "completed"}:
        problems.append(f"ledger outcomes {outcomes}")
    if result.ledger.get("status") != "completed":
        problems.append(f"job {result.ledger.get('status')}")
    released = _find(result, HOLDER, LEASE_RELEASED)
    stop = released.fields.get("stop_step") if released is not None else None
    first, last = _first(result.trained(STANDBY)), _last(result.trained(HOLDER))
    if first is None or last is None:
        problems.append("a trainer logged no step")
    else:
        if not isinstance(stop, int) or first.step != stop + 1:
            problems.append(f"replacement's first step {first.step}, instance 1 released at {stop}")
        if first.time <= last.time:
            problems.append("the replacement trained before instance 1's last step")
        if notice_at and last.time < notice_at:
            problems.append("instance 1 had stopped training before the notice")
    twice = {s.step for s in result.trained(HOLDER)} & {s.step for s in result.trained(STANDBY)}
    if twice:
        problems.append(f"steps trained twice: {sorted(twice)[:5]}")
    missing = set(range(1, result.total_steps + 1)) - {s.step for s in result.steps}
    if not result.total_steps or missing:
        problems.append(f"steps never trained: {sorted(missing)[:5]} of {result.total_steps}")
    ready = _find(result, STANDBY, STANDBY_READY)
    if warm:
        if ready is None or ready.time >= notice_at:
            problems.append("the standby was not ready before the notice")
        if _find(result, STANDBY, LEASE_TAKEN_OVER) is None:
            problems.append("the standby never took the lease over")
    else:
        if ready is not None or _find(result, STANDBY, STANDBY_WAITING) is not None:
            problems.append("the cold replacement waited as a standby")
        if _find(result, STANDBY, LEASE_ACQUIRED) is None:
            problems.append("the cold replacement never acquired the lease")
    return problems


@dataclass(frozen=True)
class Trial:
    """One measured run of one scenario."""

    scenario: str
    round: int  # 0 = the untimed warm-up
    ok: bool
    problems: list[str]
    figures: dict[str, float | None]
    load_before: float
    load_after: float
    started_utc: str
    seconds: float
    notice_step: int | None = None  # the newest step instance 1 had logged at the notice/recommendation
    stop_step: int | None = None


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float
    n: int


def spread(values: Sequence[float]) -> Spread | None:
    return Spread(statistics.median(values), min(values), max(values), len(values)) if values else None


def summarize(trials: Sequence[Trial]) -> dict[str, dict[str, Spread]]:
    """Per scenario and figure, over the counted trials (ok, not the warm-up): median and range."""
    summary: dict[str, dict[str, Spread]] = {}
    for scenario, names in FIGURES.items():
        counted = [t for t in trials if t.scenario == scenario and t.ok and t.round > 0]
        for name, _ in names:
            found = spread([v for t in counted if (v := t.figures.get(name)) is not None])
            if found is not None:
                summary.setdefault(scenario, {})[name] = found
    return summary


def warm_over_cold(
    trials: Sequence[Trial], figure: str = "notice_to_first_step_s"
) -> tuple[Spread | None, list[float]]:
    """(a)/(b): warm over cold `figure` (notice → first step; or lease released → first step, which leaves
    out instance 1's own stop, the same work in both), paired by round (a load drift skews one pair, not the
    figure); the median of the per-round ratios, and those ratios."""

    def by_round(scenario: str) -> dict[int, float]:
        return {
            t.round: v
            for t in trials
            if t.scenario == scenario and t.ok and t.round > 0 and (v := t.figures.get(figure)) is not None
        }

    warm, cold = by_round("warm"), by_round("cold")
    ratios = [warm[r] / cold[r] for r in sorted(warm.keys() & cold.keys()) if cold[r] > 0]
    return spread(ratios), ratios


def schedule(rounds: int, warmup: bool) -> list[tuple[int, str]]:
    """(round, scenario) in the order run: the order rotates each round, so each scenario runs first, second
    and third equally often over three rounds."""
    order: list[tuple[int, str]] = [(0, "cold")] if warmup else []
    for index in range(rounds):
        shift = index % len(SCENARIOS)
        order += [(index + 1, s) for s in SCENARIOS[shift:] + SCENARIOS[:shift]]
    return order


# -- the scenarios: the rebalance demo's machinery, another event -------------------------------------


class _NoticeStory(RebalanceDemo):
    """The rebalance demo's two instances, a spot notice on instance 1 instead of a recommendation."""

    def __init__(self, workdir: Path, console: Console) -> None:
        super().__init__(workdir, console)
        self.notice_at = 0.0
        self.notice_step = 0
        self.boot_at = 0.0

    def _holder_step(self) -> int:
        return max((s.step for s in self.result.steps if s.instance == HOLDER), default=0)

    def _notice(self, holder: _Instance, stack: LocalStack) -> None:
        """What AWS does to a spot instance it reclaims: the notice in IMDS, the group lets it go."""
        self.notice_step = self._holder_step()
        self.notice_at = time.time()
        holder.imds.inject_spot_notice()
        stack.client("autoscaling").terminate_instance_in_auto_scaling_group(
            InstanceId=holder.life.instance_id, ShouldDecrementDesiredCapacity=False
        )
        self.console.print(f">>> spot notice injected into {HOLDER} at its step {self.notice_step}")

    def _boot_replacement(
        self, instance_id: str, stack: LocalStack, boot: tuple[LocalStack, str, str, str]
    ) -> None:
        self.boot_at = time.time()
        self._boot(STANDBY, instance_id, REPLACEMENT_TYPE, REPLACEMENT_AZ, *boot)

    def _event(self, stack: LocalStack, boot: tuple[LocalStack, str, str, str]) -> None:
        raise NotImplementedError


class WarmNoticeStory(_NoticeStory):
    """Instance 2 launched beside instance 1 and waiting warm when the spot notice hits instance 1."""

    def _event(self, stack: LocalStack, boot: tuple[LocalStack, str, str, str]) -> None:
        holder = self._instances[0]
        if holder.life.exit_code is not None or self.notice_at:
            return
        step = self._holder_step()
        if len(self._instances) == 1:
            if step >= REBALANCE_AFTER_STEP:
                replacement = launch_replacement(stack)
                self.result.replacement_launched_at = time.time()
                self._boot_replacement(replacement, stack, boot)
            return
        stage, part = STANDBY_READY
        ready = next(
            (
                t
                for t, e in self._instances[1].run.events
                if e.get("stage") == stage and part in str(e.get("message"))
            ),
            None,
        )
        if ready is not None and time.time() - ready >= READY_SETTLE_S and step >= NOTICE_AFTER_STEP:
            self._notice(holder, stack)


class ColdNoticeStory(_NoticeStory):
    """The spot notice hits instance 1 alone; the group's replacement boots once instance 1 is gone."""

    def _event(self, stack: LocalStack, boot: tuple[LocalStack, str, str, str]) -> None:
        holder = self._instances[0]
        if not self.notice_at:
            if holder.life.exit_code is None and self._holder_step() >= NOTICE_AFTER_STEP:
                self._notice(holder, stack)
            return
        if holder.life.exit_code is not None and len(self._instances) == 1:
            # terminate_instance_in_auto_scaling_group without decrement: the group launched a replacement.
            replacement = next(i for i in stack.instance_ids() if i != holder.life.instance_id)
            self._boot_replacement(replacement, stack, boot)


# -- running the trials -------------------------------------------------------------------------------


def load() -> float:
    return os.getloadavg()[0]


def wait_for_calm(
    threshold: float,
    max_wait_s: float,
    say: Callable[[str], None],
    *,
    read: Callable[[], float] = load,
    sleep: Callable[[float], None] = time.sleep,
    poll_s: float = CALM_POLL_S,
) -> tuple[float, float, bool]:
    """Wait until the 1-minute load average is under `threshold`, at most `max_wait_s`.

    Returns (load when asked, load when done, calm reached)."""
    first = current = read()
    waited = 0.0
    while current >= threshold and waited < max_wait_s:
        if waited % 60 < poll_s:
            say(
                f"load {current:.2f} ≥ {threshold}: waiting for a calm machine "
                f"({waited:.0f}/{max_wait_s:.0f} s)"
            )
        sleep(poll_s)
        waited += poll_s
        current = read()
    return first, current, current < threshold


def _reset_moto(endpoint: str) -> None:
    request = urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")
    with urllib.request.urlopen(request, timeout=30) as answer:
        answer.read()


def run_trial(scenario: str, round_index: int, workdir: Path, endpoint: str, console: Console) -> Trial:
    """One scenario in a fresh stack (moto reset); its log in workdir/<round>-<scenario>.log."""
    from demo.report_rebalance import checks

    trial_dir = workdir / f"{round_index}-{scenario}"
    shutil.rmtree(trial_dir, ignore_errors=True)
    trial_dir.mkdir(parents=True)
    log_path = workdir / f"{round_index}-{scenario}.log"
    started = datetime.now(timezone.utc)
    load_before, clock = load(), time.monotonic()
    problems: list[str] = []
    numbers: dict[str, float | None] = {}
    notice_step = stop_step = None
    with log_path.open("w") as log:
        story_console = Console(file=log, width=160, soft_wrap=True, force_terminal=False)
        _reset_moto(endpoint)
        story: RebalanceDemo
        if scenario == "warm":
            story = WarmNoticeStory(trial_dir, story_console)
        elif scenario == "cold":
            story = ColdNoticeStory(trial_dir, story_console)
        else:
            story = RebalanceDemo(trial_dir, story_console)
        try:
            result = story.run()
        except Exception as exc:  # a failed trial is recorded, not fatal: the others still count
            problems.append(f"{type(exc).__name__}: {exc}")
            story_console.print(f"trial failed: {type(exc).__name__}: {exc}")
        else:
            if isinstance(story, _NoticeStory):
                warm = isinstance(story, WarmNoticeStory)
                problems = notice_problems(result, story.notice_at, warm=warm)
                numbers = (
                    warm_figures(result, story.notice_at)
                    if warm
                    else cold_figures(result, story.notice_at, story.boot_at)
                )
                notice_step = story.notice_step
            else:
                problems = [f"{c.name}: {c.detail}" for c in checks(result) if not c.passed]
                numbers = rebalance_figures(result)
                notice_step = result.rebalance_step
            released = _find(result, HOLDER, LEASE_RELEASED)
            stop = released.fields.get("stop_step") if released is not None else None
            stop_step = stop if isinstance(stop, int) else None
            story_console.print(json.dumps({"figures": numbers, "problems": problems}, indent=1))
    trial = Trial(
        scenario=scenario,
        round=round_index,
        ok=not problems,
        problems=problems,
        figures=numbers,
        load_before=round(load_before, 2),
        load_after=round(load(), 2),
        started_utc=f"{started:%Y-%m-%d %H:%M:%S}",
        seconds=round(time.monotonic() - clock, 1),
        notice_step=notice_step,
        stop_step=stop_step,
    )
    if trial.ok:
        shutil.rmtree(trial_dir, ignore_errors=True)  # datasets, bundles, checkpoints: the log stays
    head = HEADLINE.get(scenario, "rebalance_to_handover_s")
    console.print(
        f"{trial.started_utc} round {round_index} {scenario:<9} "
        + (f"{head} {_fmt(numbers.get(head))}" if trial.ok else f"[red]NOT COUNTED[/]: {'; '.join(problems)}")
        + f"  (trial {trial.seconds:.0f} s, load {trial.load_before:.2f} → {trial.load_after:.2f})",
        highlight=False,
    )
    return trial


def _fmt(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def hardware() -> dict[str, str]:
    """lscpu's model, CPUs and hypervisor; MemTotal; Python and torch."""
    facts: dict[str, str] = {"python": platform.python_version(), "cpus": str(os.cpu_count())}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False, timeout=10).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in (
                "Model name",
                "Hypervisor vendor",
                "Thread(s) per core",
                "L2 cache",
                "L3 cache",
            ):
                facts[key.strip()] = value.strip()
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                facts["memory_gib"] = f"{int(line.split()[1]) / 1024**2:.1f}"
    with contextlib.suppress(ImportError):
        import torch

        facts["torch"] = torch.__version__
    return facts


@contextlib.contextmanager
def _embedded_aws() -> Iterator[str]:
    """The demo's isolated environment and one moto server for every trial (reset before each)."""
    from demo.moto_server import moto_server
    from demo.run import ISOLATED_ENV

    os.environ.update(ISOLATED_ENV)
    os.environ.pop("AWS_PROFILE", None)
    with moto_server() as endpoint:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        yield endpoint


@dataclass
class Report:
    started_utc: str
    finished_utc: str = ""
    hardware: dict[str, str] = field(default_factory=dict)
    calm_threshold: float = 1.0
    load_at_start: float = 0.0
    load_when_measuring: float = 0.0
    calm_reached: bool = False
    trials: list[Trial] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        summary = summarize(self.trials)
        ratio, ratios = warm_over_cold(self.trials)
        after, afters = warm_over_cold(self.trials, "release_to_first_step_s")
        return {
            **asdict(self),
            "summary": {s: {k: asdict(v) for k, v in figs.items()} for s, figs in summary.items()},
            "warm_over_cold": asdict(ratio) if ratio else None,
            "warm_over_cold_per_round": ratios,
            "warm_over_cold_after_release": asdict(after) if after else None,
            "warm_over_cold_after_release_per_round": afters,
        }


def print_report(report: Report, console: Console) -> None:
    from rich.table import Table

    summary = summarize(report.trials)
    table = Table(title="hand-over: warm standby vs cold replacement (real agent and trainer, CPU, moto)")
    for column in ("scenario", "figure", "median s", "range s", "n"):
        table.add_column(column)
    for scenario, names in FIGURES.items():
        for name, label in names:
            found = summary.get(scenario, {}).get(name)
            digits = 6 if name.endswith("_usd") else 2
            table.add_row(
                scenario,
                label,
                _fmt(found.median if found else None, digits),
                f"{_fmt(found.low, digits)}–{_fmt(found.high, digits)}" if found else "—",
                str(found.n if found else 0),
            )
    console.print(table)
    for figure, what in (
        ("notice_to_first_step_s", "notice → first step"),
        ("release_to_first_step_s", "lease released → first step"),
    ):
        ratio, ratios = warm_over_cold(report.trials, figure)
        if ratio is not None:
            console.print(
                f"(a)/(b) warm over cold, {what}: median of per-round ratios {ratio.median:.3f} "
                f"(range {ratio.low:.3f}–{ratio.high:.3f}; rounds {', '.join(f'{r:.3f}' for r in ratios)})"
            )
    loads = [x for t in report.trials for x in (t.load_before, t.load_after)]
    counted = [t for t in report.trials if t.round > 0]
    console.print(
        f"load: {report.load_at_start:.2f} when started, {report.load_when_measuring:.2f} when measuring "
        "began "
        f"(calm < {report.calm_threshold}: {'reached' if report.calm_reached else 'NOT reached'}); "
        f"before/after trials {min(loads, default=0):.2f}–{max(loads, default=0):.2f}; "
        f"{sum(t.ok for t in counted)}/{len(counted)} trials counted"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench handover", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the three scenarios")
    parser.add_argument("--calm-load", type=float, default=1.0, help="wait for a 1-minute load under this")
    parser.add_argument("--max-wait", type=float, default=900.0, help="seconds to wait for it at most")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up trial")
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="logs and the JSON report")
    args = parser.parse_args(argv)
    console = Console(width=160)
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    report = Report(started_utc=f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S}", hardware=hardware())
    report.calm_threshold = args.calm_load
    facts = report.hardware
    console.print(
        f"{report.started_utc} UTC  {facts.get('Model name', platform.machine())}  {facts['cpus']} CPUs  "
        f"{facts.get('memory_gib', '?')} GiB  torch {facts.get('torch', '?')}",
        highlight=False,
    )
    report.load_at_start, report.load_when_measuring, report.calm_reached = wait_for_calm(
        args.calm_load, args.max_wait, lambda line: console.print(line, highlight=False)
    )
    if not report.calm_reached:
        console.print(f"[yellow]the machine did not calm down in {args.max_wait:.0f} s: measuring anyway[/]")
    json_path = workdir / "handover.json"
    with _embedded_aws() as endpoint:
        for round_index, scenario in schedule(args.rounds, warmup=not args.no_warmup):
            report.trials.append(run_trial(scenario, round_index, workdir, endpoint, console))
            json_path.write_text(json.dumps(report.as_dict(), indent=1) + "\n")
    report.finished_utc = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S}"
    json_path.write_text(json.dumps(report.as_dict(), indent=1) + "\n")
    print_report(report, console)
    console.print(f"report: {json_path}; each trial's story: {workdir}/<round>-<scenario>.log")

"""The rebalance demo's verdict: one writer at a time, no step lost or trained twice, a truthful ledger.

The checks are pure functions of a `RebalanceResult`, so each can be shown to fail on a made-up timeline
(tests/bootstrap/test_demo_rebalance.py) as well as to pass on the real run.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bootstrap.cloud_init import USER_DATA_LIMIT_BYTES
from demo.rebalance import (
    COMPLETE_LINE,
    GATE_LINE,
    HANDOVER,
    HOLDER,
    JOB_BOUND,
    LEASE_ACQUIRED,
    LEASE_RELEASED,
    LEASE_TAKEN_OVER,
    LEFT_GROUP,
    LIFE_END,
    REBALANCE_SEEN,
    RESUMING_LINE,
    STANDBY,
    STANDBY_READY,
    STANDBY_WAITING,
    STOPPED_LINE,
    TRAINER_STOPPED,
    WARM_LINE,
    AgentEvent,
    RebalanceResult,
    StepSeen,
)
from demo.report import MIN_ACCURACY, Check, cost_line, lives_table
from trainstack_job.contract import JobStatus, LifeOutcome

STEP_FOLDER = re.compile(r"^step-(\d+)/")
# What a truthful ledger says of this story: instance 1 handed the job over, instance 2 finished it.
EXPECTED_OUTCOMES = {HOLDER: LifeOutcome.HANDED_OVER.value, STANDBY: LifeOutcome.COMPLETED.value}
FAILED_OUTCOMES = {LifeOutcome.FAILED.value, LifeOutcome.STALLED.value, LifeOutcome.INTERRUPTED.value}
FIGURES_FILE = "figures.json"


@dataclass(frozen=True)
class Figures:
    """The story's numbers (bench/RESULTS.md cites the two hand-over figures from figures.json)."""

    stop_step: int | None  # the step instance 1 stopped at, confirmed and released the lease with
    resumed_step: int | None  # the step instance 2's trainer restored
    holder_last_step: int | None
    standby_first_step: int | None
    steps_lost: int | None
    # Instance 1's last trained step → instance 2's first trained step: no step is trained in between.
    handover_gap_s: float | None
    # The recommendation reaching instance 1's IMDS → instance 2 holding the lease.
    rebalance_to_handover_s: float | None
    rebalance_to_standby_ready_s: float | None
    # Instance 2's trainer waiting at its gate, warm, until the lease came (the trainer's own figure).
    gate_wait_s: float | None
    standby_seconds: float | None  # the ledger's: instance 2's life as a standby


def _field(event: AgentEvent | None, key: str) -> Any:
    return None if event is None else event.fields.get(key)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _first(steps: list[StepSeen]) -> StepSeen | None:
    return min(steps, key=lambda s: s.time) if steps else None


def _last(steps: list[StepSeen]) -> StepSeen | None:
    return max(steps, key=lambda s: s.time) if steps else None


def stop_step(result: RebalanceResult) -> int | None:
    """The step instance 1 handed over at, as its agent released the lease with it."""
    released = next((e for e in result.events if e.instance == HOLDER and e.matches(LEASE_RELEASED)), None)
    return _int(_field(released, "stop_step"))


def resumed_step(result: RebalanceResult) -> int | None:
    said = result.line(STANDBY, RESUMING_LINE)
    return int(said[1].group(1)) if said else None


def life_of(result: RebalanceResult, instance: str) -> dict[str, Any] | None:
    life = result.life(instance)
    lives = result.ledger.get("lives") or []
    return next((x for x in lives if life is not None and x.get("instance_id") == life.instance_id), None)


def figures(result: RebalanceResult) -> Figures:
    last, first = _last(result.trained(HOLDER)), _first(result.trained(STANDBY))
    resumed = resumed_step(result)
    taken = result.find(STANDBY, LEASE_TAKEN_OVER)
    ready = result.find(STANDBY, STANDBY_READY)
    gate = result.line(STANDBY, GATE_LINE)
    reached = max((s.step for s in result.trained(HOLDER)), default=None)
    standby_life = life_of(result, STANDBY) or {}
    standby_seconds = standby_life.get("standby_seconds")
    return Figures(
        stop_step=stop_step(result),
        resumed_step=resumed,
        holder_last_step=last.step if last else None,
        standby_first_step=first.step if first else None,
        # What instance 1 trained that instance 2 did not start from (make demo's definition).
        steps_lost=max(0, reached - resumed) if reached is not None and resumed is not None else None,
        handover_gap_s=round(first.time - last.time, 2) if first and last else None,
        rebalance_to_handover_s=round(taken.time - result.rebalance_at, 2)
        if taken and result.rebalance_at
        else None,
        rebalance_to_standby_ready_s=round(ready.time - result.rebalance_at, 2)
        if ready and result.rebalance_at
        else None,
        gate_wait_s=float(gate[1].group(1)) if gate else None,
        standby_seconds=float(standby_seconds) if isinstance(standby_seconds, (int, float)) else None,
    )


def final_accuracy(metrics: dict[str, Any]) -> float | None:
    final = metrics.get("final")
    source = final if isinstance(final, dict) else metrics
    value = source.get("val_accuracy")
    return float(value) if isinstance(value, (int, float)) else None


# -- the checks -------------------------------------------------------------------------------------


def check_one_trainer_at_a_time(result: RebalanceResult) -> Check:
    """Instance 2's first trained step comes after instance 1's last, and each trained only while it held
    the lease (as its agent said: instance 1 until it released it, instance 2 from its take-over)."""
    name = "one trainer at a time"
    last, first = _last(result.trained(HOLDER)), _first(result.trained(STANDBY))
    if last is None or first is None:
        return Check(
            name, False, f"step timelines incomplete: instance 1 last {last}, instance 2 first {first}"
        )
    released = result.find(HOLDER, LEASE_RELEASED)
    taken = result.find(STANDBY, LEASE_TAKEN_OVER)
    problems = []
    if first.time <= last.time:
        problems.append(
            f"instance 2 trained step {first.step} at {first.time - result.started:.2f}s, before "
            f"instance 1's last step {last.step} at {last.time - result.started:.2f}s"
        )
    if released is None or taken is None:
        problems.append("no lease release by instance 1 or take-over by instance 2 in the agents' events")
    else:
        late = [s for s in result.trained(HOLDER) if s.time > released.time]
        early = [s for s in result.trained(STANDBY) if s.time < taken.time]
        if late:
            problems.append(f"instance 1 trained step {late[0].step} after releasing the lease")
        if early:
            problems.append(f"instance 2 trained step {early[0].step} before taking the lease")
    detail = (
        f"instance 1's last step {last.step} at {last.time - result.started:.2f}s → instance 2's first step "
        f"{first.step} at {first.time - result.started:.2f}s"
    )
    return Check(name, not problems, "; ".join(problems) or detail)


def check_no_step_trained_twice(result: RebalanceResult) -> Check:
    """No step number trained by both; instance 2 starts exactly one step after instance 1's stop."""
    mine = {s.step for s in result.trained(HOLDER)}
    theirs = {s.step for s in result.trained(STANDBY)}
    both = sorted(mine & theirs)
    first = _first(result.trained(STANDBY))
    stop = stop_step(result)
    ok = not both and first is not None and stop is not None and first.step == stop + 1
    detail = (
        f"trained by both: {both[:10]}"
        if both
        else f"instance 2's first step {first.step if first else None}"
    )
    return Check("no step trained twice", ok, f"{detail}; instance 1 stopped at {stop}")


def check_steps_lost(result: RebalanceResult) -> Check:
    """Nothing instance 1 trained is missing from where instance 2 started, and every step 1..total was
    trained by one of them."""
    numbers = figures(result)
    trained = sorted({s.step for s in result.steps})
    expected = list(range(1, result.total_steps + 1))
    missing = sorted(set(expected) - set(trained))
    ok = (
        numbers.steps_lost == 0
        and numbers.stop_step is not None
        and numbers.holder_last_step == numbers.stop_step == numbers.resumed_step
        and result.total_steps > 0
        and not missing
    )
    return Check(
        "steps lost = 0",
        ok,
        f"{numbers.steps_lost} (instance 1 trained to {numbers.holder_last_step}, stopped at "
        f"{numbers.stop_step}, instance 2 restored {numbers.resumed_step}; steps never trained: "
        f"{missing[:10] or 'none'} of {result.total_steps})",
    )


def check_stop_confirmed(result: RebalanceResult) -> Check:
    """Instance 1 confirmed the step it stopped at in S3 before letting the lease go, and instance 2 took
    the lease over with that step."""
    stopped = result.find(HOLDER, TRAINER_STOPPED)
    released = result.find(HOLDER, LEASE_RELEASED)
    taken = result.find(STANDBY, LEASE_TAKEN_OVER)
    said = result.line(HOLDER, STOPPED_LINE)
    holder = result.life(HOLDER)
    step = stop_step(result)
    ok = (
        stopped is not None
        and bool(_field(stopped, "checkpoint_confirmed"))
        and _field(stopped, "reason") in (None, "handover")
        and said is not None
        and step is not None
        and _field(stopped, "checkpoint_step") == step == int(said[1].group(1))
        and released is not None
        and stopped.time <= released.time
        and _field(taken, "stop_step") == step
        and holder is not None
        and _field(taken, "from") == holder.instance_id
    )
    return Check(
        "instance 1 confirmed its stop step, then handed the lease to instance 2",
        ok,
        f"trainer stopped at {said[1].group(1) if said else None} (reason {_field(stopped, 'reason')}), "
        f"confirmed {_field(stopped, 'checkpoint_step')} ({_field(stopped, 'checkpoint_confirmed')}), lease "
        f"released at {step}, taken over at {_field(taken, 'stop_step')} from {_field(taken, 'from')}",
    )


def check_standby(result: RebalanceResult) -> Check:
    """Instance 2 found the lease held by instance 1 and waited, its trainer warm behind the gate."""
    holder = result.life(HOLDER)
    standby = result.life(STANDBY)
    waiting = result.find(STANDBY, STANDBY_WAITING)
    ready = result.find(STANDBY, STANDBY_READY)
    handover = result.find(HOLDER, HANDOVER)
    warm = result.line(STANDBY, WARM_LINE)
    taken = result.find(STANDBY, LEASE_TAKEN_OVER)
    ok = (
        holder is not None
        and standby is not None
        and waiting is not None
        and _field(waiting, "holder") == holder.instance_id
        and ready is not None
        and warm is not None
        and taken is not None
        and warm[0] < taken.time
        # The holder handed over to this standby because it read the standby's ready record. Not the two
        # lines' times: the standby says "standby ready" once its record is written, so on a loaded machine
        # the holder, reading the record, can say so first.
        and handover is not None
        and _field(handover, "standby") == standby.instance_id
    )
    return Check(
        "instance 2 waited as the warm standby",
        ok,
        f"lease holder seen {_field(waiting, 'holder')}, ready after {_field(ready, 'warm_s')}s, trainer "
        f"warm in {warm[1].group(1) if warm else None}s; instance 1 handed over to "
        f"{_field(handover, 'standby')}",
    )


def check_lease_moved_once(result: RebalanceResult) -> Check:
    """lease.json as the demo read it: instance 1's token, then instance 2's, one more; never back."""
    ids = {life.instance_id: life.name for life in result.lives}
    holders: list[str] = []
    for seen in result.leases:
        name = ids.get(seen.holder, seen.holder or "none")
        if not holders or holders[-1] != name:
            holders.append(name)
    tokens = [s.token for s in result.leases if s.token is not None]
    acquired = _int(_field(result.find(HOLDER, LEASE_ACQUIRED), "token"))
    taken = _int(_field(result.find(STANDBY, LEASE_TAKEN_OVER), "token"))
    ok = (
        [h for h in holders if h != "none"] == [HOLDER, STANDBY]
        and tokens == sorted(tokens)
        and acquired is not None
        and taken == acquired + 1
    )
    return Check(
        "the lease moved once, instance 1 → instance 2, token + 1",
        ok,
        f"holders {' → '.join(holders) or 'none seen'}; tokens {acquired} → {taken} "
        f"(read from S3: {sorted(set(tokens))})",
    )


def check_latest_forward(result: RebalanceResult) -> Check:
    """Every version of latest.json names a newer step than the one before, and a token never lower."""
    steps = [v.step for v in result.latest_history]
    tokens = [v.token for v in result.latest_history]
    backwards = [(a, b) for a, b in itertools.pairwise(steps) if a is None or b is None or b <= a]
    token_back = [(a, b) for a, b in itertools.pairwise(tokens) if a is not None and b is not None and b < a]
    ok = bool(steps) and not backwards and not token_back and steps[-1] == result.total_steps
    return Check(
        "latest.json only moved forward",
        ok,
        f"{len(steps)} versions: steps {' → '.join(str(s) for s in steps) or 'none'}; tokens "
        f"{' → '.join(str(t) for t in tokens)}"
        + (f"; moved back {backwards}" if backwards else "")
        + (f"; token went down {token_back}" if token_back else ""),
    )


def check_step_folders_once(result: RebalanceResult) -> Check:
    """Each object of each step folder has one content (the bucket is versioned: a second writer of a step
    would leave a second version with other bytes), and none at or below the hand-over step was written
    after the take-over.

    A second version with the same bytes is one writer uploading one file twice (its final flush redoes an
    upload the stop interrupted): shown, not failed."""
    contents: dict[str, set[str]] = {}
    uploads: dict[str, int] = {}
    steps: set[int] = set()
    written_after: list[str] = []
    taken = result.find(STANDBY, LEASE_TAKEN_OVER)
    stop = stop_step(result)
    for version in result.versions:
        found = STEP_FOLDER.match(version.key)
        if found is None or version.delete_marker:
            continue
        steps.add(int(found.group(1)))
        contents.setdefault(version.key, set()).add(version.etag or version.version_id)
        uploads[version.key] = uploads.get(version.key, 0) + 1
        # S3 lists whole seconds, rounded down: a write before the take-over never lists after it.
        if (
            taken is not None
            and stop is not None
            and int(found.group(1)) <= stop
            and version.written_at > taken.time
        ):
            written_after.append(version.key)
    twice = sorted(key for key, etags in contents.items() if len(etags) > 1)
    again = sorted(key for key, count in uploads.items() if count > 1 and key not in twice)
    ok = bool(contents) and not twice and not written_after
    detail = (
        f"{len(steps)} step folders ({', '.join(str(s) for s in sorted(steps))}), {len(contents)} objects"
    )
    if twice:
        detail += f"; written twice with different bytes: {', '.join(twice[:6])}"
    if written_after:
        detail += f"; at or below step {stop} but written after the take-over: {', '.join(written_after[:6])}"
    if ok:
        detail += ", each written once"
    if again:
        detail += f" (uploaded again with the same bytes: {', '.join(again[:6])})"
    return Check("no checkpoint step folder written twice", ok, detail)


def check_one_completion(result: RebalanceResult) -> Check:
    completed_alerts = [a["Subject"] for a in result.alerts if "training completed" in a["Subject"]]
    completed_lives = [
        x for x in result.ledger.get("lives") or [] if x.get("outcome") == LifeOutcome.COMPLETED.value
    ]
    complete_lines = [x for x in result.lines if COMPLETE_LINE.search(x.line)]
    ok = len(completed_alerts) == 1 and len(completed_lives) == 1 and len(complete_lines) == 1
    return Check(
        "one completion",
        ok,
        f"{len(completed_alerts)} 'training completed' notification(s), {len(completed_lives)} completed "
        f"life/lives, {len(complete_lines)} 'training complete' line(s) "
        f"({', '.join(x.instance for x in complete_lines) or 'none'})",
    )


def check_ledger(result: RebalanceResult) -> Check:
    """Two lives, instance 1 handed_over and instance 2 completed after a standby wait; one hand-over; the
    total is the sum of the lives; no failure, no interruption."""
    ledger = result.ledger
    lives = ledger.get("lives") or []
    names = {life.instance_id: life.name for life in result.lives}
    outcomes = {
        names.get(str(x.get("instance_id")), str(x.get("instance_id"))): x.get("outcome") for x in lives
    }
    standby = life_of(result, STANDBY) or {}
    standby_seconds = standby.get("standby_seconds")
    total = float(ledger.get("total_cost_usd") or 0.0)
    summed = sum(float(x.get("cost_usd") or 0.0) for x in lives)
    failed = [x.get("outcome") for x in lives if x.get("outcome") in FAILED_OUTCOMES]
    ok = (
        len(lives) == 2
        and outcomes == EXPECTED_OUTCOMES
        and isinstance(standby_seconds, (int, float))
        and standby_seconds > 0
        and ledger.get("handovers") == 1
        and total > 0
        and abs(total - summed) <= 1e-6 * max(1, len(lives))
        and ledger.get("interruptions") == 0
        and not failed
        and ledger.get("consecutive_failures") == 0
        and ledger.get("status") == JobStatus.COMPLETED.value
    )
    return Check(
        "ledger: instance 1 handed_over, instance 2 completed after a standby wait",
        ok,
        f"{len(lives)} lives ({', '.join(f'{n} {o}' for n, o in sorted(outcomes.items()))}); instance 2 "
        f"standby_seconds {standby_seconds}; handovers {ledger.get('handovers')}; total ${total:.6f} = "
        f"sum ${summed:.6f}; interruptions {ledger.get('interruptions')}, failures "
        f"{len(failed)}/{ledger.get('consecutive_failures')}; job {ledger.get('status')}",
    )


def check_group(result: RebalanceResult) -> Check:
    """Launch before terminate: desired 1 with both instances, then instance 1 gone (it terminated itself
    without lowering the capacity), then zero."""
    holder, standby = result.life(HOLDER), result.life(STANDBY)
    both, after = result.group_with_both, result.group_after_holder
    left = result.find(HOLDER, LEFT_GROUP)
    names = {life.instance_id: life.name for life in result.lives}
    ok = (
        holder is not None
        and standby is not None
        and both is not None
        and both.desired == 1
        and sorted(both.instances) == sorted([holder.instance_id, standby.instance_id])
        and after is not None
        and after.desired == 1
        and after.instances == [standby.instance_id]
        and left is not None
        and _field(left, "decrement") is False
        and result.ec2_states.get(holder.instance_id) == "terminated"
        and result.desired_capacity == 0
        and not result.group_instances
    )
    return Check(
        "the group: launch before terminate, instance 1 left, then zero",
        ok,
        f"with both: desired {both.desired if both else None}, "
        f"{len(both.instances) if both else 0} instances; after instance 1: desired "
        f"{after.desired if after else None}, holding "
        f"{[names.get(i, i) for i in (after.instances if after else [])]}; instance 1 left (decrement "
        f"{_field(left, 'decrement')}), EC2 {result.ec2_states.get(holder.instance_id) if holder else None}; "
        f"end: desired {result.desired_capacity}, {len(result.group_instances)} instances",
    )


def checks(result: RebalanceResult) -> list[Check]:
    accuracy = final_accuracy(result.metrics)
    names = {a.rsplit("/", 1)[-1] for a in result.artifacts}
    codes = {life.name: life.exit_code for life in result.lives}
    numbers = figures(result)
    return [
        Check(
            "user-data renders, is valid and fits",
            result.user_data_bytes < USER_DATA_LIMIT_BYTES,
            f"{result.user_data_bytes} bytes; {result.user_data_valid}",
        ),
        Check(
            "every agent exited 0 (2 instances)",
            len(codes) == 2 and all(code == 0 for code in codes.values()),
            ", ".join(f"{name} {code}" for name, code in codes.items()),
        ),
        check_standby(result),
        check_stop_confirmed(result),
        check_one_trainer_at_a_time(result),
        check_no_step_trained_twice(result),
        check_steps_lost(result),
        check_lease_moved_once(result),
        check_latest_forward(result),
        check_step_folders_once(result),
        check_one_completion(result),
        check_ledger(result),
        check_group(result),
        Check(
            "hand-over figures recorded",
            numbers.handover_gap_s is not None and numbers.rebalance_to_handover_s is not None,
            f"hand-over gap {_seconds(numbers.handover_gap_s)}, rebalance → hand-over "
            f"{_seconds(numbers.rebalance_to_handover_s)}",
        ),
        Check(
            f"final accuracy ≥ {MIN_ACCURACY}",
            accuracy is not None and accuracy >= MIN_ACCURACY,
            f"{accuracy}",
        ),
        Check("results in S3", {"model.pt", "metrics.json"} <= names, ", ".join(sorted(names)) or "none"),
    ]


# -- the timeline -----------------------------------------------------------------------------------


def lease_changes(result: RebalanceResult) -> list[tuple[float, str]]:
    """(time, who holds the lease from then on), from the agents' own events; lease.json as the demo read it
    where the agents said nothing (an agent that logs no lease events)."""
    changes: list[tuple[float, str]] = []
    for event in result.events:
        token = _field(event, "token")
        if event.matches(LEASE_ACQUIRED) or event.matches(LEASE_TAKEN_OVER):
            changes.append((event.time, f"{event.instance} (token {token})"))
        elif event.matches(LEASE_RELEASED):
            changes.append((event.time, f"released (step {_field(event, 'stop_step')})"))
    if changes:
        return changes
    ids = {life.instance_id: life.name for life in result.lives}
    for seen in result.leases:
        holder = ids.get(seen.holder, seen.holder)
        state = f"released (step {seen.stop_step})" if seen.released else f"{holder} (token {seen.token})"
        changes.append((seen.time, state if seen.holder else "none"))
    return changes


def holder_at(changes: list[tuple[float, str]], moment: float) -> str:
    held = "none"
    for when, who in changes:
        if when > moment:
            break
        held = who
    return held


def _event_row(result: RebalanceResult, event: AgentEvent) -> str | None:
    ids = {life.instance_id: life.name for life in result.lives}
    fields = event.fields
    if event.matches(JOB_BOUND):
        return f"job bound: {fields.get('job_id')}"
    if event.matches(LEASE_ACQUIRED):
        return f"takes the job's lease (token {fields.get('token')}) and trains"
    if event.matches(STANDBY_WAITING):
        holder = ids.get(str(fields.get("holder")), fields.get("holder"))
        return f"finds the lease held by {holder}: waits as the warm standby"
    if event.matches(STANDBY_READY):
        return f"standby ready: data, checkpoint and trainer warm ({fields.get('warm_s')}s)"
    if event.matches(REBALANCE_SEEN):
        return "its agent's IMDS poll finds the recommendation: early checkpoint requested"
    if event.matches(HANDOVER):
        standby = ids.get(str(fields.get("standby")), fields.get("standby"))
        return f"sees {standby} ready: stops at the next step boundary to hand over"
    if event.matches(TRAINER_STOPPED):
        return (
            f"checkpoint step {fields.get('checkpoint_step')} confirmed in S3 "
            f"(reason {fields.get('reason')}, confirmed {fields.get('checkpoint_confirmed')})"
        )
    if event.matches(LEASE_RELEASED):
        return f"releases the lease (stop step {fields.get('stop_step')})"
    if event.matches(LEASE_TAKEN_OVER):
        source = ids.get(str(fields.get("from")), fields.get("from"))
        return (
            f"takes the lease over from {source} (token {fields.get('token')}, stop step "
            f"{fields.get('stop_step')}) and opens its trainer's gate"
        )
    if event.matches(LEFT_GROUP):
        return f"leaves the group: TerminateInstanceInAutoScalingGroup (decrement {fields.get('decrement')})"
    if event.matches(LIFE_END):
        return f"life ends: {event.message}"
    if event.stage == "interruption":
        # After it left the group (or the group went to zero) its IMDS says target-lifecycle-state Terminated.
        return f"its IMDS now says Terminated: {event.message}"
    return None


def _rows(result: RebalanceResult) -> list[tuple[float, str, str]]:
    """(time, instance, what happened) for each moment of the story worth a line."""
    total = result.total_steps
    rows: list[tuple[float, str, str]] = []
    for life in result.lives:
        how = (
            "launched by the group before instance 1 goes (desired stays 1)"
            if life.name == STANDBY
            else "boots"
        )
        rows.append(
            (life.booted_at, life.name, f"{how}: {life.instance_id}, {life.instance_type}, {life.az}")
        )
        if life.exited_at:
            gone = "; the simulated instance is gone" if life.name == HOLDER else ""
            rows.append((life.exited_at, life.name, f"agent exits {life.exit_code}{gone}"))
    if result.rebalance_at:
        rows.append(
            (
                result.rebalance_at,
                HOLDER,
                "rebalance recommendation injected into its IMDS "
                f"(its trainer had logged step {result.rebalance_step}/{total})",
            )
        )
    for event in result.events:
        text = _event_row(result, event)
        if text is not None:
            rows.append((event.time, event.instance, text))
    for line in result.lines:
        for pattern, say in (
            (WARM_LINE, "trainer warm behind its start gate ({}s): model built, first batch loaded"),
            (GATE_LINE, "trainer's gate opened after {}s waiting: restoring"),
            (RESUMING_LINE, "trainer resumes at step {}"),
            (STOPPED_LINE, "trainer stops at step {} with its checkpoint"),
            (COMPLETE_LINE, "training complete: {} steps"),
        ):
            found = pattern.search(line.line)
            if found:
                rows.append((line.time, line.instance, say.format(found.group(1))))
    for name in (HOLDER, STANDBY):
        first, last = _first(result.trained(name)), _last(result.trained(name))
        if first:
            rows.append((first.time, name, f"first trained step {first.step}/{total}"))
        if last and last is not first:
            rows.append((last.time, name, f"last trained step {last.step}/{total}"))
    return sorted(rows, key=lambda row: row[0])


def print_timeline(result: RebalanceResult, console: Console) -> Figures:
    changes = lease_changes(result)
    table = Table(title="Capacity rebalancing: a warm standby takes over, one writer at a time")
    table.add_column("t (s)", justify="right")
    table.add_column("instance")
    table.add_column("what happened", overflow="fold")
    table.add_column("lease holder", overflow="fold")
    for moment, instance, what in _rows(result):
        table.add_row(
            f"{moment - result.started:.1f}", instance, escape(what), escape(holder_at(changes, moment))
        )
    console.print(table)
    numbers = figures(result)
    summary = Table(show_header=False, box=None)
    summary.add_column("what")
    summary.add_column("value", overflow="fold")
    summary.add_row("steps lost", str(numbers.steps_lost))
    summary.add_row(
        "hand-over gap (instance 1's last step → instance 2's first)",
        _seconds(numbers.handover_gap_s)
        + f" (step {numbers.holder_last_step} → step {numbers.standby_first_step})",
    )
    summary.add_row(
        "rebalance → hand-over (instance 2 holds the lease)", _seconds(numbers.rebalance_to_handover_s)
    )
    summary.add_row("rebalance → standby ready", _seconds(numbers.rebalance_to_standby_ready_s))
    summary.add_row("instance 2's trainer waiting warm at its gate", _seconds(numbers.gate_wait_s))
    summary.add_row("instance 2 as standby (ledger)", _seconds(numbers.standby_seconds))
    summary.add_row("final validation accuracy", str(final_accuracy(result.metrics)))
    summary.add_row("artifacts", "\n".join(result.artifacts))
    summary.add_row("group desired capacity", str(result.desired_capacity))
    summary.add_row("estimated cost", cost_line(result.ledger))
    console.print(summary)
    console.print(lives_table([("job", result.ledger)]))
    return numbers


def _seconds(value: float | None) -> str:
    return "not seen" if value is None else f"{value:.2f}s"


def write_figures(result: RebalanceResult, numbers: Figures, results: list[Check]) -> Path:
    """figures.json in the demo's folder: the numbers, and whether every check passed (so a figure from a
    failed run is never cited)."""
    path = result.workdir / FIGURES_FILE
    body = {
        **asdict(numbers),
        "total_steps": result.total_steps,
        "job_id": result.job_id,
        "checks_passed": all(c.passed for c in results),
    }
    path.write_text(json.dumps(body, indent=2) + "\n")
    return path


def plot_timeline(result: RebalanceResult, path: Path) -> Path:
    """Each trainer's steps over time; the recommendation and the take-over as lines across."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = result.started
    figure, axes = plt.subplots(figsize=(9, 4))
    for name, colour in ((HOLDER, "tab:blue"), (STANDBY, "tab:green")):
        mine = result.trained(name)
        axes.plot(
            [s.time - t0 for s in mine], [s.step for s in mine], ".", color=colour, label=f"{name} trains"
        )
    if result.rebalance_at:
        axes.axvline(
            result.rebalance_at - t0, color="tab:orange", linestyle="--", label="rebalance recommendation"
        )
    taken = result.find(STANDBY, LEASE_TAKEN_OVER)
    if taken is not None:
        axes.axvline(taken.time - t0, color="tab:red", linestyle=":", label="lease taken over")
    numbers = figures(result)
    axes.set_xlabel("seconds since the demo started")
    axes.set_ylabel("training step")
    axes.set_title(
        f"trainstack rebalance demo: steps lost = {numbers.steps_lost}, "
        f"hand-over gap {_seconds(numbers.handover_gap_s)}"
    )
    axes.legend(loc="lower right")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def report(result: RebalanceResult, console: Console) -> list[Check]:
    """Print the timeline and the figures, write figures.json and the PNG; the checks, for the caller."""
    console.rule("timeline")
    numbers = print_timeline(result, console)
    results = checks(result)
    png = plot_timeline(result, result.workdir / "timeline.png")
    console.print(f"timeline plot: {png}")
    console.print(f"figures: {write_figures(result, numbers, results)}")
    return results

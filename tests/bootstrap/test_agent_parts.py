"""Pure parts of the agent: ledger counting, stall watchdog, trainer command (scratch: test_scratch.py)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from bootstrap.imds import InstanceIdentity
from bootstrap.ledger import JobLedger
from bootstrap.pricing import GP3_USD_PER_GB_MONTH, ON_DEMAND_FALLBACK_USD_PER_HOUR, CostMeter
from bootstrap.trainer import TrainerPaths, TrainerProcess, default_trainer_command
from bootstrap.watchdog import StallWatchdog
from trainstack_job.contract import LifeOutcome

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
SPOT = InstanceIdentity("i-1", "g6.xlarge", "us-east-1a", "us-east-1", "spot")
OTHER = InstanceIdentity("i-2", "g5.xlarge", "us-east-1b", "us-east-1", "spot")


def test_cost_accumulates_across_lives_at_each_lifes_price() -> None:
    ledger = JobLedger()
    ledger.begin_life(SPOT, 0.50, T0)
    ledger.end_life(LifeOutcome.PREEMPTED, T0 + timedelta(hours=2))
    ledger = JobLedger(ledger.data)
    ledger.begin_life(OTHER, 1.00, T0 + timedelta(hours=3))
    assert ledger.update_cost(T0 + timedelta(hours=3, minutes=30)) == 1.5
    assert ledger.interruptions == 1


def test_an_agent_that_died_mid_life_counts_as_a_failure_on_restart() -> None:
    ledger = JobLedger()
    ledger.begin_life(SPOT, 0.5, T0)  # never ended: the agent process died
    restarted = JobLedger(ledger.data)
    restarted.begin_life(SPOT, 0.5, T0 + timedelta(minutes=1))
    assert restarted.consecutive_failures == 1
    assert restarted.lives[0]["outcome"] == "failed"


def test_a_life_of_another_instance_left_running_is_closed_as_interrupted_at_its_last_heartbeat() -> None:
    ledger = JobLedger()
    ledger.begin_life(SPOT, 0.60, T0)
    ledger.update_cost(T0 + timedelta(minutes=30))  # last heartbeat, then the instance vanished
    replacement = JobLedger(ledger.data)
    replacement.begin_life(OTHER, 1.00, T0 + timedelta(hours=2))
    dead = replacement.lives[0]
    assert dead["outcome"] == "interrupted" and dead["closed_by"] == "i-2"
    assert dead["ended_at"] == dead["heartbeat_at"]
    assert dead["cost_usd"] == pytest.approx(0.30), "billed up to the last heartbeat, not forever"
    assert (replacement.interruptions, replacement.consecutive_failures) == (1, 0)


def test_a_life_closed_by_its_successor_keeps_its_own_outcome_without_counting_twice() -> None:
    draining = JobLedger()
    life_id = draining.begin_life(SPOT, 0.5, T0)
    successor = JobLedger(draining.data)
    successor.begin_life(OTHER, 0.5, T0 + timedelta(minutes=5))
    late = JobLedger(successor.data, life_id)  # the old instance finishes its drain and reports
    late.end_life(LifeOutcome.PREEMPTED, T0 + timedelta(minutes=6))
    assert late.lives[0]["outcome"] == "preempted"
    assert late.interruptions == 1


def test_failures_count_in_a_row_and_a_good_life_resets_them() -> None:
    ledger = JobLedger()
    for _ in range(2):
        ledger.begin_life(SPOT, None, T0)
        ledger.end_life(LifeOutcome.FAILED, T0)
    assert ledger.consecutive_failures == 2
    ledger.begin_life(SPOT, None, T0)
    ledger.end_life(LifeOutcome.PREEMPTED, T0)
    assert ledger.consecutive_failures == 0


ON_DEMAND = InstanceIdentity("i-3", "g6.xlarge", "us-east-1a", "us-east-1", "on-demand")


def _meter(spot: list[tuple[datetime, float]], root_volume_gb: float = 0.0) -> CostMeter:
    """A meter whose EC2 answers from `spot` and whose Pricing API is unreachable (the built-in table)."""

    class Ec2:
        def get_paginator(self, _name: str) -> Any:
            return self

        def paginate(self, **request: Any) -> list[dict[str, Any]]:
            entries = [
                {"AvailabilityZone": request["AvailabilityZone"], "Timestamp": t, "SpotPrice": str(p)}
                for t, p in spot
            ]
            return [{"SpotPriceHistory": entries}]

    class Pricing:
        def get_products(self, **_request: Any) -> dict[str, Any]:
            raise ConnectionError("pricing unreachable")

    return CostMeter(
        ec2=Ec2(), pricing=Pricing(), region="us-east-1", root_volume_gb=root_volume_gb, bucket_usage=None
    )


def test_on_demand_life_is_priced_at_the_on_demand_price_not_the_spot_price() -> None:
    meter, ledger = _meter([(T0, 0.30)]), JobLedger()
    ledger.begin_life(ON_DEMAND, meter.quote(ON_DEMAND, T0, T0), T0)
    later = T0 + timedelta(hours=2)
    ledger.update_cost(later, meter.quote(ON_DEMAND, T0, later))
    life = ledger.lives[0]
    assert life["purchase_option"] == "on-demand" and "price_note" not in life
    assert life["price_usd_per_hour"] == ON_DEMAND_FALLBACK_USD_PER_HOUR["g6.xlarge"]
    assert life["price_source"].startswith("built-in on-demand table")
    assert life["instance_cost_usd"] == pytest.approx(2 * ON_DEMAND_FALLBACK_USD_PER_HOUR["g6.xlarge"])


def test_spot_life_is_priced_by_the_time_weighted_price_history_across_a_change() -> None:
    # 0.30/h in force before the start, 0.60/h from one hour in: 3 hours cost 0.30 + 2 × 0.60.
    meter, ledger = _meter([(T0 - timedelta(hours=5), 0.30), (T0 + timedelta(hours=1), 0.60)]), JobLedger()
    ledger.begin_life(SPOT, meter.quote(SPOT, T0, T0), T0)
    end = T0 + timedelta(hours=3)
    total = ledger.update_cost(end, meter.quote(SPOT, T0, end))
    life = ledger.lives[0]
    assert life["instance_cost_usd"] == pytest.approx(1.50)
    assert life["price_usd_per_hour"] == 0.60 and "1 price change" in life["price_source"]
    assert total == pytest.approx(1.50), "the cost cap's figure is the same sum"


def test_storage_accrues_pro_rata_beside_the_instance() -> None:
    meter, ledger = _meter([(T0, 0.0)], root_volume_gb=730), JobLedger()  # 730 GB gp3 = 0.08 $/h
    ledger.begin_life(SPOT, meter.quote(SPOT, T0, T0), T0)
    ledger.end_life(LifeOutcome.COMPLETED, T0 + timedelta(hours=10))
    life = ledger.lives[0]
    assert life["storage_cost_usd"] == pytest.approx(10 * GP3_USD_PER_GB_MONTH)
    assert ledger.total_cost_usd == pytest.approx(life["instance_cost_usd"] + life["storage_cost_usd"])


def test_an_on_demand_price_nobody_knows_falls_back_to_spot_with_a_note() -> None:
    meter = _meter([(T0, 0.30)])
    quote = meter.quote(InstanceIdentity("i-4", "x9.huge", "us-east-1a", "us-east-1", "on-demand"), T0, T0)
    assert quote.price_usd_per_hour == 0.30 and quote.price_note and "bill will be higher" in quote.price_note


def test_a_new_run_after_the_crash_guard_tripped_starts_with_a_fresh_counter() -> None:
    ledger = JobLedger({"status": "failed", "consecutive_failures": 3, "lives": []})
    ledger.begin_life(SPOT, None, T0)
    assert (ledger.status, ledger.consecutive_failures) == ("running", 0)


def test_stall_watchdog_fires_only_when_the_step_stops_advancing() -> None:
    now = [0.0]
    watchdog = StallWatchdog(60, clock=lambda: now[0])
    for step in range(5):
        now[0] += 50
        assert not watchdog.observe(step)
    now[0] += 50
    assert not watchdog.observe(4)
    now[0] += 11
    assert watchdog.observe(4)


def test_several_gpus_start_one_trainer_rank_per_gpu() -> None:
    assert default_trainer_command(0)[1:] == ["-m", "training", "train.processes=1"]
    assert default_trainer_command(1)[1:] == ["-m", "training", "train.processes=1"]
    assert default_trainer_command(4)[1:] == ["-m", "training", "train.processes=4"]


def test_the_trainer_accepts_the_command_line_the_agent_builds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from training.__main__ import main as trainer_main

    paths = TrainerPaths(scratch=tmp_path)
    argv = TrainerProcess(default_trainer_command(2), paths, {}, lambda _line: None).argv
    assert argv[1:3] == ["-m", "training"]
    # The job file is written only when the trainer starts: a config error (exit 2), not an argument error.
    assert trainer_main(argv[3:]) == 2
    assert "job.yaml" in capsys.readouterr().err


def test_trainer_overrides_follow_the_internals_contract() -> None:
    paths = TrainerPaths(Path("/s"))
    assert paths.overrides() == [
        "data.train_dir=/s/data/train",
        "data.val_dir=/s/data/val",
        "checkpoint.dir=/s/checkpoints",
        "checkpoint.uri=",  # the agent's persister owns the S3 copy
        "output.dir=/s/output",
        "output.uri=",  # the agent uploads the results
        # The signal files live in the folder the job's user owns (it deletes a served checkpoint request).
        "train.stop_file=/s/control/STOP",
        "train.checkpoint_request_file=/s/control/CHECKPOINT",
        # A standby's trainer waits warm at the gate until the agent removes it.
        "train.start_gate_file=/s/control/START_GATE",
    ]


def test_the_agents_catch_all_is_for_bugs_only_counted_in_cloudwatch_and_mailed_once(
    stack: Any, make_life: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-job faults are job outcomes; what still reaches the catch-all is a bug: one line, one count
    (`trainstack/AgentErrors`) and one e-mail. AWS unreachable is no bug: one line, no alert."""
    from botocore.exceptions import EndpointConnectionError

    from bootstrap import agent

    life = make_life()
    monkeypatch.setattr(agent, "InstanceLife", lambda config: life)
    monkeypatch.setattr(agent.AgentConfig, "load", staticmethod(lambda path: life.config))
    stack.alerts()

    def outage() -> Any:
        raise EndpointConnectionError(endpoint_url="https://s3.example.invalid")

    monkeypatch.setattr(life, "run", outage)
    assert agent.main(["--config", "unused.yaml"]) == 1
    assert stack.alerts() == [], "an outage is not a bug: nothing mailed"

    def bug() -> Any:
        raise KeyError("x" * 10_000)

    monkeypatch.setattr(life, "run", bug)
    assert agent.main(["--config", "unused.yaml"]) == 1
    alerts = stack.alerts()
    assert len(alerts) == 1 and "agent error on" in alerts[0]["Subject"], alerts
    assert "KeyError" in alerts[0]["Message"] and len(alerts[0]["Message"]) < 1200
    metrics = stack.client("cloudwatch").list_metrics(Namespace="trainstack", MetricName="AgentErrors")
    assert metrics["Metrics"], "the bug was not counted"

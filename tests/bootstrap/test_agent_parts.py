"""Pure parts of the agent: ledger counting, stall watchdog, scratch decision, trainer command."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from bootstrap.imds import InstanceIdentity
from bootstrap.ledger import JobLedger
from bootstrap.scratch import DLAMI_NVME, MOUNT_POINT, ROOT_VOLUME_DIR, plan_scratch
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


def test_on_demand_life_notes_that_its_estimate_is_a_spot_price() -> None:
    ledger = JobLedger()
    ledger.begin_life(InstanceIdentity("i-3", "g6.xlarge", "us-east-1a", "us-east-1", "on-demand"), 0.4, T0)
    assert "on-demand" in ledger.lives[0]["price_note"]


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


def test_scratch_prefers_config_then_dlami_nvme_then_raid_then_root() -> None:
    assert plan_scratch("/x", True, ["/dev/nvme1n1"], False).directory == Path("/x")
    assert plan_scratch(None, True, ["/dev/nvme1n1"], False).directory == DLAMI_NVME / "trainstack"
    two = plan_scratch(None, False, ["/dev/nvme2n1", "/dev/nvme1n1"], False)
    assert (two.directory, two.devices, two.raid) == (MOUNT_POINT, ("/dev/nvme1n1", "/dev/nvme2n1"), True)
    one = plan_scratch(None, False, ["/dev/nvme1n1"], False)
    assert one.devices == ("/dev/nvme1n1",) and not one.raid
    assert plan_scratch(None, False, [], True).devices == ()
    assert plan_scratch(None, False, [], False).directory == ROOT_VOLUME_DIR


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
        "train.stop_file=/s/STOP",
        "train.checkpoint_request_file=/s/CHECKPOINT",
    ]

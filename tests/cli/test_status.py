"""`trainstack status`: group, instances, progress, checkpoint age, interruptions and cost, human and JSON."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from trainstack.state import JobState
from trainstack.status import estimate_cost
from trainstack_job import Job
from trainstack_job.contract import JobEnv
from trainstack_job.records import Ledger, Progress

from .conftest import BUCKET, Deployed

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


def _iso(moment: datetime) -> str:
    return moment.isoformat()


def _running_job(now: datetime) -> dict[str, dict]:
    ledger = {
        "status": "running",
        "lives": [
            {
                "instance_id": "i-old",
                "instance_type": "g5.xlarge",
                "az": "us-east-1b",
                "lifecycle": "spot",
                "started_at": _iso(now - timedelta(hours=3)),
                "ended_at": _iso(now - timedelta(hours=1)),
                "price_usd_per_hour": 0.50,
                "cost_usd": 1.00,
                "outcome": "preempted",
            },
            {
                "instance_id": "i-new",
                "instance_type": "g6.xlarge",
                "az": "us-east-1a",
                "lifecycle": "spot",
                "started_at": _iso(now - timedelta(hours=1)),
                "ended_at": None,
                "price_usd_per_hour": 0.36,
                "cost_usd": 0.30,
                "outcome": "running",
            },
        ],
        "interruptions": 1,
        "consecutive_failures": 0,
        "total_cost_usd": 1.30,
        "updated_at": _iso(now - timedelta(minutes=10)),
    }
    progress = {
        "epoch": 3,
        "epochs": 10,
        "step": 1200,
        "total_steps": 4000,
        "loss": 1.2,
        "samples_per_s": 812.5,
        "data_wait_fraction": 0.04,
        "eta_s": 7200 + 60,
        "updated_at": _iso(now - timedelta(seconds=60)),
        "instance_id": "i-new",
        "instance_type": "g6.xlarge",
        "az": "us-east-1a",
    }
    checkpoint = {
        "step": 1000,
        "epoch": 2,
        "dir": "step-1000",
        "written_at": _iso(now - timedelta(minutes=5)),
    }
    return {"ledger": ledger, "progress": progress, "checkpoint": checkpoint}


def _state(job: dict[str, dict], checkpoint: dict | None = None) -> JobState:
    """The job as `trainstack status` reads it from the bucket."""
    return JobState(Ledger.from_json(job["ledger"]), Progress.from_json(job["progress"]), checkpoint, None)


def test_cost_so_far_counts_running_lives_since_the_ledger_was_written_and_estimates_the_rest():
    job = _running_job(NOW)
    cost = estimate_cost(_state(job, job["checkpoint"]), NOW)
    assert cost.rate_usd_per_hour == pytest.approx(0.36)
    # 1.30 in the ledger, plus 10 minutes of the running life since.
    assert cost.so_far_usd == pytest.approx(1.30 + 0.36 / 6)
    # ETA was 2h01m one minute ago: two hours left at the running price.
    assert cost.remaining_s == pytest.approx(7200)
    assert cost.to_finish_usd == pytest.approx(0.72)
    assert cost.estimate_total_usd == pytest.approx(1.30 + 0.06 + 0.72)


def test_projection_prices_the_remaining_hours_at_the_instance_plus_storage_price():
    job = _running_job(NOW)
    job["ledger"]["lives"][-1].update(
        purchase_option="on-demand",
        price_source="AWS Pricing API, on-demand us-east-1",
        storage_usd_per_hour=0.04,
        instance_cost_usd=0.28,
        storage_cost_usd=0.02,
    )
    cost = estimate_cost(_state(job, job["checkpoint"]), NOW)
    assert cost.rate_usd_per_hour == pytest.approx(0.40)
    assert cost.so_far_usd == pytest.approx(1.30 + 0.40 / 6)
    # Two hours left (the trainer's remaining steps at its recent speed) at 0.40/h.
    assert cost.to_finish_usd == pytest.approx(0.80)
    assert cost.estimate_total_usd == pytest.approx(1.30 + 0.40 / 6 + 0.80)


def test_completed_job_has_nothing_left_to_pay():
    job = _running_job(NOW)
    job["ledger"].update(status="completed", total_cost_usd=2.0)
    job["ledger"]["lives"][-1].update(outcome="completed", ended_at=_iso(NOW))
    cost = estimate_cost(_state(job), NOW)
    assert cost.remaining_s == 0
    assert cost.estimate_total_usd == pytest.approx(2.0)


def test_an_unknown_price_leaves_the_estimate_unknown_rather_than_free():
    job = _running_job(NOW)
    job["ledger"]["lives"][-1]["price_usd_per_hour"] = None
    cost = estimate_cost(_state(job), NOW)
    assert cost.rate_usd_per_hour is None
    assert cost.to_finish_usd is None
    assert cost.so_far_usd == pytest.approx(1.30)


def test_status_json_reports_group_instances_progress_checkpoint_and_cost(deployed: Deployed):
    instance = deployed.launch_instance(spot=True)
    now = datetime.now(timezone.utc)
    job = _running_job(now)
    deployed.put_state("ledger.json", job["ledger"])
    deployed.put_state("progress.json", job["progress"])
    deployed.s3().put_object(Bucket=BUCKET, Key="checkpoints/latest.json", Body=json.dumps(job["checkpoint"]))

    result = deployed.run("status", "--json")

    assert result.code == 0, result.err
    report = result.json()
    assert report["group"]["desired"] == 1
    assert report["group"]["in_service"] == 1
    assert report["group"]["instances"] == [
        {
            "instance_id": instance,
            "instance_type": "g6.xlarge",
            "az": "us-east-1a",
            "lifecycle": "spot",
            "state": "InService",
            "health": "Healthy",
        }
    ]
    assert report["status"] == "running"
    assert report["progress"]["step"] == 1200
    assert report["progress"]["remaining_s"] == pytest.approx(7200, abs=30)
    assert report["checkpoint"]["step"] == 1000
    assert report["checkpoint"]["age_s"] == pytest.approx(300, abs=30)
    assert report["interruptions"] == 1
    assert report["cost"]["so_far_usd"] == pytest.approx(1.36, abs=0.01)
    assert report["cost"]["to_finish_usd"] == pytest.approx(0.72, abs=0.01)
    assert report["cost"]["estimate_total_usd"] == pytest.approx(1.36 + 0.72, abs=0.01)
    assert report["cost"]["purchase_option"] == "spot"
    assert report["stop_requested"] is False


def test_status_json_gives_the_progress_age_of_a_users_job(deployed: Deployed, tmp_path: Path):
    # What trainstack_job writes (a user's script calling report_progress), uploaded as the agent does.
    job = Job.from_env(environ={JobEnv.PROGRESS_FILE.value: str(tmp_path / "progress.json")})
    job.report_progress(step=40, total_steps=100, loss=0.5)
    progress = json.loads((tmp_path / "progress.json").read_text())
    deployed.put_state("ledger.json", _running_job(datetime.now(timezone.utc))["ledger"])
    deployed.put_state("progress.json", progress | {"instance_id": "i-new"})

    report = deployed.run("status", "--json").json()

    assert report["progress"]["step"] == 40
    assert report["progress"]["age_s"] == pytest.approx(0, abs=30)
    # A file from a trainstack_job that still wrote `written_at` keeps its age.
    older = {"step": 40, "written_at": _iso(datetime.now(timezone.utc) - timedelta(minutes=2))}
    deployed.put_state("progress.json", older)
    assert deployed.run("status", "--json").json()["progress"]["age_s"] == pytest.approx(120, abs=30)


def test_status_table_shows_each_instance_with_its_lifecycle_and_the_eta(deployed: Deployed):
    spot = deployed.launch_instance(spot=True)
    on_demand = deployed.launch_instance(spot=False, az_index=1)
    job = _running_job(datetime.now(timezone.utc))
    deployed.put_state("ledger.json", job["ledger"])
    deployed.put_state("progress.json", job["progress"])

    result = deployed.run("status")

    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert any(spot in line and "spot" in line and "us-east-1a" in line for line in lines)
    assert any(on_demand in line and "on-demand" in line and "us-east-1b" in line for line in lines)
    assert "training running" in result.out
    assert "in service 2" in result.out
    assert "epoch 3/10, step 1200/4000" in result.out
    assert "ETA 1h 59m" in result.out or "ETA 2h 00m" in result.out
    assert "interruptions: 1" in result.out
    assert "latest checkpoint: none yet" in result.out


def test_status_before_training_starts_says_what_is_missing(deployed: Deployed):
    result = deployed.run("status")
    assert result.code == 0, result.err
    assert "training not started" in result.out
    assert "progress: none yet" in result.out
    assert "latest checkpoint: none yet" in result.out


def test_status_tells_an_instance_waiting_for_its_dataset_what_to_push(deployed: Deployed):
    deployed.put_state("ledger.json", {"status": "waiting_for_data", "lives": []})
    result = deployed.run("status")
    assert result.code == 0, result.err
    assert "training waiting_for_data" in result.out
    assert "next: the instance waits for the dataset: trainstack data push ./dataset" in result.out
    as_json = deployed.run("status", "--json").json()
    assert as_json["next_step"].endswith("trainstack data push ./dataset")


def test_status_with_a_destroyed_group_is_one_line_naming_it(deployed: Deployed):
    deployed.autoscaling().delete_auto_scaling_group(
        AutoScalingGroupName="trainstack-test-gpu", ForceDelete=True
    )
    result = deployed.run("status")
    assert result.code == 1
    assert result.err.count("\n") == 1
    assert "Auto Scaling group 'trainstack-test-gpu' not found" in result.err
    assert "pulumi up" in result.err

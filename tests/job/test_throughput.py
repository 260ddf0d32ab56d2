"""Throughput per instance type (trainstack_job/throughput.py): the shipped estimate, what lives measured per
job and per model family, the weights a pool's types get from them, the types a job drops for goodput per
dollar, and the stack's table in S3 (against the moto server)."""

from __future__ import annotations

import json
from typing import Any

import boto3
import pytest

from tests.conftest import MotoServer
from trainstack_job.records import Life
from trainstack_job.throughput import (
    ThroughputStore,
    ThroughputTable,
    capacity_weights,
    dropped_types,
    expected_throughput,
    shipped_throughput,
)

TYPES = ["g6.xlarge", "g5.xlarge", "g6e.xlarge", "g4dn.xlarge"]
JOB = "resnet-1a2b3c4d"


def life(
    instance_type: str,
    samples_per_second: float | None,
    hours: float = 1.0,
    life_id: str | None = None,
    family: str | None = "resnet50",
) -> Life:
    minutes = round(hours * 60)
    return Life(
        life_id=life_id or f"i-{instance_type}@{minutes}",
        instance_id=f"i-{instance_type}",
        started_at="2030-01-01T00:00:00Z",
        ended_at=f"2030-01-01T{minutes // 60:02d}:{minutes % 60:02d}:00Z",
        outcome="preempted",
        instance_type=instance_type,
        samples_per_second=samples_per_second,
        precision="bf16",
        model_family=family,
    )


def test_the_shipped_estimate_is_cited_relative_to_a_t4_and_counts_every_gpu() -> None:
    t4, l4, big = (shipped_throughput(t) for t in ("g4dn.xlarge", "g6.xlarge", "g6.12xlarge"))
    assert t4 is not None and l4 is not None and big is not None
    assert t4.samples_per_second == 1.0
    assert l4.samples_per_second == pytest.approx(121 / 65, abs=1e-3)
    assert big.samples_per_second == pytest.approx(4 * 121 / 65, abs=1e-3)
    assert l4.source.startswith("shipped estimate: 1x L4, NVIDIA L4 datasheet (2023)")
    assert shipped_throughput("m5.xlarge") is None and shipped_throughput("nonsense") is None


def test_a_jobs_own_lives_come_before_its_familys_and_both_before_the_estimate() -> None:
    table = ThroughputTable()
    table.merge(JOB, [life("g6.xlarge", 300.0), life("g6.xlarge", 500.0, hours=3, life_id="second")])
    table.merge("other-1a2b3c4d", [life("g6.xlarge", 100.0, life_id="other")])
    own = expected_throughput("g6.xlarge", family="resnet50", job_id=JOB, table=table)
    assert own is not None and own.samples_per_second == 450.0, "hours-weighted: (300 + 3 x 500) / 4"
    assert own.source == f"measured: 2 lives of job {JOB}"
    new_job = expected_throughput("g6.xlarge", family="resnet50", job_id="new-1a2b3c4d", table=table)
    assert new_job is not None and new_job.samples_per_second == pytest.approx((300 + 1500 + 100) / 5)
    assert new_job.source == "measured: 3 lives of model family resnet50"
    nothing = expected_throughput("g6.xlarge", family="vit", job_id="new-1a2b3c4d", table=table)
    assert nothing == shipped_throughput("g6.xlarge")


def test_a_type_the_job_never_ran_on_is_scaled_from_the_type_it_did() -> None:
    table = ThroughputTable()
    table.merge(JOB, [life("g4dn.xlarge", 100.0)])
    l40s = expected_throughput("g6e.xlarge", job_id=JOB, table=table)
    assert l40s is not None and l40s.samples_per_second == pytest.approx(100 * 362 / 65, abs=1e-3)
    assert l40s.source.startswith(f"estimate: job {JOB} measured on g4dn.xlarge, scaled by the shipped")


def test_weights_come_from_the_recorded_lives_relative_to_the_slowest_type() -> None:
    assert capacity_weights(TYPES) == {"g6.xlarge": 2, "g5.xlarge": 2, "g6e.xlarge": 6, "g4dn.xlarge": 1}
    table = ThroughputTable()
    # Measured: this model trains at 3x a T4's speed on an L4 (the datasheet says 1.9x), and 4x on an A10G.
    table.merge(JOB, [life("g4dn.xlarge", 100.0), life("g6.xlarge", 300.0), life("g5.xlarge", 400.0)])
    weights = capacity_weights(TYPES, job_id=JOB, table=table)
    assert weights == {"g4dn.xlarge": 1, "g6.xlarge": 3, "g5.xlarge": 4, "g6e.xlarge": 6}


def test_a_pool_with_a_type_nothing_is_known_of_stays_unweighted() -> None:
    assert capacity_weights(["g6.xlarge", "m7i.large"]) == {"g6.xlarge": 1, "m7i.large": 1}


def test_a_type_whose_progress_per_dollar_loses_by_the_margin_is_dropped_for_the_job() -> None:
    table = ThroughputTable()
    table.merge(JOB, [life("g4dn.xlarge", 100.0), life("g6.xlarge", 300.0)])
    prices = {"g4dn.xlarge": 0.22, "g6.xlarge": 0.38, "g5.xlarge": None}
    # Per dollar: the T4 trains 100 x 3600 / 0.22 = 1.64M samples, the L4 2.84M: the T4 is 42% behind.
    dropped = dropped_types(["g4dn.xlarge", "g6.xlarge", "g5.xlarge"], prices, job_id=JOB, table=table)
    assert list(dropped) == ["g4dn.xlarge"], "a type without a price is kept: nothing says it loses"
    assert dropped["g4dn.xlarge"] == (
        "g4dn.xlarge: 1,636,364 samples per dollar, 42% below g6.xlarge's 2,842,105 "
        "(more than the 25% margin)"
    )
    # Within the margin, both stay; the best type is never dropped, whatever the margin.
    assert dropped_types(["g4dn.xlarge", "g6.xlarge"], prices, job_id=JOB, table=table, margin=0.5) == {}
    assert "g6.xlarge" not in dropped_types(["g4dn.xlarge", "g6.xlarge"], prices, table=table, margin=0)
    assert dropped_types(["g4dn.xlarge"], {}, table=table) == {}


def test_the_table_round_trips_and_counts_a_life_merged_twice_once() -> None:
    table = ThroughputTable()
    lives = [life("g6.xlarge", 300.0), life("g6.xlarge", None, life_id="unmeasured")]
    assert table.merge(JOB, lives) == 1
    assert table.merge(JOB, lives) == 0
    running = Life(life_id="r", instance_id="i", started_at="2030-01-01T00:00:00Z", samples_per_second=9.0)
    assert table.merge(JOB, [running]) == 0, "a running life has not finished measuring"
    again = ThroughputTable.from_json(json.loads(json.dumps(table.to_json())))
    assert again == table
    assert again.jobs[JOB]["g6.xlarge"].lives == 1 and again.families["resnet50"]["g6.xlarge"].lives == 1


@pytest.mark.parametrize(
    "raw",
    [None, [], "text", {"jobs": []}, {"jobs": {JOB: {"g6.xlarge": {"samples_per_second": "fast"}}}}],
)
def test_a_table_that_does_not_read_is_an_empty_one(raw: Any) -> None:
    assert ThroughputTable.from_json(raw) == ThroughputTable()


def test_the_stacks_table_in_s3_merges_two_lives_ends_without_losing_either(aws: MotoServer) -> None:
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket="trainstack-throughput")
    store = ThroughputStore(s3, "trainstack-throughput", "state/throughput.json")
    assert store.merge(JOB, [life("g6.xlarge", 300.0)]) == 1
    assert store.merge("other-1a2b3c4d", [life("g5.xlarge", 200.0, life_id="other")]) == 1
    table = store.load()
    assert set(table.jobs) == {JOB, "other-1a2b3c4d"}
    assert set(table.families["resnet50"]) == {"g6.xlarge", "g5.xlarge"}

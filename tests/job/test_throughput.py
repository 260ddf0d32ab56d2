"""Throughput per instance type (trainstack_job/throughput.py): the shipped estimate, what lives measured per
job and per model family, the weights a pool's types get from them, the types a job drops for goodput per
dollar, and the stack's table in S3 (against the moto server)."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace
from typing import Any

import boto3
import pytest

from tests.conftest import MotoServer
from trainstack_job import throughput
from trainstack_job.records import Life
from trainstack_job.throughput import (
    ThroughputStore,
    ThroughputTable,
    capacity_units,
    capacity_weights,
    expected_throughput,
    life_hours,
    pool_capacity_weights,
    pool_throughput,
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
    precision: str | None = "bf16",
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
        precision=precision,
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


# -- which figure a type gets, and where it comes from ---------------------------------------------------


def test_every_figure_is_for_the_type_asked_about_whatever_its_source() -> None:
    table = ThroughputTable()
    table.merge(JOB, [life("g4dn.xlarge", 100.0)])
    shipped = shipped_throughput("g6.xlarge")
    measured = expected_throughput("g4dn.xlarge", job_id=JOB, table=table)
    scaled = expected_throughput("g6e.xlarge", job_id=JOB, table=table)
    assert shipped is not None and measured is not None and scaled is not None
    assert (shipped.instance_type, measured.instance_type, scaled.instance_type) == (
        "g6.xlarge",
        "g4dn.xlarge",
        "g6e.xlarge",
    )


def test_one_measured_life_is_said_as_one_life() -> None:
    table = ThroughputTable()
    table.merge(JOB, [life("g6.xlarge", 300.0)])
    one = expected_throughput("g6.xlarge", job_id=JOB, table=table)
    assert one is not None and one.source == f"measured: 1 life of job {JOB}"


def test_the_estimate_scales_by_the_two_types_datasheet_ratio_to_a_thousandth() -> None:
    table = ThroughputTable()
    table.merge(JOB, [life("g6.xlarge", 242.0), life("g5.xlarge", 10.0, life_id="other", family="vit")])
    # An L40S has 362/121 of an L4's datasheet speed: 242 samples/s on the L4 make 724 on the L40S.
    l40s = expected_throughput("g6e.xlarge", family="resnet50", job_id="new-1a2b3c4d", table=table)
    assert l40s is not None and l40s.samples_per_second == 724.0
    table = ThroughputTable()
    table.merge(JOB, [life("g6.xlarge", 100.0)])
    # 100 x 362 / 121 = 299.1735...: given to a thousandth, as the table keeps its measured figures.
    scaled = expected_throughput("g6e.xlarge", job_id=JOB, table=table)
    assert scaled is not None and scaled.samples_per_second == 299.174


def test_the_estimate_scales_from_the_type_measured_longest() -> None:
    table = ThroughputTable()
    table.merge(
        JOB, [life("g5.xlarge", 400.0, hours=1), life("g6.xlarge", 300.0, hours=3), life("m7i.large", 5.0, 9)]
    )
    l40s = expected_throughput("g6e.xlarge", job_id=JOB, table=table)
    assert l40s is not None and l40s.samples_per_second == pytest.approx(300 * 362 / 121, abs=1e-3)
    assert l40s.source.startswith(f"estimate: job {JOB} measured on g6.xlarge, scaled by the shipped")


def test_a_type_the_datasheets_do_not_know_is_neither_scaled_nor_scaled_from() -> None:
    table = ThroughputTable()
    table.merge(JOB, [life("m7i.large", 50.0)])
    # Nothing to scale from: the job's only measurement is of a type without a datasheet figure.
    assert expected_throughput("g6.xlarge", job_id=JOB, table=table) == shipped_throughput("g6.xlarge")
    table.merge(JOB, [life("g6.xlarge", 300.0)])
    # Nothing to scale to: a type without a datasheet figure that the job never ran on stays unknown.
    assert expected_throughput("c7i.large", job_id=JOB, table=table) is None


# -- a life counted once, weighted by its hours -----------------------------------------------------------


def test_a_lifes_hours_run_from_its_start_to_its_end_and_never_below_zero() -> None:
    assert life_hours(life("g6.xlarge", 1.0, hours=1.5)) == 1.5
    assert life_hours(life("g6.xlarge", 1.0, hours=0.25)) == 0.25
    skewed = Life(
        life_id="skewed",
        instance_id="i",
        started_at="2030-01-01T01:00:00Z",
        ended_at="2030-01-01T00:00:00Z",
        instance_type="g6.xlarge",
        samples_per_second=100.0,
    )
    assert life_hours(skewed) == 0.0, "a clock that stepped back never gives a life negative hours"
    table = ThroughputTable()
    assert table.merge(JOB, [skewed]) == 1
    assert table.jobs[JOB]["g6.xlarge"].hours == pytest.approx(1 / 60), "it counts as a minute"


def test_a_short_life_weighs_by_its_own_hours() -> None:
    table = ThroughputTable()
    table.merge(JOB, [life("g6.xlarge", 100.0, hours=0.5), life("g6.xlarge", 400.0, hours=1)])
    measured = table.jobs[JOB]["g6.xlarge"]
    assert (measured.samples_per_second, measured.hours) == (300.0, 1.5), "(0.5 x 100 + 400) / 1.5"


def test_each_new_measured_life_counts_once_wherever_it_stands_in_the_list() -> None:
    table = ThroughputTable()
    first = life("g6.xlarge", 300.0, life_id="first")
    assert table.merge(JOB, [first]) == 1
    no_type = Life(life_id="no-type", instance_id="i", started_at="2030-01-01T00:00:00Z")
    lives = [
        first,  # merged before
        no_type,
        life("g6.xlarge", None, life_id="unmeasured"),
        life("g6.xlarge", 0.0, life_id="stalled"),
        life("g6.xlarge", 0.5, life_id="slow"),  # a large model: slow, still a measurement
        life("g6.xlarge", 300.0, life_id="second"),
        life("g6.xlarge", 300.0, life_id="second"),  # the same life listed twice
        life("g5.xlarge", 200.0, life_id="third"),
    ]
    assert table.merge(JOB, lives) == 3
    assert table.jobs[JOB]["g6.xlarge"].lives == 3 and table.jobs[JOB]["g5.xlarge"].lives == 1
    assert table.merged_lives == ["first", "slow", "second", "third"]


def test_each_precision_a_type_trained_in_is_listed_once_and_a_life_without_one_adds_none() -> None:
    table = ThroughputTable()
    table.merge(
        JOB,
        [
            life("g5.xlarge", 100.0, life_id="a", precision=None),
            life("g5.xlarge", 100.0, life_id="b", precision=None),
            life("g6.xlarge", 100.0, life_id="c", precision="bf16"),
            life("g6.xlarge", 100.0, life_id="d", precision="fp16"),
            life("g6.xlarge", 100.0, life_id="e", precision="bf16"),
            life("g6.xlarge", 100.0, life_id="f", precision=None),
        ],
    )
    for scope in (table.jobs[JOB], table.families["resnet50"]):
        assert scope["g5.xlarge"].precisions == []
        assert scope["g6.xlarge"].precisions == ["bf16", "fp16"]


# -- the table as written and as read ---------------------------------------------------------------------


def test_the_table_as_written_keeps_samples_per_second_to_a_thousandth_and_hours_to_a_microhour() -> None:
    table = ThroughputTable()
    table.merge(JOB, [life("g6.xlarge", 100 / 3, hours=1 / 3)])
    assert table.to_json()["jobs"][JOB]["g6.xlarge"] == {
        "samples_per_second": 33.333,
        "lives": 1,
        "hours": 0.333333,
        "precisions": ["bf16"],
    }


GOOD = {"samples_per_second": 300.0, "lives": 2, "hours": 1.5, "precisions": ["bf16"]}


@pytest.mark.parametrize(
    "entry",
    [
        {**GOOD, "samples_per_second": 0},
        {**GOOD, "samples_per_second": "fast"},
        {**GOOD, "hours": 0},
        {key: value for key, value in GOOD.items() if key != "hours"},
        {**GOOD, "lives": "2"},
        {**GOOD, "lives": True},
        "300 samples/s",
    ],
)
def test_an_entry_that_does_not_read_is_left_out_and_its_neighbours_kept(entry: Any) -> None:
    raw = {"jobs": {"old-job": ["not", "a", "table"], JOB: {"g5.xlarge": entry, "g6.xlarge": GOOD}}}
    table = ThroughputTable.from_json(raw)
    assert list(table.jobs) == [JOB] and list(table.jobs[JOB]) == ["g6.xlarge"]
    assert table.jobs[JOB]["g6.xlarge"].samples_per_second == 300.0


@pytest.mark.parametrize("precisions", ["absent", None, "bf16", {"bf16": True}])
def test_an_entry_without_a_list_of_precisions_reads_with_none(precisions: Any) -> None:
    entry = {key: value for key, value in GOOD.items() if key != "precisions"}
    if precisions != "absent":  # a table written before precisions were kept has no key at all
        entry["precisions"] = precisions
    table = ThroughputTable.from_json({"jobs": {JOB: {"g6.xlarge": entry}}})
    assert table.jobs[JOB]["g6.xlarge"].precisions == []
    assert table.jobs[JOB]["g6.xlarge"].lives == 2


# -- weights and units ------------------------------------------------------------------------------------


def test_a_new_job_is_weighted_by_its_model_familys_lives() -> None:
    table = ThroughputTable()
    table.merge("older-1a2b3c4d", [life("g4dn.xlarge", 100.0), life("g6.xlarge", 300.0)])
    weights = capacity_weights(
        ["g4dn.xlarge", "g6.xlarge"], family="resnet50", job_id="new-1a2b3c4d", table=table
    )
    assert weights == {"g4dn.xlarge": 1, "g6.xlarge": 3}, "the datasheets alone would give the L4 2"


def test_a_type_expected_to_train_at_next_to_nothing_leaves_the_pool_unweighted() -> None:
    table = ThroughputTable()
    # 0.001 samples/s on 8 H100s scales to 0.00001 on one T4: zero to a thousandth, no weight to divide by.
    table.merge(JOB, [life("p5.48xlarge", 0.001)])
    g4dn = expected_throughput("g4dn.xlarge", job_id=JOB, table=table)
    assert g4dn is not None and g4dn.samples_per_second == 0.0
    weights = capacity_weights(["p5.48xlarge", "g4dn.xlarge"], job_id=JOB, table=table)
    assert weights == {"p5.48xlarge": 1, "g4dn.xlarge": 1}


def test_n_instances_are_n_units_whether_or_not_the_pool_is_weighted() -> None:
    assert capacity_units(3) == 3
    assert capacity_units(3, {}) == 3
    assert capacity_units(3, {"g4dn.xlarge": 1, "g6e.xlarge": 6}) == 3
    with pytest.raises(
        ValueError, match=r"weights \{'g6.xlarge': 2, 'g6e.xlarge': 6\} must give the slowest"
    ):
        capacity_units(3, {"g6.xlarge": 2, "g6e.xlarge": 6})


# -- the stack's table in S3 ------------------------------------------------------------------------------


def test_the_store_files_a_life_without_a_reported_model_under_the_family_it_is_given(
    aws: MotoServer,
) -> None:
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket="trainstack-throughput")
    store = ThroughputStore(s3, "trainstack-throughput", "state/throughput.json")
    assert store.merge(JOB, [life("g6.xlarge", 300.0, family=None)], family="vit") == 1
    assert list(store.load().families) == ["vit"]


class _AlwaysOvertaken:
    """An S3 client whose every write another writer overtakes: it writes the table just before."""

    def __init__(self, s3: Any) -> None:
        self._s3 = s3
        self.rival_writes = 0

    def get_object(self, **kwargs: Any) -> Any:
        return self._s3.get_object(**kwargs)

    def put_object(self, **kwargs: Any) -> Any:
        self.rival_writes += 1
        rival = {"jobs": {}, "merged_lives": [f"rival-{self.rival_writes}"]}
        self._s3.put_object(Bucket=kwargs["Bucket"], Key=kwargs["Key"], Body=json.dumps(rival).encode())
        return self._s3.put_object(**kwargs)


def test_a_merge_always_overtaken_backs_off_briefly_then_says_so_and_overwrites_nothing(
    aws: MotoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket="trainstack-throughput")
    racing = _AlwaysOvertaken(s3)
    waits: list[float] = []
    monkeypatch.setattr(throughput, "time", SimpleNamespace(sleep=waits.append))
    store = ThroughputStore(racing, "trainstack-throughput", "state/throughput.json")
    with pytest.raises(
        RuntimeError,
        match=r"^s3://trainstack-throughput/state/throughput\.json: 10 concurrent writers in a row; "
        r"the next life end merges$",
    ):
        store.merge(JOB, [life("g6.xlarge", 300.0)])
    assert racing.rival_writes == 10, "ten tries, each read again after the write it lost to"
    assert ThroughputStore(s3, "trainstack-throughput", "state/throughput.json").load().merged_lives == [
        "rival-10"
    ], "the last rival's table stands"
    # The agent waits at a life's end: the first retry comes soon, each later one a little later, all in
    # a few seconds.
    assert 0 < waits[0] <= 0.05
    assert all(later > earlier for earlier, later in itertools.pairwise(waits))
    assert sum(waits) < 3


@pytest.mark.parametrize(
    ("started_at", "ended_at"),
    [("2030-01-01T00:00:00", "2030-01-01T01:00:00Z"), ("yesterday", "2030-01-01T01:00:00Z")],
)
def test_a_life_whose_times_do_not_read_is_left_out_and_never_stops_the_others(
    started_at: str, ended_at: str
) -> None:
    unreadable = Life(
        life_id="unreadable",
        instance_id="i",
        started_at=started_at,
        ended_at=ended_at,
        instance_type="g6.xlarge",
        samples_per_second=100.0,
    )
    assert life_hours(unreadable) is None
    table = ThroughputTable()
    assert table.merge(JOB, [unreadable, life("g6.xlarge", 300.0)]) == 1
    assert table.jobs[JOB]["g6.xlarge"].samples_per_second == 300.0


# -- a pool's weights from the stack's measured figures (trainstack:measuredThroughput) --------------------


def shipped(instance_type: str) -> float:
    found = shipped_throughput(instance_type)
    assert found is not None, instance_type
    return found.samples_per_second


def test_without_measured_types_a_pool_keeps_the_shipped_estimates() -> None:
    assert pool_throughput(TYPES, {}) == {t: shipped_throughput(t) for t in TYPES}
    assert pool_throughput(TYPES, {"p5.48xlarge": 900.0}) == {t: shipped_throughput(t) for t in TYPES}


def test_measured_types_train_at_their_figure_and_the_others_are_scaled_by_the_geometric_mean() -> None:
    found = pool_throughput(TYPES, {"g4dn.xlarge": 100.0, "g6.xlarge": 500.0})
    measured = found["g4dn.xlarge"], found["g6.xlarge"]
    assert [(m.samples_per_second if m else None) for m in measured] == [100.0, 500.0]
    assert all(m is not None and m.source == "measured: trainstack:measuredThroughput" for m in measured)
    scale = ((100.0 / shipped("g4dn.xlarge")) * (500.0 / shipped("g6.xlarge"))) ** 0.5
    for instance_type in ("g5.xlarge", "g6e.xlarge"):
        estimated = found[instance_type]
        assert estimated is not None
        assert estimated.samples_per_second == pytest.approx(shipped(instance_type) * scale, rel=1e-12)
        assert estimated.source.startswith("estimated: the shipped estimate: 1x ")
        assert estimated.source.endswith(", scaled by the measured types' measured/shipped ratio")
    assert list(found) == TYPES, "in the pool's order"


def test_a_type_neither_measured_nor_estimated_has_no_throughput_and_leaves_the_pool_unweighted() -> None:
    found = pool_throughput(["g6.xlarge", "m7i.large"], {"g6.xlarge": 400.0})
    assert found["m7i.large"] is None
    assert capacity_weights(["g6.xlarge", "m7i.large"], measured={"g6.xlarge": 400.0}) == {
        "g6.xlarge": 1,
        "m7i.large": 1,
    }
    # Measured on an unknown type only: nothing to scale the known ones by.
    alone = pool_throughput(["m7i.large", "g6.xlarge"], {"m7i.large": 50.0})
    assert alone["g6.xlarge"] is None and alone["m7i.large"] is not None
    assert alone["m7i.large"].samples_per_second == 50.0


def test_measured_figures_decide_the_weights_over_the_table_and_the_estimate() -> None:
    table = ThroughputTable()
    measured = {"g4dn.xlarge": 100.0, "g6.xlarge": 500.0}
    weights = capacity_weights(TYPES, job_id=JOB, table=table, measured=measured)
    scale = ((100.0 / shipped("g4dn.xlarge")) * (500.0 / shipped("g6.xlarge"))) ** 0.5
    assert weights == {
        "g6.xlarge": 5,
        "g5.xlarge": round(shipped("g5.xlarge") * scale / 100.0),
        "g6e.xlarge": round(shipped("g6e.xlarge") * scale / 100.0),
        "g4dn.xlarge": 1,
    }
    # A mapping that names none of the pool's types is no measurement of it: the estimate decides.
    assert capacity_weights(TYPES, measured={"p5.48xlarge": 900.0}) == capacity_weights(TYPES)


def test_only_a_pool_of_one_instance_and_one_job_is_weighted() -> None:
    measured = {"g4dn.xlarge": 100.0, "g6.xlarge": 500.0}
    assert pool_capacity_weights(TYPES, max_instances=1, max_jobs=1) == capacity_weights(TYPES)
    assert pool_capacity_weights(TYPES, max_instances=1, max_jobs=1, measured=measured) == capacity_weights(
        TYPES, measured=measured
    )
    assert pool_capacity_weights(TYPES, max_instances=2, max_jobs=1) is None, "a multi-node pool"
    assert pool_capacity_weights(TYPES, max_instances=1, max_jobs=2) is None, "a pool of lanes"
    assert pool_capacity_weights(TYPES, max_instances=0, max_jobs=1) is None
    # Every type weighing 1 is no weighting at all (a unit is an instance already).
    assert pool_capacity_weights(["g6.xlarge"], max_instances=1, max_jobs=1) is None
    assert pool_capacity_weights(["g6.xlarge", "g5.xlarge"], max_instances=1, max_jobs=1) is None


def test_a_pool_measured_on_every_type_is_weighted_by_the_measurements_alone() -> None:
    both = {"g4dn.xlarge": 100.0, "g6.xlarge": 500.0}
    assert capacity_weights(["g6.xlarge", "g4dn.xlarge"], measured=both) == {"g6.xlarge": 5, "g4dn.xlarge": 1}
    found = pool_throughput(["g6.xlarge", "g5.xlarge"], {"g6.xlarge": 400.0})
    assert [(t, f.instance_type if f else None) for t, f in found.items()] == [
        ("g6.xlarge", "g6.xlarge"),
        ("g5.xlarge", "g5.xlarge"),
    ], "each figure names its own type, measured or estimated"


def test_a_pool_whose_heaviest_type_weighs_2_is_weighted_and_one_of_no_types_is_not() -> None:
    assert pool_capacity_weights(["g5.xlarge", "g4dn.xlarge"], max_instances=1, max_jobs=1) == {
        "g5.xlarge": 2,
        "g4dn.xlarge": 1,
    }
    assert pool_capacity_weights([], max_instances=1, max_jobs=1) is None

"""Sweeps in-process (trainstack/sweep.py): `--sweep KEY=V1,V2,...` axes read once each, every malformed one
named; their grid in order, each point one job named after its values; each point applied to the trainer's
config or a user's environment; and the ranking `trainstack jobs --sweep NAME` shows."""

from __future__ import annotations

import math
from typing import Any

import pytest

from trainstack.sweep import (
    MAX_POINTS,
    SweepAxis,
    SweepError,
    SweepPoint,
    grid,
    metric_value,
    parse_axes,
    rank,
    trainer_point,
    user_job_point,
)
from trainstack_job.jobfile import JobSpec


def _problems(specs: list[str]) -> list[str]:
    with pytest.raises(SweepError) as raised:
        parse_axes(specs)
    assert str(raised.value) == "; ".join(raised.value.problems), "the error is its problems, one line each"
    return raised.value.problems


def _spec(**env: str) -> JobSpec:
    return JobSpec.from_mapping({"name": "tiny", "command": ["python", "train.py"], "env": env}, "job.yaml")


def test_each_value_is_read_as_yaml_and_kept_as_written() -> None:
    """A value is typed as the config file's would be, and kept as the user wrote it, spaces trimmed."""
    (lr, name) = parse_axes([" train.lr = 0.10, 3 ,true", "data.name=a"])
    assert lr == SweepAxis("train.lr", (0.1, 3, True), ("0.10", "3", "true"))
    assert (name.key, name.values, name.texts) == ("data.name", ("a",), ("a",))


def test_every_malformed_sweep_is_named_in_one_error_one_line_each() -> None:
    """All malformed `--sweep` arguments are found in one pass, each named with its fix; good ones pass."""
    specs = ["train.lr", "=1,2", "train.epochs=1,,2", "train.lr=0.1", "train.lr=0.2", "a.b=1,1", "c"]
    problems = _problems(specs)
    assert len(problems) == 6
    for problem, spec in zip(problems[:3], specs[:3], strict=True):
        assert problem.startswith(f"--sweep {spec!r}: expected KEY=V1,V2,...")
    assert problems[3] == "--sweep train.lr: given twice; put all its values in one --sweep train.lr=V1,V2"
    assert problems[4].startswith("--sweep a.b: a value repeats (1,1)")
    assert problems[5].startswith("--sweep 'c': expected KEY=V1,V2,...")


def test_a_value_may_hold_an_equals_sign() -> None:
    """Only the first `=` ends the key: a value such as `--lr=1` is kept whole."""
    (axis,) = parse_axes(["ARGS=--lr=1,--lr=2"])
    assert (axis.key, axis.texts, axis.values) == ("ARGS", ("--lr=1", "--lr=2"), ("--lr=1", "--lr=2"))


def test_a_key_first_given_malformed_may_still_be_given_once_well() -> None:
    """Only a key read well counts as given: its malformed first try does not make the next a repeat."""
    with pytest.raises(SweepError) as raised:
        parse_axes(["train.lr=0.1,0.1", "train.lr=0.1,0.2"])
    assert raised.value.problems == ["--sweep train.lr: a value repeats (0.1,0.1); give each value once"]
    assert [axis.key for axis in parse_axes(["train.lr=0.1", "train.epochs=1"])] == [
        "train.lr",
        "train.epochs",
    ]


def test_a_grid_of_at_most_max_points_is_accepted_and_a_larger_one_refused() -> None:
    """At most MAX_POINTS jobs at once: that many points pass, one more is one line saying how many."""
    values = ",".join(str(i) for i in range(MAX_POINTS // 2))
    assert len(grid(parse_axes([f"train.epochs={values}", "train.lr=0.1,0.2"]))) == MAX_POINTS
    assert len(grid(parse_axes([f"train.epochs={values}"]))) == MAX_POINTS // 2
    problems = _problems([f"train.epochs={values}", "train.lr=0.1,0.2,0.3"])
    size = MAX_POINTS // 2 * 3
    assert problems == [
        f"--sweep: the grid has {size} points (at most {MAX_POINTS} jobs at once); sweep fewer values"
    ]
    assert len(_problems([f"train.epochs={','.join(str(i) for i in range(MAX_POINTS + 1))}"])) == 1


@pytest.mark.parametrize(
    ("key", "short"),
    [
        ("train.lr", "lr"),
        ("LR", "lr"),
        ("train.batch_size", "bs"),
        ("model.encoder.hidden_size", "hs"),
        ("model.num-layers", "nl"),
        ("optim.weight__decay_", "wd"),
    ],
)
def test_a_key_is_named_in_a_job_by_its_last_part_or_its_initials(key: str, short: str) -> None:
    """A point's label names each key by its last part, lowercased, or its words' initials."""
    assert SweepAxis(key, (1,), ("1",)).short == short


def test_the_grid_varies_the_first_axis_slowest_and_labels_each_point_by_its_values() -> None:
    """Every combination once, in grid order; each label names its values, made safe for a job's name."""
    points = grid(parse_axes(["train.lr=0.1,1E-3", "optim.kind=Adam W,(sgd)"]))
    assert [p.label for p in points] == [
        "lr0.1-kindadam-w",
        "lr0.1-kindsgd",
        "lr1e-3-kindadam-w",
        "lr1e-3-kindsgd",
    ]
    assert [p.values for p in points] == [
        {"train.lr": 0.1, "optim.kind": "Adam W"},
        {"train.lr": 0.1, "optim.kind": "(sgd)"},
        {"train.lr": "1E-3", "optim.kind": "Adam W"},
        {"train.lr": "1E-3", "optim.kind": "(sgd)"},
    ]
    assert points[3].texts == {"train.lr": "1E-3", "optim.kind": "(sgd)"}
    record = points[0].to_json()
    record["train.lr"] = 9
    assert points[0].values["train.lr"] == 0.1, "the record's copy, not the point's own values"


def test_a_trainer_point_sets_its_keys_as_written_in_a_copy_of_the_config() -> None:
    """The built-in trainer's point: the config with the point's dotted keys set, the original untouched."""
    config: dict[str, Any] = {"train": {"lr": 0.1, "epochs": 3}, "model": {"name": "resnet"}}
    (point,) = grid(parse_axes(["train.lr=0.03"]))
    assert trainer_point(config, point) == {"train": {"lr": 0.03, "epochs": 3}, "model": {"name": "resnet"}}
    assert config["train"]["lr"] == 0.1


def test_a_trainer_point_the_config_cannot_take_is_a_sweep_error_naming_the_point() -> None:
    """A point whose key is no dotted key (not one parse_axes makes) is the sweep's one-line error."""
    point = SweepPoint({"": 1}, {"": "1"}, "odd")
    with pytest.raises(SweepError) as raised:
        trainer_point({"train": {"lr": 0.1}}, point)
    (problem,) = raised.value.problems
    assert problem.startswith("--sweep odd: override '=1': expected dotted.key=value")


def test_a_user_jobs_point_is_its_environment_over_the_jobs_own() -> None:
    """A user's job is swept through its environment: the point's values as written, over the file's."""
    spec = _spec(EPOCHS="3", LR="1")
    (point,) = grid(parse_axes(["LR=1e-3"]))
    swept = user_job_point(spec, point, "job.yaml")
    assert swept.env == {"EPOCHS": "3", "LR": "1e-3"}
    assert (swept.name, swept.command) == (spec.name, spec.command)
    assert spec.env["LR"] == "1", "the job file's own spec is unchanged"


def test_a_user_jobs_point_that_is_no_variable_name_is_refused_naming_each_key() -> None:
    """Each key that is no environment variable name is one line; the job file's checks name the point."""
    (point,) = grid(parse_axes(["train.lr=0.1", "LR=1", "model.depth=2"]))
    with pytest.raises(SweepError) as raised:
        user_job_point(_spec(), point, "job.yaml")
    assert [problem.split(":")[0] for problem in raised.value.problems] == [
        "--sweep train.lr",
        "--sweep model.depth",
    ]
    assert all("use a variable name (e.g. LR)" in problem for problem in raised.value.problems)
    (agents,) = grid(parse_axes(["TRAINSTACK_JOB_ID=x"]))
    with pytest.raises(SweepError) as raised:
        user_job_point(_spec(), agents, "job.yaml")
    assert raised.value.problems == [
        f"job.yaml (--sweep {agents.label}): env.TRAINSTACK_JOB_ID: TRAINSTACK_* are set by the agent; "
        "choose another name"
    ]


@pytest.mark.parametrize(
    ("metrics", "value"),
    [
        ({"final": {"val_accuracy": 0.75}}, 0.75),
        ({"final": {"val_accuracy": 1}}, 1.0),
        ({"final": {"val_accuracy": 0}}, 0.0),
        ({"final": {"val_accuracy": True}}, None),
        ({"final": {"val_accuracy": "0.7"}}, None),
        ({"final": {"val_accuracy": math.nan}}, None),
        ({"final": {"val_accuracy": math.inf}}, None),
        ({"final": {"val_loss": 0.1}}, None),
        ({"final": 0.75}, None),
        ({"val_accuracy": 0.75}, None),
        (None, None),
    ],
)
def test_a_metric_is_its_dotted_key_when_that_holds_a_finite_number(
    metrics: Any, value: float | None
) -> None:
    """Only a finite number (not a bool) at the dotted key ranks a job; anything else is no metric yet."""
    found = metric_value(metrics, "final.val_accuracy")
    assert found == value and (found is None or type(found) is float)


def test_ranking_puts_the_best_first_and_jobs_without_a_metric_last_in_their_order() -> None:
    """Best first (higher or lower is better), a metric of 0 still ranked, jobs without one last as given."""
    rows: list[dict[str, Any]] = [
        {"name": "a", "metric": None},
        {"name": "b", "metric": 0.5},
        {"name": "c", "metric": 0.0},
        {"name": "d"},
        {"name": "e", "metric": 0.9},
        {"name": "f", "metric": 0.5},
    ]
    assert [row["name"] for row in rank(rows)] == ["e", "b", "f", "c", "a", "d"]
    assert [row["name"] for row in rank(rows, higher_is_better=False)] == ["c", "b", "f", "e", "a", "d"]
    assert rank([]) == []

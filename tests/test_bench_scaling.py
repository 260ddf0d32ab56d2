"""The scaling bench's harness (bench/scaling.py) on a tiny run: the report's structure, and that the speed-up
is computed from the two measured runs. No timing is asserted: this machine's speed is not under test."""

from __future__ import annotations

import json
import subprocess
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import bench.scaling
from bench.scaling import Report, allreduce_seconds, scaling, steady_throughput
from tests.forkserver import ForkServer
from training.sample_data import write_dataset


def _line(step: int, rate: float, rank_prefix: str = "") -> str:
    return (
        f"2026-11-30T20:29:09 {rank_prefix}INFO epoch 1/2 step {step}/8  loss 1.3454  {rate} samples/s  "
        "data-wait 5%  eta 0m15s"
    )


def test_steady_throughput_skips_the_warm_up_and_weighs_intervals_by_their_time() -> None:
    log = "\n".join(
        [
            "a launcher warning",
            _line(2, 1.0),  # holds the warm-up steps 1-2: left out however slow
            _line(4, 100.0, "[rank 0] "),
            "2026-11-30T20:29:15 INFO epoch 1 done: train loss 0.8232 acc 0.775  val loss 2.0417 acc 0.625",
            _line(8, 50.0),  # an interval of 4 steps
        ]
    )
    samples_per_s, steps = steady_throughput(log, global_batch=10, warmup_steps=2)
    # 20 samples at 100/s (0.2 s) + 40 samples at 50/s (0.8 s): 60 samples in 1 s.
    assert steps == 6
    assert samples_per_s == pytest.approx(60.0)
    with pytest.raises(ValueError, match="no progress lines"):
        steady_throughput(_line(2, 10.0), global_batch=10, warmup_steps=2)


@pytest.fixture()
def forked_trainers(fork_server: ForkServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness's `python -m training` runs forked from the worker's fork server (tests/forkserver.py):
    the same command, environment and merged log, without torch's imports each (the two ranks of the
    2-process run are processes torch's engine starts). Timing is not under test here."""

    def run(command: Sequence[str], *, cwd: Path, env: dict[str, str], timeout: float, **options: Any) -> Any:
        log = tmp_path / f"trainer-{len(list(tmp_path.glob('trainer-*.log')))}.log"
        life = fork_server.start(list(command[1:]), env, cwd, log)
        try:
            output = life.communicate(timeout=timeout)[0]
        finally:
            life.kill()
        return subprocess.CompletedProcess(list(command), life.wait(), output, "")

    monkeypatch.setattr(bench.scaling, "subprocess", types.SimpleNamespace(run=run))


@pytest.mark.slow(seconds=10)
@pytest.mark.usefixtures("forked_trainers")
def test_a_tiny_scaling_run_reports_both_sides_and_the_ratio_of_their_measurements(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_dataset(data, classes=2, train_per_class=32, val_per_class=4, size=32)
    report = scaling(
        tmp_path / "work",
        data,
        model="mobilenet_v3_small",
        image_size=32,
        global_batch=16,  # 4 steps an epoch; 8 per rank with 2 processes
        epochs=1,  # each run's CPU is mostly its start (Python, torch): one epoch holds both log intervals
        processes=2,
        rounds=1,
        warmup_steps=2,
        log_every=2,
        warmup_round=False,
        classes=2,
        measure_allreduce=False,  # keeps this test under 20 s; the next one covers it
    )
    assert isinstance(report, Report)
    (only,) = report.rounds
    assert (only.single.processes, only.multi.processes) == (1, 2)
    for run in (only.single, only.multi):
        assert run.steps_timed == 2  # 4 steps, the interval holding steps 1-2 left out
        assert run.samples_per_s > 0 and run.reported_samples_per_s > 0
    measured = only.multi.samples_per_s / only.single.samples_per_s
    assert only.speedup == pytest.approx(measured)
    assert report.speedup == pytest.approx(measured) == report.speedup_min == report.speedup_max
    assert report.efficiency == pytest.approx(measured / 2)
    assert report.single_samples_per_s == only.single.samples_per_s
    assert report.multi_step_s == pytest.approx(16 / only.multi.samples_per_s)
    assert report.threads_per_process == 1
    assert report.allreduce is None  # asked not to: it has its own test below
    written = json.loads(json.dumps(report.as_dict()))
    assert written["rounds"][0]["speedup"] == pytest.approx(measured)
    expected = {"speedup", "efficiency", "single_samples_per_s", "multi_samples_per_s", "allreduce", "rounds"}
    assert expected <= set(written)


def test_the_allreduce_timing_runs_between_two_single_threaded_processes() -> None:
    timed = allreduce_seconds(4096, processes=2, threads=1, repeats=2)
    assert timed.parameters == 4096
    assert timed.megabytes == pytest.approx(4096 * 4 / 1e6)
    assert 0 < timed.seconds_min <= timed.seconds_median
    assert timed.threads_per_process == 1

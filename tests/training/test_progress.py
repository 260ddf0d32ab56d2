"""Progress lines, progress.json, the data-starvation warning and the precision choice."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import torch

from training.precision import choose_precision
from training.progress import ProgressReporter


def reporter(tmp_path: Path) -> ProgressReporter:
    return ProgressReporter(
        tmp_path, epochs=2, total_steps=100, log_every=10, device=torch.device("cpu"), num_workers=3
    )


def log_line(progress: ProgressReporter, step: int, wait_share: float) -> dict[str, object]:
    progress.resume()
    time.sleep(0.02)
    progress.record_step(wait_seconds=0.02 * wait_share, samples=64)
    return progress.report(epoch=1, step=step, loss=1.5)


def test_progress_json_is_rewritten_at_every_log_line(tmp_path: Path) -> None:
    progress = reporter(tmp_path)
    log_line(progress, 10, 0.1)
    log_line(progress, 20, 0.1)
    written = json.loads((tmp_path / "progress.json").read_text())
    assert written["step"] == 20 and written["total_steps"] == 100 and written["epochs"] == 2
    assert written["eta_s"] >= 0 and written["samples_per_s"] > 0
    assert 0.0 < written["data_wait_fraction"] < 0.2
    assert not list(tmp_path.glob(".progress.json.tmp*"))


def test_sustained_data_wait_warns_once_with_the_fix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    progress = reporter(tmp_path)
    with caplog.at_level(logging.INFO, logger="training"):
        log_line(progress, 10, 0.9)
        log_line(progress, 20, 0.9)
        assert "bottleneck" not in caplog.text  # one slow interval is not a pattern
        for step in (30, 40, 50):
            log_line(progress, step, 0.9)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "data loading is the bottleneck" in warnings[0] and "raise data.num_workers (now 3)" in warnings[0]
    line = next(r.getMessage() for r in caplog.records if "step 10/100" in r.getMessage())
    assert "loss 1.5000" in line and "data-wait" in line and "eta" in line


def test_no_warning_when_the_loader_keeps_up(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    progress = reporter(tmp_path)
    with caplog.at_level(logging.WARNING, logger="training"):
        for step in range(10, 70, 10):
            log_line(progress, step, 0.05)
    assert not caplog.records


@pytest.mark.parametrize(
    ("device", "bf16_supported", "expected", "scaler"),
    [("cpu", True, "fp32", False), ("cuda", True, "bf16", False), ("cuda", False, "fp16", True)],
    ids=["cpu-fp32", "ampere-bf16", "t4-v100-fp16-with-scaler"],
)
def test_auto_precision(
    monkeypatch: pytest.MonkeyPatch, device: str, bf16_supported: bool, expected: str, scaler: bool
) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16_supported)
    plan = choose_precision("auto", torch.device(device))
    assert plan.precision == expected and plan.needs_scaler is scaler


def test_explicit_precision_is_respected_on_cpu() -> None:
    assert choose_precision("bf16", torch.device("cpu")).dtype is torch.bfloat16


# -- time to first step (issue 35) --------------------------------------------------------------------


class Clock:
    """A wall clock the test moves (seconds since the epoch); counts how often it was read."""

    def __init__(self, now: float) -> None:
        self.now, self.reads = now, 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


def timed_reporter(tmp_path: Path, clock: Clock, device: str = "cpu") -> ProgressReporter:
    return ProgressReporter(
        tmp_path,
        epochs=1,
        total_steps=100,
        log_every=10,
        device=torch.device(device),
        num_workers=2,
        wall_clock=clock,
    )


# 2030-01-01T00:00:00Z
EPOCH_2030 = 1893456000.0


def test_progress_carries_the_first_step_of_this_process_exactly_once(tmp_path: Path) -> None:
    clock = Clock(EPOCH_2030 + 42.125)
    progress = timed_reporter(tmp_path, clock)
    progress.report(epoch=1, step=0, loss=2.0)
    assert "first_step_at" not in json.loads((tmp_path / "progress.json").read_text()), "no step yet"
    progress.record_step(wait_seconds=0.0, samples=8)
    clock.now += 600  # later steps and reports never move it
    progress.record_step(wait_seconds=0.0, samples=8)
    written = progress.report(epoch=1, step=10, loss=1.5)
    assert written["first_step_at"] == "2030-01-01T00:00:42.125Z"
    progress.record_step(wait_seconds=0.0, samples=8)
    progress.report(epoch=1, step=20, loss=1.4)
    on_disk = json.loads((tmp_path / "progress.json").read_text())
    assert on_disk["first_step_at"] == "2030-01-01T00:00:42.125Z"
    assert clock.reads == 1, "the wall clock is read at the first step only"


def test_a_resumed_lifes_trainer_reports_its_own_first_step(tmp_path: Path) -> None:
    before, after = tmp_path / "life-1", tmp_path / "life-2"
    before.mkdir()
    after.mkdir()
    first = timed_reporter(before, Clock(EPOCH_2030 + 10))
    first.record_step(wait_seconds=0.0, samples=8)
    assert first.report(epoch=1, step=10, loss=1.5)["first_step_at"] == "2030-01-01T00:00:10.000Z"
    resumed = timed_reporter(after, Clock(EPOCH_2030 + 3600))
    resumed.record_step(wait_seconds=0.0, samples=8)
    assert resumed.report(epoch=1, step=50, loss=1.0)["first_step_at"] == "2030-01-01T01:00:00.000Z"


def test_on_a_gpu_the_first_step_is_timed_when_its_kernels_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    progress = timed_reporter(tmp_path, Clock(EPOCH_2030), device="cuda:0")
    for _ in range(3):
        progress.record_step(wait_seconds=0.0, samples=8)
    assert synced == [torch.device("cuda:0")], "one wait, at the first step only"
    cpu = timed_reporter(tmp_path, Clock(EPOCH_2030))
    cpu.record_step(wait_seconds=0.0, samples=8)
    assert synced == [torch.device("cuda:0")], "nothing to wait for on a CPU"

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

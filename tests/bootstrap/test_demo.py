"""`python -m demo` end to end, real agent and real trainer: interruption, resume, zero steps lost."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_resumes_after_a_spot_interruption_with_zero_steps_lost_and_scales_to_zero(
    tmp_path: Path,
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "demo", "--workdir", str(tmp_path / "demo")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=540,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "COLUMNS": "200"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    for check in ("steps lost = 0", "instance 2 resumed at the checkpoint step", "group scaled to zero"):
        assert f"PASS {check}" in output, output[-4000:]
    assert "FAIL" not in output
    assert (tmp_path / "demo" / "timeline.png").stat().st_size > 10_000
    assert (tmp_path / "demo" / "user-data.yaml").read_text().startswith("#cloud-config")

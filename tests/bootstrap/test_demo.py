"""`python -m demo` end to end, real agent and real trainer: interruption, resume, zero steps lost."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.iam.plugin import recording_env

REPO = Path(__file__).resolve().parents[2]


def run_demo(tmp_path: Path, *extra: str) -> str:
    """Run `python -m demo` piped, as in CI, with one torch thread (tests/conftest.py); its whole output."""
    result = subprocess.run(
        [sys.executable, "-m", "demo", "--workdir", str(tmp_path / "demo"), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        # The IAM recording folder (tests/iam) too: the demo's agents inherit it and record their calls.
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OMP_NUM_THREADS": "1", **recording_env()},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return output


@pytest.mark.slow
def test_demo_resumes_after_a_spot_interruption_with_zero_steps_lost_and_scales_to_zero(
    tmp_path: Path,
) -> None:
    output = run_demo(tmp_path)
    for check in (
        "steps lost = 0",
        "instance 2 resumed at the checkpoint step",
        "instance 2 resumed across precisions",
        "group scaled to zero",
    ):
        assert f"PASS {check}" in output, output[-4000:]
    assert "FAIL" not in output
    # Piped output is not cut at 80 columns: whole artifact names, whole lines.
    assert "s3://trainstack-demo-data/results/metrics.json" in output
    assert "…" not in output
    cost = next(line for line in output.splitlines() if "estimated cost" in line)
    assert "at simulated spot prices (g6.xlarge $0.38/h, g4dn.xlarge $0.22/h)" in cost
    # An L4 life in bf16, a T4 replacement in fp16 (the device profiles on this CPU), one resume across.
    assert "device profile g6.xlarge: 1x L4 24 GiB, bf16" in output
    assert "device profile g4dn.xlarge: 1x T4 16 GiB, fp16" in output
    assert "precision bf16 -> fp16, fresh fp16 loss scaler" in output
    assert "$0.0000 " not in cost
    assert (tmp_path / "demo" / "timeline.png").stat().st_size > 10_000
    assert (tmp_path / "demo" / "user-data.yaml").read_text().startswith("#cloud-config")


def test_a_bad_job_file_is_refused_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text("name: x\ncommand: python train.py\n")
    result = subprocess.run(
        [sys.executable, "-m", "demo", "--job", str(tmp_path), "--workdir", str(tmp_path / "demo")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "job error:" in result.stdout and "command:" in result.stdout and "Traceback" not in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("example", "steps", "own_result"),
    [("charlm", "200", "sample.txt"), ("lightning-mnist-like", "120", "model.pt")],
)
def test_each_example_survives_a_spot_notice_under_the_real_agent(
    tmp_path: Path, example: str, steps: str, own_result: str
) -> None:
    """The example as shipped, shortened through its job file only: resumed from the confirmed checkpoint,
    0 steps lost, results in S3.

    This is also the demo taking a user's job (a folder named by a relative path, as in the README) and
    keeping the same promise, with the job's own result file among the artifacts: it replaces a separate
    run of tests/bootstrap/user_job through the demo, which proved a subset of this (the same checks, its
    result.json listed), with a job built on the same trainstack_job helper as charlm."""
    import os
    import shutil

    import yaml

    job_dir = tmp_path / example
    shutil.copytree(
        REPO / "examples" / example, job_dir, ignore=shutil.ignore_patterns("checkpoints", "output")
    )
    spec = yaml.safe_load((job_dir / "job.yaml").read_text())
    command = list(spec["command"])
    command[command.index("--steps") + 1] = steps
    spec["command"] = command
    (job_dir / "job.yaml").write_text(yaml.safe_dump(spec))
    output = run_demo(tmp_path, "--job", os.path.relpath(job_dir, REPO))
    for check in ("steps lost = 0", "instance 2 resumed at the checkpoint step", "results in S3"):
        assert f"PASS {check}" in output, output[-4000:]
    assert "FAIL" not in output and f"s3://trainstack-demo-data/results/{own_result}" in output
    if example == "lightning-mnist-like":
        # Lightning itself, not only the step count, says the second life loaded the confirmed checkpoint.
        assert "Restored all states from the checkpoint at" in output, output[-4000:]

"""A user's own job under the real agent: the same spot promise as the built-in trainer."""

from __future__ import annotations

import io
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from bootstrap.eventlog import EventLog
from bootstrap.job import pinned_constraints, prepare_python
from bootstrap.lifecycle import InstanceLife
from demo.imds import ImdsSimulator
from demo.stack import LocalStack
from trainstack_job.jobfile import JobSpec, JobSpecError, load_job_spec

JOB_DIR = Path(__file__).with_name("user_job")
# The first life counts without end (only the notice can stop it, however late it lands on a loaded
# machine: a fixed count could end first); the second counts a few steps past the confirmed checkpoint.
ENDLESS = 10**9
AFTER_RESUME = 5


def user_life(stack: LocalStack, scratch: Path, **spec_changes: Any) -> InstanceLife:
    spec = {**load_job_spec(JOB_DIR / "job.yaml").to_mapping(), **spec_changes}
    config = stack.agent_config(poll_seconds=0.2, scratch_dir=str(scratch), user_job=spec)
    return InstanceLife(
        config,
        log=EventLog(io.StringIO()),
        identity_wait_seconds=2,
        # No wait for a drain hook: no test here terminates the instance, and the wait polls every 2 s
        # (python -m demo covers the terminating path end to end).
        release_wait_seconds=0,
        state_poll_seconds=0.5,
        tick_seconds=0.1,
        job_root=JOB_DIR,
    )


def test_a_users_job_resumes_after_a_spot_notice_with_no_step_lost_and_its_results_uploaded(
    stack: LocalStack, imds: ImdsSimulator, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = user_life(stack, tmp_path / "instance-1", command=["python", "count.py", str(ENDLESS)])
    running = ThreadPoolExecutor(max_workers=1).submit(first.run)
    progress = tmp_path / "instance-1" / "output" / "progress.json"
    deadline = time.monotonic() + 60
    while not (progress.exists() and json.loads(progress.read_text() or "{}").get("step", 0) >= 25):
        assert time.monotonic() < deadline, "the job never made progress"
        time.sleep(0.05)
    imds.inject_spot_notice()
    assert running.result(timeout=60).outcome == "preempted"
    latest = stack.read_json("checkpoints/latest.json")
    reached = json.loads(progress.read_text())["step"]
    assert latest is not None and latest["step"] == reached, "steps lost between progress and the checkpoint"

    imds.clear_events()
    capsys.readouterr()
    steps = latest["step"] + AFTER_RESUME
    second = user_life(stack, tmp_path / "instance-2", command=["python", "count.py", str(steps)])
    assert second.run().outcome == "completed"
    assert json.dumps({"event": "resumed", "step": latest["step"]}) in capsys.readouterr().out
    assert stack.read_json("results/result.json") == {"steps": steps}
    assert stack.group()["DesiredCapacity"] == 0


def test_a_job_file_with_every_kind_of_mistake_is_refused_naming_each_key() -> None:
    with pytest.raises(JobSpecError) as error:
        JobSpec.from_mapping(
            {"name": "x", "command": [], "workdir": "../up", "epochs": 3, "data": {"sync": "yes"}}, "job.yaml"
        )
    assert [p.split(": ")[1] for p in error.value.problems] == ["epochs", "command", "workdir", "data"]


def test_requirements_go_into_a_cached_venv_on_top_of_the_amis_torch(tmp_path: Path) -> None:
    import sys

    requirements = tmp_path / "requirements.txt"
    requirements.write_text("# nothing to install: the venv still sees the base packages\n")
    logged: list[str] = []
    python = prepare_python(
        sys.executable, requirements, tmp_path / "cache", lambda *a, **_: logged.append(a[1])
    )
    assert python != sys.executable and Path(python).exists()
    again = prepare_python(
        sys.executable, requirements, tmp_path / "cache", lambda *a, **_: logged.append(a[1])
    )
    assert again == python and logged[-1] == "job environment reused"
    assert "torch==" in pinned_constraints(sys.executable), "pip is constrained to the base torch"
    import subprocess

    # Where the venv's Python finds torch, and which version: the base one (metadata only; importing torch
    # would prove no more and cost 2 s of CPU).
    probe = (
        "import importlib.metadata as m, importlib.util as u; "
        "print(u.find_spec('torch').origin, m.version('torch'))"
    )
    seen = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    assert seen.returncode == 0, seen.stderr
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec("torch")
    assert spec is not None
    base = [str(spec.origin), importlib.metadata.version("torch")]
    assert seen.stdout.split() == base, "the venv sees the base torch"


def test_a_job_on_an_efa_cluster_gets_the_libfabric_settings(
    stack: LocalStack, imds: ImdsSimulator, tmp_path: Path
) -> None:
    spec = load_job_spec(JOB_DIR / "job.yaml").to_mapping()
    config = stack.agent_config(poll_seconds=0.2, scratch_dir=str(tmp_path), user_job=spec, efa=True)
    life = InstanceLife(config, log=EventLog(io.StringIO()), identity_wait_seconds=2, job_root=JOB_DIR)
    life.identity = life.imds.identity("us-east-1")
    from bootstrap.phases.training import job_process
    from bootstrap.trainer import TrainerPaths

    process = job_process(life, TrainerPaths(tmp_path), gpu_count=0, restored=None)
    assert process._env["FI_PROVIDER"] == "efa"
    plain = InstanceLife(stack.agent_config(scratch_dir=str(tmp_path), user_job=spec), job_root=JOB_DIR)
    plain.identity = life.identity
    assert "FI_PROVIDER" not in job_process(plain, TrainerPaths(tmp_path), gpu_count=0, restored=None)._env


def test_a_users_job_exiting_2_is_reported_as_its_own_exit_not_as_the_trainer_config(
    stack: LocalStack, imds: ImdsSimulator, tmp_path: Path
) -> None:
    # argparse exits 2 on an unknown option, as Python does for a script it cannot open: the job contract's
    # configuration error (permanent: another instance would fail the same way), in the job's own words.
    parse = "import argparse; argparse.ArgumentParser().parse_args()"
    life = user_life(stack, tmp_path, command=["python", "-c", parse, "--stepz", "10"])
    result = life.run()
    assert (result.outcome, result.exit_code) == ("gave_up", 0), "no second life for the same bad argv"
    (alert,) = stack.alerts()
    assert "your job exited 2" in alert["Subject"] and "trainer config" not in alert["Subject"]
    assert "unrecognized arguments: --stepz 10" in alert["Message"], "the job's own last lines"
    assert "trainingConfig" not in alert["Message"] and "command and arguments" in alert["Message"]

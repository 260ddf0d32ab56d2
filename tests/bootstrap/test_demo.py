"""`python -m demo --job DIR`: a user's job through the spot story, and what the demo refuses.

`python -m demo` itself (make demo's story, the queue) runs end to end in
tests/bootstrap/test_demo_queue.py."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from demo.agent import TRAINER_PYTHON_ENV
from tests.forkserver import ForkServer
from tests.iam.plugin import recording_env

REPO = Path(__file__).resolve().parents[2]
# The suite's counting job, shortened: the queue story (test_demo_queue.py) already takes an example through
# spot notices under the real agent; this one keeps the `--job` path covered. The job sleeps 0.02 s a step on
# any machine: the demo's notice from step 64 (40%) leaves 96 steps, 1.9 s or more, four times the ~0.5 s the
# notice takes to stop it (the demo's 0.2 s poll, the agent's 0.25 s poll, a step).
USER_JOB_STEPS = 160


def demo_env(tmp_path: Path, forked: ForkServer | None = None) -> dict[str, str]:
    """The environment a story's `python -m demo` gets: piped, as in CI, one torch thread (tests/conftest.py);
    with `forked`, the agents start the built-in trainer's lives from that fork server (demo/agent.py)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    if forked is not None:
        env[TRAINER_PYTHON_ENV] = str(forked.python)
    return env


def run_demo(tmp_path: Path, *extra: str, timeout: float = 240, forked: ForkServer | None = None) -> str:
    """Run `python -m demo` (demo_env); its whole output."""
    result = subprocess.run(
        [sys.executable, "-m", "demo", "--workdir", str(tmp_path / "demo"), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        # The IAM recording folder (tests/iam) too: the demo's agents inherit it and record their calls.
        env={**demo_env(tmp_path, forked), **recording_env()},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return output


def short_user_job(destination: Path, steps: int) -> Path:
    """tests/bootstrap/user_job copied, its job file counting to `steps`: the copy's folder."""
    shutil.copytree(REPO / "tests" / "bootstrap" / "user_job", destination)
    job_file = destination / "job.yaml"
    spec = yaml.safe_load(job_file.read_text())
    spec["command"] = [*spec["command"][:-1], str(steps)]
    job_file.write_text(yaml.safe_dump(spec, sort_keys=False))
    return destination


@pytest.mark.slow(seconds=14)
def test_a_users_job_goes_through_the_spot_story_with_zero_steps_lost(tmp_path: Path) -> None:
    """`python -m demo --job DIR` end to end with the suite's counting job (no torch: about 7 s of CPU): the
    notice stops it mid-run with a confirmed checkpoint, a g4dn.xlarge in another zone resumes it at that
    step, its own results reach S3, the group ends at zero and the timeline is drawn."""
    job = short_user_job(tmp_path / "user_job", USER_JOB_STEPS)
    output = run_demo(tmp_path, "--job", str(job))
    for check in (
        "the notice interrupted the job mid-run",
        "instance 1 stopped with a confirmed checkpoint",
        "steps lost = 0",
        "checkpoint confirmed within the 2-minute notice",
        "instance 2 resumed at the checkpoint step",
        "instance 2 completed",
        "results in S3",
        "group scaled to zero",
        "completion notification sent",
        "ledger counts one interruption",
    ):
        assert f"PASS {check}" in output, output[-4000:]
    assert "FAIL" not in output and "all checks passed" in output
    assert "device profile g4dn.xlarge: 1x T4 16 GiB, fp16" in output
    assert "result.json" in next(line for line in output.splitlines() if line.startswith("PASS results"))
    assert f"reaches step {USER_JOB_STEPS}/{USER_JOB_STEPS}" in output
    assert (tmp_path / "demo" / "timeline.png").stat().st_size > 10_000


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


@pytest.mark.parametrize("example", ["charlm", "lightning-mnist-like"])
def test_the_demo_takes_each_example_by_a_relative_folder_and_its_user_data_fits(
    tmp_path: Path, example: str
) -> None:
    """`python -m demo --job examples/<name>` (the README's line) finds the job file in the folder, bundles
    the example's own workdir and renders user-data that EC2 accepts (under 16 KB with the job in it).

    An example's run under the real agent through a spot notice (resumed from the confirmed checkpoint,
    0 steps lost, its own result file in S3) is `make demo`'s story (tests/bootstrap/test_demo_queue.py),
    where Lightning's runs as a queued job; charlm's stop and resume are tests/job/test_examples.py's."""
    from rich.console import Console

    from bootstrap.cloud_init import USER_DATA_LIMIT_BYTES
    from demo.__main__ import job_file_of
    from demo.instance import agent_config_from_user_data
    from demo.run import Demo
    from demo.stack import LocalStack

    folder = Path(os.path.relpath(REPO / "examples" / example))
    demo = Demo(tmp_path, Console(file=io.StringIO()), job_file_of(folder))
    assert demo.job is not None and demo.job.name == example and demo.result.job_name == example
    assert demo.job_dir == (REPO / "examples" / example).resolve()
    # The stack's names only: building the agent config makes no AWS call.
    stack = LocalStack(
        "trainstack-demo",
        "us-east-1",
        "trainstack-demo-data",
        "arn:aws:kms:us-east-1:123456789012:key/demo",
        "arn:aws:sns:us-east-1:123456789012:trainstack-demo-alerts",
        "trainstack-demo-gpu",
        "/trainstack/trainstack-demo",
        "http://127.0.0.1/queue",
    )
    user_data = demo.user_data(stack, "code/" + "0" * 64 + "/bundle.tar.gz", "0" * 64)
    assert user_data.startswith("#cloud-config") and len(user_data.encode()) < USER_DATA_LIMIT_BYTES
    rendered = agent_config_from_user_data(user_data, tmp_path / "scratch", poll_seconds=0.25)
    assert rendered["user_job"]["command"] == list(demo.job.command)


def test_queue_refuses_the_options_of_other_stories(capsys: pytest.CaptureFixture[str]) -> None:
    from demo.__main__ import main

    assert main(["--queue", "--job", str(REPO / "examples" / "charlm")]) == 2
    out = capsys.readouterr().out
    assert "error:" in out and "--queue (the default story) submits its own jobs" in out
    assert "leave out --job" in out


@pytest.mark.parametrize("isolated", [False, True])
def test_the_suites_trainer_python_is_used_only_where_the_job_runs_as_the_agents_own_user(
    monkeypatch: pytest.MonkeyPatch, isolated: bool
) -> None:
    """demo/agent.py: TRAINSTACK_DEMO_TRAINER_PYTHON puts the fork server's stand-in first in the built-in
    trainer's command, and is gone from the environment the trainer inherits; where the job would run as its
    own user (who may not open the test's stand-in or socket), the trainer starts as a real process."""
    import demo.agent
    from bootstrap import agent, jobuser, supervisor

    seen: dict[str, object] = {}

    def agent_main(argv: list[str] | None) -> int:
        seen["command"] = supervisor.default_trainer_command(2)
        seen["env"] = os.environ.get(TRAINER_PYTHON_ENV)
        return 0

    user = jobuser.JobUser("trainstack-job", 1500, 1500) if isolated else None
    monkeypatch.setattr(jobuser, "detect", lambda: jobuser.JobLaunch(user=user, reason="test"))
    monkeypatch.setattr(agent, "main", agent_main)
    monkeypatch.setattr(supervisor, "default_trainer_command", supervisor.default_trainer_command)
    monkeypatch.setattr(agent, "InstanceLife", agent.InstanceLife)
    monkeypatch.setenv(TRAINER_PYTHON_ENV, "/stand/in/python")

    assert demo.agent.main([]) == 0
    command = seen["command"]
    assert isinstance(command, list) and command[1:] == ["-m", "training", "train.processes=2"]
    assert (command[0] == "/stand/in/python") is not isolated
    assert seen["env"] is None

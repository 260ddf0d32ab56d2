"""`trainstack shell` / `forward PORT`: the exact `aws ssm start-session` the user's terminal is handed to."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainstack.session import session_command

from .conftest import REGION, REPO, STACK, Deployed


def _fake_tools(bin_dir: Path, record: Path, *, plugin: bool = True) -> None:
    """Stand-ins for the AWS CLI and the Session Manager plugin; `aws` records the argv it was given."""
    bin_dir.mkdir()
    aws = bin_dir / "aws"
    aws.write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > {record}\n')
    aws.chmod(0o755)
    if plugin:
        tool = bin_dir / "session-manager-plugin"
        tool.write_text("#!/bin/sh\nexit 0\n")
        tool.chmod(0o755)


def _trainstack(deployed: Deployed, bin_dir: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**_aws_env(), "PATH": str(bin_dir)}
    where = ["--cwd", str(deployed.project), "--stack", STACK, "--outputs", str(deployed.outputs_file)]
    return subprocess.run(
        [sys.executable, "-m", "trainstack", *argv, *where],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _aws_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("AWS_")}


def test_shell_hands_the_terminal_to_an_ssm_session_on_the_running_instance(
    deployed: Deployed, tmp_path: Path
):
    instance = deployed.launch_instance()
    record = tmp_path / "argv"
    _fake_tools(tmp_path / "bin", record)

    result = _trainstack(deployed, tmp_path / "bin", "shell")

    assert result.returncode == 0, result.stderr
    assert record.read_text().splitlines() == [
        "ssm",
        "start-session",
        "--target",
        instance,
        "--region",
        REGION,
    ]


def test_forward_opens_a_port_forwarding_session(deployed: Deployed, tmp_path: Path):
    instance = deployed.launch_instance()
    record = tmp_path / "argv"
    _fake_tools(tmp_path / "bin", record)

    result = _trainstack(deployed, tmp_path / "bin", "forward", "6006", "--local-port", "16006")

    assert result.returncode == 0, result.stderr
    argv = record.read_text().splitlines()
    assert argv[:4] == ["ssm", "start-session", "--target", instance]
    assert argv[argv.index("--document-name") + 1] == "AWS-StartPortForwardingSession"
    assert json.loads(argv[argv.index("--parameters") + 1]) == {
        "portNumber": ["6006"],
        "localPortNumber": ["16006"],
    }
    assert f"forwarding localhost:16006 → {instance}:6006" in result.stdout


def test_shell_without_the_plugin_says_how_to_install_it(deployed: Deployed, tmp_path: Path):
    _fake_tools(tmp_path / "bin", tmp_path / "argv", plugin=False)

    result = _trainstack(deployed, tmp_path / "bin", "shell")

    assert result.returncode == 1
    assert result.stderr.count("\n") == 1
    assert "session-manager-plugin is not on PATH" in result.stderr
    assert "session-manager-working-with-install-plugin.html" in result.stderr
    assert not (tmp_path / "argv").exists()


def test_shell_with_nothing_in_service_points_at_status_and_resume(deployed: Deployed, tmp_path: Path):
    _fake_tools(tmp_path / "bin", tmp_path / "argv")
    result = _trainstack(deployed, tmp_path / "bin", "shell")
    assert result.returncode == 1
    assert "no instance in service in group trainstack-test-gpu (desired 0)" in result.stderr
    assert "`trainstack resume`" in result.stderr


def test_forward_rejects_a_port_out_of_range(deployed: Deployed, tmp_path: Path):
    _fake_tools(tmp_path / "bin", tmp_path / "argv")
    result = _trainstack(deployed, tmp_path / "bin", "forward", "70000")
    assert result.returncode == 1
    assert "PORT 70000: a TCP port is 1-65535" in result.stderr


@pytest.mark.parametrize("port", [None, 8888])
def test_session_command_names_the_target_and_region(port: int | None):
    command = session_command("i-0abc", "eu-west-1", port)
    assert command[:7] == ["aws", "ssm", "start-session", "--target", "i-0abc", "--region", "eu-west-1"]
    assert ("--document-name" in command) == (port is not None)

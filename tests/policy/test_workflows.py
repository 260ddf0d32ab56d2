"""The code-review workflows are valid GitHub Actions (actionlint + shellcheck) and do what review needs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = REPO / ".github" / "workflows"
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: run `make venv` (it comes with the dev extras)")
    return found


def _workflow(name: str) -> dict[Any, Any]:
    loaded = yaml.safe_load((WORKFLOWS / name).read_text())
    assert isinstance(loaded, dict)
    # YAML 1.1 reads the key `on` as True.
    return {("on" if key is True else key): value for key, value in loaded.items()}


def _steps(workflow: dict[Any, Any]) -> list[dict[str, Any]]:
    return [step for job in workflow["jobs"].values() for step in job["steps"]]


def test_workflows_pass_actionlint_with_shellcheck() -> None:
    result = subprocess.run(
        [_tool("actionlint"), "-verbose", "-shellcheck", _tool("shellcheck"), "preview.yml", "test.yml"],
        cwd=WORKFLOWS,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert 'Rule "shellcheck" was disabled' not in result.stderr, "shellcheck did not run inside actionlint"


def test_preview_runs_pulumi_preview_with_diff_policy_pack_and_pr_comment() -> None:
    workflow = _workflow("preview.yml")
    assert "pull_request" in workflow["on"]
    assert workflow["permissions"] == {"id-token": "write", "contents": "read", "pull-requests": "write"}
    steps = _steps(workflow)
    uses = [step.get("uses", "") for step in steps]
    assert all(re.fullmatch(r"[\w.-]+/[\w.-]+@v\d+", use) for use in uses if use), (
        "pin actions to a major version"
    )
    credentials = next(
        step for step in steps if step.get("uses", "").startswith("aws-actions/configure-aws-credentials")
    )
    assert "role-to-assume" in credentials["with"] and "aws-access-key-id" not in credentials["with"]
    pulumi = next(step for step in steps if step.get("uses", "").startswith("pulumi/actions@"))
    assert pulumi["with"]["command"] == "preview"
    assert pulumi["with"]["diff"] is True and pulumi["with"]["comment-on-pr"] is True
    assert pulumi["with"]["policyPacks"] == "policypack"
    assert "vars." in pulumi["with"]["stack-name"]
    job = next(iter(workflow["jobs"].values()))
    assert job["env"]["PULUMI_ACCESS_TOKEN"] == "${{ secrets.PULUMI_ACCESS_TOKEN }}"


def test_test_workflow_runs_the_readme_test_command_after_cloud_init() -> None:
    runs = [step.get("run", "") for step in _steps(_workflow("test.yml"))]
    installs = next(i for i, run in enumerate(runs) if "apt-get install" in run and "cloud-init" in run)
    tests = next(i for i, run in enumerate(runs) if run.strip() == "make test")
    assert installs < tests
    assert "make test" in (REPO / "README.md").read_text()

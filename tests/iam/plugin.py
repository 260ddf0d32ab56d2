"""The session's IAM check: record every call of the agent, the Lambda and the CLI; check them at the end.

tests/conftest.py imports these hooks. The controller (or the only process, without xdist) makes the
recording folder and names it in TRAINSTACK_IAM_RECORD before any worker starts, so workers and every
agent, demo or trainer they start inherit it. At the end of the session the controller checks every
recorded call against the policy the program declares for its principal and fails the run, naming the
principal, action and resource of each call that policy does not allow.

Who records what:
- the agent (in-process and subprocess): bootstrap/aws.py, principal instance-role;
- the capacity-fallback handler: the client tests/infra/test_capacity.py hands it, via `record_as`;
- the CLI in-process: every client `trainstack.aws.Clients` makes, wrapped here, principal cli-user.
The tests' own set-up clients (demo/stack.py, boto3 in fixtures) are not recorded: they stand in for
`pulumi up` and the operator, whose permissions are not the program's to declare.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from bootstrap.aws import IAM_RECORD_ENV, record_calls
from tests.iam.check import check_folder, report
from tests.iam.principals import CLI

_KEY = pytest.StashKey[dict[str, Any]]()


def record_as(client: Any, principal: str) -> Any:
    """Record `client`'s calls as `principal`'s when the session records (always under pytest)."""
    folder = os.environ.get(IAM_RECORD_ENV)
    if folder:
        record_calls(client, principal, folder)
    return client


def recording_env() -> dict[str, str]:
    """The recording folder's variable, for a subprocess started with an environment of its own."""
    return {k: v for k, v in os.environ.items() if k == IAM_RECORD_ENV}


def _record_cli_clients() -> None:
    from trainstack.aws import Clients

    made_by_cli = Clients.client

    def client(self: Clients, service: str, region: str | None = None) -> Any:
        made = made_by_cli(self, service, region)
        # Clients made once per command are recorded once; a test's stubbed override is not the CLI's call.
        if service not in self._overrides and not getattr(made, "_trainstack_iam_recorded", False):
            record_as(made, CLI)
            made._trainstack_iam_recorded = True
        return made

    Clients.client = client  # type: ignore[method-assign]


def configure(config: pytest.Config) -> None:
    state: dict[str, Any] = {"owner": False, "findings": [], "checked": 0, "principals": {}}
    if not hasattr(config, "workerinput") and not os.environ.get(IAM_RECORD_ENV):
        # The controller owns a fresh folder; a folder set from outside is kept (to read it afterwards).
        os.environ[IAM_RECORD_ENV] = tempfile.mkdtemp(prefix="trainstack-iam-")
        state["owner"] = True
    config.stash[_KEY] = state
    _record_cli_clients()


def sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput"):
        return  # the controller checks once every worker is done
    state = session.config.stash[_KEY]
    folder = Path(os.environ[IAM_RECORD_ENV])
    findings, checked, principals = check_folder(folder)
    state.update(findings=findings, checked=checked, principals=dict(principals))
    if findings and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if state["owner"]:
        shutil.rmtree(folder, ignore_errors=True)


def terminal_summary(reporter: Any, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or _KEY not in config.stash:
        return
    state = config.stash[_KEY]
    calls = ", ".join(f"{p} {n}" for p, n in sorted(state["principals"].items())) or "none"
    if not state["findings"]:
        reporter.write_line(f"IAM check: {state['checked']} authorizations allowed (calls: {calls})")
        return
    reporter.write_sep("=", "IAM check: calls the declared policies do not allow", red=True)
    for line in report(state["findings"]):
        reporter.write_line(line)
    reporter.write_line(f"({state['checked']} authorizations checked; calls: {calls}; see docs/internals.md)")

"""`trainstack shell` / `forward PORT`: SSM Session Manager into an instance; no SSH, no open port."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence

from trainstack.aws import Clients
from trainstack.errors import CliError
from trainstack.stack import Stack
from trainstack.state import Group, read_group

AWS_CLI_INSTALL = "https://docs.aws.amazon.com/cli/latest/userguide/getting-started-install.html"
PLUGIN_INSTALL = "https://docs.aws.amazon.com/systems-manager/latest/userguide/session-manager-working-with-install-plugin.html"
PORT_FORWARDING_DOCUMENT = "AWS-StartPortForwardingSession"

Exec = Callable[[str, Sequence[str]], None]


def replace_process(file: str, argv: Sequence[str]) -> None:
    """Hand the terminal to the session: its exit status becomes the user's."""
    os.execvp(file, list(argv))


def pick_instance(group: Group, wanted: str | None) -> str:
    """The instance asked for, or the first one in service."""
    in_service = [i.instance_id for i in group.instances if i.state == "InService"]
    if wanted:
        if wanted not in in_service:
            listed = ", ".join(in_service) or "none"
            raise CliError(
                f"instance {wanted} is not in service in group {group.name} (in service: {listed})"
            )
        return wanted
    if not in_service:
        raise CliError(
            f"no instance in service in group {group.name} (desired {group.desired}): wait for one "
            "(`trainstack status`) or start one with `trainstack resume`"
        )
    return in_service[0]


def session_command(
    instance_id: str, region: str | None, port: int | None = None, local_port: int | None = None
) -> list[str]:
    """The `aws ssm start-session` command line; with a port, a port-forwarding session to it."""
    command = ["aws", "ssm", "start-session", "--target", instance_id]
    if region:
        command += ["--region", region]
    if port is not None:
        parameters = {"portNumber": [str(port)], "localPortNumber": [str(local_port or port)]}
        command += ["--document-name", PORT_FORWARDING_DOCUMENT, "--parameters", json.dumps(parameters)]
    return command


def require_session_tools() -> None:
    if shutil.which("aws") is None:
        raise CliError(f"the AWS CLI (v2) is not on PATH: install it ({AWS_CLI_INSTALL}), then retry")
    if shutil.which("session-manager-plugin") is None:
        raise CliError(
            "session-manager-plugin is not on PATH: `aws ssm start-session` needs it; "
            f"install it ({PLUGIN_INSTALL})"
        )


def _validate_port(name: str, port: int | None) -> None:
    if port is not None and not 1 <= port <= 65535:
        raise CliError(f"{name} {port}: a TCP port is 1-65535 (Jupyter 8888, TensorBoard 6006)")


def run(
    clients: Clients,
    stack: Stack,
    *,
    instance: str | None,
    port: int | None = None,
    local_port: int | None = None,
    exec_: Exec = replace_process,
) -> int:
    _validate_port("PORT", port)
    _validate_port("--local-port", local_port)
    require_session_tools()
    target = pick_instance(read_group(clients, stack.outputs.group_name), instance)
    command = session_command(target, clients.region, port, local_port)
    if port is not None:
        print(f"forwarding localhost:{local_port or port} → {target}:{port} (Ctrl-C ends it)", flush=True)
    exec_(command[0], command)
    return 0

"""`trainstack dev jupyter` / `dev tensorboard`: start the server on the dev box, bound to 127.0.0.1, and
forward its port through Session Manager; nothing listens beyond the box's loopback.

The server is started by SSM Run Command (AWS-RunShellScript, as the `ubuntu` user, in the workspace) and
reused when one already serves the port: running the command twice never starts a second server. The
Jupyter token is read back from `jupyter server list --json` on the box.
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from trainstack.aws import Clients, error_code
from trainstack.dev.identity import require_trusted_dev_box
from trainstack.errors import CliError
from trainstack.session import Exec, replace_process, require_session_tools, session_command
from trainstack.stack import Stack

WORKSPACE = (
    "/workspace"  # where `trainstack dev up` mounts the workspace volume (trainstack/dev/lifecycle.py)
)
SSH_USER = "ubuntu"  # the Deep Learning AMI's (Ubuntu) login user
RUN_SHELL_DOCUMENT = "AWS-RunShellScript"
JUPYTER_PORT = 8888
TENSORBOARD_PORT = 6006
DEFAULT_LOGDIR = "runs"  # PyTorch's SummaryWriter writes under ./runs by default
# A first start installs the server into the workspace (pip): minutes, not seconds.
COMMAND_TIMEOUT_SECONDS = 900
POLL_SECONDS = 1.0
BEGIN = "TRAINSTACK-SERVER-BEGIN"
END = "TRAINSTACK-SERVER-END"
_RUNNING = {"Pending", "InProgress", "Delayed"}

Sleep = Callable[[float], None]

# Runs as the box's user in the workspace, with the AMI's PyTorch env; a tool the AMI lacks is installed once
# into the workspace (it outlives the box) next to the AMI's packages.
_PRELUDE = """set -eu
ws={workspace}
if [ ! -d "$ws" ] || [ ! -w "$ws" ]; then
  echo "trainstack: $ws is not mounted or not writable by $(id -un): check trainstack dev status" >&2; exit 3
fi
cd "$ws"
state="$ws/.trainstack"; mkdir -p "$state"
# The AMI's env script is not written for `set -u`.
if [ -f /opt/pytorch/bin/activate ]; then set +u; . /opt/pytorch/bin/activate; set -u; fi
tools="$state/tools"
purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'
need() {{
  if ! command -v "$1" >/dev/null 2>&1; then
    if [ ! -x "$tools/bin/$1" ]; then
      python3 -m venv "$tools"
      # The AMI's env after the tools' own packages: a notebook's kernel imports the AMI's torch.
      python3 -c "$purelib" >"$("$tools/bin/python" -c "$purelib")/trainstack-ami-env.pth"
      "$tools/bin/pip" install --quiet "$2"
    fi
    PATH="$tools/bin:$PATH"
  fi
}}
"""

_JUPYTER = """need jupyter-lab jupyterlab
port={port}
listed() {{ jupyter server list --json 2>/dev/null | grep -q "\\"port\\": ${{port}}[,}}]"; }}
if ! listed; then
  setsid nohup jupyter-lab --no-browser --ip=127.0.0.1 --port="$port" --port-retries=0 \\
    --ServerApp.root_dir="$ws" >"$state/jupyter-$port.log" 2>&1 </dev/null &
  pid=$!
  for _ in $(seq 240); do listed && break; kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
fi
echo {begin}
jupyter server list --json 2>/dev/null || true
echo {end}
listed || {{ tail -n 5 "$state/jupyter-$port.log" >&2; exit 4; }}
"""

_TENSORBOARD = """need tensorboard tensorboard
port={port}
logdir={logdir}
pidfile="$state/tensorboard-$port.pid"; dirfile="$state/tensorboard-$port.logdir"
reused=false
# Listening on the port is what "up" means here (bash's own TCP connect: no process per poll).
up() {{ (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; }}
if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null && up; then
  old=$(cat "$pidfile")
  # Another folder on this port: that server gives way to this one (and frees the port first).
  if [ "$(cat "$dirfile" 2>/dev/null)" = "$logdir" ]; then reused=true
  else kill "$old"; for _ in $(seq 40); do up || break; sleep 0.25; done; fi
fi
if [ "$reused" = false ]; then
  mkdir -p "$logdir"
  setsid nohup tensorboard --logdir "$logdir" --host 127.0.0.1 --port "$port" \\
    >"$state/tensorboard-$port.log" 2>&1 </dev/null &
  pid=$!
  echo "$pid" >"$pidfile"; printf '%s\\n' "$logdir" >"$dirfile"
  for _ in $(seq 240); do up && break; kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
fi
echo {begin}
python3 -c 'import json,sys; print(json.dumps({{"port": int(sys.argv[1]), "logdir": sys.argv[2], \\
"reused": sys.argv[3] == "true", "up": sys.argv[4] == "0"}}))' "$port" "$logdir" "$reused" "$(up; echo $?)"
echo {end}
up || {{ tail -n 5 "$state/tensorboard-$port.log" >&2; exit 4; }}
"""


def _as_user(body: str) -> list[str]:
    """The Run Command lines: the body runs as the box's user (Run Command itself runs as root)."""
    return [
        f"sudo -u {SSH_USER} -H bash -l -s <<'TRAINSTACK_SCRIPT'",
        *body.splitlines(),
        "TRAINSTACK_SCRIPT",
    ]


def jupyter_body(port: int, workspace: str = WORKSPACE) -> str:
    """The shell script that starts (or finds) Jupyter on `port` and lists the box's servers."""
    return _PRELUDE.format(workspace=shlex.quote(workspace)) + _JUPYTER.format(
        port=port, begin=BEGIN, end=END
    )


def tensorboard_body(port: int, logdir: str, workspace: str = WORKSPACE) -> str:
    """The shell script that starts TensorBoard on `logdir` (or reuses the one serving it on `port`)."""
    return _PRELUDE.format(workspace=shlex.quote(workspace)) + _TENSORBOARD.format(
        port=port, logdir=shlex.quote(logdir), begin=BEGIN, end=END
    )


def jupyter_script(port: int) -> list[str]:
    return _as_user(jupyter_body(port))


def tensorboard_script(port: int, logdir: str) -> list[str]:
    return _as_user(tensorboard_body(port, logdir))


def between_markers(output: str) -> list[dict[str, Any]]:
    """The JSON objects printed one per line between BEGIN and END; other lines (warnings) are skipped."""
    found: list[dict[str, Any]] = []
    inside = False
    for line in output.splitlines():
        text = line.strip()
        if text == BEGIN:
            inside = True
        elif text == END:
            inside = False
        elif inside and text.startswith("{"):
            try:
                document = json.loads(text)
            except json.JSONDecodeError:
                continue
            if isinstance(document, dict):
                found.append(document)
    return found


def jupyter_url(servers: Sequence[dict[str, Any]], port: int, local_port: int) -> str:
    """The browser URL of the server on `port`, through the local end of the forward."""
    for server in servers:
        if server.get("port") == port:
            base = str(server.get("base_url") or "/")
            base = base if base.startswith("/") else "/" + base
            token = str(server.get("token") or "")
            return f"http://127.0.0.1:{local_port}{base}" + (f"?token={token}" if token else "")
    listed = ", ".join(str(s.get("port")) for s in servers) or "none"
    raise CliError(
        f"no Jupyter server on port {port} in the dev box's `jupyter server list` (ports: {listed}); "
        f"its log is {WORKSPACE}/.trainstack/jupyter-{port}.log (`trainstack shell` there)"
    )


@dataclass(frozen=True)
class Invocation:
    status: str
    stdout: str
    stderr: str


def run_on_box(
    ssm: Any,
    instance_id: str,
    lines: list[str],
    *,
    comment: str,
    timeout_s: float = COMMAND_TIMEOUT_SECONDS,
    sleep: Sleep = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> Invocation:
    """Runs `lines` on the box with Run Command and waits for its end (its status, stdout and stderr)."""
    try:
        sent = ssm.send_command(
            InstanceIds=[instance_id],
            DocumentName=RUN_SHELL_DOCUMENT,
            Comment=comment[:100],
            Parameters={"commands": lines, "executionTimeout": [str(int(timeout_s))]},
        )
    except ClientError as error:
        if error_code(error) in ("InvalidInstanceId", "InvalidInstanceInformationFilterValue"):
            raise CliError(
                f"Session Manager does not see dev box {instance_id} yet ({error_code(error)}): wait a "
                "minute after `trainstack dev up`, then retry"
            ) from None
        raise
    command_id = sent["Command"]["CommandId"]
    deadline = clock() + timeout_s + 30
    while True:
        try:
            answer = ssm.get_command_invocation(CommandId=command_id, InstanceId=instance_id)
        except ClientError as error:
            # The invocation exists a moment after send_command returns.
            if error_code(error) != "InvocationDoesNotExist":
                raise
            answer = {"Status": "Pending"}
        status = str(answer.get("Status", ""))
        if status not in _RUNNING:
            return Invocation(
                status,
                str(answer.get("StandardOutputContent", "")),
                str(answer.get("StandardErrorContent", "")),
            )
        if clock() > deadline:
            raise CliError(
                f"{comment}: command {command_id} on {instance_id} still {status} after {timeout_s:.0f} s; "
                f"`aws ssm get-command-invocation --command-id {command_id} --instance-id {instance_id}`"
            )
        sleep(POLL_SECONDS)


def _require_success(invocation: Invocation, what: str, instance_id: str) -> None:
    if invocation.status != "Success":
        why = [line for line in invocation.stderr.splitlines() if line.strip()][-1:] or ["no error output"]
        raise CliError(f"{what} on dev box {instance_id} failed ({invocation.status}): {why[0].strip()}")


def _validate_ports(port: int, local_port: int | None) -> int:
    for name, value in (("--port", port), ("--local-port", local_port)):
        if value is not None and not 1024 <= value <= 65535:
            raise CliError(f"{name} {value}: use an unprivileged TCP port, 1024-65535")
    return local_port or port


def _forward(clients: Clients, instance_id: str, port: int, local_port: int, url: str, exec_: Exec) -> int:
    print(f"{url}\n(forwarding 127.0.0.1:{local_port} → {instance_id}:{port}; Ctrl-C ends it)", flush=True)
    command = session_command(instance_id, clients.region, port, local_port)
    exec_(command[0], command)
    return 0


def run_jupyter(
    clients: Clients,
    stack: Stack,
    *,
    port: int = JUPYTER_PORT,
    local_port: int | None = None,
    exec_: Exec = replace_process,
    sleep: Sleep = time.sleep,
) -> int:
    local = _validate_ports(port, local_port)
    require_session_tools()
    # Not by its tag alone: the token, the forward and the code typed into the notebook would all go to an
    # instance anyone with RunInstances could have tagged (trainstack/dev/identity.py).
    box = require_trusted_dev_box(clients, stack.outputs)
    done = run_on_box(
        clients.ssm(), box.instance_id, jupyter_script(port), comment="trainstack dev jupyter", sleep=sleep
    )
    _require_success(done, "starting Jupyter", box.instance_id)
    url = jupyter_url(between_markers(done.stdout), port, local)
    return _forward(clients, box.instance_id, port, local, url, exec_)


def run_tensorboard(
    clients: Clients,
    stack: Stack,
    *,
    logdir: str = DEFAULT_LOGDIR,
    port: int = TENSORBOARD_PORT,
    local_port: int | None = None,
    exec_: Exec = replace_process,
    sleep: Sleep = time.sleep,
) -> int:
    local = _validate_ports(port, local_port)
    if not logdir.strip() or "\n" in logdir:
        raise CliError(f"--logdir {logdir!r}: a folder on the box, relative to {WORKSPACE} or absolute")
    require_session_tools()
    box = require_trusted_dev_box(clients, stack.outputs)
    done = run_on_box(
        clients.ssm(),
        box.instance_id,
        tensorboard_script(port, logdir),
        comment="trainstack dev tensorboard",
        sleep=sleep,
    )
    _require_success(done, "starting TensorBoard", box.instance_id)
    started = between_markers(done.stdout)
    if not started or not started[0].get("up"):
        raise CliError(
            f"TensorBoard did not answer on port {port} of dev box {box.instance_id}; its log is "
            f"{WORKSPACE}/.trainstack/tensorboard-{port}.log"
        )
    return _forward(clients, box.instance_id, port, local, f"http://127.0.0.1:{local}/", exec_)


def add_server_commands(dev_commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    jupyter = dev_commands.add_parser(
        "jupyter",
        parents=parents,
        help="start JupyterLab on the dev box (127.0.0.1 only), forward it, print its URL with the token",
        description="Starts JupyterLab in the workspace as the box's user, or reuses the one already serving "
        "the port, then forwards the port through Session Manager until Ctrl-C.",
    )
    jupyter.add_argument(
        "--port",
        type=int,
        default=JUPYTER_PORT,
        metavar="N",
        help=f"port on the box (default {JUPYTER_PORT})",
    )
    jupyter.add_argument("--local-port", type=int, metavar="N", help="local port (default: --port)")
    tensorboard = dev_commands.add_parser(
        "tensorboard",
        parents=parents,
        help="start TensorBoard on the dev box (127.0.0.1 only) and forward it",
        description="Starts TensorBoard on LOGDIR as the box's user, or reuses the one already serving that "
        "folder on the port, then forwards the port through Session Manager until Ctrl-C.",
    )
    tensorboard.add_argument(
        "--logdir",
        default=DEFAULT_LOGDIR,
        metavar="D",
        help=f"event files' folder on the box, relative to {WORKSPACE} (default {DEFAULT_LOGDIR})",
    )
    tensorboard.add_argument(
        "--port",
        type=int,
        default=TENSORBOARD_PORT,
        metavar="N",
        help=f"port on the box (default {TENSORBOARD_PORT})",
    )
    tensorboard.add_argument("--local-port", type=int, metavar="N", help="local port (default: --port)")


def dispatch(
    args: argparse.Namespace, stack: Stack, clients: Clients, exec_: Exec = replace_process
) -> int | None:
    action = getattr(args, "dev_command", None)
    if action == "jupyter":
        return run_jupyter(clients, stack, port=args.port, local_port=args.local_port, exec_=exec_)
    if action == "tensorboard":
        return run_tensorboard(
            clients, stack, logdir=args.logdir, port=args.port, local_port=args.local_port, exec_=exec_
        )
    return None

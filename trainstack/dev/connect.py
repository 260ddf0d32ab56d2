"""`trainstack dev ssh-config` / `dev proxy`: editors reach the dev box by SSH carried inside Session Manager.

No port is open and no long-lived key is on the box: each connection pushes the user's public key with EC2
Instance Connect (valid 60 s, only for the first login) and tunnels SSH through `aws ssm start-session`
(AWS-StartSSHSession). The SSH config entry names no address, so it survives every new dev box: the
ProxyCommand finds the stack's current one when ssh connects.

Host keys: the entry pins the box's host key under one alias in a known_hosts file of this stack's own, with
`StrictHostKeyChecking accept-new`; `dev proxy` empties that file when the dev box is a new instance (new
instance, new host key), so the first key of each instance is accepted and any change on the same instance
is refused. Accepting that first key is safe enough because the SSH stream never crosses the network on its
own: Session Manager delivers it, over TLS authenticated by AWS, to the SSM agent of the instance id the
ProxyCommand resolved with the user's credentials; nobody in between can present another host key. And the
instance is resolved by more than its `trainstack:dev` tag, which anyone who may run instances can set: it
must come from the stack's dev template, with the stack's dev profile, in its subnets (identity.py), or
known_hosts is left as it is and the proxy refuses.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

from trainstack.aws import Clients, error_code
from trainstack.dev import servers
from trainstack.dev.identity import require_trusted_dev_box
from trainstack.dev.instances import dev_box_name
from trainstack.dev.servers import SSH_USER
from trainstack.errors import CliError
from trainstack.session import Exec, replace_process, require_session_tools, session_command
from trainstack.stack import Stack

SSH_DOCUMENT = "AWS-StartSSHSession"
SERVER_ALIVE_SECONDS = 30
OPENSSH_INSTALL = (
    "install the OpenSSH client (apt install openssh-client; on Windows: Settings → Optional features)"
)

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


def host_alias(stack_name: str) -> str:
    """The SSH host name of the stack's dev box (a Pulumi stack may be named org/project/stack)."""
    return "trainstack-" + re.sub(r"[^A-Za-z0-9_.-]", "-", stack_name)


@dataclass(frozen=True)
class SshFiles:
    """Where this stack's SSH files live: all under ~/.ssh/trainstack/<alias>/, none ever uploaded."""

    folder: Path

    @classmethod
    def for_stack(cls, stack_name: str, home: Path | None = None) -> SshFiles:
        return cls((home or Path.home()) / ".ssh" / "trainstack" / host_alias(stack_name))

    @property
    def key(self) -> Path:
        return self.folder / "id_ed25519"

    @property
    def public_key(self) -> Path:
        return self.folder / "id_ed25519.pub"

    @property
    def known_hosts(self) -> Path:
        return self.folder / "known_hosts"

    @property
    def last_instance(self) -> Path:
        """The instance whose host key known_hosts holds."""
        return self.folder / "instance"


def ensure_key(files: SshFiles, comment: str, run: Runner = subprocess.run) -> str:
    """The stack's ed25519 public key, generating the pair once (private key 0600, folder 0700)."""
    files.folder.mkdir(parents=True, exist_ok=True)
    files.folder.chmod(0o700)
    if not files.key.is_file():
        if shutil.which("ssh-keygen") is None:
            raise CliError(f"ssh-keygen is not on PATH: {OPENSSH_INSTALL}, then retry")
        files.public_key.unlink(missing_ok=True)
        made = run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(files.key)],
            capture_output=True,
            text=True,
            check=False,
        )
        if made.returncode != 0 or not files.key.is_file():
            why = (made.stderr or made.stdout).strip().splitlines()[-1:] or ["no key written"]
            raise CliError(f"ssh-keygen failed for {files.key}: {why[0]}")
    # ssh refuses a private key others can read ("UNPROTECTED PRIVATE KEY FILE").
    files.key.chmod(0o600)
    if not files.public_key.is_file():
        raise CliError(
            f"{files.public_key} is missing beside {files.key}: delete {files.key} and run "
            "`trainstack dev ssh-config` again for a new pair"
        )
    return files.public_key.read_text(encoding="utf-8").strip()


def _launcher() -> list[str]:
    """How ssh starts this CLI: the `trainstack` on PATH now, else this interpreter (an editor's ssh may run
    with another PATH, so the path is absolute either way)."""
    found = shutil.which("trainstack")
    return [str(Path(found).resolve())] if found else [sys.executable, "-m", "trainstack"]


def proxy_command(stack: Stack, *, region: str | None) -> str:
    """`trainstack dev proxy %h %p` with everything that picks this stack, so it works from any folder."""
    words = [*_launcher(), "dev", "proxy", "%h", "%p", "--stack", stack.name]
    words += ["--cwd", str(stack.project_dir.resolve())]
    if stack.outputs_file is not None:
        words += ["--outputs", str(stack.outputs_file.resolve())]
    if region:
        words += ["--region", region]
    profile = os.environ.get("AWS_PROFILE")
    prefix = ["env", f"AWS_PROFILE={profile}"] if profile else []
    # %h and %p are ssh's tokens: left unquoted so ssh substitutes them.
    return " ".join(w if w in ("%h", "%p") else shlex.quote(w) for w in [*prefix, *words])


def _begin(stack_name: str) -> str:
    return f"# >>> trainstack dev box of stack {stack_name} (`trainstack dev ssh-config --write`) >>>"


def _end(stack_name: str) -> str:
    return f"# <<< trainstack dev box of stack {stack_name} <<<"


def _ssh_path(path: Path, home: Path) -> str:
    """A path as ssh_config reads it: ~ for the home folder, quoted when it holds a space."""
    try:
        text = "~/" + path.relative_to(home).as_posix()
    except ValueError:
        text = path.as_posix()
    return f'"{text}"' if " " in text else text


def render_entry(stack_name: str, files: SshFiles, proxy: str, home: Path | None = None) -> str:
    """The `Host trainstack-<stack>` block, between the markers that make `--write` idempotent."""
    home = home or Path.home()
    alias = host_alias(stack_name)
    options = [
        ("HostName", alias),
        ("User", SSH_USER),
        ("IdentityFile", _ssh_path(files.key, home)),
        ("IdentitiesOnly", "yes"),
        ("ProxyCommand", proxy),
        ("HostKeyAlias", alias),
        ("UserKnownHostsFile", _ssh_path(files.known_hosts, home)),
        ("StrictHostKeyChecking", "accept-new"),
        ("ServerAliveInterval", str(SERVER_ALIVE_SECONDS)),
        ("ServerAliveCountMax", "4"),
    ]
    lines = [_begin(stack_name), f"Host {alias}", *(f"    {k} {v}" for k, v in options), _end(stack_name)]
    return "\n".join(lines) + "\n"


def merge_entry(existing: str, entry: str, stack_name: str, source: str) -> str:
    """`existing` with this stack's block replaced by `entry`, or `entry` first when there is none: ssh takes
    the first value it finds for each option, so a `Host *` above the block would override its User."""
    begin, end = _begin(stack_name), _end(stack_name)
    lines = existing.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.rstrip("\n") == begin]
    if not starts:
        separator = "\n" if existing.strip() else ""
        return entry + separator + existing
    start = starts[0]
    ends = [i for i, line in enumerate(lines) if i > start and line.rstrip("\n") == end]
    if not ends:
        raise CliError(
            f"{source}: line {start + 1} opens the trainstack block of stack {stack_name} but no line "
            f"closes it ({end!r}): delete that block by hand, then run `trainstack dev ssh-config --write`"
        )
    return "".join(lines[:start]) + entry + "".join(lines[ends[0] + 1 :])


def write_entry(config: Path, entry: str, stack_name: str) -> bool:
    """Writes the block into `config` (created 0600 in a 0700 folder); False when it was already there."""
    config.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    existing = config.read_text(encoding="utf-8") if config.is_file() else ""
    merged = merge_entry(existing, entry, stack_name, str(config))
    if merged == existing:
        return False
    mode = config.stat().st_mode & 0o777 if config.is_file() else 0o600
    # Written beside it and renamed: an editor reading the config never sees half of it.
    handle, temporary = tempfile.mkstemp(dir=config.parent, prefix=".config.trainstack-")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(merged)
        Path(temporary).chmod(mode)
        Path(temporary).replace(config)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return True


def run_ssh_config(stack: Stack, *, region: str | None, write: bool, home: Path | None = None) -> int:
    dev_box_name(
        stack.outputs
    )  # a stack without the dev template gets the fix, not an entry that cannot work
    home = home or Path.home()
    files = SshFiles.for_stack(stack.name, home)
    ensure_key(files, comment=f"trainstack {host_alias(stack.name)}")
    entry = render_entry(stack.name, files, proxy_command(stack, region=region), home)
    alias = host_alias(stack.name)
    if not write:
        sys.stdout.write(entry)
        print(f"# `trainstack dev ssh-config --write` puts this into ~/.ssh/config; then: ssh {alias}")
        return 0
    config = home / ".ssh" / "config"
    changed = write_entry(config, entry, stack.name)
    state = "wrote" if changed else "already current:"
    print(f"{state} Host {alias} in {config}; connect with `ssh {alias}` or VS Code Remote-SSH → {alias}")
    return 0


def reset_known_host_if_new(files: SshFiles, instance_id: str) -> None:
    """A new dev box has a new host key: forget the old one, so accept-new takes the new box's first key."""
    previous = (
        files.last_instance.read_text(encoding="utf-8").strip() if files.last_instance.is_file() else ""
    )
    if previous != instance_id:
        files.known_hosts.write_text("", encoding="utf-8")
        files.last_instance.write_text(instance_id + "\n", encoding="utf-8")


def push_public_key(clients: Clients, instance_id: str, public_key: str) -> None:
    """EC2 Instance Connect: the key is accepted for one login within 60 s, then the box forgets it."""
    try:
        answer = clients.client("ec2-instance-connect").send_ssh_public_key(
            InstanceId=instance_id, InstanceOSUser=SSH_USER, SSHPublicKey=public_key
        )
    except ClientError as error:
        code = error_code(error)
        if code in ("EC2InstanceNotFoundException", "EC2InstanceStateInvalidException"):
            raise CliError(
                f"dev box {instance_id} is not running ({code}): see `trainstack dev status`; "
                "`trainstack dev up` starts one"
            ) from None
        if code == "EC2InstanceUnavailableException":
            raise CliError(
                f"EC2 Instance Connect cannot reach {instance_id} yet (its agent starts at boot): "
                "retry in a minute"
            ) from None
        raise
    if not answer.get("Success", True):
        raise CliError(
            f"EC2 Instance Connect refused the key for {instance_id}: retry, or `trainstack dev up`"
        )


def ssh_session_command(instance_id: str, region: str | None, port: int) -> list[str]:
    return [
        *session_command(instance_id, region),
        "--document-name",
        SSH_DOCUMENT,
        "--parameters",
        f"portNumber={port}",
    ]


def run_proxy(
    clients: Clients,
    stack: Stack,
    *,
    host: str,
    port: int,
    exec_: Exec = replace_process,
    home: Path | None = None,
) -> int:
    """ssh's ProxyCommand: stdin/stdout become the SSH stream, so nothing but errors is ever printed."""
    alias = host_alias(stack.name)
    if host.lower() != alias.lower():
        raise CliError(
            f"dev proxy {host}: this stack's dev box is {alias}; run `trainstack dev ssh-config --write`, "
            f"then `ssh {alias}`"
        )
    if not 1 <= port <= 65535:
        raise CliError(f"dev proxy PORT {port}: a TCP port is 1-65535 (SSH is 22)")
    require_session_tools()
    files = SshFiles.for_stack(stack.name, home)
    if not files.key.is_file() or not files.public_key.is_file():
        raise CliError(
            f"no SSH key for {alias} in {files.folder}: run `trainstack dev ssh-config --write` first"
        )
    # Before any key is pushed or known_hosts emptied: only an instance that is the stack's dev box by its
    # template, profile and network (not by its tag alone) may have its first host key accepted.
    box = require_trusted_dev_box(clients, stack.outputs)
    if box.state != "running":
        raise CliError(f"dev box {box.instance_id} is still {box.state}: retry in a minute")
    push_public_key(clients, box.instance_id, files.public_key.read_text(encoding="utf-8").strip())
    reset_known_host_if_new(files, box.instance_id)
    command = ssh_session_command(box.instance_id, clients.region, port)
    exec_(command[0], command)
    return 0


# The `dev` subcommands this module (and servers.py) answer; the rest are the lifecycle's.
COMMANDS = frozenset({"ssh-config", "proxy", "jupyter", "tensorboard"})


def add_dev_connect_commands(dev_commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    """`dev ssh-config`, `dev proxy`, `dev jupyter`, `dev tensorboard` under the `dev` group."""
    ssh_config = dev_commands.add_parser(
        "ssh-config",
        parents=parents,
        help="an SSH config entry for the dev box (VS Code Remote-SSH, PyCharm, ssh, rsync): no open port",
        description="Prints (or with --write puts into ~/.ssh/config, replacing only its own block) a "
        "`Host trainstack-<stack>` entry whose ProxyCommand is `trainstack dev proxy`: SSH through Session "
        "Manager with a key pushed for 60 s by EC2 Instance Connect. The key is generated once under "
        "~/.ssh/trainstack/ and never uploaded.",
    )
    ssh_config.add_argument("--write", action="store_true", help="write the entry into ~/.ssh/config")
    proxy = dev_commands.add_parser(
        "proxy",
        parents=parents,
        help="ssh's ProxyCommand (written by ssh-config): push the key, then tunnel SSH through SSM",
    )
    proxy.add_argument("host", metavar="HOST", help="the entry's host name, trainstack-<stack> (ssh's %%h)")
    proxy.add_argument("port", type=int, metavar="PORT", help="the SSH port on the box (ssh's %%p)")
    servers.add_server_commands(dev_commands, parents)


def dispatch(args: argparse.Namespace, stack: Stack, clients: Clients, exec_: Exec = replace_process) -> int:
    """Runs one of COMMANDS."""
    action = args.dev_command
    if action == "ssh-config":
        return run_ssh_config(stack, region=args.region, write=args.write)
    if action == "proxy":
        return run_proxy(clients, stack, host=args.host, port=args.port, exec_=exec_)
    code = servers.dispatch(args, stack, clients, exec_)
    if code is None:
        raise CliError(f"unknown dev command {action!r}: see `trainstack dev --help`")
    return code

"""`trainstack dev ssh-config|proxy|jupyter|tensorboard`: editors reach the dev box with no open port.

The SSH entry is parsed back (and resolved by `ssh -G` where OpenSSH is installed); `dev proxy` pushes its key
through moto's EC2 Instance Connect and hands ssh's stdin/stdout to a fake `aws` that records its argv; the
Jupyter and TensorBoard starts run against moto's Run Command, or a recorded answer of the box.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from demo.stack import STAND_IN_AMI
from tests.tools import require_tool
from trainstack.aws import Clients, new_session
from trainstack.dev import servers
from trainstack.dev.connect import SshFiles, host_alias, merge_entry
from trainstack.dev.instances import DEV_TAG
from trainstack.errors import CliError

from .conftest import REGION, STACK, Result, write_project

ALIAS = host_alias(STACK)
DEV_BOX = "trainstack-test-dev"
RECORDED_SERVER_LIST = (
    "[W 2026-12-01 10:00:00.000 ServerApp] A `_jupyter_server_extension_points` function was not found\n"
    '{"base_url": "/", "hostname": "127.0.0.1", "password": false, "pid": 4242, "port": 8888, '
    '"root_dir": "/workspace", "secure": false, "sock": "", "token": "5e1f0c2b9a", '
    '"url": "http://127.0.0.1:8888/", "version": "2.14.2"}\n'
    '{"base_url": "/lab2/", "hostname": "127.0.0.1", "password": false, "pid": 4343, "port": 8890, '
    '"root_dir": "/workspace", "secure": false, "sock": "", "token": "77aa", '
    '"url": "http://127.0.0.1:8890/lab2/", "version": "2.14.2"}\n'
)


@dataclass
class DevStack:
    project: Path
    outputs_file: Path
    home: Path
    argv_file: Path
    pushed: list[dict[str, Any]]
    clients: Clients
    cli: Callable[..., Result]
    instance_id: str = ""

    def run(self, *argv: str, clients: Clients | None = None) -> Result:
        where = ["--cwd", str(self.project), "--stack", STACK, "--outputs", str(self.outputs_file)]
        return self.cli(*argv, *where, clients=clients or self.clients)

    @property
    def files(self) -> SshFiles:
        return SshFiles.for_stack(STACK, self.home)

    def session_argv(self) -> list[str]:
        return self.argv_file.read_text().splitlines()


def _fake_tools(bin_dir: Path, record: Path) -> None:
    """Stand-ins for the AWS CLI and the Session Manager plugin; `aws` records the argv it was handed."""
    bin_dir.mkdir()
    aws = bin_dir / "aws"
    aws.write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > {record}\n')
    plugin = bin_dir / "session-manager-plugin"
    plugin.write_text("#!/bin/sh\nexit 0\n")
    for tool in (aws, plugin):
        tool.chmod(0o755)


@pytest.fixture()
def box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli: Callable[..., Result]) -> DevStack:
    """A deployed stack with a dev template as its outputs say (no AWS call needed to read them), a home
    folder of its own, and `exec` running the fake `aws` instead of replacing the test's process."""
    project = write_project(tmp_path, {"aws:region": REGION})
    outputs = {
        "region": REGION,
        "bucket_name": "trainstack-test-data",
        "group_name": "trainstack-test-gpu",
        "dev_template_id": "lt-0dev",
        "dev_box_name": DEV_BOX,
    }
    outputs_file = tmp_path / "outputs.json"
    outputs_file.write_text(json.dumps(outputs), encoding="utf-8")
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    bin_dir, argv_file = tmp_path / "bin", tmp_path / "aws-argv"
    _fake_tools(bin_dir, argv_file)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def exec_fake(file: str, argv: Sequence[str]) -> None:
        # The session replaces the CLI's process on a user's machine; here it runs and returns.
        subprocess.run([str(shutil.which(file)), *argv[1:]], check=True, timeout=30)

    monkeypatch.setattr(os, "execvp", exec_fake)
    pushed: list[dict[str, Any]] = []
    session = new_session()
    session.events.register(
        "provide-client-params.ec2-instance-connect.SendSSHPublicKey",
        lambda params, **_: pushed.append(dict(params)),
    )
    return DevStack(project, outputs_file, home, argv_file, pushed, Clients(None, session=session), cli)


@pytest.fixture()
def dev(box: DevStack, aws: Any) -> DevStack:
    """`box` with its dev box up in moto, launched from the stack's dev template in its subnet as `trainstack
    dev up` does: the proxy trusts no instance by its tag alone (trainstack/dev/identity.py)."""
    ec2 = boto3.client("ec2", region_name=REGION)
    subnet = ec2.describe_subnets()["Subnets"][0]["SubnetId"]
    template_id = ec2.create_launch_template(
        LaunchTemplateName=DEV_BOX, LaunchTemplateData={"ImageId": STAND_IN_AMI, "InstanceType": "g6.xlarge"}
    )["LaunchTemplate"]["LaunchTemplateId"]
    outputs = json.loads(box.outputs_file.read_text(encoding="utf-8"))
    outputs.update(dev_template_id=template_id, dev_subnet_ids=[subnet])
    box.outputs_file.write_text(json.dumps(outputs), encoding="utf-8")
    box.instance_id = ec2.run_instances(
        LaunchTemplate={"LaunchTemplateId": template_id, "Version": "$Default"},
        MinCount=1,
        MaxCount=1,
        SubnetId=subnet,
        TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": DEV_TAG, "Value": DEV_BOX}]}],
    )["Instances"][0]["InstanceId"]
    return box


def parse_ssh_config(text: str) -> dict[str, dict[str, str]]:
    """`Host` blocks as {host: {option (lower case): value}}, the way ssh_config reads them."""
    hosts: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        key, _, value = stripped.partition(" ")
        if key.lower() == "host":
            current = hosts.setdefault(value.strip(), {})
        elif current is not None:
            current.setdefault(key.lower(), value.strip())
    return hosts


def test_ssh_config_entry_names_the_proxy_the_key_and_a_host_key_alias(box: DevStack) -> None:
    result = box.run("dev", "ssh-config")

    assert result.code == 0, result.err
    entry = parse_ssh_config(result.out)[ALIAS]
    assert entry["user"] == "ubuntu"
    assert entry["identityfile"] == "~/.ssh/trainstack/trainstack-test/id_ed25519"
    assert entry["identitiesonly"] == "yes"
    proxy = entry["proxycommand"]
    assert " dev proxy %h %p --stack test --cwd " in proxy
    assert f"--outputs {box.outputs_file.resolve()}" in proxy
    assert entry["hostkeyalias"] == ALIAS
    assert entry["userknownhostsfile"] == "~/.ssh/trainstack/trainstack-test/known_hosts"
    assert entry["stricthostkeychecking"] == "accept-new"
    assert int(entry["serveraliveinterval"]) > 0
    # The key pair exists once, private key readable by the user only, and nothing else was written.
    assert stat.S_IMODE(box.files.key.stat().st_mode) == 0o600
    assert stat.S_IMODE(box.files.folder.stat().st_mode) == 0o700
    assert box.files.public_key.read_text().startswith("ssh-ed25519 ")
    assert not (box.home / ".ssh" / "config").exists()
    # OpenSSH's own reading of the entry: what VS Code Remote-SSH and rsync will get (without ssh: a skip
    # locally, a failure naming it in CI; never an assertion silently left out).
    ssh = require_tool("ssh", "reads the entry as OpenSSH does (apt-get install openssh-client)")
    config = box.home / "printed-config"
    config.write_text(result.out)
    resolved = subprocess.run(
        [ssh, "-G", "-F", str(config), ALIAS], capture_output=True, text=True, check=True, timeout=10
    ).stdout
    options = dict(line.split(" ", 1) for line in resolved.splitlines() if " " in line)
    assert options["user"] == "ubuntu"
    assert options["hostkeyalias"] == ALIAS
    assert options["identityfile"] == "~/.ssh/trainstack/trainstack-test/id_ed25519"
    project, outputs = box.project.resolve(), box.outputs_file.resolve()
    where = f"--stack test --cwd {project} --outputs {outputs}"
    assert options["proxycommand"].endswith(f" dev proxy %h %p {where}")


def test_write_puts_the_entry_first_keeps_the_users_entries_and_is_idempotent(box: DevStack) -> None:
    config = box.home / ".ssh" / "config"
    config.parent.mkdir(mode=0o700)
    users = "Host *\n    User someone-else\n\nHost build\n    HostName build.example.com\n"
    config.write_text(users)
    config.chmod(0o600)

    first = box.run("dev", "ssh-config", "--write")
    key_before = box.files.key.read_bytes()
    written = config.read_text()
    second = box.run("dev", "ssh-config", "--write")

    assert first.code == 0 and "wrote Host trainstack-test" in first.out, first.err
    assert second.code == 0 and "already current" in second.out
    assert config.read_text() == written  # the second run changed nothing, not even the key
    assert box.files.key.read_bytes() == key_before
    assert written.endswith(users)  # every entry of the user's kept, byte for byte
    # First in the file: ssh takes the first value of each option, so `Host *`'s User cannot win.
    assert written.index(f"Host {ALIAS}") < written.index("Host *")
    assert written.count(f"Host {ALIAS}") == 1
    assert stat.S_IMODE(config.stat().st_mode) == 0o600


def test_a_changed_entry_replaces_only_its_own_block() -> None:
    begin = "# >>> trainstack dev box of stack test (`trainstack dev ssh-config --write`) >>>"
    end = "# <<< trainstack dev box of stack test <<<"
    existing = f"Host a\n    User x\n{begin}\nHost trainstack-test\n    User old\n{end}\nHost b\n    User y\n"
    new_entry = f"{begin}\nHost trainstack-test\n    User ubuntu\n{end}\n"

    merged = merge_entry(existing, new_entry, "test", "config")

    assert merged == f"Host a\n    User x\n{new_entry}Host b\n    User y\n"
    with pytest.raises(CliError, match=r"config: line 3 opens the trainstack block of stack test"):
        merge_entry(f"Host a\n    User x\n{begin}\nHost trainstack-test\n", new_entry, "test", "config")


def test_proxy_pushes_the_key_for_one_login_then_hands_ssh_to_an_ssm_session(dev: DevStack) -> None:
    assert dev.run("dev", "ssh-config", "--write").code == 0

    result = dev.run("dev", "proxy", ALIAS, "22")

    assert result.code == 0, result.err
    assert result.out == ""  # stdout is the SSH stream: nothing else may be written to it
    assert dev.pushed == [
        {
            "InstanceId": dev.instance_id,
            "InstanceOSUser": "ubuntu",
            "SSHPublicKey": dev.files.public_key.read_text().strip(),
        }
    ]
    assert dev.session_argv() == [
        "ssm",
        "start-session",
        "--target",
        dev.instance_id,
        "--region",
        REGION,
        "--document-name",
        "AWS-StartSSHSession",
        "--parameters",
        "portNumber=22",
    ]


def test_proxy_forgets_the_host_key_of_an_earlier_dev_box_only(dev: DevStack) -> None:
    assert dev.run("dev", "ssh-config", "--write").code == 0
    files = dev.files
    files.known_hosts.write_text(f"{ALIAS} ssh-ed25519 AAAAold\n")
    files.last_instance.write_text("i-0earlierbox\n")

    assert dev.run("dev", "proxy", ALIAS, "22").code == 0
    assert files.known_hosts.read_text() == ""  # a new box, a new host key: accepted once, then pinned
    assert files.last_instance.read_text().strip() == dev.instance_id

    files.known_hosts.write_text(f"{ALIAS} ssh-ed25519 AAAAnew\n")
    assert dev.run("dev", "proxy", ALIAS, "22").code == 0
    assert files.known_hosts.read_text() == f"{ALIAS} ssh-ed25519 AAAAnew\n"  # same box: the key stays pinned


def test_proxy_refuses_with_one_line_each(dev: DevStack) -> None:
    no_key = dev.run("dev", "proxy", ALIAS, "22")
    assert no_key.code == 1
    assert "no SSH key for trainstack-test" in no_key.err and "ssh-config --write" in no_key.err
    assert dev.run("dev", "ssh-config", "--write").code == 0

    other = dev.run("dev", "proxy", "build.example.com", "22")
    assert other.code == 1 and "this stack's dev box is trainstack-test" in other.err

    boto3.client("ec2", region_name=REGION).terminate_instances(InstanceIds=[dev.instance_id])
    gone = dev.run("dev", "proxy", ALIAS, "22")
    assert gone.code == 1 and "no dev box is up: `trainstack dev up`" in gone.err
    assert dev.pushed == [] and not dev.argv_file.exists()
    for result in (no_key, other, gone):
        assert len(result.err.strip().splitlines()) == 1


def test_jupyter_script_runs_as_ubuntu_in_the_workspace_bound_to_localhost_and_reuses_a_server() -> None:
    lines = servers.jupyter_script(8890)
    script = "\n".join(lines)

    assert (
        lines[0] == "sudo -u ubuntu -H bash -l -s <<'TRAINSTACK_SCRIPT'" and lines[-1] == "TRAINSTACK_SCRIPT"
    )
    assert "ws=/workspace" in script and 'cd "$ws"' in script
    assert "--ip=127.0.0.1" in script and "--port-retries=0" in script and "port=8890" in script
    assert "--no-browser" in script
    # Started only when `jupyter server list` does not already show the port; detached from Run Command.
    assert "if ! listed; then\n  setsid nohup jupyter-lab" in script
    assert script.index(servers.BEGIN) < script.index("jupyter server list --json 2>/dev/null || true")


def test_jupyter_url_comes_from_the_recorded_server_list() -> None:
    found = servers.between_markers(f"noise\n{servers.BEGIN}\n{RECORDED_SERVER_LIST}{servers.END}\ntail\n")

    assert [s["port"] for s in found] == [8888, 8890]
    assert servers.jupyter_url(found, 8888, 18888) == "http://127.0.0.1:18888/?token=5e1f0c2b9a"
    assert servers.jupyter_url(found, 8890, 8890) == "http://127.0.0.1:8890/lab2/?token=77aa"
    with pytest.raises(CliError, match=r"no Jupyter server on port 9999 .*\(ports: 8888, 8890\)"):
        servers.jupyter_url(found, 9999, 9999)


def test_tensorboard_script_keeps_the_logdir_literal() -> None:
    script = "\n".join(servers.tensorboard_script(6006, "runs/exp 1; $(reboot)"))

    assert "logdir='runs/exp 1; $(reboot)'" in script
    assert '--host 127.0.0.1 --port "$port"' in script
    assert 'if [ "$reused" = false ]; then' in script  # the same folder on the same port: reused


class RecordedBox:
    """SSM Run Command as the box answers it: `stdout` recorded from a real box, status as given."""

    def __init__(self, stdout: str, status: str = "Success", stderr: str = "") -> None:
        self.answer = {"Status": status, "StandardOutputContent": stdout, "StandardErrorContent": stderr}
        self.sent: list[dict[str, Any]] = []
        self.polls = 0

    def send_command(self, **params: Any) -> dict[str, Any]:
        self.sent.append(params)
        return {"Command": {"CommandId": "c-1"}}

    def get_command_invocation(self, **_: Any) -> dict[str, Any]:
        self.polls += 1
        return {"Status": "InProgress"} if self.polls == 1 else self.answer


def _with_ssm(ssm: Any) -> Clients:
    return Clients(None, session=new_session(), overrides={"ssm": ssm})


@pytest.fixture()
def no_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servers, "POLL_SECONDS", 0.0)


def test_jupyter_starts_on_the_box_then_forwards_and_prints_the_token_url(
    dev: DevStack, no_sleep: None
) -> None:
    box = RecordedBox(f"{servers.BEGIN}\n{RECORDED_SERVER_LIST}{servers.END}\n")

    result = dev.run("dev", "jupyter", "--local-port", "18888", clients=_with_ssm(box))

    assert result.code == 0, result.err
    assert result.out.splitlines()[0] == "http://127.0.0.1:18888/?token=5e1f0c2b9a"
    sent = box.sent[0]
    assert sent["InstanceIds"] == [dev.instance_id] and sent["DocumentName"] == "AWS-RunShellScript"
    assert sent["Parameters"]["commands"] == servers.jupyter_script(8888)
    argv = dev.session_argv()
    assert argv[:4] == ["ssm", "start-session", "--target", dev.instance_id]
    assert argv[argv.index("--document-name") + 1] == "AWS-StartPortForwardingSession"
    assert json.loads(argv[argv.index("--parameters") + 1]) == {
        "portNumber": ["8888"],
        "localPortNumber": ["18888"],
    }


def test_a_failed_start_is_one_line_with_the_boxs_error_and_forwards_nothing(
    dev: DevStack, no_sleep: None
) -> None:
    box = RecordedBox(
        "", status="Failed", stderr="pip: no matching distribution\nOSError: [Errno 28] No space\n"
    )

    result = dev.run("dev", "tensorboard", clients=_with_ssm(box))

    assert result.code == 1
    assert result.err.strip() == (
        f"trainstack: error: starting TensorBoard on dev box {dev.instance_id} failed (Failed): "
        "OSError: [Errno 28] No space"
    )
    assert not dev.argv_file.exists()


def test_tensorboard_reused_on_the_box_is_forwarded(dev: DevStack, no_sleep: None) -> None:
    answer = '{"port": 6006, "logdir": "runs", "reused": true, "up": true}'
    box = RecordedBox(f"{servers.BEGIN}\n{answer}\n{servers.END}\n")

    result = dev.run("dev", "tensorboard", "--port", "6007", clients=_with_ssm(box))

    assert result.code == 0, result.err
    assert result.out.splitlines()[0] == "http://127.0.0.1:6007/"
    assert "logdir=runs" in "\n".join(box.sent[0]["Parameters"]["commands"])


def test_jupyter_against_moto_run_command_says_which_server_is_missing(dev: DevStack, no_sleep: None) -> None:
    # moto runs no script: its invocation succeeds with empty output, so no server is listed.
    result = dev.run("dev", "jupyter")

    assert result.code == 1
    assert "no Jupyter server on port 8888 in the dev box's `jupyter server list` (ports: none)" in result.err
    assert not dev.argv_file.exists()


def test_bad_arguments_are_one_line_and_touch_nothing(box: DevStack) -> None:
    assert box.run("dev", "ssh-config", "--write").code == 0
    cases = {
        ("dev", "jupyter", "--port", "80"): "--port 80: use an unprivileged TCP port",
        ("dev", "tensorboard", "--logdir", " "): "--logdir ' ': a folder on the box",
        ("dev", "proxy", ALIAS, "0"): "dev proxy PORT 0: a TCP port is 1-65535",
    }
    for argv, message in cases.items():
        result = box.run(*argv)
        assert result.code == 1 and message in result.err and len(result.err.splitlines()) == 1
    assert box.pushed == [] and not box.argv_file.exists()


def _reserved_port() -> socket.socket:
    """A port the OS picked, held for the whole test by a socket bound and never listening (issue 27: no
    number probed free and handed on). While it is open no other process can bind the port: only a socket of
    this user that also sets SO_REUSEPORT, as the fake tensorboard does; with no fake server up, a connection
    there is refused, so the script's `up` on the port means our fake server and never a stranger."""
    reserved = socket.socket()
    reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    reserved.bind(("127.0.0.1", 0))
    return reserved


def _run_on_fake_box(body: str, bin_dir: Path, home: Path) -> subprocess.CompletedProcess[str]:
    """The script as Run Command runs it on the box (less the sudo), with the fake servers on PATH."""
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(home)}
    return subprocess.run(["bash", "-s"], input=body, env=env, capture_output=True, text=True, timeout=60)


def _fake_servers(bin_dir: Path, runs: Path) -> None:
    """`jupyter-lab` records each start and registers a server that `jupyter server list --json` lists;
    `tensorboard` records each start and serves HTTP on its --port (sharing the test's reservation
    of it) until killed."""
    bin_dir.mkdir()
    listing = runs / "servers.jsonl"
    (bin_dir / "jupyter-lab").write_text(
        f"#!{sys.executable}\n"
        "import json, sys, time\n"
        f"open({str(runs / 'jupyter-starts')!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "port = int(next(a for a in sys.argv if a.startswith('--port=')).split('=')[1])\n"
        "server = {'port': port, 'base_url': '/', 'token': f't{port}'}\n"
        f"open({str(listing)!r}, 'a').write(json.dumps(server) + '\\n')\n"
        "time.sleep(3)\n"
    )
    (bin_dir / "jupyter").write_text(
        f"#!/bin/sh\n[ \"$1 $2 $3\" = 'server list --json' ] && cat {listing} 2>/dev/null\n"
    )
    (bin_dir / "tensorboard").write_text(
        f"#!{sys.executable}\n"
        "import http.server, socket, sys\n"
        f"open({str(runs / 'tensorboard-starts')!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "port = int(sys.argv[sys.argv.index('--port') + 1])\n"
        "class Server(http.server.HTTPServer):\n"
        "    def server_bind(self):\n"
        "        # joins the test's reservation of the port (_reserved_port)\n"
        "        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)\n"
        "        super().server_bind()\n"
        "Server(('127.0.0.1', port), http.server.SimpleHTTPRequestHandler).serve_forever()\n"
    )
    for tool in ("jupyter-lab", "jupyter", "tensorboard"):
        (bin_dir / tool).chmod(0o755)


def test_jupyter_script_on_a_box_starts_one_server_and_reuses_it(tmp_path: Path) -> None:
    workspace, runs = tmp_path / "workspace", tmp_path / "runs"
    workspace.mkdir()
    runs.mkdir()
    _fake_servers(tmp_path / "bin", runs)
    body = servers.jupyter_body(8899, workspace=str(workspace))

    first = _run_on_fake_box(body, tmp_path / "bin", tmp_path)
    second = _run_on_fake_box(body, tmp_path / "bin", tmp_path)

    assert first.returncode == 0, first.stderr
    assert second.returncode == 0, second.stderr
    starts = (runs / "jupyter-starts").read_text().splitlines()
    assert len(starts) == 1  # the second run found the server listed and started nothing
    assert "--ip=127.0.0.1" in starts[0] and f"--ServerApp.root_dir={workspace}" in starts[0]
    url = servers.jupyter_url(servers.between_markers(second.stdout), 8899, 8899)
    assert url == "http://127.0.0.1:8899/?token=t8899"
    missing = _run_on_fake_box(
        servers.jupyter_body(8899, str(tmp_path / "unmounted")), tmp_path / "bin", tmp_path
    )
    assert missing.returncode == 3 and "is not mounted or not writable" in missing.stderr


def test_tensorboard_script_on_a_box_reuses_the_same_folder_and_restarts_for_another(tmp_path: Path) -> None:
    workspace, runs = tmp_path / "workspace", tmp_path / "runs"
    workspace.mkdir()
    runs.mkdir()
    _fake_servers(tmp_path / "bin", runs)
    reserved = _reserved_port()
    port = int(reserved.getsockname()[1])
    pidfile = workspace / ".trainstack" / f"tensorboard-{port}.pid"
    try:
        answers = []
        for logdir in ("runs", "runs", "other runs"):
            done = _run_on_fake_box(
                servers.tensorboard_body(port, logdir, str(workspace)), tmp_path / "bin", tmp_path
            )
            assert done.returncode == 0, done.stderr
            answers.append(servers.between_markers(done.stdout)[0])
    finally:
        if pidfile.exists():
            os.kill(int(pidfile.read_text()), signal.SIGTERM)
        reserved.close()

    assert [(a["logdir"], a["reused"], a["up"]) for a in answers] == [
        ("runs", False, True),
        ("runs", True, True),
        ("other runs", False, True),
    ]
    starts = (runs / "tensorboard-starts").read_text().splitlines()
    assert starts == [
        f"--logdir runs --host 127.0.0.1 --port {port}",
        f"--logdir other runs --host 127.0.0.1 --port {port}",
    ]
    assert (workspace / "other runs").is_dir()


def test_without_ssh_keygen_or_with_a_readable_key_ssh_config_says_or_fixes_it(
    box: DevStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", str(box.argv_file.parent / "bin"))  # the fake aws only: no OpenSSH
    missing = box.run("dev", "ssh-config")
    assert missing.code == 1
    assert "ssh-keygen is not on PATH: install the OpenSSH client" in missing.err
    assert not box.files.key.exists()

    monkeypatch.setenv("PATH", path)
    assert box.run("dev", "ssh-config").code == 0
    box.files.key.chmod(0o644)  # copied around with a loose umask: ssh would refuse it
    assert box.run("dev", "ssh-config").code == 0
    assert stat.S_IMODE(box.files.key.stat().st_mode) == 0o600


class RefusingInstanceConnect:
    def send_ssh_public_key(self, **_: Any) -> dict[str, Any]:
        raise ClientError(
            {"Error": {"Code": "EC2InstanceStateInvalidException", "Message": "stopping"}}, "SendSSHPublicKey"
        )


def test_a_key_instance_connect_refuses_is_one_line_and_no_session(dev: DevStack) -> None:
    assert dev.run("dev", "ssh-config", "--write").code == 0
    clients = Clients(
        None, session=new_session(), overrides={"ec2-instance-connect": RefusingInstanceConnect()}
    )

    result = dev.run("dev", "proxy", ALIAS, "22", clients=clients)

    assert result.code == 1
    assert f"dev box {dev.instance_id} is not running (EC2InstanceStateInvalidException)" in result.err
    assert not dev.argv_file.exists()


def test_a_stack_without_the_dev_template_gets_the_fix_and_no_entry(box: DevStack) -> None:
    outputs = json.loads(box.outputs_file.read_text())
    del outputs["dev_template_id"], outputs["dev_box_name"]
    box.outputs_file.write_text(json.dumps(outputs))

    result = box.run("dev", "ssh-config", "--write")

    assert result.code == 1
    assert "`pulumi config set trainstack:devBox true && pulumi up`" in result.err
    assert not (box.home / ".ssh").exists()

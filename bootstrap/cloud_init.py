"""Instance user-data: a `#cloud-config` that freezes the OS, writes the agent config, starts the agent."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from bootstrap.agent_config import AgentConfig

# EC2 rejects user-data over 16 KB (before base64).
USER_DATA_LIMIT_BYTES = 16 * 1024
INSTANCE_DIR = Path(__file__).resolve().parent / "instance"
AGENT_CONFIG_PATH = "/etc/trainstack/agent.yaml"
BUNDLE_ENV_PATH = "/etc/trainstack/bundle.env"
# The job user and its IMDS firewall rule (bootstrap/instance/job-sandbox.sh, bootstrap/jobuser.py).
JOB_SANDBOX_PATH = "/usr/local/sbin/trainstack-job-sandbox"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_KEY = re.compile(r"^[A-Za-z0-9!_.*'()/-]+$")
# Turns apt's periodic jobs off even if a unit comes back after a package install.
_APT_PERIODIC_OFF = 'APT::Periodic::Update-Package-Lists "0";\nAPT::Periodic::Unattended-Upgrade "0";\n'


class UserDataError(ValueError):
    """User-data that cannot be rendered; the message names the input and the fix."""


def _instance_file(name: str) -> str:
    return (INSTANCE_DIR / name).read_text()


def _bundle_env(agent_config: AgentConfig, bundle_key: str, bundle_sha256: str) -> str:
    values = {
        "BUNDLE_BUCKET": agent_config.bucket,
        "BUNDLE_KEY": bundle_key,
        "BUNDLE_SHA256": bundle_sha256,
        "AWS_REGION": agent_config.region,
    }
    return "".join(f"{name}={shlex.quote(value)}\n" for name, value in values.items())


def _file(path: str, content: str, permissions: str = "0644") -> dict[str, Any]:
    return {"path": path, "owner": "root:root", "permissions": permissions, "content": content}


def render_user_data(agent_config: AgentConfig, *, bundle_key: str, bundle_sha256: str) -> str:
    """The `#cloud-config` document for the launch template: pure, deterministic, secret-free, < 16 KB."""
    if not _SHA256.match(bundle_sha256):
        raise UserDataError(
            f"bundle_sha256 {bundle_sha256!r} is not a lowercase sha256 hex digest; use build_bundle()"
        )
    if not _KEY.match(bundle_key) or bundle_key.startswith("/"):
        raise UserDataError(f"bundle_key {bundle_key!r} is not a plain S3 key; use CodeBundle.key()")
    # The agent records the config's bundle as the code its job is pinned to: it must be the one booted.
    for name, carried, booted in (
        ("bundle_key", agent_config.bundle_key, bundle_key),
        ("bundle_sha256", agent_config.bundle_sha256, bundle_sha256),
    ):
        if carried and carried != booted:
            raise UserDataError(
                f"agent config {name} {carried!r} is not the bundle booted ({booted!r}); build both from "
                "one CodeBundle"
            )
    document: dict[str, Any] = {
        # The DLAMI is already current; a boot-time upgrade would race the driver hold below.
        "package_update": False,
        "package_upgrade": False,
        # The seeds' SSH hardening by default: no root login, no passwords (SSM Session Manager instead).
        "disable_root": True,
        "ssh_pwauth": False,
        "write_files": [
            _file("/etc/apt/apt.conf.d/99trainstack-no-periodic", _APT_PERIODIC_OFF),
            _file(AGENT_CONFIG_PATH, agent_config.to_yaml(), "0640"),
            _file(BUNDLE_ENV_PATH, _bundle_env(agent_config, bundle_key, bundle_sha256), "0640"),
            _file("/usr/local/sbin/trainstack-prepare-os", _instance_file("prepare-os.sh"), "0755"),
            _file(JOB_SANDBOX_PATH, _instance_file("job-sandbox.sh"), "0755"),
            _file("/usr/local/sbin/trainstack-install-agent", _instance_file("install-agent.sh"), "0755"),
            _file("/etc/systemd/system/trainstack-agent.service", _instance_file("trainstack-agent.service")),
            _file(
                "/etc/systemd/system/trainstack-giveup.service", _instance_file("trainstack-giveup.service")
            ),
        ],
        "runcmd": [
            ["/usr/local/sbin/trainstack-prepare-os"],
            # Before anything of the job can run; the agent's unit runs it again at every start.
            [JOB_SANDBOX_PATH],
            ["/usr/local/sbin/trainstack-install-agent"],
        ],
    }
    text = "#cloud-config\n" + yaml.safe_dump(document, sort_keys=False, width=120)
    size = len(text.encode())
    if size > USER_DATA_LIMIT_BYTES:
        raise UserDataError(
            f"user-data is {size} bytes, over EC2's {USER_DATA_LIMIT_BYTES}: keep jobs out of the agent "
            "config (job, user_job) and submit them to the stack's queue (`trainstack run`, or "
            "trainstack:job / trainingConfig through `pulumi up`)"
        )
    return text

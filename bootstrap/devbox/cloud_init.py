"""The dev box's user-data: mount the workspace, write the stack outputs, install and start the idle watcher,
then install the trainstack CLI.

Bootstrap only: no agent, no job. The box boots the dev bundle (the agent's packages plus `trainstack/` and
`infra/`, infra/bundle.py DEV_BOX_PACKAGES), fetched and checked by the job instances' install script; the
CLI's own script comes in that bundle, so it costs the user-data one line.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from bootstrap.cloud_init import (
    BUNDLE_ENV_PATH,
    USER_DATA_LIMIT_BYTES,
    UserDataError,
    _file,
    _instance_file,
)
from bootstrap.devbox.watcher import STACK_OUTPUTS_PATH

DEV_INSTANCE_DIR = Path(__file__).resolve().parent / "instance"
WATCHER_SERVICE = "trainstack-devidle.service"
MOUNT_WORKSPACE_PATH = "/usr/local/sbin/trainstack-mount-workspace"
INSTALL_PATH = "/usr/local/sbin/trainstack-install-agent"
# In the bundle install-agent.sh has just unpacked and checked (bootstrap/devbox/instance/install-cli.sh).
INSTALL_CLI_PATH = "/opt/trainstack/current/bootstrap/devbox/instance/install-cli.sh"


def render_dev_user_data(stack_outputs: Mapping[str, Any], *, bundle_key: str, bundle_sha256: str) -> str:
    """The `#cloud-config` for the dev template: pure, secret-free (outputs are names and ARNs), < 16 KB.
    `stack_outputs` are the stack's outputs the CLI reads (trainstack_job.contract.StackOutput names): the
    box's `trainstack` reads them by default, so `trainstack run job.yaml` works there as on a laptop."""
    missing = [k for k in ("region", "bucket_name", "dev_box_name") if not stack_outputs.get(k)]
    if missing:
        raise UserDataError(
            f"dev box user-data: stack outputs {', '.join(missing)} missing; pass every output"
        )
    bundle_env = {
        "BUNDLE_BUCKET": str(stack_outputs["bucket_name"]),
        "BUNDLE_KEY": bundle_key,
        "BUNDLE_SHA256": bundle_sha256,
        "AWS_REGION": str(stack_outputs["region"]),
        # install-agent.sh starts this unit instead of the job agent's.
        "AGENT_SERVICE": WATCHER_SERVICE,
    }
    document: dict[str, Any] = {
        "package_update": False,
        "package_upgrade": False,
        "disable_root": True,
        "ssh_pwauth": False,
        "write_files": [
            _file(str(STACK_OUTPUTS_PATH), json.dumps(dict(stack_outputs), indent=2, sort_keys=True) + "\n"),
            _file(BUNDLE_ENV_PATH, "".join(f"{k}={shlex.quote(v)}\n" for k, v in bundle_env.items()), "0640"),
            _file(MOUNT_WORKSPACE_PATH, (DEV_INSTANCE_DIR / "mount-workspace.sh").read_text(), "0755"),
            _file(INSTALL_PATH, _instance_file("install-agent.sh"), "0755"),
            _file(f"/etc/systemd/system/{WATCHER_SERVICE}", (DEV_INSTANCE_DIR / WATCHER_SERVICE).read_text()),
        ],
        # The workspace first: the user may connect before the watcher's packages are installed. The CLI
        # last: the watcher guards the bill first.
        "runcmd": [[MOUNT_WORKSPACE_PATH], [INSTALL_PATH], [INSTALL_CLI_PATH]],
    }
    text = "#cloud-config\n" + yaml.safe_dump(document, sort_keys=False, width=120)
    size = len(text.encode())
    if size > USER_DATA_LIMIT_BYTES:
        raise UserDataError(f"dev box user-data is {size} bytes, over EC2's {USER_DATA_LIMIT_BYTES}")
    return text

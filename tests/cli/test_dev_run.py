"""From the dev box to a job in one step: the dev bundle unpacked as install-agent.sh unpacks it,
install-cli.sh's venv and `trainstack` command, and `trainstack run` from the developer's working folder
without the Pulumi SDK, against moto, its calls recorded as the dev box's role (the IAM check)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml

from bootstrap.devbox.cloud_init import render_dev_user_data
from infra.bundle import DEV_BOX_PACKAGES, CodeBundle, build_bundle
from tests.bootstrap.test_install_agent import _probe_wheel
from tests.cli.conftest import create_stack_resources
from tests.conftest import MotoServer

REPO = Path(__file__).resolve().parents[2]
INSTALL_CLI = REPO / "bootstrap" / "devbox" / "instance" / "install-cli.sh"
REGION = "us-east-1"
# The names tests/iam derives from a stack's name, so the dev role's calls are judged against this stack.
STACK = "devrun"
BUCKET, GROUP, LOG_GROUP = f"{STACK}-data", f"{STACK}-gpu", f"/trainstack/{STACK}"
OUTPUTS_PATH = "/etc/trainstack/stack-outputs.json"
# The AMI's python for install-cli.sh: `-m pip download` serves the test's wheels (no index here); the rest,
# the venv and the `-m pip install` into it included, is this python and its real pip.
FAKE_AMI_PYTHON = "\n".join(
    [
        "#!/bin/sh",
        'if [ "$1" = "-m" ] && [ "$2" = "pip" ] && [ "$3" = "download" ]; then',
        '  echo "$*" >> "$FAKE_PIP_LOG"',
        '  for a; do [ "$prev" = "--dest" ] && cp "$FAKE_WHEELS"/*.whl "$a"; prev=$a; done',
        "  exit 0",
        "fi",
        f'exec {sys.executable} "$@"',
        "",
    ]
)
# The box's interpreter as the CLI meets it: no Pulumi SDK, no torch; its clients recorded as the dev role's.
SITECUSTOMIZE = """
import builtins, os
_real_import = builtins.__import__
def _on_the_box(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and name.split(".")[0] in {"pulumi", "pulumi_aws", "torch", "torchvision"}:
        raise ImportError(f"{name} is not installed on the dev box")
    return _real_import(name, globals, locals, fromlist, level)
builtins.__import__ = _on_the_box
if os.environ.get("TRAINSTACK_IAM_RECORD"):
    from bootstrap.aws import record_calls
    from trainstack.aws import Clients
    _made_by_cli = Clients.client
    def _recorded(self, service, region=None):
        made = _made_by_cli(self, service, region)
        if not getattr(made, "_dev_role_recorded", False):
            record_calls(made, "dev-role", os.environ["TRAINSTACK_IAM_RECORD"])
            made._dev_role_recorded = True
        return made
    Clients.client = _recorded
"""
JOB_FILE = {"name": "notebook-idea", "command": ["python", "train.py"], "env": {"EPOCHS": "1"}}


@dataclass(frozen=True)
class Box:
    """The dev box's /opt/trainstack, /etc/trainstack and /usr/local/bin as install-cli.sh leaves them."""

    root: Path
    bundle: CodeBundle
    trainstack: Path
    outputs: Path
    site: Path
    install: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Box:
    root = tmp_path_factory.mktemp("devbox")
    bundle = build_bundle(packages=DEV_BOX_PACKAGES)
    unpacked = root / "opt" / bundle.sha256
    unpacked.mkdir(parents=True)
    subprocess.run(["tar", "-xzf", "-", "-C", str(unpacked)], input=bundle.data, check=True, timeout=60)
    (root / "opt" / "current").symlink_to(unpacked)
    wheels, bin_dir, site = root / "wheels", root / "bin", root / "site"
    for folder in (wheels, bin_dir, site):
        folder.mkdir()
    probe = _probe_wheel(wheels)
    # The box's lock names rich, which needs PyPI; a locked probe wheel proves the hashed offline install.
    lock = root / "requirements-cli.lock.txt"
    lock.write_text(
        f"trainstack-probe==1.0 \\\n    --hash=sha256:{hashlib.sha256(probe.read_bytes()).hexdigest()}\n"
    )
    (bin_dir / "python-ami").write_text(FAKE_AMI_PYTHON)
    (bin_dir / "python-ami").chmod(0o755)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(root),
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_INDEX": "1",
        "FAKE_PIP_LOG": str(root / "pip.log"),
        "FAKE_WHEELS": str(wheels),
        "TRAINSTACK_INSTALL_ROOT": str(root / "opt"),
        "TRAINSTACK_PYTORCH_PYTHON": str(bin_dir / "python-ami"),
        "TRAINSTACK_BIN_DIR": str(root / "usr-local-bin"),
        "TRAINSTACK_OUTPUTS_FILE": str(root / "etc" / "stack-outputs.json"),
        "TRAINSTACK_CLI_LOCK": str(lock),
    }
    install = subprocess.run(
        ["bash", str(INSTALL_CLI)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    (root / "etc").mkdir()
    return Box(
        root,
        bundle,
        root / "usr-local-bin" / "trainstack",
        root / "etc" / "stack-outputs.json",
        site,
        install,
    )


def test_install_cli_makes_a_venv_over_the_amis_env_with_the_hashed_lock_and_a_trainstack_command(
    box: Box,
) -> None:
    assert box.install.returncode == 0, box.install.stdout + box.install.stderr
    (download,) = (box.root / "pip.log").read_text().splitlines()
    assert all(f in download.split() for f in ("--require-hashes", "--only-binary=:all:", "--no-deps"))
    venv_python = box.root / "opt" / "cli" / "bin" / "python"
    seen = subprocess.run(
        [str(venv_python), "-c", "import trainstack_probe, yaml, boto3; print(trainstack_probe.__file__)"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.startswith(str(box.root / "opt" / "cli")), "the lock's packages go into the CLI's venv"
    wrapper = box.trainstack.read_text()
    assert f"TRAINSTACK_OUTPUTS:-{box.outputs}" in wrapper and "PYTHONSAFEPATH=1" in wrapper
    assert f'PYTHONPATH="{box.root / "opt" / "current"}' in wrapper


def test_install_cli_refuses_a_bundle_without_the_cli(tmp_path: Path) -> None:
    (tmp_path / "opt" / "current").mkdir(parents=True)
    env = {"PATH": "/usr/bin:/bin", "TRAINSTACK_INSTALL_ROOT": str(tmp_path / "opt")}
    result = subprocess.run(
        ["bash", str(INSTALL_CLI)], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 1
    assert "no trainstack CLI in" in result.stdout and "run pulumi up" in result.stdout
    assert not (tmp_path / "opt" / "cli").exists()


@pytest.fixture()
def stack(aws: MotoServer, box: Box) -> dict[str, Any]:
    """What `pulumi up` made, and the outputs the dev user-data writes to /etc/trainstack on the box."""
    key = create_stack_resources(BUCKET, GROUP, LOG_GROUP)
    topic = boto3.client("sns", region_name=REGION).create_topic(Name=f"{STACK}-alerts")["TopicArn"]
    # The keys infra/__main__.py passes the dev box.
    outputs = {
        "region": REGION,
        "bucket_name": BUCKET,
        "data_prefix": "data/",
        "code_prefix": "code/",
        "state_prefix": "state/",
        "jobs_prefix": "jobs/",
        "group_name": GROUP,
        "instance_count": 2,
        "instance_types": ["g6.xlarge"],
        "log_group_name": LOG_GROUP,
        "topic_arn": topic,
        "kms_key_arn": key,
        "dev_box_name": f"{STACK}-dev",
    }
    user_data = yaml.safe_load(
        render_dev_user_data(outputs, bundle_key=box.bundle.key(), bundle_sha256=box.bundle.sha256)
    )
    (written,) = [f["content"] for f in user_data["write_files"] if f["path"] == OUTPUTS_PATH]
    box.outputs.write_text(written)
    return outputs


def _on_the_box(box: Box, moto: MotoServer, *argv: str, cwd: Path) -> subprocess.Popen[str]:
    """`trainstack ARGV` as the developer types it on the box, in `cwd`."""
    env = {**moto.env(), "PATH": "/usr/bin:/bin", "HOME": str(box.root), "PYTHONPATH": str(box.site)}
    env["COLUMNS"] = "220"  # no wrapped line
    return subprocess.Popen(
        [str(box.trainstack), *argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=60)
    return process.returncode, out, err


def _object(key: str) -> bytes:
    return bytes(boto3.client("s3", region_name=REGION).get_object(Bucket=BUCKET, Key=key)["Body"].read())


def _bundle_names(data: bytes) -> set[str]:
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(data))) as tar:
        return set(tar.getnames())


def _working_folder(tmp_path: Path) -> Path:
    """A developer's folder in /workspace: the code tried in a notebook, a local venv, and folders named like
    the CLI's own packages (ignored by the CLI's import path, shipped as the job's files)."""
    folder = tmp_path / "workspace" / "idea"
    for name, text in {
        "train.py": "print('trained')\n",
        "notes/params.yaml": "lr: 0.1\n",
        "infra/__init__.py": "raise ImportError('the CLI imported the working folder')\n",
        "training/__init__.py": "raise ImportError('the CLI imported the working folder')\n",
        ".venv/lib/site.py": "x = 1\n",
        "checkpoints/step-1/model.pt": "weights\n",
    }.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    (folder / "job.yaml").write_text(yaml.safe_dump(JOB_FILE))
    return folder


def test_run_config_on_the_box_submits_with_the_boxs_outputs_and_wakes_the_group(
    box: Box, stack: dict[str, Any], aws: MotoServer, tmp_path: Path
) -> None:
    folder = _working_folder(tmp_path)
    (folder / "small.yaml").write_text((REPO / "training" / "configs" / "default.yaml").read_text())
    code, out, err = _finish(_on_the_box(box, aws, "run", "--config", "small.yaml", "--detach", cwd=folder))
    assert code == 0, err
    job_id = out.strip()
    assert job_id.startswith("small-")
    record = json.loads(_object(f"jobs/{job_id}/job.json"))
    assert json.loads(_object(f"queue/{job_id}.json"))["job_id"] == job_id
    bundle = _object(record["agent"]["bundle_key"])
    # The same sources as on a laptop, the same content-addressed bundle: the agent's packages, no CLI.
    assert hashlib.sha256(bundle).hexdigest() == build_bundle(REPO).sha256 == record["agent"]["bundle_sha256"]
    assert not {n for n in _bundle_names(bundle) if n.startswith(("trainstack/", "infra/"))}
    group = boto3.client("autoscaling", region_name=REGION).describe_auto_scaling_groups(
        AutoScalingGroupNames=[GROUP]
    )
    assert group["AutoScalingGroups"][0]["DesiredCapacity"] == 2, "a group at zero wakes for the job"


def _agent_ends_the_queued_job(end: str) -> threading.Thread:
    """Plays the agent: the job the box queued is taken and ends `end`."""

    def run() -> None:
        s3 = boto3.client("s3", region_name=REGION)
        # The CLI's own bound (_finish): a loaded machine may take most of it to start the CLI and submit.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            found = s3.list_objects_v2(Bucket=BUCKET, Prefix="queue/").get("Contents", [])
            if found:
                job_id = found[0]["Key"].removeprefix("queue/").removesuffix(".json")
                ledger = {"status": end, "lives": [], "total_cost_usd": 0.1}
                s3.put_object(Bucket=BUCKET, Key=f"jobs/{job_id}/state/ledger.json", Body=json.dumps(ledger))
                return
            time.sleep(0.02)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_run_job_yaml_on_the_box_ships_the_working_folder_and_follows_the_job_to_its_end(
    box: Box, stack: dict[str, Any], aws: MotoServer, tmp_path: Path
) -> None:
    # A job is running: the new one queues behind it (and the dev role reads the group, never EC2).
    scaling = boto3.client("autoscaling", region_name=REGION)
    scaling.update_auto_scaling_group(AutoScalingGroupName=GROUP, DesiredCapacity=1)
    folder = _working_folder(tmp_path)
    agent = _agent_ends_the_queued_job("completed")
    code, out, err = _finish(_on_the_box(box, aws, "run", "job.yaml", cwd=folder))
    agent.join(5)
    assert code == 0, out + err
    assert not agent.is_alive(), "the fake agent was still polling the queue 5 s after the job ended"
    last = out.strip().splitlines()[-1]
    assert last.startswith("job notebook-idea-") and " completed" in last, out
    (entry,) = boto3.client("s3", region_name=REGION).list_objects_v2(Bucket=BUCKET, Prefix="queue/")[
        "Contents"
    ]
    job_id = entry["Key"].removeprefix("queue/").removesuffix(".json")
    record = json.loads(_object(f"jobs/{job_id}/job.json"))
    bundle = _object(record["agent"]["bundle_key"])
    assert hashlib.sha256(bundle).hexdigest() == build_bundle(REPO, job_dir=folder).sha256
    shipped = {n.removeprefix("job/") for n in _bundle_names(bundle) if n.startswith("job/")}
    assert shipped == {
        "train.py",
        "job.yaml",
        "notes/params.yaml",
        "infra/__init__.py",
        "training/__init__.py",
    }
    (group,) = scaling.describe_auto_scaling_groups(AutoScalingGroupNames=[GROUP])["AutoScalingGroups"]
    assert group["DesiredCapacity"] == 1, "a group already up takes the job after its current one"


def test_the_box_cli_names_a_missing_outputs_file_and_the_fix(
    box: Box, aws: MotoServer, tmp_path: Path
) -> None:
    folder = _working_folder(tmp_path)
    missing = tmp_path / "nowhere.json"
    code, out, err = _finish(_on_the_box(box, aws, "run", "job.yaml", "--outputs", str(missing), cwd=folder))
    assert code == 1 and out == ""
    assert f"--outputs {missing}: no such file" in err and "Traceback" not in err

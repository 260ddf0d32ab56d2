"""What every demo story prepares before it boots an instance: the generated dataset, the code bundle in
the stack's bucket, the built-in trainer's config and the user-data `pulumi up` would render, checked.

The dataset and the trainer's model are sized for CPU: the stories prove what the agents and the trainer do
around a spot notice or a hand-over, not what a model learns, and every image, step and checkpoint megabyte
costs each test run CPU (moto serves every request in the demo's own process)."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bootstrap.agent_config import AgentConfig
from bootstrap.cloud_init import render_user_data
from demo.stack import LocalStack
from infra.bundle import CodeBundle, build_bundle
from training.sample_data import write_dataset

REPO = Path(__file__).resolve().parent.parent
JOB_CONFIG = REPO / "training" / "configs" / "tiny.yaml"
# 4 classes of 32 px shapes, 32 training and 8 validation images each: 160 files to push and sync (each one
# a request to moto per life), still learnt to a validation accuracy of 1.0 by the small model in 48 steps.
TRAIN_PER_CLASS = 32
VAL_PER_CLASS = 8
CLASSES = 4
# tiny.yaml's global batch is 32: 4 steps an epoch.
STEPS_PER_EPOCH = CLASSES * TRAIN_PER_CLASS // 32
# The stories' built-in trainer model: 0.35M parameters against resnet18's 11M (tiny.yaml's), so a step costs
# a third of the CPU and a checkpoint is 3 MB, not 86 (each one uploaded, hashed and kept by moto in memory).
MODEL = "shufflenet_v2_x0_5"


@dataclass(frozen=True)
class UserData:
    """The rendered user-data, where it was written, its size and the schema check's verdict."""

    text: str
    path: Path
    valid: str

    @property
    def size(self) -> int:
        return len(self.text.encode())


def one_torch_thread() -> dict[str, str]:
    """The environment a story's trainers get unless OMP_NUM_THREADS is set: one torch thread. The small
    model's operations are too small to split, and a second thread spins against the agent and the embedded
    AWS for the cores (measured on a loaded 2-core machine: 1.7 s a step with two threads, 0.1-0.45 s with
    one); the tests run every story so."""
    return {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": "1"}


def write_demo_dataset(workdir: Path) -> Path:
    """The generated ImageFolder dataset under workdir/dataset (train/ and val/): its folder."""
    root = workdir / "dataset"
    write_dataset(root, classes=CLASSES, train_per_class=TRAIN_PER_CLASS, val_per_class=VAL_PER_CLASS)
    return root


def upload_dataset(stack: LocalStack, root: Path, prefix: str = "data/") -> int:
    """Every file under `root` to the stack's data prefix, as a stack's first dataset: the count uploaded."""
    s3 = stack.client("s3")
    files = sorted(p for p in root.rglob("*") if p.is_file())
    for path in files:
        s3.upload_file(str(path), stack.bucket, prefix + path.relative_to(root).as_posix())
    return len(files)


def upload_bundle(stack: LocalStack, job_dir: Path | None = None) -> CodeBundle:
    """The code bundle as `pulumi up` uploads it (the agent, the trainer and `job_dir` if given)."""
    bundle = build_bundle(REPO, job_dir=job_dir)
    stack.client("s3").put_object(Bucket=stack.bucket, Key=bundle.key(), Body=bundle.data)
    return bundle


def trainer_config(epochs: int, **train: Any) -> dict[str, Any]:
    """tiny.yaml as shipped, trained for `epochs` on the stories' small model; `train` sets more of its
    train section (log_every_steps, processes)."""
    config: dict[str, Any] = yaml.safe_load(JOB_CONFIG.read_text())
    config["model"]["name"] = MODEL
    config["train"].update(epochs=epochs, **train)
    return config


def write_user_data(workdir: Path, config: AgentConfig, bundle: CodeBundle) -> UserData:
    """The user-data `pulumi up` renders for this agent config, written to workdir/user-data.yaml and checked
    against cloud-init's schema where cloud-init is installed."""
    text = render_user_data(config, bundle_key=bundle.key(), bundle_sha256=bundle.sha256)
    path = workdir / "user-data.yaml"
    path.write_text(text)
    return UserData(text, path, validate_user_data(path))


def validate_user_data(path: Path) -> str:
    """What was checked; a user-data file cloud-init's schema rejects raises, naming it."""
    yaml.safe_load(path.read_text())
    if shutil.which("cloud-init") is None:
        return "parses as YAML (cloud-init not installed: schema not checked)"
    result = subprocess.run(
        ["cloud-init", "schema", "-c", str(path)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"{path}: cloud-init schema rejected the user-data: {result.stdout.strip()}")
    return "valid per cloud-init schema"

"""A checkpoint's context: what wrote it (job, code, data, instance, GPU, precision, batch arithmetic,
torch/CUDA), recorded in its manifest.json under "context" so a later life, the CLI or a person can say what
it resumes from and what changed.

Standard library only (users' jobs import it). The built-in trainer fills every field; `trainstack_job.Job`
fills what the agent tells the job (TRAINSTACK_*) and what the job adds itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainstack_job.contract import SYNC_MANIFEST, JobEnv


@dataclass(frozen=True)
class CheckpointContext:
    """Every field may be None: an older checkpoint, or a job that does not know it."""

    job_id: str | None = None
    code_hash: str | None = None  # the code bundle's sha256 under the agent, else a hash of the source
    dataset_version: str | None = None  # "sha256:<16 hex>" of the synced data's listing; None if not synced
    instance_type: str | None = None
    device: str | None = None  # "cuda" or "cpu"
    gpu_model: str | None = None  # the device profile's ("L4"), or the CUDA device's name
    gpu_count: int | None = None
    # True when a GPU profile's precision ran on a CPU (the local world): the numbers are not a GPU's.
    emulated: bool = False
    precision: str | None = None  # "bf16", "fp16" or "fp32"
    loss_scaling: bool | None = None  # an fp16 GradScaler's state is in the checkpoint
    world_size: int | None = None
    global_batch: int | None = None
    micro_batch: int | None = None
    accumulation: int | None = None
    torch: str | None = None
    cuda: str | None = None  # the CUDA runtime torch used on a GPU; None on a CPU
    model: str | None = None
    optimizer: str | None = None  # the optimizer's class name: "SGD", "AdamW"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Any) -> CheckpointContext | None:
        """The context a manifest recorded; None when it has none. Unknown keys (a newer writer) and values
        of the wrong type (a hand-edited file) are dropped rather than trusted."""
        if not isinstance(raw, Mapping):
            return None
        values: dict[str, Any] = {}
        for item in dataclasses.fields(cls):
            value = raw.get(item.name)
            if item.name == "emulated":
                values[item.name] = value is True
            elif item.name == "loss_scaling":
                values[item.name] = value if isinstance(value, bool) else None
            elif item.type == "int | None":
                ok = isinstance(value, int) and not isinstance(value, bool)
                values[item.name] = value if ok else None
            else:
                values[item.name] = value if isinstance(value, str) else None
        return cls(**values)

    def describe(self) -> str:
        """`resnet18, SGD, bf16 on 1x L4` (what a person tells two runs apart by)."""
        what = [part for part in (self.model, self.optimizer) if part]
        return ", ".join([*what, f"{self.precision or 'unknown precision'} on {self.hardware()}"])

    def hardware(self) -> str:
        if self.gpu_model:
            where = f"{self.gpu_count or 1}x {self.gpu_model}"
            return f"{where} (emulated on cpu)" if self.emulated else where
        if self.device == "cpu":
            return f"{self.world_size or 1}x cpu"
        return self.device or "an unknown device"

    def differences(self, now: CheckpointContext) -> list[str]:
        """What changed from this (saved) context to `now`, one phrase each; fields either side does not know
        are not compared."""
        labels = {
            "job_id": "job",
            "code_hash": "code",
            "dataset_version": "dataset",
            "instance_type": "instance type",
            "precision": "precision",
            "world_size": "world size",
            "global_batch": "global batch",
            "micro_batch": "micro-batch",
            "accumulation": "accumulation",
            "torch": "torch",
            "cuda": "CUDA",
            "model": "model",
            "optimizer": "optimizer",
        }
        changed: list[str] = []
        known = (self.gpu_model or self.device) and (now.gpu_model or now.device)
        if known and self.hardware() != now.hardware():
            before, after = self.hardware(), now.hardware()
            suffix = " (emulated on cpu)"
            if self.emulated and now.emulated and self.gpu_model and now.gpu_model:
                # Both simulated: said once, after the pair.
                before, after = before.removesuffix(suffix), after.removesuffix(suffix) + suffix
            changed.append(f"device {before} -> {after}")
        for key, label in labels.items():
            before, after = getattr(self, key), getattr(now, key)
            if before is not None and after is not None and before != after:
                short = key in ("code_hash", "dataset_version")
                changed.append(
                    f"{label} {_short(before) if short else before} -> {_short(after) if short else after}"
                )
        return changed


def _short(value: Any) -> str:
    text = str(value)
    return text.split(":", 1)[-1][:12]


def dataset_version(directories: Iterable[Path | None]) -> str | None:
    """The synced dataset's version: a hash of the listing the agent synced it from (every object's key,
    size and ETag), from the first directory that holds one; None where no sync left a listing."""
    for directory in directories:
        if directory is None:
            continue
        try:
            listing = json.loads((directory / SYNC_MANIFEST).read_text())
        except (OSError, ValueError):
            continue
        canonical = json.dumps(listing, sort_keys=True, separators=(",", ":")).encode()
        return f"sha256:{hashlib.sha256(canonical).hexdigest()[:16]}"
    return None


def _int(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


def environment_context(
    environ: Mapping[str, str], data_dirs: Iterable[Path | None] = ()
) -> CheckpointContext:
    """What the agent told this job about where it runs (TRAINSTACK_*), the dataset's version, and torch's
    versions when the job has imported torch (never imported here: this module stays standard library)."""

    def value(var: JobEnv) -> str | None:
        return environ.get(var.value, "").strip() or None

    data = value(JobEnv.DATA_DIR)
    torch_version = cuda = device = None
    torch = sys.modules.get("torch")
    if torch is not None:
        torch_version = str(getattr(torch, "__version__", "")) or None
        try:
            on_gpu = bool(torch.cuda.is_available())
        except Exception:  # a half-initialised torch must not stop a checkpoint
            on_gpu = False
        device = "cuda" if on_gpu else "cpu"
        cuda = getattr(torch.version, "cuda", None) if on_gpu else None
    gpu_model = value(JobEnv.GPU_MODEL)
    return CheckpointContext(
        job_id=value(JobEnv.JOB_ID),
        code_hash=value(JobEnv.CODE_HASH),
        dataset_version=dataset_version([Path(data) if data else None, *data_dirs]),
        instance_type=value(JobEnv.INSTANCE_TYPE),
        device=device,
        gpu_model=gpu_model,
        gpu_count=_int(value(JobEnv.GPU_COUNT)),
        emulated=gpu_model is not None and device == "cpu",
        precision=value(JobEnv.PRECISION),
        torch=torch_version,
        cuda=cuda,
    )

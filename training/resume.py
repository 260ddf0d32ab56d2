"""What a checkpoint can resume as: its context against this life's, adapted where it can be, refused in one
line where it cannot.

Adapted: the precision (bf16, fp16, fp32 either way: the weights and the optimizer state are fp32 under
autocast in every case, only the fp16 loss scaler's state differs), the GPU model and count, the world size
and the micro-batch (training/loop.py plan_batches keeps the global batch), torch and CUDA versions.
Refused (exit 2, the agent stops the job instead of retrying): another model's parameters or another
optimizer, which no amount of retrying on other instances can load.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import torch

from training.config import ConfigError
from trainstack_job.context import CheckpointContext
from trainstack_job.layout import step_dir_name

log = logging.getLogger("training")

# The trainer's own code, hashed when no agent names the bundle (a run by hand): enough to tell two
# checkpoints of different trainer code apart.
_SOURCE_PACKAGES = ("training", "trainstack_job")
_ROOT = Path(__file__).resolve().parent.parent


class ResumeRefusedError(ConfigError):
    """The checkpoint cannot be loaded into this run: one problem line, exit 2 (permanent)."""


@cache
def source_hash() -> str:
    digest = hashlib.sha256()
    for package in _SOURCE_PACKAGES:
        for path in sorted((_ROOT / package).glob("*.py")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return f"source:{digest.hexdigest()[:16]}"


def optimizer_name(state: Mapping[str, Any]) -> str | None:
    """The class of the optimizer that saved `state` (an older checkpoint has no context), from the
    hyper-parameters only that class keeps in its param groups."""
    groups = state.get("param_groups") or []
    keys = set(groups[0]) if groups and isinstance(groups[0], Mapping) else set()
    if "betas" in keys:
        return "AdamW"
    if "momentum" in keys and "dampening" in keys:
        return "SGD"
    return None


def saved_context(saved: Mapping[str, Any]) -> CheckpointContext:
    """The context a checkpoint's state carries; for one written before contexts, what its state says."""
    recorded = CheckpointContext.from_dict(saved.get("context"))
    if recorded is not None:
        return recorded
    batch = saved.get("batch") or {}
    precision = saved.get("precision")
    return CheckpointContext(
        precision=precision if isinstance(precision, str) else None,
        loss_scaling=bool(saved.get("scaler")),
        world_size=batch.get("world_size"),
        global_batch=batch.get("global_batch"),
        micro_batch=batch.get("micro_batch"),
        accumulation=batch.get("accumulation"),
        optimizer=optimizer_name(saved.get("optimizer") or {}),
    )


def _model_problem(saved: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor]) -> str | None:
    missing = [key for key in current if key not in saved]
    extra = [key for key in saved if key not in current]
    shapes = [
        (key, list(saved[key].shape), list(value.shape))
        for key, value in current.items()
        if key in saved and saved[key].shape != value.shape
    ]
    if not (missing or extra or shapes):
        return None
    if shapes:
        key, before, after = shapes[0]
        example = f"{key} {before} in the checkpoint, {after} here"
    elif missing:
        example = f"{missing[0]} is not in the checkpoint"
    else:
        example = f"{extra[0]} is not in this model"
    count = len(shapes) + len(missing) + len(extra)
    return f"the model's parameters differ ({count} tensor(s), e.g. {example})"


def check_resumable(
    saved: Mapping[str, Any],
    before: CheckpointContext,
    now: CheckpointContext,
    model_state: Mapping[str, torch.Tensor],
    classes: list[str],
) -> None:
    """Raise ResumeRefusedError (one line naming both contexts, what differs and the fix) when `saved`
    cannot be loaded into this run's model and optimizer; return quietly when it can."""
    problems: list[str] = []
    fixes: list[str] = []
    model = _model_problem(saved["model"], model_state)
    if model is not None:
        problems.append(model)
        saved_classes = saved.get("classes")
        if isinstance(saved_classes, list) and len(saved_classes) != len(classes):
            problems.append(
                f"the dataset has {len(classes)} classes, the checkpoint "
                f"{len(saved_classes)} (data.train_dir)"
            )
        if before.model and before.model != now.model:
            fixes.append(f"model.name={before.model}")
    saved_optimizer = before.optimizer or optimizer_name(saved.get("optimizer") or {})
    if saved_optimizer and now.optimizer and saved_optimizer != now.optimizer:
        problems.append(f"the optimizer differs ({saved_optimizer} in the checkpoint, {now.optimizer} here)")
        fixes.append(f"train.optimizer={saved_optimizer.lower()}")
    if not problems:
        return
    keep = f"set {' and '.join(fixes)} to continue it, or " if fixes else ""
    step = saved.get("train", {}).get("global_step")
    name = step_dir_name(step) if isinstance(step, int) else "?"
    raise ResumeRefusedError(
        [
            f"checkpoint {name} ({before.describe()}) cannot resume in this run ({now.describe()}): "
            f"{'; '.join(problems)}; {keep}start a new job (a new checkpoint.dir, or a new trainstack "
            "job without resumeFrom) to train this one from scratch"
        ]
    )


def load_scaler(scaler: torch.amp.GradScaler, saved: Mapping[str, Any]) -> str:
    """Give this life's loss scaler the state it can use; returns what changed, for the resume line.

    fp16 -> fp16: the saved scale and growth tracker (the scale the run had settled on, not 65536 again).
    bf16/fp32 -> fp16: the checkpoint has no scaler state (a disabled GradScaler saves {}), so this life's
    fresh scaler starts at its initial scale and finds its level within a few steps, as a new fp16 run does.
    fp16 -> bf16/fp32: the saved state is dropped: this life does not scale its loss."""
    state = saved.get("scaler") or {}
    if scaler.is_enabled():
        if state:
            scaler.load_state_dict(dict(state))
            return ""  # as before: nothing to say
        return f"fresh fp16 loss scaler (scale {scaler.get_scale():g}; the checkpoint has none)"
    if state:
        return "the checkpoint's fp16 loss scaler dropped (this precision does not scale the loss)"
    return ""

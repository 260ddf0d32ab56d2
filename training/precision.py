"""Choose the numeric precision: bf16 autocast where supported, fp16 + loss scaling where not, fp32 on CPU."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch

Precision = Literal["bf16", "fp16", "fp32"]


@dataclass(frozen=True)
class PrecisionPlan:
    precision: Precision
    device: torch.device

    @property
    def dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[self.precision]

    @property
    def needs_scaler(self) -> bool:
        # fp16's narrow exponent underflows small gradients; bf16 shares fp32's range and needs no scaling.
        return self.precision == "fp16"

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(self.device.type, enabled=self.needs_scaler)


def resolve_device(requested: str) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def choose_precision(requested: str, device: torch.device) -> PrecisionPlan:
    """`auto`: bf16 on GPUs with native bf16 (Ampere and newer), fp16 on V100/T4, fp32 on CPU."""
    if requested != "auto":
        return PrecisionPlan(requested, device)  # type: ignore[arg-type]
    if device.type != "cuda":
        return PrecisionPlan("fp32", device)
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return PrecisionPlan("bf16", device)
    return PrecisionPlan("fp16", device)

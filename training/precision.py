"""Choose the numeric precision: bf16 autocast where supported, fp16 + loss scaling where not, fp32 on CPU.

On a CPU the agent's device profile (TRAINSTACK_PRECISION, bootstrap/devices.py) decides `auto`: the local
world trains a simulated T4 in fp16 and a simulated L4 in bf16, so checkpoints cross the same precision
boundaries as on AWS.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch

Precision = Literal["bf16", "fp16", "fp32"]
PRECISIONS: tuple[Precision, ...] = ("bf16", "fp16", "fp32")


@dataclass(frozen=True)
class PrecisionPlan:
    precision: Precision
    device: torch.device
    # A CPU without kernels for this dtype (no AVX512-FP16/AMX-FP16 for fp16, no AVX512-BF16 for bf16): torch
    # would fall back to its reference convolution, ~20x slower than fp32 (measured: resnet18, 32 px). The
    # math then runs in fp32, while everything a checkpoint carries stays this precision's: the precision
    # recorded, and for fp16 the loss scaler (scaled backward, unscale, inf check, update, its state saved
    # and restored). What is not reproduced is fp16's rounding and overflow, so the scaler never backs off.
    emulated: bool = False
    # Where the choice came from, for the start-up line: "train.precision", "the GPU", "the device profile".
    source: str = "train.precision"

    @property
    def dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[self.precision]

    @property
    def needs_scaler(self) -> bool:
        # fp16's narrow exponent underflows small gradients; bf16 shares fp32's range and needs no scaling.
        return self.precision == "fp16"

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.dtype is None or self.emulated:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(self.device.type, enabled=self.needs_scaler)

    def emulation(self) -> str:
        """`emulated: fp32 math with the fp16 loss scaler, this CPU has no fp16 kernels`, or ""."""
        if not self.emulated:
            return ""
        scaler = " with the fp16 loss scaler" if self.needs_scaler else ""
        return f"emulated: fp32 math{scaler}, this CPU has no {self.precision} kernels"


def resolve_device(requested: str) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def cpu_has_kernels(precision: Precision) -> bool:
    """Whether oneDNN runs this dtype's convolutions natively on this CPU."""
    if precision == "fp32":
        return True
    try:
        check = (
            torch.ops.mkldnn._is_mkldnn_fp16_supported
            if precision == "fp16"
            else torch.ops.mkldnn._is_mkldnn_bf16_supported
        )
        return bool(check())
    except (AttributeError, RuntimeError):
        return False


def choose_precision(requested: str, device: torch.device, profile: str | None = None) -> PrecisionPlan:
    """`auto`: on a GPU, bf16 where it is native (Ampere and newer), fp16 on V100/T4; on a CPU the device
    profile's precision (`profile`, from the agent), else fp32. An explicit precision is always used."""
    if requested != "auto":
        chosen: Precision = requested  # type: ignore[assignment]
        source = "train.precision"
    elif device.type == "cuda":
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        chosen, source = ("bf16" if bf16 else "fp16"), "the GPU"
    elif profile in PRECISIONS:
        chosen, source = profile, "the device profile"
    else:
        chosen, source = "fp32", "a CPU without a device profile"
    emulated = device.type == "cpu" and not cpu_has_kernels(chosen)
    return PrecisionPlan(chosen, device, emulated=emulated, source=source)

"""What GPU an instance type has: model, count, memory, and the precision a trainer uses on it.

The agent maps IMDS `instance-type` to a `DeviceProfile` and hands it to the job (TRAINSTACK_GPU_MODEL,
TRAINSTACK_GPU_COUNT, TRAINSTACK_GPU_MEMORY_GIB, TRAINSTACK_PRECISION). On a GPU the built-in trainer's
`train.precision: auto` still asks the hardware (the authority); on a CPU (the local demo, the tests) the
profile decides, so a simulated T4 trains in fp16 with a loss scaler and a simulated L4 in bf16, as the real
ones would, and a checkpoint crosses the same precision boundaries it would cross on AWS.

Standard library only: the agent imports it before any install. infra/config/ NVIDIA_FAMILIES lists the
families the stack accepts; tests keep the two in step (every family there has a profile here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainstack_job.contract import JobEnv

Precision = Literal["bf16", "fp16"]


@dataclass(frozen=True)
class Gpu:
    model: str
    memory_gib: int
    # bf16 needs native support (Ampere and newer); Turing (T4) and Volta (V100) train in fp16 + loss scaling.
    precision: Precision


@dataclass(frozen=True)
class DeviceProfile:
    instance_type: str
    gpu: Gpu
    gpu_count: int

    @property
    def gpu_model(self) -> str:
        return self.gpu.model

    @property
    def precision(self) -> Precision:
        return self.gpu.precision

    @property
    def memory_gib(self) -> int:
        """Per GPU."""
        return self.gpu.memory_gib

    def describe(self) -> str:
        """`1x T4 16 GiB, fp16`."""
        return f"{self.gpu_count}x {self.gpu.model} {self.gpu.memory_gib} GiB, {self.gpu.precision}"

    def env(self) -> dict[str, str]:
        """The job's variables for this profile (docs/job-contract.md)."""
        return {
            JobEnv.INSTANCE_TYPE.value: self.instance_type,
            JobEnv.GPU_MODEL.value: self.gpu.model,
            JobEnv.GPU_COUNT.value: str(self.gpu_count),
            JobEnv.GPU_MEMORY_GIB.value: str(self.gpu.memory_gib),
            JobEnv.PRECISION.value: self.gpu.precision,
        }


T4 = Gpu("T4", 16, "fp16")
V100 = Gpu("V100", 16, "fp16")
V100_32 = Gpu("V100", 32, "fp16")
A10G = Gpu("A10G", 24, "bf16")
L4 = Gpu("L4", 24, "bf16")
L40S = Gpu("L40S", 48, "bf16")
A100_40 = Gpu("A100", 40, "bf16")
A100_80 = Gpu("A100", 80, "bf16")
H100 = Gpu("H100", 80, "bf16")
H200 = Gpu("H200", 141, "bf16")
B200 = Gpu("B200", 179, "bf16")
B300 = Gpu("B300", 268, "bf16")
RTX_PRO_6000 = Gpu("RTX PRO 6000", 96, "bf16")

# family -> (its GPU, GPUs per size where that is not 1). From the EC2 accelerated-computing type pages;
# sizes not listed have one GPU (every family's smallest sizes do).
FAMILIES: dict[str, tuple[Gpu, dict[str, int]]] = {
    "g4dn": (T4, {"12xlarge": 4, "metal": 8}),
    "g5": (A10G, {"12xlarge": 4, "24xlarge": 4, "48xlarge": 8}),
    "g6": (L4, {"12xlarge": 4, "24xlarge": 4, "48xlarge": 8}),
    "gr6": (L4, {}),
    "g6e": (L40S, {"12xlarge": 4, "24xlarge": 4, "48xlarge": 8}),
    "g7e": (RTX_PRO_6000, {"12xlarge": 2, "24xlarge": 4, "48xlarge": 8}),
    "p3": (V100, {"8xlarge": 4, "16xlarge": 8}),
    "p3dn": (V100_32, {"24xlarge": 8}),
    "p4d": (A100_40, {"24xlarge": 8}),
    "p4de": (A100_80, {"24xlarge": 8}),
    "p5": (H100, {"48xlarge": 8}),
    "p5e": (H200, {"48xlarge": 8}),
    "p5en": (H200, {"48xlarge": 8}),
    "p6-b200": (B200, {"48xlarge": 8}),
    "p6-b300": (B300, {"48xlarge": 8}),
}


def device_profile(instance_type: str) -> DeviceProfile | None:
    """The profile of `g4dn.xlarge` and the like; None for a type without an NVIDIA GPU we know."""
    family, dot, size = instance_type.strip().partition(".")
    if not dot or family not in FAMILIES or not size:
        return None
    gpu, counts = FAMILIES[family]
    return DeviceProfile(instance_type.strip(), gpu, counts.get(size, 1))


def context_env(job_id: str, code_hash: str, instance_type: str | None) -> tuple[dict[str, str], str]:
    """The variables that tell a job what it runs as (recorded in its checkpoints' context), and a line for
    the agent's log saying which device profile it got."""
    env = {JobEnv.JOB_ID.value: job_id}
    if code_hash:
        env[JobEnv.CODE_HASH.value] = code_hash
    if instance_type is None:
        return env, "no instance type known: the job's precision is its own (the hardware's on a GPU)"
    env[JobEnv.INSTANCE_TYPE.value] = instance_type
    profile = device_profile(instance_type)
    if profile is None:
        return env, f"no device profile for {instance_type}: the trainer asks the hardware for its precision"
    return env | profile.env(), f"device profile {instance_type}: {profile.describe()}"

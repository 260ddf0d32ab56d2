"""The device table: every instance type the stack offers has a GPU profile, handed to the job."""

from __future__ import annotations

import pytest

from bootstrap.devices import FAMILIES, context_env, device_profile
from infra.config import DEFAULTS, NVIDIA_FAMILIES
from trainstack_job.contract import JobEnv

# What a user of the default instanceTypes gets on each: the L4/A10G/L40S train in bf16, the T4 in fp16.
DEFAULT_TYPES = {
    "g6.xlarge": ("L4", 1, 24, "bf16"),
    "g5.xlarge": ("A10G", 1, 24, "bf16"),
    "g6e.xlarge": ("L40S", 1, 48, "bf16"),
    "g4dn.xlarge": ("T4", 1, 16, "fp16"),
}


def test_every_default_instance_type_has_its_profile() -> None:
    assert set(DEFAULTS["instanceTypes"]) == set(DEFAULT_TYPES), "the default list changed: add its profile"
    for instance_type, expected in DEFAULT_TYPES.items():
        profile = device_profile(instance_type)
        assert profile is not None, instance_type
        assert (profile.gpu_model, profile.gpu_count, profile.memory_gib, profile.precision) == expected


def test_every_family_the_stack_accepts_has_a_profile_of_the_same_gpu() -> None:
    assert set(NVIDIA_FAMILIES) == set(FAMILIES)
    for family, gpu in NVIDIA_FAMILIES.items():
        profile = device_profile(f"{family}.48xlarge")
        assert profile is not None and profile.gpu_model == gpu, family


@pytest.mark.parametrize(
    ("instance_type", "gpus", "gpu", "precision"),
    [
        ("g4dn.12xlarge", 4, "T4", "fp16"),
        ("g6.12xlarge", 4, "L4", "bf16"),
        ("g5.48xlarge", 8, "A10G", "bf16"),
        ("p3.2xlarge", 1, "V100", "fp16"),
        ("p4d.24xlarge", 8, "A100", "bf16"),
        ("p5.4xlarge", 1, "H100", "bf16"),
        ("p5.48xlarge", 8, "H100", "bf16"),
        ("p5en.48xlarge", 8, "H200", "bf16"),
    ],
)
def test_multi_gpu_sizes(instance_type: str, gpus: int, gpu: str, precision: str) -> None:
    profile = device_profile(instance_type)
    assert profile is not None
    assert (profile.gpu_count, profile.gpu_model, profile.precision) == (gpus, gpu, precision)


def test_types_without_a_known_nvidia_gpu_have_no_profile() -> None:
    assert device_profile("c7i.xlarge") is None
    assert device_profile("g5g.xlarge") is None  # Graviton with T4G: refused by the stack
    assert device_profile("not-a-type") is None


def test_the_job_is_told_its_profile_job_and_code() -> None:
    env, line = context_env("j-1", "ab" * 32, "g4dn.xlarge")
    assert env == {
        JobEnv.JOB_ID.value: "j-1",
        JobEnv.CODE_HASH.value: "ab" * 32,
        JobEnv.INSTANCE_TYPE.value: "g4dn.xlarge",
        JobEnv.GPU_MODEL.value: "T4",
        JobEnv.GPU_COUNT.value: "1",
        JobEnv.GPU_MEMORY_GIB.value: "16",
        JobEnv.PRECISION.value: "fp16",
    }
    assert line == "device profile g4dn.xlarge: 1x T4 16 GiB, fp16"
    env, line = context_env("j-1", "", "m7i.large")
    assert env == {JobEnv.JOB_ID.value: "j-1", JobEnv.INSTANCE_TYPE.value: "m7i.large"}
    assert "no device profile for m7i.large" in line
    assert context_env("j-1", "", None)[0] == {JobEnv.JOB_ID.value: "j-1"}

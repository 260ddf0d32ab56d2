"""GPU preflight: the driver answers (nvidia-smi) and torch can run a CUDA kernel; repair the driver once."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from bootstrap.eventlog import EventLog

_TORCH_CHECK = (
    "import torch; assert torch.cuda.is_available(), 'torch.cuda.is_available() is False'; "
    "print(torch.cuda.device_count(), float((torch.ones(8, device='cuda') * 2).sum()))"
)
# Package globs of the NVIDIA driver on the DLAMI's Ubuntu; the seeds' fix for a broken nvidia-smi is
# reinstalling exactly these.
_DRIVER_PACKAGES = ("nvidia-driver-*", "nvidia-dkms-*", "nvidia-kernel-common-*", "libnvidia-compute-*")


@dataclass(frozen=True)
class PreflightResult:
    ok: bool
    gpu_count: int
    detail: str


def _run(argv: Sequence[str], timeout: float) -> tuple[int, str]:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        return 127, f"{argv[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, f"{argv[0]}: timed out after {timeout:.0f}s"
    return done.returncode, (done.stdout + done.stderr).strip()


class GpuPreflight:
    """Runs the checks with the trainer's python, so torch is the very build that will train."""

    def __init__(self, python: str, log: EventLog) -> None:
        self._python = python
        self._log = log

    def check(self) -> PreflightResult:
        code, listing = _run(["nvidia-smi", "-L"], timeout=60)
        if code != 0:
            return PreflightResult(False, 0, f"nvidia-smi failed ({code}): {listing[-300:]}")
        gpus = [line for line in listing.splitlines() if line.startswith("GPU ")]
        code, output = _run([self._python, "-c", _TORCH_CHECK], timeout=180)
        if code != 0:
            return PreflightResult(False, len(gpus), f"torch CUDA check failed: {output.splitlines()[-1:]}")
        return PreflightResult(True, len(gpus), f"{len(gpus)} GPU(s): {'; '.join(gpus)}")

    def repair(self) -> bool:
        """Reinstall the installed driver packages and reload the module; True when something was done."""
        code, listing = _run(["dpkg-query", "-W", "-f=${binary:Package}\\n", *_DRIVER_PACKAGES], timeout=60)
        packages = (
            [p for p in listing.splitlines() if p and "no packages found" not in p] if code == 0 else []
        )
        if not packages:
            self._log.event("preflight", "no driver packages to reinstall (not a dpkg-managed driver)")
            return False
        self._log.event("preflight", "reinstalling the NVIDIA driver packages", packages=packages)
        code, output = _run(
            ["apt-get", "install", "-y", "--reinstall", "--allow-change-held-packages", *packages],
            timeout=1200,
        )
        if code != 0:
            self._log.event("preflight", "driver reinstall failed", output=output[-500:])
            return False
        _run(["modprobe", "nvidia"], timeout=60)
        return True

    def run(self) -> PreflightResult:
        result = self.check()
        if result.ok:
            return result
        self._log.event("preflight", "GPU check failed; trying the driver repair once", detail=result.detail)
        if self.repair():
            result = self.check()
        return result

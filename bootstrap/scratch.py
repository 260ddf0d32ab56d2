"""Scratch space for data and checkpoints: instance-store NVMe when there is some, else the root volume."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from bootstrap.eventlog import EventLog

DLAMI_NVME = Path("/opt/dlami/nvme")
INSTANCE_STORE_GLOB = "nvme-Amazon_EC2_NVMe_Instance_Storage_*"
MOUNT_POINT = Path("/mnt/trainstack")
ROOT_VOLUME_DIR = Path("/var/lib/trainstack/scratch")
RAID_DEVICE = "/dev/md/trainstack"
# Where the kernel names the instance-store disks and lists what is mounted (module-level: tests point them
# at a folder of their own).
DISKS_BY_ID = Path("/dev/disk/by-id")
PROC_MOUNTS = Path("/proc/mounts")


@dataclass(frozen=True)
class ScratchPlan:
    """What to do: use a directory as is, or build a filesystem on instance-store devices and mount it."""

    directory: Path
    devices: tuple[str, ...] = ()
    raid: bool = False
    reason: str = ""


def plan_scratch(
    configured: str | None, dlami_nvme_mounted: bool, free_instance_store: list[str], mounted_at: bool
) -> ScratchPlan:
    """Pure decision, tested directly: configured dir > AMI's NVMe mount > our mount > new RAID0/fs > root."""
    if configured:
        return ScratchPlan(Path(configured), reason="scratch_dir from the agent config")
    if dlami_nvme_mounted:
        return ScratchPlan(DLAMI_NVME / "trainstack", reason="instance store mounted by the DLAMI")
    if mounted_at:
        return ScratchPlan(MOUNT_POINT, reason="instance store mounted by an earlier life")
    if free_instance_store:
        devices = tuple(sorted(free_instance_store))
        return ScratchPlan(
            MOUNT_POINT, devices, raid=len(devices) > 1, reason=f"{len(devices)} instance-store disk(s)"
        )
    return ScratchPlan(ROOT_VOLUME_DIR, reason="no instance store; root volume")


def _free_instance_store() -> list[str]:
    """The instance-store disks (by their real device path) that nothing has mounted: a disk whose name is in
    the mount table, itself or a partition of it, is in use and never formatted."""
    if not DISKS_BY_ID.is_dir():
        return []
    devices = {os.path.realpath(p) for p in DISKS_BY_ID.glob(INSTANCE_STORE_GLOB) if "-part" not in p.name}
    mounted = PROC_MOUNTS.read_text() if PROC_MOUNTS.exists() else ""
    return sorted(d for d in devices if d not in mounted)


def _build_filesystem(plan: ScratchPlan) -> None:
    device = plan.devices[0]
    if plan.raid:
        # RAID0: instance store is ephemeral anyway, so striping for throughput costs no safety.
        subprocess.run(
            [
                "mdadm",
                "--create",
                RAID_DEVICE,
                "--run",
                "--level=0",
                f"--raid-devices={len(plan.devices)}",
                *plan.devices,
            ],
            check=True,
        )
        device = RAID_DEVICE
    subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "nodiscard", device], check=True)
    plan.directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-o", "noatime", device, str(plan.directory)], check=True)


def prepare_scratch(configured: str | None, log: EventLog) -> Path:
    """Make the scratch directory ready and return it."""
    plan = plan_scratch(
        configured,
        dlami_nvme_mounted=os.path.ismount(DLAMI_NVME),
        free_instance_store=[] if configured else _free_instance_store(),
        mounted_at=os.path.ismount(MOUNT_POINT),
    )
    if plan.devices:
        log.event("scratch", "formatting instance store", devices=list(plan.devices), raid0=plan.raid)
        try:
            _build_filesystem(plan)
        except (OSError, subprocess.CalledProcessError) as exc:
            log.event("scratch", "instance store unusable; falling back to the root volume", error=str(exc))
            plan = ScratchPlan(ROOT_VOLUME_DIR, reason="instance store setup failed")
    plan.directory.mkdir(parents=True, exist_ok=True)
    log.event("scratch", "scratch ready", directory=str(plan.directory), reason=plan.reason)
    return plan.directory

"""bootstrap/scratch.py: the scratch space a life trains in. Instance store first (the DLAMI's mount, an
earlier life's, or free disks striped, formatted and mounted), the root volume otherwise; a disk in use is
never formatted, and a failed setup falls back to the root volume instead of failing the life."""

from __future__ import annotations

import io
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bootstrap import scratch
from bootstrap.eventlog import EventLog
from bootstrap.scratch import plan_scratch, prepare_scratch

STORE = "nvme-Amazon_EC2_NVMe_Instance_Storage_AWS"


class Machine:
    """The paths prepare_scratch reads, under a temporary folder: the DLAMI's mount, ours, the root volume's
    folder, /dev/disk/by-id and /proc/mounts; the commands it runs are recorded, never run."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.dlami = root / "opt/dlami/nvme"
        self.mount_point = root / "mnt/trainstack"
        self.root_volume = root / "var/lib/trainstack/scratch"
        self.by_id = root / "dev/disk/by-id"
        self.mounts = root / "proc/mounts"
        self.mounted: set[Path] = set()
        self.commands: list[list[str]] = []
        self.fail: Callable[[list[str]], None] | None = None
        self.by_id.mkdir(parents=True)
        self.mounts.parent.mkdir(parents=True)
        self.mounts.write_text("/dev/nvme0n1p1 / ext4 rw,relatime 0 0\n")
        for name, value in (
            ("DLAMI_NVME", self.dlami),
            ("MOUNT_POINT", self.mount_point),
            ("ROOT_VOLUME_DIR", self.root_volume),
            ("DISKS_BY_ID", self.by_id),
            ("PROC_MOUNTS", self.mounts),
        ):
            monkeypatch.setattr(scratch, name, value)
        monkeypatch.setattr(scratch.os.path, "ismount", lambda path: Path(path) in self.mounted)
        monkeypatch.setattr(scratch.subprocess, "run", self._run)

    def _run(self, command: list[str], check: bool = False, **_: Any) -> subprocess.CompletedProcess[str]:
        assert check, f"{command[0]} must fail the setup when it fails"
        self.commands.append(list(command))
        if self.fail is not None:
            self.fail(command)
        return subprocess.CompletedProcess(command, 0)

    def disk(self, name: str, serial: str) -> str:
        """An instance-store disk as udev names it: a link in by-id to the device node."""
        device = self.root / "dev" / name
        device.touch()
        (self.by_id / f"{STORE}{serial}").symlink_to(device)
        return str(device)


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Machine:
    return Machine(tmp_path, monkeypatch)


def events(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_scratch_prefers_config_then_dlami_nvme_then_our_mount_then_free_disks_then_root() -> None:
    """Each plan says why it was chosen, and only free disks are ever formatted (striped when several)."""
    configured = plan_scratch("/x", True, ["/dev/nvme1n1"], True)
    assert (configured.directory, configured.devices) == (Path("/x"), ())
    assert configured.reason == "scratch_dir from the agent config"
    dlami = plan_scratch(None, True, ["/dev/nvme1n1"], True)
    assert (dlami.directory, dlami.devices) == (scratch.DLAMI_NVME / "trainstack", ())
    assert dlami.reason == "instance store mounted by the DLAMI"
    ours = plan_scratch(None, False, ["/dev/nvme1n1"], True)
    assert (ours.directory, ours.devices) == (scratch.MOUNT_POINT, ())
    assert ours.reason == "instance store mounted by an earlier life"
    two = plan_scratch(None, False, ["/dev/nvme2n1", "/dev/nvme1n1"], False)
    assert (two.directory, two.devices, two.raid) == (
        scratch.MOUNT_POINT,
        ("/dev/nvme1n1", "/dev/nvme2n1"),
        True,
    )
    assert two.reason == "2 instance-store disk(s)"
    one = plan_scratch(None, False, ["/dev/nvme1n1"], False)
    assert (one.devices, one.raid, one.reason) == (("/dev/nvme1n1",), False, "1 instance-store disk(s)")
    root = plan_scratch(None, False, [], False)
    assert (root.directory, root.devices, root.raid) == (scratch.ROOT_VOLUME_DIR, (), False)
    assert root.reason == "no instance store; root volume"


def test_only_whole_instance_store_disks_that_nothing_mounted_are_free(machine: Machine) -> None:
    """A partition's link is not a disk; a disk whose partition is mounted is in use; an EBS volume's link is
    not instance store; each disk is named by its device path, in order."""
    second = machine.disk("nvme2n1", "2")
    first = machine.disk("nvme1n1", "1")
    used = machine.disk("nvme3n1", "3")
    (machine.by_id / f"{STORE}1-part1").symlink_to(first + "p1")
    (machine.by_id / "nvme-Amazon_Elastic_Block_Store_vol0").symlink_to(machine.root / "dev/nvme0n1")
    machine.mounts.write_text(machine.mounts.read_text() + f"{used}p1 /data xfs rw 0 0\n")
    assert scratch._free_instance_store() == [first, second]
    machine.mounts.unlink()  # no mount table: nothing is known to be in use
    assert scratch._free_instance_store() == [first, second, used]
    for link in machine.by_id.iterdir():
        link.unlink()
    machine.by_id.rmdir()
    assert scratch._free_instance_store() == []


def test_two_free_disks_are_striped_formatted_and_mounted_before_the_scratch_is_used_once(
    machine: Machine,
) -> None:
    first, second = machine.disk("nvme1n1", "1"), machine.disk("nvme2n1", "2")
    out = io.StringIO()
    assert prepare_scratch(None, EventLog(out)) == machine.mount_point
    assert machine.mount_point.is_dir()
    raid = scratch.RAID_DEVICE
    assert machine.commands == [
        ["mdadm", "--create", raid, "--run", "--level=0", "--raid-devices=2", first, second],
        ["mkfs.ext4", "-q", "-F", "-E", "nodiscard", raid],
        ["mount", "-o", "noatime", raid, str(machine.mount_point)],
    ]
    formatting, ready = events(out)
    assert (formatting["stage"], formatting["message"]) == ("scratch", "formatting instance store")
    assert (formatting["devices"], formatting["raid0"]) == ([first, second], True)
    assert (ready["stage"], ready["message"]) == ("scratch", "scratch ready")
    assert (ready["directory"], ready["reason"]) == (str(machine.mount_point), "2 instance-store disk(s)")


def test_one_free_disk_is_formatted_and_mounted_as_it_is(machine: Machine) -> None:
    disk = machine.disk("nvme1n1", "1")
    out = io.StringIO()
    assert prepare_scratch(None, EventLog(out)) == machine.mount_point
    assert machine.commands == [
        ["mkfs.ext4", "-q", "-F", "-E", "nodiscard", disk],
        ["mount", "-o", "noatime", disk, str(machine.mount_point)],
    ]
    assert events(out)[0]["raid0"] is False


@pytest.mark.parametrize(
    "failure",
    [
        subprocess.CalledProcessError(1, ["mkfs.ext4"]),
        FileNotFoundError(2, "No such file or directory: 'mdadm'"),
    ],
)
def test_an_instance_store_that_cannot_be_set_up_falls_back_to_the_root_volume_saying_why(
    machine: Machine, failure: Exception
) -> None:
    machine.disk("nvme1n1", "1")
    machine.disk("nvme2n1", "2")

    def fail(command: list[str]) -> None:
        raise failure

    machine.fail = fail
    out = io.StringIO()
    assert prepare_scratch(None, EventLog(out)) == machine.root_volume
    assert machine.root_volume.is_dir() and not machine.mount_point.exists()
    _, unusable, ready = events(out)
    assert unusable["message"] == "instance store unusable; falling back to the root volume"
    assert (unusable["stage"], unusable["error"]) == ("scratch", str(failure))
    assert (ready["directory"], ready["reason"]) == (str(machine.root_volume), "instance store setup failed")


def test_a_configured_folder_is_used_as_it_is_and_no_disk_is_looked_at(machine: Machine) -> None:
    """Even a machine whose disks cannot be listed (here a mount table that cannot be read) trains in it."""
    machine.disk("nvme1n1", "1")
    machine.mounts.unlink()
    machine.mounts.mkdir()
    configured = machine.root / "my/scratch"
    out = io.StringIO()
    assert prepare_scratch(str(configured), EventLog(out)) == configured
    assert configured.is_dir() and machine.commands == []
    assert [e["message"] for e in events(out)] == ["scratch ready"]
    assert events(out)[0]["reason"] == "scratch_dir from the agent config"


@pytest.mark.parametrize("mounted_by", ["dlami", "earlier life"])
def test_an_instance_store_mounted_already_is_used_and_never_formatted_again(
    machine: Machine, mounted_by: str
) -> None:
    machine.disk("nvme1n1", "1")  # listed, yet in use under the mount below
    mount = machine.dlami if mounted_by == "dlami" else machine.mount_point
    mount.mkdir(parents=True)
    machine.mounted.add(mount)
    expected = machine.dlami / "trainstack" if mounted_by == "dlami" else machine.mount_point
    assert prepare_scratch(None, EventLog(io.StringIO())) == expected
    assert expected.is_dir() and machine.commands == []


def test_the_root_volume_is_the_scratch_of_a_type_without_instance_store(machine: Machine) -> None:
    out = io.StringIO()
    assert prepare_scratch(None, EventLog(out)) == machine.root_volume
    assert machine.root_volume.is_dir() and machine.commands == []
    assert events(out)[0]["reason"] == "no instance store; root volume"


def test_a_mount_point_folder_left_by_an_earlier_boot_is_mounted_onto_not_given_up(machine: Machine) -> None:
    """After a reboot the folder is there but nothing is mounted on it: the free disk is formatted and
    mounted there, not dropped for the root volume."""
    disk = machine.disk("nvme1n1", "1")
    machine.mount_point.mkdir(parents=True)
    assert prepare_scratch(None, EventLog(io.StringIO())) == machine.mount_point
    assert machine.commands[-1] == ["mount", "-o", "noatime", disk, str(machine.mount_point)]

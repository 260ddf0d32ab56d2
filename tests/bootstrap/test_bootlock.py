"""The instance's hashed lock (bootstrap/requirements-instance.lock.txt) and what a boot picks from it.

Resolving the lock needs PyPI, so it is done by `make lock` (pip-compile --generate-hashes, then a download
of every pinned wheel for CPython 3.12 and 3.11 on x86_64 manylinux); these tests read what it wrote.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from trainstack_job.bootlock import (
    AMI_OWNED,
    NEVER_LOCKED,
    LockEntry,
    LockError,
    canonical,
    has_hashes,
    parse_lock,
    select,
)

REPO = Path(__file__).resolve().parents[2]
REQUIREMENTS = REPO / "bootstrap" / "requirements-instance.txt"
LOCK = REPO / "bootstrap" / "requirements-instance.lock.txt"


def _requirements() -> list[Requirement]:
    lines = [line.split("#", 1)[0].strip() for line in REQUIREMENTS.read_text().splitlines()]
    return [Requirement(line) for line in lines if line]


def test_the_lock_pins_every_requirement_at_a_version_it_allows() -> None:
    locked = {entry.name: entry for entry in parse_lock(LOCK.read_text())}
    for requirement in _requirements():
        entry = locked.get(canonical(requirement.name))
        assert entry is not None, f"{requirement.name} is not in {LOCK.name}: run make lock"
        assert requirement.specifier.contains(Version(entry.version)), (requirement, entry.version)


def test_every_locked_package_has_a_sha256_and_an_exact_version() -> None:
    entries = parse_lock(LOCK.read_text())  # raises on any line pip --require-hashes would refuse
    assert len(entries) >= len(_requirements())
    for entry in entries:
        assert entry.hashes and all(len(digest) == 64 for digest in entry.hashes), entry.name
        Version(entry.version)
    assert len({entry.name for entry in entries}) == len(entries)


def test_the_lock_never_holds_torch_or_torchvision() -> None:
    names = {entry.name for entry in parse_lock(LOCK.read_text())}
    assert not names & NEVER_LOCKED, "torch and torchvision stay the AMI's: never lock them"


def test_the_lock_says_how_it_was_made() -> None:
    assert "--generate-hashes" in (REPO / "Makefile").read_text()
    assert "make lock" in LOCK.read_text()[:400]


def test_a_boot_installs_what_is_missing_or_at_another_version_but_keeps_the_amis_numpy() -> None:
    entries = parse_lock(LOCK.read_text())
    by_name = {entry.name: entry for entry in entries}
    installed = {
        "boto3": by_name["boto3"].version,  # already at the locked version: left alone
        "botocore": "0.0.1",  # another version: replaced by the locked one
        "numpy": "1.26.4",  # the AMI's: kept whatever its version
        "torch": "2.9.0",
    }
    chosen = {entry.name for entry in select(entries, installed)}
    assert "boto3" not in chosen and "numpy" not in chosen
    assert "botocore" in chosen and "matplotlib" in chosen
    assert "numpy" in {entry.name for entry in select(entries, {})}, "an AMI without numpy gets the lock's"
    assert "numpy" in AMI_OWNED


def test_parse_joins_continuations_and_refuses_unhashed_or_unpinned_lines() -> None:
    text = "# header\nPyYAML==6.0.4 \\\n    --hash=sha256:" + "a" * 64 + " \\\n    --hash=sha256:" + "b" * 64
    text += "\n    # via -r requirements.txt\n"
    (entry,) = parse_lock(text)
    assert entry == LockEntry("pyyaml", "6.0.4", ("a" * 64, "b" * 64), entry.text)
    assert parse_lock(entry.text) == [entry]
    with pytest.raises(LockError, match="boto3"):
        parse_lock("boto3==1.0\n")
    with pytest.raises(LockError, match="boto3"):
        parse_lock("boto3>=1.0 --hash=sha256:" + "c" * 64 + "\n")
    assert has_hashes(text) and not has_hashes("boto3==1.0\n")


def test_the_script_form_prints_the_entries_this_interpreter_lacks(tmp_path: Path) -> None:
    lock = tmp_path / "lock.txt"
    other = "trainstack-not-installed==1.0 --hash=sha256:" + "e" * 64
    lock.write_text("pip==0.0.1 --hash=sha256:" + "d" * 64 + "\n" + other + "\n")
    script = REPO / "trainstack_job" / "bootlock.py"
    out = subprocess.run([sys.executable, str(script), "select", str(lock)], capture_output=True, text=True,
                         check=True, timeout=60).stdout  # fmt: skip
    assert [entry.name for entry in parse_lock(out)] == ["pip", "trainstack-not-installed"]

"""The hashed lock of the instance's boot-time packages: parse it, and pick what a boot must install.

Standard library only, importing no other trainstack module: install-agent.sh runs this file as a script
with the AMI's Python before anything is installed (`python trainstack_job/bootlock.py select LOCK`), and
preview (infra/wheels.py) and the job's environment (bootstrap/job.py) import it. It lives in trainstack_job/,
beside the job's other shared definitions, so the Pulumi program reads the lock without importing the agent.

What a boot installs: every locked package the AMI's env does not already hold at the locked version,
except the packages the AMI owns (AMI_OWNED: its numpy is the one its torch and compiled packages were
built against), which stay the AMI's at whatever version it ships, like torch itself. pip then installs
the selection with --require-hashes --only-binary=:all:, so every file it installs is one the lock names.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

# Kept as the AMI ships them whenever the AMI has them: never in the lock (torch, torchvision) or never
# replaced by it (numpy). Anything else in the lock is installed at exactly its locked version.
NEVER_LOCKED = frozenset({"torch", "torchvision", "torchaudio"})
AMI_OWNED = frozenset({"numpy", *NEVER_LOCKED})

_REQUIREMENT = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;\\]+)")
_HASH = re.compile(r"--hash=sha256:(?P<digest>[0-9a-f]{64})")


class LockError(ValueError):
    """A lock line pip would refuse under --require-hashes; the message names the line."""


@dataclass(frozen=True)
class LockEntry:
    """One pinned requirement: its canonical name, exact version, allowed sha256s and its lines as written."""

    name: str
    version: str
    hashes: tuple[str, ...]
    text: str


def canonical(name: str) -> str:
    """PEP 503 normalisation: `PyYAML`, `pyyaml` and `py_yaml` are one project."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _logical_lines(text: str) -> list[str]:
    """Lines with their backslash continuations joined, comments and blanks dropped."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if line:
            lines.append(line)
    if pending.strip():
        lines.append(pending.strip())
    return lines


def has_hashes(text: str) -> bool:
    """Whether a requirements file pins by hash (pip then needs --require-hashes for all of it)."""
    return any(_HASH.search(line) for line in _logical_lines(text))


def parse_lock(text: str) -> list[LockEntry]:
    """Every `name==version --hash=sha256:...` requirement; anything else is an error naming the line."""
    entries: list[LockEntry] = []
    for line in _logical_lines(text):
        match = _REQUIREMENT.match(line)
        hashes = tuple(m.group("digest") for m in _HASH.finditer(line))
        if match is None or not hashes:
            raise LockError(f"{line.split()[0]!r} is not pinned as name==version with --hash=sha256: lines")
        name, version = canonical(match.group("name")), match.group("version")
        pins = [f"{match.group('name')}=={version}", *(f"--hash=sha256:{h}" for h in hashes)]
        body = " \\\n    ".join(pins)
        entries.append(LockEntry(name, version, hashes, body + "\n"))
    return entries


def installed_versions() -> dict[str, str]:
    """The running interpreter's installed distributions, by canonical name."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonical(name), dist.version)
    return found


def select(
    entries: Iterable[LockEntry], installed: Mapping[str, str], ami_owned: Iterable[str] = AMI_OWNED
) -> list[LockEntry]:
    """The entries a boot installs: not present at the locked version, and not one the AMI owns and has."""
    owned = {canonical(name) for name in ami_owned}
    chosen: list[LockEntry] = []
    for entry in entries:
        have = installed.get(entry.name)
        if have == entry.version or (have is not None and entry.name in owned):
            continue
        chosen.append(entry)
    return chosen


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "select":
        print("usage: bootlock.py select LOCK  (prints the lock entries this env lacks)", file=sys.stderr)
        return 2
    entries = parse_lock(Path(argv[1]).read_text(encoding="utf-8"))
    sys.stdout.write("".join(entry.text for entry in select(entries, installed_versions())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""install-agent.sh in a sandbox: the agent starts only from a bundle whose sha256 matches the user-data."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra.bundle import build_bundle

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bootstrap/instance/install-agent.sh"
# Stand-ins for the instance's `aws` CLI (copies from a local "bucket" folder) and systemctl (records calls).
FAKE_AWS = "\n".join(
    [
        "#!/bin/sh",
        "for last; do :; done",
        'uri=$(eval echo "\\${$(($# - 1))}")',
        'cp "$FAKE_S3/${uri#s3://}" "$last"',
        "",
    ]
)
FAKE_SYSTEMCTL = '#!/bin/sh\necho "$*" >> "$SYSTEMCTL_LOG"\n'


def sandbox(tmp_path: Path, bundle: bytes, sha256: str) -> tuple[dict[str, str], Path]:
    key = f"code/{sha256}/bundle.tar.gz"
    stored = tmp_path / "s3" / "bucket-x" / key
    stored.parent.mkdir(parents=True)
    stored.write_bytes(bundle)
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "bundle.env").write_text(
        f"BUNDLE_BUCKET=bucket-x\nBUNDLE_KEY={key}\nBUNDLE_SHA256={sha256}\nAWS_REGION=us-east-1\n"
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("aws", FAKE_AWS), ("systemctl", FAKE_SYSTEMCTL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "FAKE_S3": str(tmp_path / "s3"),
        "SYSTEMCTL_LOG": str(tmp_path / "systemctl.log"),
        "TRAINSTACK_ETC_DIR": str(etc),
        "TRAINSTACK_INSTALL_ROOT": str(tmp_path / "opt"),
        "TRAINSTACK_PYTORCH_PYTHON": sys.executable,
        "HOME": str(tmp_path),
        "PIP_NO_INDEX": "1",  # everything is already installed here: pip must not need the network
    }
    return env, tmp_path


@pytest.fixture(scope="module")
def bundle() -> tuple[bytes, str]:
    built = build_bundle(REPO)
    return built.data, built.sha256


def test_verified_bundle_is_unpacked_and_the_agent_service_started(
    tmp_path: Path, bundle: tuple[bytes, str]
) -> None:
    data, sha = bundle
    env, root = sandbox(tmp_path, data, sha)
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    current = root / "opt" / "current"
    assert os.path.realpath(current) == str(root / "opt" / sha)
    assert (current / "bootstrap" / "agent.py").is_file()
    assert (root / "systemctl.log").read_text().splitlines() == [
        "daemon-reload",
        "enable --now trainstack-agent.service",
    ]


def test_tampered_bundle_is_refused_and_nothing_starts(tmp_path: Path, bundle: tuple[bytes, str]) -> None:
    data, sha = bundle
    env, root = sandbox(tmp_path, data + b"tampered", sha)
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "sha256 mismatch" in result.stdout
    assert not (root / "opt" / sha).exists()
    assert not (root / "systemctl.log").exists()
    assert hashlib.sha256(data).hexdigest() == sha

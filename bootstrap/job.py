"""A user's job on the instance: its Python environment, its command's contract environment and the observed
interruption rate the agent gives it (docs/job-contract.md). The job file's schema is
trainstack_job/jobfile.py's, shared with the CLI and the Pulumi program.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

from bootstrap.safefiles import remove_entry, replace_file
from trainstack_job.bootlock import has_hashes
from trainstack_job.contract import JobEnv
from trainstack_job.jobfile import PINNED_PACKAGES, VENDORED_WHEELS_DIR, JobSpecError

# Spot interruptions in the ledger before its rate replaces the published band for the job.
MIN_OBSERVED_INTERRUPTIONS = 2
# The agent's mark, inside a job's venv, that the venv was built completely (prepare_python).
VENV_READY = ".trainstack-ready"


def contract_env(
    *,
    checkpoint_dir: Path,
    output_dir: Path,
    data_dir: Path | None,
    stop_file: Path,
    checkpoint_request_file: Path,
    progress_file: Path,
    restored_step: int | None,
) -> dict[str, str]:
    """The variables every job gets, the built-in trainer included."""
    env = {
        JobEnv.CHECKPOINT_DIR.value: str(checkpoint_dir),
        JobEnv.OUTPUT_DIR.value: str(output_dir),
        JobEnv.STOP_FILE.value: str(stop_file),
        JobEnv.CHECKPOINT_REQUEST_FILE.value: str(checkpoint_request_file),
        JobEnv.PROGRESS_FILE.value: str(progress_file),
        JobEnv.RESTORED_STEP.value: "" if restored_step is None else str(restored_step),
    }
    if data_dir is not None:
        env[JobEnv.DATA_DIR.value] = str(data_dir)
    return env


def interruption_env(interruptions: int, spot_hours: float) -> dict[str, str]:
    """The observed interruption rate for the job (`checkpoint.every_minutes: auto`), once the ledger has
    MIN_OBSERVED_INTERRUPTIONS: one alone says little about the rate; before that the job uses its default."""
    if interruptions < MIN_OBSERVED_INTERRUPTIONS or spot_hours <= 0:
        return {}
    return {
        JobEnv.MTBI_HOURS.value: f"{spot_hours / interruptions:.3f}",
        JobEnv.MTBI_SOURCE.value: f"the ledger's {interruptions} interruptions over {spot_hours:.1f} h",
    }


def pinned_constraints(python: str) -> str:
    """`torch==<AMI version>` lines for the packages a job's requirements must never replace."""
    script = (
        "import importlib.metadata as m\n"
        f"for name in {PINNED_PACKAGES!r}:\n"
        "    try:\n"
        "        print(f'{name}=={m.version(name)}')\n"
        "    except m.PackageNotFoundError:\n"
        "        pass\n"
    )
    result = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    return result.stdout


def _see_base_packages(base_python: str, python: str) -> None:
    """Put the base environment's site-packages on the new venv's path, after its own."""
    ask = (
        "import site, sysconfig\n"
        "p = sysconfig.get_paths()\n"
        "print(*dict.fromkeys([p['purelib'], p['platlib'], *site.getsitepackages()]), sep='\\n')"
    )
    base = subprocess.run([base_python, "-c", ask], capture_output=True, text=True, timeout=60, check=True)
    own = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    Path(own.stdout.strip(), "_trainstack_base_env.pth").write_text(base.stdout)


class RunsAs(Protocol):
    """Who the job's pip runs as (bootstrap/jobuser.py's JobLaunch): its command line and its files."""

    def wrap(self, argv: list[str], unit: str | None) -> list[str]: ...

    def give(self, directories: Iterable[Path]) -> None: ...


@runtime_checkable
class RunsInScope(RunsAs, Protocol):
    """A RunsAs that also puts the job in its own scope with its own environment (JobLaunch does): pip
    then runs as the job does, and whatever its build steps leave running is killed with the scope."""

    def unit_name(self) -> str | None: ...

    def stop(self, unit: str | None) -> None: ...

    def inherited_environment(self, environ: Mapping[str, str], home: Path | None) -> dict[str, str]: ...


def _venv_ready(marker: Path) -> bool:
    """The venv was completed by this agent: its marker is a regular file (not a link) of the agent's own
    user. The job's user owns the venv: it may delete the marker or put its own there, never make one of
    root's, so a venv the job tampered with that way is rebuilt, never repaired."""
    try:
        info = os.lstat(marker)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()


def pip_install_args(requirements: Path) -> list[str]:
    """How pip reads the job's requirements: --require-hashes (and wheels only) when they pin hashes, as the
    instance's own lock is installed; offline from a `wheels/` folder next to them when the job vendors one
    (trainstack:networkIsolation requires both, infra/config/)."""
    args = ["-r", str(requirements)]
    if has_hashes(requirements.read_text(encoding="utf-8")):
        args += ["--require-hashes", "--only-binary=:all:"]
    wheels = requirements.parent / VENDORED_WHEELS_DIR
    if wheels.is_dir():
        args += ["--no-index", "--find-links", str(wheels)]
    return args


def prepare_python(
    base_python: str,
    requirements: Path | None,
    cache_root: Path,
    log: Callable[..., None],
    should_abort: Callable[[], bool] = lambda: False,
    launch: RunsAs | None = None,
) -> str:
    """The interpreter the job runs with: the AMI's own, or a venv on top of it with the job's requirements.

    The venv sees the AMI's packages (a .pth file naming their site-packages: `--system-site-packages`
    would see the interpreter's base, not the AMI's own venv) and pip is constrained to their torch version,
    so torch is found installed and never reinstalled. It is keyed by the requirements' content and reused
    by later lives on this instance. Never root's env: the venv is the job's own, and with `launch` (the
    job's unprivileged user) it is that user's and pip runs as that user (in the job's scope when `launch`
    has one), so no package's install code runs as root. Hashed requirements are installed with
    --require-hashes (pip_install_args).

    Root never runs or repairs anything in a venv the job has owned: one without the agent's ready marker
    (_venv_ready) is removed, links never followed, and built again from nothing; root runs only the base
    interpreter and the fresh venv's own Python before the venv is given to the job.
    """
    if requirements is None:
        return base_python
    constraints = pinned_constraints(base_python)
    # Keyed by what decides the environment: the requirements, the pinned torch and the base interpreter.
    digest = hashlib.sha256(requirements.read_bytes() + constraints.encode() + base_python.encode())
    key = digest.hexdigest()[:16]
    venv = cache_root / f"venv-{key}"
    python = venv / "bin" / "python"
    ready = venv / VENV_READY
    if _venv_ready(ready):
        log("job", "job environment reused", requirements=str(requirements), venv=str(venv))
        return str(python)
    cache_root.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(venv):
        # Half-built, or the job deleted the marker (after replacing bin/python, say): `python -m venv` and
        # the sysconfig probe below would run the job's own files as root.
        log("job", "job environment rebuilt from scratch (not marked complete by the agent)", venv=str(venv))
        remove_entry(venv, ignore_errors=False)
    # No pip of its own: `python -m pip` in the venv runs the base env's pip (seen through the .pth below) and
    # installs into the venv. ensurepip would copy a second pip in, about 4 s, and run it uncompiled.
    subprocess.run([base_python, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    _see_base_packages(base_python, str(python))
    constraints_file = venv / "constraints.txt"
    constraints_file.write_text(constraints)
    pip_cache = cache_root / "pip-cache"
    pip_env = {**os.environ, "PIP_CACHE_DIR": str(pip_cache)}
    unit: str | None = None
    if launch is not None:
        # The job user's venv and cache; its HOME is the cache (root's home is not its).
        launch.give([venv, pip_cache])
        pip_env["HOME"] = str(pip_cache)
        if isinstance(launch, RunsInScope):
            # The job's environment (none of the agent's credentials) and a scope of its own.
            inherited = launch.inherited_environment(os.environ, pip_cache)
            pip_env = {**inherited, "PIP_CACHE_DIR": str(pip_cache), "HOME": str(pip_cache)}
            unit = launch.unit_name()
    log(
        "job", "installing the job's requirements", requirements=str(requirements), pinned=constraints.split()
    )
    argv = [
        str(python),
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "-q",
        *pip_install_args(requirements),
        "-c",
        str(constraints_file),
    ]
    try:
        process = subprocess.Popen(
            launch.wrap(argv, unit) if launch is not None else argv,
            env=pip_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        while True:
            try:
                output, _ = process.communicate(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if should_abort():
                    process.kill()
                    process.communicate()
                    raise InterruptedError("requirements install interrupted by a stop") from None
    finally:
        if unit is not None and isinstance(launch, RunsInScope):
            launch.stop(unit)  # whatever a build step started and left running
    if process.returncode != 0:
        tail = " | ".join(output.strip().splitlines()[-3:])
        raise JobSpecError(
            [f"{requirements}: pip install failed ({tail}); fix the requirements (torch stays the AMI's)"]
        )
    # Root's own file in the job's venv, written without following a link pip's build steps (run as the job's
    # user) may have put at the name.
    replace_file(ready, sys.version.encode(), say=lambda line: log("job", line, level="warning"))
    return str(python)

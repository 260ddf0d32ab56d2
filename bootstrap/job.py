"""A user's own job: its job file (validated at preview and on the instance), its Python environment, its
command line and the contract environment the agent gives it (docs/job-contract.md)."""

from __future__ import annotations

import difflib
import hashlib
import os
import re
import stat
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import yaml

from bootstrap.bootlock import has_hashes
from bootstrap.safefiles import remove_entry, replace_file
from bootstrap.secrets import env_secret_problem, parse_secrets, refs_to_mapping
from trainstack_job.contract import JobEnv
from trainstack_job.resources import ResourceError, ResourceRequest, parse_resources
from trainstack_job.text import not_utf8

# Where the job's workdir sits inside the code bundle (infra/bundle.py puts it there).
BUNDLE_JOB_DIR = "job"
# Spot interruptions in the ledger before its rate replaces the published band for the job.
MIN_OBSERVED_INTERRUPTIONS = 2
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_KNOWN = {"name", "command", "workdir", "requirements", "env", "secrets", "data", "checkpoint", "resources"}
# A job's vendored wheels: a folder of this name next to its requirements file (infra/wheels.py checks it).
VENDORED_WHEELS_DIR = "wheels"
# Packages a job's requirements may not replace: the AMI's builds match its CUDA driver.
PINNED_PACKAGES = ("torch", "torchvision", "torchaudio")
# The agent's mark, inside a job's venv, that the venv was built completely (prepare_python).
VENV_READY = ".trainstack-ready"


class JobSpecError(ValueError):
    """Every problem of a job file, one line each, naming the key and the fix."""

    def __init__(self, problems: list[str], fix: str = "") -> None:
        super().__init__("; ".join(problems))
        self.problems = problems
        # What the notification's "Fix:" line says; empty: the job file's own (requirements) fix.
        self.fix = fix


@dataclass(frozen=True)
class JobSpec:
    """What `examples/<name>/job.yaml` says; paths relative to the job file's folder."""

    name: str
    command: tuple[str, ...]
    workdir: str = "."
    requirements: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    data_sync: bool = True
    checkpoint_keep: int = 3
    # ENV_NAME -> a secret's name under the stack's path (bootstrap/secrets.py); the agent resolves them.
    secrets: dict[str, str] = field(default_factory=dict)
    # What the job asks for (trainstack_job/resources.py): matched to a pool at submit, carried by the record
    # (its `resources` and `agent.pool`), so it is not part of the definition below.
    resources: ResourceRequest = field(default_factory=ResourceRequest)

    def to_mapping(self) -> dict[str, Any]:
        """The form carried in the agent config (workdir: where the bundle put it)."""
        mapping: dict[str, Any] = {
            "name": self.name,
            "command": list(self.command),
            "workdir": self.workdir,
            "requirements": self.requirements,
            "env": dict(self.env),
            "data": {"sync": self.data_sync},
            "checkpoint": {"keep": self.checkpoint_keep},
        }
        if self.secrets:
            # Only when named: a job without secrets keeps the definition, and the job id, it always had.
            mapping["secrets"] = dict(self.secrets)
        return mapping

    @classmethod
    def from_mapping(cls, raw: Any, source: str, base_dir: Path | None = None) -> JobSpec:
        """Validate a parsed job file; with `base_dir`, also that workdir and requirements exist there."""
        if not isinstance(raw, dict):
            raise JobSpecError(
                [f"{source}: expected a mapping with name, command, workdir; see docs/job-contract.md"]
            )
        problems = [
            f"{source}: {key}: unknown key (known: {', '.join(sorted(_KNOWN))})"
            for key in raw
            if key not in _KNOWN
        ]
        name = raw.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            problems.append(f"{source}: name: required, lowercase letters, digits and '-' (e.g. charlm)")
        command = raw.get("command")
        if isinstance(command, str):
            problems.append(
                f'{source}: command: give the argv as a list, e.g. [python, train.py], not "{command}"'
            )
        elif (
            not isinstance(command, list)
            or not command
            or not all(isinstance(a, (str, int, float)) for a in command)
        ):
            problems.append(
                f"{source}: command: required, a non-empty list of arguments, e.g. [python, train.py]"
            )
        workdir = raw.get("workdir", ".")
        if not isinstance(workdir, str) or Path(workdir).is_absolute() or ".." in Path(workdir).parts:
            problems.append(f"{source}: workdir: a folder relative to the job file, inside it (e.g. .)")
        requirements = raw.get("requirements")
        if requirements is not None and not isinstance(requirements, str):
            problems.append(f"{source}: requirements: a file name relative to workdir, e.g. requirements.txt")
        env = raw.get("env", {}) or {}
        if not isinstance(env, dict):
            problems.append(f"{source}: env: a mapping of NAME: value")
            env = {}
        for key, value in env.items():
            if not isinstance(key, str) or not _ENV_NAME.match(key):
                problems.append(f"{source}: env.{key}: not a valid environment variable name")
            elif key.startswith("TRAINSTACK_"):
                problems.append(
                    f"{source}: env.{key}: TRAINSTACK_* are set by the agent; choose another name"
                )
            elif not isinstance(value, (str, int, float, bool)):
                problems.append(f"{source}: env.{key}: a string value")
            else:
                # Parsed values, not the file's text: a folded or quoted token is still seen.
                secret = env_secret_problem(f"{source}: env", key, value)
                if secret:
                    problems.append(secret)
        secrets, secret_problems = parse_secrets(raw.get("secrets"), f"{source}: secrets")
        problems += secret_problems
        problems += [
            f"{source}: secrets.{key}: also set in env; keep it under secrets: only"
            for key in secrets
            if key in env
        ]
        resources = ResourceRequest()
        try:
            resources = parse_resources(raw.get("resources"), f"{source}: resources")
        except ResourceError as error:
            problems += error.problems
        data = raw.get("data", {}) or {}
        if not isinstance(data, dict) or set(data) - {"sync"} or not isinstance(data.get("sync", True), bool):
            problems.append(f"{source}: data: only {{sync: true|false}} is known")
            data = {}
        checkpoint = raw.get("checkpoint", {}) or {}
        keep = checkpoint.get("keep", 3) if isinstance(checkpoint, dict) else None
        if not isinstance(keep, int) or isinstance(keep, bool) or not 1 <= keep <= 100:
            problems.append(f"{source}: checkpoint.keep: an integer from 1 to 100")
            keep = 3
        if base_dir is not None and isinstance(workdir, str) and not problems:
            root = base_dir / workdir
            if not root.is_dir():
                problems.append(f"{source}: workdir: {root} is not a folder")
            elif requirements and not (root / requirements).is_file():
                problems.append(f"{source}: requirements: {root / requirements} does not exist")
            elif requirements and (encoding := _not_utf8_file(root / requirements)) is not None:
                # Read as UTF-8 on the instance (pip_install_args): refused at preview, not at boot.
                problems.append(f"{source}: requirements: {root / requirements}: {encoding}")
            else:
                # Only the folder the job ships is known here: a typo in its script's name fails preview.
                argv = tuple(str(a) for a in command) if isinstance(command, list) else ()
                missing = command_problem(argv, root, bool(requirements))
                if missing:
                    problems.append(f"{source}: command: {missing}")
        if problems:
            raise JobSpecError(problems)
        return cls(
            name=str(name),
            command=tuple(str(a) for a in command),  # type: ignore[union-attr]
            workdir=str(workdir),
            requirements=requirements,
            env={str(k): _env_value(v) for k, v in env.items()},
            data_sync=bool(data.get("sync", True)),
            checkpoint_keep=int(keep),
            secrets=refs_to_mapping(secrets),
            resources=resources,
        )


# Interpreters whose first operand is a file in the job's folder, and their options that take a value
# (attached, -Wignore, or as the next argument, -o pipefail).
_PYTHON = re.compile(r"^python(3(\.\d+)?)?$")
_SHELLS = frozenset({"bash", "sh", "dash", "zsh"})
_PYTHON_VALUE_LETTERS, _SHELL_VALUE_LETTERS = "WX", "oO"
_LONG_OPTIONS_WITH_VALUE = frozenset({"--check-hash-based-pycs", "--rcfile", "--init-file"})
# Modules every job can run with `python -m` although they are not in its folder: the instance's PyTorch
# builds (the AMI's, never reinstalled) and the code bundle's own packages (PYTHONPATH; e.g. `training`).
_INSTANCE_MODULES = frozenset({*PINNED_PACKAGES, "pip", "venv", "ensurepip"})
_CODE_ROOT = Path(__file__).resolve().parent.parent


def command_problem(command: tuple[str, ...], root: Path, has_requirements: bool) -> str | None:
    """What is wrong with a command whose script is not in the job's folder (`root`), else None.

    Checked: the script after `python` (and its options), the script after `bash`/`sh`, a relative program
    (`./run.sh`), and `python -m <module>`. Absolute paths and programs found on PATH (`torchrun`, `bash -c`)
    are the instance's business and pass: only the folder the job ships can be known at preview."""
    if not command:
        return None
    program = Path(command[0]).name
    if _PYTHON.match(program):
        kind, operand = _first_operand(command[1:], python=True)
    elif program in _SHELLS:
        kind, operand = _first_operand(command[1:], python=False)
    elif "/" in command[0] and not Path(command[0]).is_absolute():
        kind, operand = "file", command[0]
    else:
        return None
    if operand is None or kind == "code":
        return None
    if kind == "module":
        return _module_problem(operand, root, has_requirements)
    if Path(operand).is_absolute() or operand == "-" or (root / operand).is_file():
        return None
    return f"{operand} is not in {root}{_did_you_mean(operand, _files(root))}"


def _first_operand(args: tuple[str, ...], *, python: bool) -> tuple[str, str | None]:
    """("file", the script), ("module", name) for python's -m, ("code", None) for -c, or ("file", None)."""
    value_letters = _PYTHON_VALUE_LETTERS if python else _SHELL_VALUE_LETTERS
    index = 0
    while index < len(args):
        arg = args[index]
        index += 1
        if arg == "--":
            return "file", args[index] if index < len(args) else None
        if arg in ("-", "+") or not arg.startswith(("-", "+")):
            return "file", arg
        if arg.startswith("--"):
            index += arg in _LONG_OPTIONS_WITH_VALUE
            continue
        # A group of short options: -u, -OO, -uc "code", -Wignore, -um pkg, -eo pipefail.
        for position, letter in enumerate(arg[1:], start=2):
            rest = arg[position:]
            if letter == "c":
                return "code", None
            if python and letter == "m":
                return "module", rest or (args[index] if index < len(args) else None)
            if letter in value_letters:
                index += not rest
                break
    return "file", None


def _module_problem(module: str, root: Path, has_requirements: bool) -> str | None:
    top = module.split(".", 1)[0]
    local = [root / top, root / f"{top}.py", _CODE_ROOT / top, _CODE_ROOT / f"{top}.py"]
    if any(path.exists() for path in local) or top in sys.stdlib_module_names or top in _INSTANCE_MODULES:
        return None
    # The job's requirements install packages whose module names preview cannot know (scikit-learn is
    # sklearn): a module may come from them, so only a job without requirements is refused.
    if has_requirements:
        return None
    names = [Path(name).stem for name in _files(root, depth=1)]
    return (
        f"python -m {module}: {top} is not in {root} and the job has no requirements to install it"
        f"{_did_you_mean(top, names)}"
    )


def _files(root: Path, depth: int = 3) -> list[str]:
    """The job folder's files (and, at depth 1, its packages), as the command names them; a bounded walk."""
    found: list[str] = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if len(relative.parts) > depth or any(part.startswith(".") for part in relative.parts):
            continue
        if path.is_file() or (depth == 1 and (path / "__init__.py").is_file()):
            found.append(relative.as_posix() if depth > 1 else path.name)
        if len(found) >= 2000:
            break
    return found


def _did_you_mean(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _env_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _not_utf8_file(path: Path) -> str | None:
    """Why `path` cannot be read as UTF-8 text, or None when it can."""
    try:
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        return not_utf8(exc)
    return None


def load_job_spec(path: Path) -> JobSpec:
    """Read and validate a job file, its workdir and requirements included."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise JobSpecError(
            [f"{path}: cannot read the job file ({exc.strerror}); check trainstack:job"]
        ) from exc
    except UnicodeDecodeError as exc:  # saved in another encoding, or not a text file at all
        raise JobSpecError([f"{path}: {not_utf8(exc)}"]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise JobSpecError([f"{path}{where}: not valid YAML; fix the syntax there"]) from None
    return JobSpec.from_mapping(raw, str(path), base_dir=path.parent)


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
    (trainstack:networkIsolation requires both, infra/config.py)."""
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

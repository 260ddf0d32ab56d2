"""A user's job file (`job.yaml`, docs/job-contract.md): its schema, validated the same way at preview
(infra/config/), by `trainstack run` and `trainstack sweep`, and on the instance (the agent). The agent's
side of a job (its Python environment, its contract environment) is bootstrap/job.py's.

Standard library and PyYAML only (load_job_spec reads the file): the CLI, the Pulumi program and the agent all
import it, and none of them imports another's code for it. Not part of the scheduler function's package
(infra/scheduler.py NOT_PACKAGED): the Lambda runtime has no PyYAML and never reads a job file.
"""

from __future__ import annotations

import difflib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainstack_job.credentials import env_secret_problem
from trainstack_job.resources import ResourceError, ResourceRequest, parse_resources
from trainstack_job.secret_refs import ENV_NAME, parse_secrets, refs_to_mapping
from trainstack_job.text import not_utf8

# Where the job's workdir sits inside the code bundle (infra/bundle.py puts it there).
BUNDLE_JOB_DIR = "job"
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
# data.mode: sync (the dataset copied whole before the job starts) or stream (its shard indexes only).
DATA_MODES = ("sync", "stream")
_KNOWN = {"name", "command", "workdir", "requirements", "env", "secrets", "data", "checkpoint", "resources"}
# A job's vendored wheels: a folder of this name next to its requirements file (infra/wheels.py checks it).
VENDORED_WHEELS_DIR = "wheels"
# Packages a job's requirements may not replace: the AMI's builds match its CUDA driver.
PINNED_PACKAGES = ("torch", "torchvision", "torchaudio")


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
    # "sync": the dataset is copied whole to the data folder before the job starts; "stream": a version
    # pushed as shards is not copied, the data folder holds each split's shard index (docs/job-contract.md).
    data_mode: str = "sync"
    checkpoint_keep: int = 3
    # ENV_NAME -> a secret's name under the stack's path (secret_refs.py); the agent resolves them.
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
            # mode only when streamed: a job that does not stream keeps the definition (and id) it had.
            "data": {"sync": self.data_sync} | ({"mode": self.data_mode} if self.data_mode != "sync" else {}),
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
            if not isinstance(key, str) or not ENV_NAME.match(key):
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
        if (
            not isinstance(data, dict)
            or set(data) - {"sync", "mode"}
            or not isinstance(data.get("sync", True), bool)
            or data.get("mode", "sync") not in DATA_MODES
        ):
            problems.append(f"{source}: data: only {{sync: true|false, mode: sync|stream}} is known")
            data = {}
        elif data.get("mode") == "stream" and data.get("sync") is False:
            problems.append(
                f"{source}: data: mode: stream with sync: false; drop one (stream needs the agent)"
            )
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
            data_mode=str(data.get("mode", "sync")),
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

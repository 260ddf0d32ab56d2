"""Run a job with the code it started with: fetch its bundle, check it, unpack it, re-execute the agent there.

A replacement launched after a `pulumi up` that changed the job carries the new code in its user-data; the
job that is still running must not be continued by it (docs/internals.md, "Binding a life to its job").
The same holds for the next queued job on an instance that is up: it runs the code it was submitted with.
The job's record names its bundle; the agent unpacks it beside its own code (as install-agent.sh does,
`<install root>/<sha256>/`) and replaces itself with the same entry point run from there, with the job's
fields over this instance's agent config. Only the environment's code (`code/`, written by `pulumi up`) is
ever re-executed; the code a job was submitted with (`job-code/`, `trainstack run`) is unpacked for the job's
user to run (`prepare_job_code`), never by the agent (SECURITY.md, [T15]).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import sys
import tarfile
import tempfile
import zlib
from collections.abc import Sequence
from dataclasses import MISSING, asdict, is_dataclass
from pathlib import Path
from typing import Any, NoReturn

import yaml
from botocore.exceptions import ClientError

from bootstrap.agent_config import AgentConfig
from bootstrap.jobbinding import OVERRIDE_FIELDS, record_fields
from bootstrap.trainer import CODE_ROOT

# Under the install root: the code jobs were submitted with, apart from the environments' (`<sha256>/`).
JOB_CODE_DIR = "job-code"

# Set for the re-executed agent to the job it runs: it must serve that job with its own code, never hop again
# for the same job (a hop loop); going on to another queued job with that job's code is allowed.
PINNED_ENV = "TRAINSTACK_PINNED_JOB"


class PinnedCodeError(RuntimeError):
    """The running job's code cannot be fetched or fails its check; the message names the object and fix."""


def pinned_config(config: AgentConfig, record: dict[str, Any]) -> dict[str, Any]:
    """This instance's agent config (stack, bucket, group…) with the running job's definition over it.

    The stack settings a record overrides (its cost cap, instance count) stay the stack's here: the
    re-executed agent reads the record again when it binds, and must not pass them on to the next job."""
    merged = record_fields(config, record)
    for name in OVERRIDE_FIELDS:
        merged[name] = getattr(config, name)
    # The job's code may be older than this agent and refuse keys it does not know (exit 2, never
    # restarted): a key at its default says nothing the older code's own default would not.
    return {name: value for name, value in merged.items() if not _at_default(name, value)}


def _at_default(name: str, value: Any) -> bool:
    field = AgentConfig.__dataclass_fields__.get(name)
    if field is None:
        return False
    if field.default is not MISSING:
        return bool(value == field.default)
    if field.default_factory is not MISSING:
        default = field.default_factory()
        if is_dataclass(default) and not isinstance(default, type):
            return bool(value == asdict(default))
        return bool(value == default)
    return False  # required: always written


def unpack_bundle(s3: Any, bucket: str, record: dict[str, Any], install_root: Path) -> Path:
    """The job's environment bundle (the agent's code from an earlier `pulumi up`) unpacked at
    `<install_root>/<sha256>` (reused when already there).

    A bundle that is missing, replaced or not a gzipped tar raises PinnedCodeError: no instance can ever run
    the job with it, so the job fails and the queue moves on. S3 unreachable raises botocore's error: the
    next life tries again."""
    return _unpack(s3, bucket, record, install_root, holds=Path("bootstrap") / "agent.py")


def unpack_job_code(s3: Any, bucket: str, record: dict[str, Any], install_root: Path) -> Path:
    """The code a job was submitted with (`trainstack run`: `job-code/<sha256>/…`) unpacked, owned by root and
    read-only to the job, at `<install_root>/job-code/<sha256>`. The agent never imports or executes it: the
    job's user runs the trainer or the job's command from it. Same refusals as unpack_bundle."""
    return _unpack(s3, bucket, record, install_root / JOB_CODE_DIR, holds=Path("training"))


def _unpack(s3: Any, bucket: str, record: dict[str, Any], root: Path, *, holds: Path) -> Path:
    key, sha256 = str(record.get("bundle_key") or ""), str(record.get("bundle_sha256") or "")
    job = str(record.get("job_id", "?"))[:80]
    if not key or not sha256:
        raise PinnedCodeError(
            f"job {job}: its record names no code bundle; submit the job again with `trainstack run`"
        )
    if not re.fullmatch(r"[0-9a-f]{64}", sha256):
        # It names the folder the bundle is unpacked to: nothing but 64 hex digits may.
        raise PinnedCodeError(
            f"job {job}: its record's bundle_sha256 is not a sha256; submit the job again with "
            "`trainstack run`"
        )
    destination = root / sha256
    if (destination / holds).exists():
        return destination
    uri = f"s3://{bucket}/{key[:200]}"
    try:
        data = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in {"NoSuchKey", "404", "NotFound"}:
            raise PinnedCodeError(
                f"{uri}: job {job}'s code bundle is missing; submit the job again with `trainstack run`"
            ) from None
        raise
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256:
        raise PinnedCodeError(
            f"{uri}: sha256 {actual} is not job {job}'s {sha256}; the object was replaced: submit the job "
            "again with `trainstack run`"
        )
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".{sha256}.unpack-{os.getpid()}"
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
            # The data filter: no absolute names, no `..`, no links out, no devices, no setuid bits.
            archive.extractall(staging, filter="data")
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise PinnedCodeError(
            f"{uri}: job {job}'s code bundle cannot be unpacked ({type(exc).__name__}); submit the job "
            "again with `trainstack run`"
        ) from None
    if not (staging / holds).exists():
        shutil.rmtree(staging, ignore_errors=True)
        raise PinnedCodeError(
            f"{uri}: job {job}'s code bundle holds no {holds.as_posix()}; submit the job again with "
            "`trainstack run`"
        )
    staging.replace(destination)
    return destination


def prepare_pinned(
    s3: Any, config: AgentConfig, record: dict[str, Any], *, install_root: Path | None = None
) -> Path:
    """The job's code unpacked and checked, and its agent config written (readable by root only: it names the
    stack's resources); the config's path. Raises PinnedCodeError for a job whose code can never run."""
    root = install_root or default_install_root()
    code = unpack_bundle(s3, config.bucket, record, root)
    config_path = code / f"agent-{record.get('job_id', 'job')}.yaml"
    text = yaml.safe_dump(pinned_config(config, record), sort_keys=False)
    fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)
        out.write(text)
    return config_path


def prepare_job_code(
    s3: Any, config: AgentConfig, record: dict[str, Any], *, install_root: Path | None = None
) -> Path:
    """The folder the job's submitted code is unpacked in (unpack_job_code); raises PinnedCodeError for a job
    whose code can never run."""
    return unpack_job_code(s3, config.bucket, record, install_root or default_install_root())


def default_install_root() -> Path:
    """Beside this agent's own bundle when it runs from one (`/opt/trainstack/<sha256>`), else a temp dir."""
    if re.fullmatch(r"[0-9a-f]{64}", CODE_ROOT.name):
        return CODE_ROOT.parent
    return Path(tempfile.gettempdir()) / "trainstack-code"


def reexec_argv(argv: Sequence[str], config_path: Path) -> list[str]:
    """The same entry point and flags, reading `config_path`: `-m bootstrap.agent --config FILE`."""
    args = list(argv)
    if "--config" in args:
        args[args.index("--config") + 1] = str(config_path)
    else:
        args += ["--config", str(config_path)]
    return [sys.executable, *args]


def run_pinned(
    s3: Any, config: AgentConfig, record: dict[str, Any], *, install_root: Path | None = None
) -> NoReturn:
    """Replace this agent with the running job's own code (never returns; raises if it cannot)."""
    if os.environ.get(PINNED_ENV) == str(record.get("job_id")):
        raise PinnedCodeError(
            f"job {record.get('job_id')}: already running its pinned code, yet asked to hop again; "
            "its record's bundle_key/bundle_sha256 must name the bundle it runs from"
        )
    config_path = prepare_pinned(s3, config, record, install_root=install_root)
    code = config_path.parent
    own = str(CODE_ROOT)
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != own]
    env = {
        **os.environ,
        PINNED_ENV: str(record.get("job_id")),
        "PYTHONPATH": os.pathsep.join([str(code), *path]),
    }
    sys.stdout.flush()
    sys.stderr.flush()
    os.chdir(code)
    # orig_argv is the interpreter's own command line: `-m bootstrap.agent` on an instance, `-m demo.agent`
    # in the demo; both re-run from the job's code.
    os.execve(sys.executable, reexec_argv(sys.orig_argv[1:], config_path), env)

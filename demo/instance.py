"""A simulated instance boot: what the rendered user-data does, then the real agent as a subprocess."""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.markup import escape

from bootstrap.cloud_init import AGENT_CONFIG_PATH

REPO = Path(__file__).resolve().parent.parent


@dataclass
class AgentRun:
    """One agent process and what it said, each line stamped with the time it arrived."""

    name: str
    process: subprocess.Popen[str]
    events: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    trainer_lines: list[tuple[float, str]] = field(default_factory=list)

    def find(self, message_part: str) -> tuple[float, dict[str, Any]] | None:
        return next(((t, e) for t, e in self.events if message_part in str(e.get("message", ""))), None)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)


@dataclass(frozen=True)
class AgentEcho:
    """Prints each agent event and trainer line as it arrives, stamped with the seconds since the story
    began: the same live output for every demo story."""

    console: Console
    started: float

    def event(self, run: AgentRun, event: dict[str, Any]) -> None:
        extra = {k: v for k, v in event.items() if k not in ("time", "stage", "message", "argv", "metrics")}
        details = escape(", ".join(f"{k}={v}" for k, v in extra.items()))
        elapsed = time.time() - self.started
        self.console.print(
            f"[dim]{elapsed:6.1f}s[/] [bold cyan]{run.name}[/] [magenta]{event['stage']:<12}[/] "
            f"{escape(str(event['message']))}" + (f" [dim]({details})[/]" if details else ""),
            highlight=False,
        )

    def trainer(self, run: AgentRun, line: str) -> None:
        self.console.print(
            f"[dim]{time.time() - self.started:6.1f}s {run.name} trainer  {escape(line)}[/]", highlight=False
        )


def agent_config_from_user_data(user_data: str, scratch_dir: Path, poll_seconds: float) -> dict[str, Any]:
    """The agent.yaml that cloud-init writes, pointed at this simulated instance's own "instance store"."""
    files = {entry["path"]: entry["content"] for entry in yaml.safe_load(user_data)["write_files"]}
    config: dict[str, Any] = yaml.safe_load(files[AGENT_CONFIG_PATH])
    config.update(scratch_dir=str(scratch_dir), poll_seconds=poll_seconds)
    return config


def install_bundle(s3: Any, bucket: str, key: str, sha256: str, root: Path) -> Path:
    """install-agent.sh's job: fetch the bundle, refuse it unless the sha256 matches, unpack it."""
    data = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256:
        raise RuntimeError(f"s3://{bucket}/{key}: sha256 {actual} does not match the user-data's {sha256}")
    destination = root / sha256
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        archive.extractall(destination, filter="data")
    return destination


def boot_agent(
    name: str,
    code_root: Path,
    config: dict[str, Any],
    env: dict[str, str],
    on_event: Callable[[AgentRun, dict[str, Any]], None],
    on_line: Callable[[AgentRun, str], None],
) -> AgentRun:
    """Write the agent config and start the agent from the unpacked bundle (through `demo.agent`)."""
    config_file = Path(config["scratch_dir"]).parent / f"{name}-agent.yaml"
    config_file.parent.mkdir(parents=True, exist_ok=True)
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    # The agent and trainer come from the unpacked bundle (first on the path); only the entry point that
    # hands the agent simulated spot prices (demo.agent) comes from the repository.
    process = subprocess.Popen(
        [sys.executable, "-m", "demo.agent", "--config", str(config_file)],
        cwd=code_root,
        env={
            **os.environ,
            **env,
            "PYTHONPATH": os.pathsep.join((str(code_root), str(REPO))),
            "PYTHONUNBUFFERED": "1",
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    run = AgentRun(name, process)

    def event(now: float, record: dict[str, Any]) -> None:
        run.events.append((now, record))
        on_event(run, record)

    def line(now: float, text: str) -> None:
        run.trainer_lines.append((now, text))
        on_line(run, text)

    read_agent_output(process, name, event, line)
    return run


def read_agent_output(
    process: subprocess.Popen[str],
    name: str,
    on_event: Callable[[float, dict[str, Any]], None],
    on_line: Callable[[float, str], None],
) -> threading.Thread:
    """Read an agent's piped output on a thread of its own: each JSON event (a line with a `stage`) and each
    other line (the trainer's, passed through), with the time it was read."""

    def pump() -> None:
        assert process.stdout is not None
        for raw in process.stdout:
            line, now = raw.rstrip("\n"), time.time()
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict) and "stage" in record:
                on_event(now, record)
            else:
                on_line(now, line)

    thread = threading.Thread(target=pump, name=f"{name}-output", daemon=True)
    thread.start()
    return thread


def children_by_parent() -> dict[int, list[int]]:
    """Each process's children, from one read of /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name (field 2) may hold spaces: the parent pid is the 2nd field after its ')'.
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return children


def descendants(pid: int, children: Mapping[int, list[int]] | None = None) -> list[int]:
    """Every process below `pid` (agent → launcher → ranks), from /proc (or from `children`, a
    `children_by_parent()` a caller has added edges to); empty where there is none."""
    if children is None:
        children = children_by_parent()
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(run: AgentRun) -> None:
    """A hung agent's trainer would outlive it and keep a core busy: kill what it started, then it."""
    for pid in [*descendants(run.process.pid), run.process.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
    run.process.wait()


def kill_running(runs: Iterable[AgentRun]) -> None:
    """A story that failed: every agent still running is killed, with what it started."""
    for run in runs:
        if run.process.poll() is None:
            kill_tree(run)

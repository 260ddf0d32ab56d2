"""Checkpoints in the docs/job-contract.md layout: atomic local writes; S3 through a persister the trainer is
given (the agent's, bootstrap/persist.py, when run by hand as `python -m bootstrap.standalone`)."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from training.faults import fault_point
from trainstack_job.atomic import fsync_dir, write_atomic
from trainstack_job.context import CheckpointContext
from trainstack_job.layout import (
    LATEST,
    MANIFEST,
    STEP_DIR,
    latest_json,
    now_iso,
    read_manifest,
    sha256_file,
    step_dir_name,
    verify_dir,
)

log = logging.getLogger(__name__)

STATE = "state.pt"
# How long a standalone trainer (checkpoint.uri set, no agent) waits for its last upload before exit.
FINAL_UPLOAD_SECONDS = 300.0


@dataclass
class CheckpointTimings:
    """What metrics.json reports about checkpointing."""

    count: int = 0
    save_seconds: list[float] = field(default_factory=list)
    upload_seconds: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "save_seconds_mean": sum(self.save_seconds) / len(self.save_seconds)
            if self.save_seconds
            else 0.0,
            "upload_seconds_mean": (
                sum(self.upload_seconds) / len(self.upload_seconds) if self.upload_seconds else 0.0
            ),
            "save_seconds_max": max(self.save_seconds, default=0.0),
            "upload_seconds_max": max(self.upload_seconds, default=0.0),
        }


@dataclass(frozen=True)
class Restored:
    step: int
    directory: Path
    manifest: dict[str, Any]

    @property
    def context(self) -> CheckpointContext | None:
        """What wrote it (manifest.json "context"); None for a checkpoint from before contexts."""
        return CheckpointContext.from_dict(self.manifest.get("context"))

    def load_state(self) -> dict[str, Any]:
        # weights_only: a checkpoint from S3 is data, never code.
        state: dict[str, Any] = torch.load(self.directory / STATE, map_location="cpu", weights_only=True)
        return state

    def state_bytes(self) -> bytes:
        """The state file as written, for ranks on other machines (`state_from_bytes` there)."""
        return (self.directory / STATE).read_bytes()


def state_from_bytes(data: bytes) -> dict[str, Any]:
    """A state file's bytes, loaded as `Restored.load_state` loads the file: data only, tensors on the CPU."""
    state: dict[str, Any] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    return state


class Flushed(Protocol):
    """Where persistence stands at the end of the run (bootstrap/checkpoint_store.py's PersistResult)."""

    @property
    def confirmed(self) -> bool: ...


class Persister(Protocol):
    """What the trainer needs of a persister that mirrors checkpoint.dir to checkpoint.uri: the agent's own
    (bootstrap/persist.py's CheckpointPersister) is one. Received, never imported: the agent imports the
    trainer's packages, so the trainer must not import the agent's."""

    upload_seconds: list[float]

    @property
    def uri(self) -> str: ...

    @property
    def confirmed_step(self) -> int | None: ...

    def restore(self) -> int | None: ...

    def start(self) -> None: ...

    def finish(self, deadline: float) -> Flushed: ...

    def close(self) -> None: ...


# (checkpoint.uri, checkpoint.dir, checkpoint.keep) -> the persister of that folder to that URI.
PersisterFactory = Callable[[str, Path, int], Persister]


class CheckpointManager:
    """Saves committed `step-<N>/` directories in checkpoint.dir, keeps the last K, restores the newest that
    verifies. Under the agent checkpoint.uri is empty: the agent persists checkpoint.dir to S3. Run by hand
    with checkpoint.uri set, the trainer runs the persister `persister_factory` makes for it (the agent's,
    given by bootstrap/standalone.py)."""

    def __init__(
        self,
        root: str | Path,
        uri: str = "",
        keep: int = 3,
        persister_factory: PersisterFactory | None = None,
    ) -> None:
        if uri and persister_factory is None:
            raise ValueError(f"checkpoint.uri {uri}: no persister to upload with (persister_factory)")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.timings = CheckpointTimings()
        self.latest_saved_step: int | None = None
        self.persister = persister_factory(uri, self.root, keep) if uri and persister_factory else None
        self._persisting = False
        # Half-written directories of a process that died mid-save or mid-download are never restorable.
        for leftover in self.root.glob(".step-*"):
            shutil.rmtree(leftover, ignore_errors=True)

    @property
    def remote_uri(self) -> str:
        return self.persister.uri if self.persister else ""

    @property
    def confirmed_remote_step(self) -> int | None:
        return self.persister.confirmed_step if self.persister else None

    # -- saving ---------------------------------------------------------------------------------------

    def save(
        self,
        state: dict[str, Any],
        *,
        step: int,
        epoch: int,
        world_size: int,
        config_hash: str,
        context: CheckpointContext | None = None,
        step_in_epoch: int | None = None,
    ) -> Path:
        """Write step-<N> atomically (staging directory, manifest last, rename); returns the directory.
        `context` goes into the manifest, readable without loading the state (the CLI, users' jobs), and so
        does `step_in_epoch`: with `epoch`, where the data resumes (`resume_position`)."""
        started = time.monotonic()
        name = step_dir_name(step)
        tmp = self.root / f".{name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir()
            with (tmp / STATE).open("wb") as handle:
                torch.save(state, handle)
                handle.flush()
                os.fsync(handle.fileno())
            fault_point("checkpoint-state-written", step=step)
            manifest = {
                "step": step,
                "epoch": epoch,
                **({"step_in_epoch": step_in_epoch} if step_in_epoch is not None else {}),
                "world_size": world_size,
                "config_hash": config_hash,
                **({"context": context.to_dict()} if context is not None else {}),
                "written_at": now_iso(),
                "files": {STATE: {"sha256": sha256_file(tmp / STATE), "size": (tmp / STATE).stat().st_size}},
            }
            write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=2).encode())
            final = self.root / name
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if exc.errno == 28:  # ENOSPC
                raise OSError(
                    exc.errno,
                    f"disk full while saving checkpoint step {step} "
                    f"(about {_state_bytes(state) / 1e9:.1f} GB needed, "
                    f"{shutil.disk_usage(self.root).free / 1e9:.1f} GB free); free space or raise "
                    "trainstack:rootVolumeSizeGb",
                    str(self.root),
                ) from exc
            raise
        fsync_dir(self.root)
        fault_point("checkpoint-dir-committed", step=step)
        write_atomic(self.root / LATEST, latest_json(step, epoch))
        self.timings.count += 1
        self.timings.save_seconds.append(time.monotonic() - started)
        self.latest_saved_step = step
        self._prune_local()
        if self.persister is not None and not self._persisting:
            self.persister.start()
            self._persisting = True
        return final

    def wait_uploaded(self, timeout: float = FINAL_UPLOAD_SECONDS) -> bool:
        """With a persister of its own: block until the newest saved step is confirmed in S3 (bounded).
        Under the agent there is nothing to wait for here: True."""
        if self.persister is None:
            return True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            confirmed = self.persister.confirmed_step
            if self.latest_saved_step is None or (
                confirmed is not None and confirmed >= self.latest_saved_step
            ):
                return True
            time.sleep(0.1)
        return False

    def finish(self, timeout: float = FINAL_UPLOAD_SECONDS) -> bool:
        """At the end of the run: True when every saved step is persisted (always True under the agent)."""
        if self.persister is None:
            return True
        result = self.persister.finish(time.monotonic() + timeout)
        self.timings.upload_seconds.extend(self.persister.upload_seconds)
        return result.confirmed

    def close(self) -> None:
        if self.persister is not None:
            self.persister.close()

    def _local_steps(self) -> list[int]:
        return local_steps(self.root)

    def _prune_local(self) -> None:
        for step in self._local_steps()[self.keep :]:
            shutil.rmtree(self.root / step_dir_name(step), ignore_errors=True)

    # -- restoring ------------------------------------------------------------------------------------

    def restore_local(self) -> Restored | None:
        """The newest committed step (renamed into place with its manifest) whose files verify."""
        for step in self._local_steps():
            directory = self.root / step_dir_name(step)
            manifest, why = verify_dir(directory)
            if manifest is not None:
                return Restored(step, directory, manifest)
            log.warning("skipping local checkpoint step %d: %s", step, why)
        return None

    def restore(self) -> Restored | None:
        """The newest checkpoint that verifies. With a persister of its own, S3 is consulted first (the
        newest verified step there is downloaded into checkpoint.dir) and uploads start afterwards."""
        if self.persister is not None and not self._persisting:
            self.persister.restore()
            self.persister.start()
            self._persisting = True
        found = self.restore_local()
        if found is not None:
            self.latest_saved_step = found.step
        return found


def local_steps(root: Path) -> list[int]:
    """The step folders in `root`, newest first (none when `root` does not exist)."""
    steps = []
    for entry in root.iterdir() if root.is_dir() else ():
        match = STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            steps.append(int(match.group(1)))
    return sorted(steps, reverse=True)


def resume_position(root: Path) -> tuple[int, int] | None:
    """Where the newest committed checkpoint in `root` resumes the data: (epoch, batch within the epoch), from
    its manifest alone. A gated standby warms its loader there, so a streamed dataset's next shards are on
    its disk before the hand-over; it loads no state before the gate (the restore after it decides what is
    trained, and may find a newer step). None without one, or for a checkpoint from before the manifest
    said its batch."""
    for step in local_steps(root):
        manifest = read_manifest(root / step_dir_name(step))
        if manifest is None:
            continue  # not committed: an older step may be
        epoch, batch = manifest.get("epoch"), manifest.get("step_in_epoch")
        if isinstance(epoch, int) and isinstance(batch, int) and epoch >= 0 and batch >= 0:
            return epoch, batch
        return None
    return None


def _state_bytes(state: dict[str, Any]) -> int:
    total = 0
    for value in state.values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, dict):
            total += _state_bytes(value)
    return total

"""Checkpoints in the DESIGN.md layout: atomic local writes, background S3 upload, verified restore."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from training.faults import fault_point
from training.store import STEP_DIR, S3Prefix

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "latest.json"
STATE = "state.pt"


def step_dir_name(step: int) -> str:
    return f"step-{step}"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(4 * 2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write via a temp file, fsync, rename and fsync the directory: readers see old or new, never half."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(path)
    _fsync_dir(path.parent)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def verify_dir(directory: Path) -> tuple[dict[str, Any] | None, str]:
    """(manifest, "") if every listed file has its recorded size and sha256, else (None, why not)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None, f"{directory / MANIFEST} missing or unreadable"
    for name, meta in manifest.get("files", {}).items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != meta["size"]:
            return None, f"{path} missing or truncated"
        if sha256_file(path) != meta["sha256"]:
            return None, f"{path} sha256 mismatch"
    return manifest, ""


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

    def load_state(self) -> dict[str, Any]:
        # weights_only: a checkpoint from S3 is data, never code.
        state: dict[str, Any] = torch.load(self.directory / STATE, map_location="cpu", weights_only=True)
        return state


class CheckpointManager:
    """Saves to checkpoint.dir (and checkpoint.uri), keeps the last K, restores the newest that verifies."""

    def __init__(self, root: str | Path, uri: str = "", keep: int = 3) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.remote = S3Prefix(uri) if uri else None
        self.keep = keep
        self.timings = CheckpointTimings()
        self.latest_saved_step: int | None = None
        self.confirmed_remote_step: int | None = None
        self._uploader = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="ckpt-upload"
        )
        self._pending: list[tuple[concurrent.futures.Future[None], Path, int, int]] = []
        # Half-written directories of a process that died mid-save or mid-download are never restorable.
        for leftover in self.root.glob(".step-*"):
            shutil.rmtree(leftover, ignore_errors=True)

    @property
    def remote_uri(self) -> str:
        return self.remote.uri if self.remote else ""

    # -- saving ---------------------------------------------------------------------------------------

    def save(
        self, state: dict[str, Any], *, step: int, epoch: int, world_size: int, config_hash: str
    ) -> Path:
        """Write step-<N> locally (atomic), then queue its upload; returns the local directory."""
        started = time.monotonic()
        name = step_dir_name(step)
        tmp = self.root / f".{name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        with (tmp / STATE).open("wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        fault_point("checkpoint-state-written", step=step)
        manifest = {
            "step": step,
            "epoch": epoch,
            "world_size": world_size,
            "config_hash": config_hash,
            "written_at": now_iso(),
            "files": {STATE: {"sha256": sha256_file(tmp / STATE), "size": (tmp / STATE).stat().st_size}},
        }
        write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=2).encode())
        final = self.root / name
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync_dir(self.root)
        fault_point("checkpoint-dir-committed", step=step)
        write_atomic(self.root / LATEST, self._latest_json(step, epoch))
        self.timings.count += 1
        self.timings.save_seconds.append(time.monotonic() - started)
        self.latest_saved_step = step
        if self.remote is None:
            self._prune_local()
        else:
            self._queue_upload(final, step, epoch)
        return final

    def _queue_upload(self, directory: Path, step: int, epoch: int) -> None:
        self._pending.append(
            (self._uploader.submit(self._upload, directory, step, epoch), directory, step, epoch)
        )

    @staticmethod
    def _latest_json(step: int, epoch: int) -> bytes:
        return json.dumps(
            {"step": step, "epoch": epoch, "dir": step_dir_name(step), "written_at": now_iso()}
        ).encode()

    def _upload(self, directory: Path, step: int, epoch: int) -> None:
        try:
            self._upload_once(directory, step, epoch)
        except Exception as exc:
            log.error(
                "checkpoint step %d: upload to %s failed (%s); retrying before exit",
                step,
                self.remote_uri,
                exc,
            )
            raise

    def _upload_once(self, directory: Path, step: int, epoch: int) -> None:
        assert self.remote is not None
        started = time.monotonic()
        name = directory.name
        manifest = json.loads((directory / MANIFEST).read_text())
        for file_name in manifest["files"]:
            self.remote.upload_file(directory / file_name, f"{name}/{file_name}")
            fault_point("upload-file-done", step=step)
        # The manifest after the files, latest.json after the manifest: a partial upload is never latest.
        self.remote.upload_file(directory / MANIFEST, f"{name}/{MANIFEST}")
        self.remote.upload_bytes(self._latest_json(step, epoch), LATEST)
        self.confirmed_remote_step = step
        self.timings.upload_seconds.append(time.monotonic() - started)
        log.info("checkpoint step %d uploaded to %s/%s", step, self.remote.uri, name)
        self._prune_remote(step)
        self._prune_local()

    def wait_uploaded(self) -> None:
        """Block until every queued upload is confirmed; a failed one is retried once, then raised."""
        pending, self._pending = self._pending, []
        for future, directory, step, epoch in pending:
            superseded = self.confirmed_remote_step is not None and self.confirmed_remote_step >= step
            if future.exception() is not None and directory.is_dir() and not superseded:
                self._upload_once(directory, step, epoch)

    def close(self) -> None:
        self._uploader.shutdown(wait=True)

    def _local_steps(self) -> list[int]:
        steps = []
        for entry in self.root.iterdir():
            match = STEP_DIR.match(entry.name)
            if match and entry.is_dir():
                steps.append(int(match.group(1)))
        return sorted(steps, reverse=True)

    def _prune_local(self) -> None:
        for step in self._local_steps()[self.keep :]:
            shutil.rmtree(self.root / step_dir_name(step), ignore_errors=True)

    def _prune_remote(self, latest_step: int) -> None:
        assert self.remote is not None
        confirmed = [s for s in self.remote.step_dirs() if s <= latest_step]
        for step in confirmed[self.keep :]:
            self.remote.delete_dir(step_dir_name(step))

    # -- restoring ------------------------------------------------------------------------------------

    def _candidates(self, steps: list[int], latest: int | None) -> list[int]:
        """latest.json's step first, then older ones newest first; steps above latest are partial writes."""
        if latest is None:
            return steps
        return [s for s in steps if s <= latest]

    def _read_local_latest(self) -> int | None:
        try:
            return int(json.loads((self.root / LATEST).read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def restore_local(self) -> Restored | None:
        for step in self._candidates(self._local_steps(), self._read_local_latest()):
            directory = self.root / step_dir_name(step)
            manifest, why = verify_dir(directory)
            if manifest is not None:
                return Restored(step, directory, manifest)
            log.warning("skipping local checkpoint step %d: %s", step, why)
        return None

    def _read_remote_latest(self) -> int | None:
        assert self.remote is not None
        raw = self.remote.read_bytes(LATEST)
        try:
            return int(json.loads(raw)["step"]) if raw else None
        except (ValueError, KeyError, TypeError):
            log.warning("%s/%s is unreadable; looking at every uploaded step", self.remote.uri, LATEST)
            return None

    def restore_remote(self, newer_than: int) -> Restored | None:
        """Download and verify the newest S3 checkpoint above `newer_than`, into the local root."""
        assert self.remote is not None
        for step in self._candidates(self.remote.step_dirs(), self._read_remote_latest()):
            if step <= newer_than:
                return None
            name = step_dir_name(step)
            staging = self.root / f".{name}.download-{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            try:
                raw = self.remote.read_bytes(f"{name}/{MANIFEST}")
                if raw is None:
                    log.warning("skipping %s/%s: no manifest (partial upload)", self.remote.uri, name)
                    continue
                (staging / MANIFEST).write_bytes(raw)
                for file_name in json.loads(raw).get("files", {}):
                    self.remote.download_file(f"{name}/{file_name}", staging / file_name)
                manifest, why = verify_dir(staging)
                if manifest is None:
                    log.warning("skipping %s/%s: %s", self.remote.uri, name, why.replace(str(staging), name))
                    continue
                final = self.root / name
                shutil.rmtree(final, ignore_errors=True)
                staging.rename(final)
                write_atomic(self.root / LATEST, self._latest_json(step, int(manifest["epoch"])))
                log.info("restored checkpoint step %d from %s/%s", step, self.remote.uri, name)
                return Restored(step, final, manifest)
            except (OSError, ValueError) as exc:
                log.warning("skipping %s/%s: %s", self.remote.uri, name, exc)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        return None

    def restore(self) -> Restored | None:
        """The newest checkpoint that verifies: local first, then S3 if it holds a newer one."""
        local = self.restore_local()
        remote = self.restore_remote(local.step if local else -1) if self.remote else None
        found = remote or local
        if found is not None and remote is None and self.remote is not None:
            self._reupload_if_missing(found)
        if found is not None:
            self.latest_saved_step = found.step
        return found

    def _reupload_if_missing(self, restored: Restored) -> None:
        """A life killed mid-upload leaves S3 behind the local disk: finish that upload in the background."""
        assert self.remote is not None
        remote_latest = self._read_remote_latest()
        if remote_latest is None or remote_latest < restored.step:
            self._queue_upload(restored.directory, restored.step, int(restored.manifest["epoch"]))

"""`Job`: where a training script saves, whether it must stop, how it resumes (docs/job-contract.md).

Standard library only, so it imports on an instance without installs. Under the agent every place comes
from the TRAINSTACK_* variables; without them (a workstation) checkpoints go to ./checkpoints, output to
./output, and only SIGTERM/SIGINT ask the script to stop.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from trainstack_job.atomic import fsync_dir, write_atomic
from trainstack_job.context import CheckpointContext, environment_context
from trainstack_job.contract import ExitCode, JobEnv
from trainstack_job.layout import (
    LATEST,
    MANIFEST,
    build_manifest,
    committed_steps,
    latest_json,
    now_iso,
    step_dir_name,
    verify_dir,
)
from trainstack_job.records import Progress, first_step_stamp

LOCAL_CHECKPOINT_DIR = Path("checkpoints")
LOCAL_OUTPUT_DIR = Path("output")
DEFAULT_KEEP = 3


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint whose files match its manifest."""

    step: int
    directory: Path
    manifest: dict[str, Any]

    @property
    def context(self) -> CheckpointContext | None:
        """What wrote it (job, code, dataset, instance, GPU, precision, ...): compare it with
        `job.checkpoint_context()` to adapt, e.g. `context.precision != job.precision`. None when the
        checkpoint was written without one."""
        return CheckpointContext.from_dict(self.manifest.get("context"))


class Job:
    """A training job's side of the contract. Build it with `Job.from_env()`."""

    def __init__(
        self,
        checkpoint_dir: Path,
        output_dir: Path,
        *,
        data_dir: Path | None = None,
        stop_file: Path | None = None,
        checkpoint_request_file: Path | None = None,
        progress_file: Path | None = None,
        restored_step: int | None = None,
        keep: int = DEFAULT_KEEP,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1 (the newest checkpoint), got {keep}")
        self.checkpoint_dir = checkpoint_dir
        self.output_dir = output_dir
        self.data_dir = data_dir
        self.stop_file = stop_file
        self.checkpoint_request_file = checkpoint_request_file
        self.progress_file = progress_file
        self.restored_step = restored_step
        self.keep = keep
        # What the agent said about this life (job id, device profile, ...), for checkpoint contexts.
        self._environ = dict(os.environ if environ is None else environ)
        self._stop_requested = False
        self._stop_reason = ""
        self._watching_signals = False
        # When this process first reported a step past the one it resumed from: its time to first step.
        self._first_step_at: str | None = None

    @classmethod
    def from_env(cls, *, keep: int = DEFAULT_KEEP, environ: Mapping[str, str] | None = None) -> Job:
        """The job the agent describes in TRAINSTACK_*, or a local one; creates the directories and starts
        watching SIGTERM/SIGINT at once, so a stop that comes while the model is still loading is not lost."""
        env = os.environ if environ is None else environ

        def path(var: JobEnv) -> Path | None:
            value = env.get(var.value, "")
            return Path(value) if value else None

        restored = env.get(JobEnv.RESTORED_STEP.value, "")
        # The job file's checkpoint.keep, when the agent runs the job; the caller's default otherwise.
        kept = env.get(JobEnv.CHECKPOINT_KEEP.value, "")
        keep = int(kept) if kept.isdigit() and int(kept) > 0 else keep
        job = cls(
            checkpoint_dir=path(JobEnv.CHECKPOINT_DIR) or LOCAL_CHECKPOINT_DIR,
            output_dir=path(JobEnv.OUTPUT_DIR) or LOCAL_OUTPUT_DIR,
            data_dir=path(JobEnv.DATA_DIR),
            stop_file=path(JobEnv.STOP_FILE),
            checkpoint_request_file=path(JobEnv.CHECKPOINT_REQUEST_FILE),
            progress_file=path(JobEnv.PROGRESS_FILE),
            restored_step=int(restored) if restored.isdigit() else None,
            keep=keep,
            environ=env,
        )
        job.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        job.output_dir.mkdir(parents=True, exist_ok=True)
        job.watch_signals()
        return job

    @property
    def precision(self) -> str | None:
        """The precision this instance's GPU trains in ("bf16", or "fp16" with a loss scaler on T4/V100),
        from the agent's device profile; None when the agent does not know the type (or no agent)."""
        return self._environ.get(JobEnv.PRECISION.value) or None

    def checkpoint_context(self, **fields: Any) -> CheckpointContext:
        """This life's context as `save_checkpoint` records it: what the agent says (job id, code hash,
        instance type, GPU model and count, the profile's precision), the synced dataset's version, torch's
        versions when the job imported torch, and `fields` on top, e.g. `precision="fp16", model="gpt2",
        optimizer="AdamW", world_size=8, micro_batch=16, accumulation=4`."""
        base = environment_context(self._environ, [self.data_dir])
        return dataclasses.replace(base, **fields)

    @property
    def managed(self) -> bool:
        """True when the trainstack agent runs this job (it set TRAINSTACK_STOP_FILE)."""
        return self.stop_file is not None

    # -- stopping -----------------------------------------------------------------------------------

    def watch_signals(self) -> None:
        """Make SIGTERM and SIGINT set the stop flag instead of killing the process (main thread only).

        Safe to call again after a framework replaced the handlers; a second Ctrl-C still interrupts."""
        try:
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        except ValueError:  # not the main thread: signals cannot be caught here, the stop file still works
            return
        # A launcher may start the job with stop signals blocked so that none kills it while it loads;
        # now that they only set a flag, let them in (a pending one is delivered at once).
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
        self._watching_signals = True

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self._stop_requested:
            raise KeyboardInterrupt
        self._request_stop(signal.Signals(signum).name)

    def _request_stop(self, reason: str) -> None:
        if not self._stop_requested:
            self._stop_requested = True
            self._stop_reason = reason
            print(f"trainstack_job: {reason}: saving a checkpoint at the next step, then exiting", flush=True)

    def should_stop(self) -> bool:
        """True once a stop was asked for (SIGTERM, SIGINT or the agent's stop file); it stays true.

        Answer it by committing a checkpoint and calling `exit_stopped()`."""
        if not self._watching_signals:
            self.watch_signals()
        if not self._stop_requested and self.stop_file is not None and self.stop_file.exists():
            self._request_stop("stop requested")
        return self._stop_requested

    def exit_stopped(self, step: int | None = None) -> NoReturn:
        """Exit 75: stopped on request with the newest checkpoint committed; the next life resumes it."""
        where = f" at step {step}" if step is not None else ""
        code = int(ExitCode.STOPPED)
        print(f"trainstack_job: stopped{where}, checkpoint committed; exit {code}", flush=True)
        sys.exit(code)

    def checkpoint_requested(self) -> bool:
        """True when the agent asks for a checkpoint now (the job then carries on); the next
        `save_checkpoint` answers it."""
        return self.checkpoint_request_file is not None and self.checkpoint_request_file.exists()

    # -- checkpoints --------------------------------------------------------------------------------

    @contextmanager
    def save_checkpoint(
        self, step: int, *, epoch: int | None = None, context: CheckpointContext | None = None
    ) -> Iterator[Path]:
        """Write the files of step `step` into the directory this yields; on leaving the block they are
        committed as `step-<step>/` (manifest with sha256 and `context`, default `checkpoint_context()`,
        rename, `latest.json`) and steps beyond `keep` are pruned. If the block raises, nothing is
        committed. A step already committed intact is kept as it is (the same step holds the same state)."""
        if step < 0:
            raise ValueError(f"a checkpoint step is a non-negative integer, got {step}")
        answering_request = self.checkpoint_requested()
        name = step_dir_name(step)
        staging = self.checkpoint_dir / f".{name}.staging-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            yield staging
            self._commit(staging, step, epoch, context or self.checkpoint_context())
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if answering_request and self.checkpoint_request_file is not None:
            self.checkpoint_request_file.unlink(missing_ok=True)
        self._prune()

    def _commit(self, staging: Path, step: int, epoch: int | None, context: CheckpointContext) -> None:
        final = self.checkpoint_dir / step_dir_name(step)
        if final.exists():
            if verify_dir(final)[0] is not None:
                return
            # A damaged directory of the same step: move it aside first, so `final` is never half-replaced.
            aside = self.checkpoint_dir / f".{final.name}.damaged-{os.getpid()}"
            shutil.rmtree(aside, ignore_errors=True)
            final.rename(aside)
            shutil.rmtree(aside, ignore_errors=True)
        manifest = build_manifest(staging, step=step, extra={"epoch": epoch, "context": context.to_dict()})
        # The files reach the disk before the manifest that vouches for them.
        for path in staging.rglob("*"):
            if path.is_file():
                with path.open("rb") as handle:
                    os.fsync(handle.fileno())
        write_atomic(staging / MANIFEST, json.dumps(manifest, indent=1).encode())
        staging.rename(final)
        fsync_dir(self.checkpoint_dir)
        newest = committed_steps(self.checkpoint_dir)[0]
        if newest == step:
            write_atomic(self.checkpoint_dir / LATEST, latest_json(step, epoch))

    def _prune(self) -> None:
        for step in committed_steps(self.checkpoint_dir)[self.keep :]:
            old = self.checkpoint_dir / step_dir_name(step)
            aside = self.checkpoint_dir / f".{old.name}.pruned-{os.getpid()}"
            # Renamed first: the agent never sees a committed step directory with files going missing.
            old.rename(aside)
            shutil.rmtree(aside, ignore_errors=True)

    def latest_checkpoint(self) -> Checkpoint | None:
        """The newest committed checkpoint whose files verify, or None (a fresh start). A damaged one is
        reported and skipped for the one before it."""
        for step in committed_steps(self.checkpoint_dir):
            directory = self.checkpoint_dir / step_dir_name(step)
            manifest, why = verify_dir(directory)
            if manifest is not None:
                return Checkpoint(step=step, directory=directory, manifest=manifest)
            print(f"trainstack_job: skipping damaged checkpoint {directory.name}: {why}", file=sys.stderr)
        return None

    # -- progress -----------------------------------------------------------------------------------

    def report_progress(self, step: int, total_steps: int | None = None, **metrics: Any) -> None:
        """Tell the agent how far the job is (its stall watchdog follows `step`); a no-op locally.

        Cheap enough to call every step: no fsync, a reader sees the old file or the new one."""
        if self.progress_file is None:
            return
        if self._first_step_at is None and step > (self.restored_step or 0):
            # The first step this process trained (a report of the restored step itself, before any step, is
            # not one): the agent keeps it as the life's time to first step.
            self._first_step_at = first_step_stamp(datetime.now(timezone.utc))
        value = Progress(
            step, total_steps, updated_at=now_iso(), first_step_at=self._first_step_at, extra=metrics
        ).to_json()
        tmp = self.progress_file.with_name(f".{self.progress_file.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(value, default=_plain))
        tmp.replace(self.progress_file)


def _plain(value: Any) -> Any:
    """JSON for metric values that are not plain numbers (a 0-d tensor, a numpy scalar)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)

"""PyTorch Lightning integration: a callback that saves full Lightning checkpoints as trainstack steps.

    job = Job.from_env()
    callback = TrainstackCallback(job, every_n_steps=200)
    trainer = lightning.pytorch.Trainer(max_steps=..., callbacks=[callback], enable_checkpointing=False)
    trainer.fit(model, datamodule, ckpt_path=resume_path(job))
    if callback.stopped:
        job.exit_stopped(trainer.global_step)

Needs `lightning`; import it only from scripts that use Lightning. Single device or DDP on one node.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.exceptions import SIGTERMException

from trainstack_job.job import Job

CHECKPOINT_FILE = "lightning.ckpt"


def resume_path(job: Job) -> str | None:
    """`ckpt_path=` for `Trainer.fit`: the newest verified checkpoint's Lightning file, or None (fresh)."""
    checkpoint = job.latest_checkpoint()
    if checkpoint is None or not (checkpoint.directory / CHECKPOINT_FILE).is_file():
        return None
    return str(checkpoint.directory / CHECKPOINT_FILE)


class TrainstackCallback(pl.Callback):
    """Commits `trainer.save_checkpoint` as `step-<global_step>/` every `every_n_steps`, when the agent
    requests a checkpoint, and at a stop request (SIGTERM, SIGINT, stop file), after which it stops the
    trainer: `fit` returns, `stopped` is True and the script exits 75. Also reports progress."""

    def __init__(self, job: Job, every_n_steps: int | None = None) -> None:
        self.job = job
        self.every_n_steps = every_n_steps
        self.stopped_at: int | None = None
        self._saved_step: int | None = None

    @property
    def stopped(self) -> bool:
        """True when training ended on a stop request with its checkpoint committed."""
        return self.stopped_at is not None

    def _take_signals_back(self) -> None:
        # Lightning installs its own SIGTERM handler when fit starts; left in place it ends the process
        # with status 0 ("completed") at the next batch. The job's handler only sets the stop flag.
        self.job.watch_signals()

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take_signals_back()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take_signals_back()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if trainer.is_global_zero:
            total = trainer.max_steps if trainer.max_steps > 0 else int(trainer.estimated_stepping_batches)
            self.job.report_progress(step, total, epoch=trainer.current_epoch)
        strategy = trainer.strategy
        stop = strategy.reduce_boolean_decision(self.job.should_stop(), all=False)
        requested = strategy.reduce_boolean_decision(self.job.checkpoint_requested(), all=False)
        due = bool(self.every_n_steps) and step % (self.every_n_steps or 1) == 0
        if stop or requested or due:
            self._save(trainer)
        if stop and not (0 < trainer.max_steps <= step):  # a stop at the last step: let it complete
            self.stopped_at = step
            trainer.should_stop = True

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        # Lightning saw a SIGTERM before this callback took the handler back; its exit status would be 0.
        if self.stopped_at is None:
            self._save(trainer)
        self.job.exit_stopped(trainer.global_step)

    def _save(self, trainer: pl.Trainer) -> None:
        step = trainer.global_step
        if step == self._saved_step:  # gradient accumulation: several batches end on the same step
            return
        if trainer.is_global_zero:
            with self.job.save_checkpoint(step, epoch=trainer.current_epoch) as directory:
                trainer.save_checkpoint(directory / CHECKPOINT_FILE)
        else:
            # Every rank takes part in save_checkpoint (a barrier); under DDP only rank 0 writes the file.
            scratch = self.job.checkpoint_dir / f".step-{step}.rank-{trainer.global_rank}"
            trainer.save_checkpoint(Path(scratch) / CHECKPOINT_FILE)
            shutil.rmtree(scratch, ignore_errors=True)
        self._saved_step = step

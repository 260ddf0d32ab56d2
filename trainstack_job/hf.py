"""Hugging Face `Trainer` integration: every checkpoint the Trainer saves becomes a committed trainstack step.

    job = Job.from_env()
    callback = TrainstackCallback(job)
    args = TrainingArguments(output_dir=str(job.output_dir), save_strategy="steps", save_steps=200, ...)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train(resume_from_checkpoint=resume_path(job))
    if callback.stopped:
        job.exit_stopped(trainer.state.global_step)
    trainer.save_model(str(job.output_dir))

The Trainer writes `checkpoint-<N>/` under `output_dir` as usual; the callback moves its files into
`step-<N>/` in the job's checkpoint directory and commits it, so `save_total_limit` and
`load_best_model_at_end` (which look for `checkpoint-<N>` folders) do not apply; `Job(keep=...)` prunes.
Needs `transformers`; import it only from scripts that use it. Single process or DDP on one node.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from trainstack_job.job import Job


def resume_path(job: Job) -> str | None:
    """`resume_from_checkpoint=` for `Trainer.train`: the newest verified checkpoint, or None (fresh)."""
    checkpoint = job.latest_checkpoint()
    return None if checkpoint is None else str(checkpoint.directory)


class TrainstackCallback(TrainerCallback):
    """Saves at a stop request (SIGTERM, SIGINT, stop file) and ends training, so `train` returns with
    `stopped` True; saves when the agent requests a checkpoint; commits every Trainer checkpoint; reports
    progress."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.stopped_at: int | None = None

    @property
    def stopped(self) -> bool:
        """True when training ended on a stop request with its checkpoint committed."""
        return self.stopped_at is not None

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if state.is_world_process_zero:
            self.job.report_progress(state.global_step, state.max_steps, epoch=state.epoch)
        if self.job.checkpoint_requested():
            control.should_save = True
        if self.job.should_stop() and state.global_step < state.max_steps:
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at = state.global_step

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank has written its part (its RNG state) of the checkpoint
        if state.is_world_process_zero:
            saved = Path(str(args.output_dir)) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            epoch = int(state.epoch) if state.epoch is not None else None
            with self.job.save_checkpoint(state.global_step, epoch=epoch) as directory:
                for entry in saved.iterdir():
                    shutil.move(entry, directory / entry.name)
            shutil.rmtree(saved, ignore_errors=True)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

"""A tiny Lightning job for tests/job/test_lightning.py: random regression data, a linear model on CPU."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainstack_job import Job
from trainstack_job.lightning import TrainstackCallback, resume_path

MAX_STEPS = 50  # stops at 30 and 40 (tests/job/test_lightning.py), past the checkpoint at 25


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # Not slowed: the stop lands at its step however fast the steps run (tests/job/hold_at_step.py).
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class ReportStart(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        print(f"start global_step {trainer.global_step}", flush=True)


def main() -> None:
    job = Job.from_env()
    pl.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    callback = TrainstackCallback(job, every_n_steps=25)
    trainer = pl.Trainer(
        max_steps=MAX_STEPS,
        accelerator="cpu",
        callbacks=[callback, ReportStart()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(job.output_dir),
    )
    trainer.fit(Regression(), DataLoader(data, batch_size=8, shuffle=True), ckpt_path=resume_path(job))
    if callback.stopped:
        job.exit_stopped(trainer.global_step)
    print(f"end global_step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()

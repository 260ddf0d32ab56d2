"""A small CNN classifies MNIST-like synthetic digits with PyTorch Lightning, interruption-safe through
trainstack_job.lightning. Nothing is downloaded: each class is a fixed random stroke pattern, every image
a shifted, noisy copy of its class's pattern (the same seed builds the same data in every life).

Runs under trainstack (job.yaml) or locally: `python train.py` (checkpoints in ./checkpoints, the model
and metrics in ./output).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:
    from trainstack_job import Job
    from trainstack_job.lightning import TrainstackCallback, resume_path
except ModuleNotFoundError:  # run from a trainstack checkout that is not installed: use the checkout's copy
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from trainstack_job import Job
    from trainstack_job.lightning import TrainstackCallback, resume_path

CLASSES = 10


def synthetic_digits(count: int, seed: int) -> TensorDataset:
    """`count` 1x28x28 images of 10 classes: a class pattern shifted by up to 3 pixels plus noise."""
    patterns = (torch.rand(CLASSES, 1, 28, 28, generator=torch.Generator().manual_seed(1234)) > 0.8).float()
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(CLASSES, (count,), generator=generator)
    shifts = torch.randint(-3, 4, (count, 2), generator=generator).tolist()
    images = torch.stack(
        [
            torch.roll(patterns[label], shifts=(dy, dx), dims=(1, 2))
            for label, (dy, dx) in zip(labels.tolist(), shifts, strict=True)
        ]
    )
    images = images + 0.5 * torch.randn(images.shape, generator=generator)
    return TensorDataset(images, labels)


class DigitClassifier(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 7 * 7, CLASSES),
        )
        self.val_correct = 0
        self.val_seen = 0

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = nn.functional.cross_entropy(self(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        self.val_correct += int((self(images).argmax(dim=1) == labels).sum())
        self.val_seen += len(labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--checkpoint-every", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=int(os.environ.get("DIGITS_SEED", "1")))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    job = Job.from_env()
    pl.seed_everything(args.seed, verbose=False)
    train = DataLoader(synthetic_digits(6000, seed=args.seed), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(synthetic_digits(1000, seed=args.seed + 1), batch_size=256)
    model = DigitClassifier(args.lr)
    callback = TrainstackCallback(job, every_n_steps=args.checkpoint_every)
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="auto",
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,  # TrainstackCallback saves the checkpoints the agent persists
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(job.output_dir),
    )
    trainer.fit(model, train, ckpt_path=resume_path(job))
    if callback.stopped:
        job.exit_stopped(trainer.global_step)

    trainer.validate(model, val, verbose=False)
    metrics = {"steps": trainer.global_step, "val_accuracy": model.val_correct / max(1, model.val_seen)}
    torch.save(model.state_dict(), job.output_dir / "model.pt")
    (job.output_dir / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print(f"done: {json.dumps(metrics)}", flush=True)


if __name__ == "__main__":
    main()

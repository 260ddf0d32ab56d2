"""A tiny Hugging Face Trainer job for tests/job/test_hf.py: a 2-layer GPT-2 built from its config (nothing
downloaded) on random token sequences, on CPU."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from trainstack_job import Job
from trainstack_job.hf import TrainstackCallback, resume_path

MAX_STEPS = 25  # the stop at 15 lands past the save_steps checkpoint at 10, with steps left to train


class RandomTokens(Dataset):
    def __init__(self, count: int, length: int, vocab: int) -> None:
        self.tokens = torch.randint(vocab, (count, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


class ReportStart(TrainerCallback):
    """Says where training starts. Nothing slows the steps: the test's stop lands at its step however fast
    they run (tests/job/hold_at_step.py holds the job there until the stop arrives)."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        print(f"start global_step {state.global_step}", flush=True)


def main() -> None:
    job = Job.from_env()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    callback = TrainstackCallback(job)
    args = TrainingArguments(
        output_dir=str(job.output_dir),
        max_steps=MAX_STEPS,
        per_device_train_batch_size=4,
        save_strategy="steps",
        save_steps=10,
        logging_steps=1000,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=RandomTokens(512, 16, 64),
        callbacks=[callback, ReportStart()],
    )
    trainer.train(resume_from_checkpoint=resume_path(job))
    if callback.stopped:
        job.exit_stopped(trainer.state.global_step)
    trainer.save_model(str(job.output_dir))
    print(f"end global_step {trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()

"""A character-level GRU language model on corpus.txt, interruption-safe through trainstack_job.

Runs under trainstack (job.yaml) or locally: `python train.py` (checkpoints in ./checkpoints, the model
and a text sample in ./output). A resumed run continues bit for bit: the checkpoint holds the model, the
optimizer, the torch RNG and the batch sampler's generator (the data position).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

try:
    from trainstack_job import Job
except ModuleNotFoundError:  # run from a trainstack checkout that is not installed: use the checkout's copy
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from trainstack_job import Job


class CharGRU(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.gru = nn.GRU(hidden, hidden, num_layers=layers, batch_first=True, dropout=0.1)
        self.head = nn.Linear(hidden, vocab)

    def forward(
        self, tokens: torch.Tensor, state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, state = self.gru(self.embed(tokens), state)
        return self.head(out), state


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--text", type=Path, default=Path(__file__).with_name("corpus.txt"))
    parser.add_argument("--seed", type=int, default=int(os.environ.get("CHARLM_SEED", "1")))
    return parser.parse_args()


def sample(model: CharGRU, chars: list[str], prompt: str, length: int) -> str:
    index = {c: i for i, c in enumerate(chars)}
    generator = torch.Generator().manual_seed(0)
    model.eval()
    with torch.no_grad():
        tokens = torch.tensor([[index[c] for c in prompt]])
        logits, state = model(tokens)
        out = list(prompt)
        for _ in range(length):
            probs = torch.softmax(logits[0, -1] / 0.8, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=generator))
            out.append(chars[nxt])
            logits, state = model(torch.tensor([[nxt]]), state)
    model.train()
    return "".join(out)


def main() -> None:
    args = parse_args()
    job = Job.from_env()
    text = args.text.read_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)

    torch.manual_seed(args.seed)
    model = CharGRU(len(chars), args.hidden, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    batches = torch.Generator().manual_seed(args.seed)  # where the next batch comes from
    step = 0

    checkpoint = job.latest_checkpoint()
    if checkpoint is not None:
        state = torch.load(checkpoint.directory / "state.pt")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        batches.set_state(state["batches"])
        torch.set_rng_state(state["torch_rng"])
        step = state["step"]
        print(f"resumed from step {step}", flush=True)

    def save() -> None:
        with job.save_checkpoint(step) as directory:
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "batches": batches.get_state(),
                    "torch_rng": torch.get_rng_state(),
                    "step": step,
                },
                directory / "state.pt",
            )

    loss_fn = nn.CrossEntropyLoss()
    data_time = compute_time = 0.0
    loss = torch.tensor(float("nan"))
    while step < args.steps:
        started = time.perf_counter()
        starts = torch.randint(len(data) - args.seq_len - 1, (args.batch_size,), generator=batches)
        window = torch.stack([data[s : s + args.seq_len + 1] for s in starts.tolist()])
        fetched = time.perf_counter()
        logits, _ = model(window[:, :-1])
        loss = loss_fn(logits.reshape(-1, len(chars)), window[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        data_time += fetched - started
        compute_time += time.perf_counter() - fetched
        job.report_progress(step, args.steps, loss=loss.item())
        if step % 50 == 0 or step == args.steps:
            print(
                f"step {step}/{args.steps} loss {loss.item():.3f} "
                f"data {data_time * 1000 / 50:.1f} ms compute {compute_time * 1000 / 50:.1f} ms per step",
                flush=True,
            )
            data_time = compute_time = 0.0
        stop = job.should_stop()
        if stop or job.checkpoint_requested() or step % args.checkpoint_every == 0:
            save()
        if stop:
            job.exit_stopped(step)

    torch.save(model.state_dict(), job.output_dir / "model.pt")
    (job.output_dir / "sample.txt").write_text(sample(model, chars, "Day 1", 300) + "\n")
    metrics = {"steps": step, "final_loss": loss.item(), "vocab": len(chars)}
    (job.output_dir / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print(f"done: {json.dumps(metrics)}", flush=True)


if __name__ == "__main__":
    main()

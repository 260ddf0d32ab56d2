"""The GPU check, run through bench/gpu.sh (≤ 8 minutes on one NVIDIA machine), in five sections:

1. throughput: ResNet-50 on synthetic data, the trainer's step (bf16, channels_last, the trainer's micro-batch
   search; `--compile` adds the torch.compile'd step) against the naive fp32 loop;
2. fp16: the same step under fp16 autocast with the GradScaler (the T4/V100 path): finite losses, the scale;
3. stop and resume: `python -m training` stopped with SIGTERM mid-run (exit 75, its checkpoint), started again
   (resumes at the stopped step, runs to exit 0);
4. NCCL: 2 ranks (an allreduce's bus bandwidth, and the trainer with train.processes=2) where the machine has
   2 GPUs or more, else skipped, saying so;
5. the figures, with GPU model, driver, torch/CUDA versions and the date, as a new dated section of
   bench/RESULTS.md.

`--device cpu --tiny` is the dry run that proves the plumbing on a CPU (tests/test_bench_gpu.py): a tiny
model, a few steps, fp16 autocast on the CPU, gloo instead of NCCL, the results to `--results`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.batch_size import cuda_step_probe, search_micro_batch
from training.config import Config
from training.loop import make_optimizer
from training.model import build_model
from training.precision import choose_precision

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "RESULTS.md"
NUM_CLASSES = 1000
# The trainer's own lines (training/loop.py, training/progress.py) that the stop-and-resume section reads.
PROGRESS_LINE = re.compile(r"epoch \d+/\d+ step (?P<step>\d+)/(?P<total>\d+)")
STOPPED_LINE = re.compile(r"stopped at step (\d+)")
RESUMING_LINE = re.compile(r"resuming at step (\d+)")
PARTS = ("throughput", "fp16", "stop-resume", "two-ranks")
# Anchor: NVIDIA DeepLearningExamples ConvNets, ResNet-50 AMP training, 1x A100-80G, batch 256.
ANCHOR_IMG_PER_S = 2470


def measure(step: Callable[[], None], device: torch.device, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def naive(
    model_name: str, device: torch.device, image_size: int, batch: int, warmup: int, steps: int
) -> dict[str, float]:
    """The seeds' loop: fp32, NCHW, a fixed batch halved until it fits."""
    while batch >= 1:
        try:
            return _naive_at(model_name, device, image_size, batch, warmup, steps)
        except torch.OutOfMemoryError:
            _release(device)
            batch //= 2
    raise RuntimeError("naive loop: not even a batch of 1 fits")


def _naive_at(
    model_name: str, device: torch.device, image_size: int, batch: int, warmup: int, steps: int
) -> dict[str, float]:
    model = build_model(model_name, NUM_CLASSES, torch.device("cpu")).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(batch, 3, image_size, image_size, device=device)
    y = torch.randint(0, NUM_CLASSES, (batch,), device=device)

    def step() -> None:
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    _reset_peak(device)
    seconds = measure(step, device, warmup, steps)
    return {"img_per_s": batch * steps / seconds, "micro_batch": batch, "peak_gib": _peak(device)}


def trainer(
    model_name: str,
    device: torch.device,
    image_size: int,
    compile_model: bool,
    max_batch: int,
    warmup: int,
    steps: int,
    precision_name: str = "auto",
) -> dict[str, Any]:
    """The trainer's components: its precision, channels_last, micro-batch search, optional compile."""
    config = Config()
    precision = choose_precision(precision_name, device)
    model = build_model(model_name, NUM_CLASSES, device)
    if device.type == "cuda":
        probe = cuda_step_probe(
            model, lambda m: make_optimizer(m, config), image_size, NUM_CLASSES, precision.autocast, device
        )
        micro = min(search_micro_batch(probe, per_rank=None), max_batch)
    else:
        micro = max_batch
    optimizer = make_optimizer(model, config)
    scaler = precision.grad_scaler()
    runner: nn.Module = torch.compile(model) if compile_model else model  # type: ignore[assignment]
    x = torch.randn(micro, 3, image_size, image_size, device=device)
    if device.type == "cuda":
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, NUM_CLASSES, (micro,), device=device)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    losses: list[torch.Tensor] = []

    def step() -> None:
        with precision.autocast():
            loss = criterion(runner(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    _reset_peak(device)
    seconds = measure(step, device, warmup + (20 if compile_model else 0), steps)
    # Read once at the end: a float() per step would add a device sync to every timed step.
    finite = bool(torch.isfinite(torch.stack(losses)).all())
    return {
        "img_per_s": micro * steps / seconds,
        "micro_batch": micro,
        "peak_gib": _peak(device),
        "precision": precision.precision,
        "finite_losses": finite,
        "scale": float(scaler.get_scale()) if scaler.is_enabled() else None,
    }


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class Section:
    """One part of the check: its table rows (label, figure) and whether it held."""

    name: str
    ok: bool = True
    rows: list[tuple[str, str]] = field(default_factory=list)
    note: str = ""


def environment(device: torch.device) -> dict[str, str]:
    """Where the figures come from: GPU model and count, driver, torch and CUDA versions, the date."""
    found = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda or "none"),
        "device": "CPU (dry run)",
        "driver": "none",
    }
    if device.type == "cuda":
        count = torch.cuda.device_count()
        found["device"] = f"{count} x {torch.cuda.get_device_name(device)}"
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            found["driver"] = subprocess.run(
                query, capture_output=True, text=True, timeout=30
            ).stdout.split()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            found["driver"] = "unknown (nvidia-smi failed)"
    return found


def throughput(args: argparse.Namespace, device: torch.device) -> Section:
    section = Section("throughput")
    # bf16 where the GPU has it (Ampere and newer); the trainer's auto choice (fp16 on T4/V100) elsewhere.
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    chosen = "bf16" if bf16 else "auto"
    naive_run = naive(args.model, device, args.image_size, args.naive_batch, args.warmup, args.steps)
    _release(device)
    runs = {"naive fp32": naive_run}
    for compile_model in (False, True) if args.compile else (False,):
        label = f"trainer {chosen}{' compiled' if compile_model else ''}"
        runs[label] = trainer(
            args.model,
            device,
            args.image_size,
            compile_model,
            args.max_batch,
            args.warmup,
            args.steps,
            chosen,
        )
        _release(device)
    base = naive_run["img_per_s"]
    for label, run in runs.items():
        section.rows.append(
            (
                f"{args.model} {args.image_size} px, {label}",
                f"{run['img_per_s']:.0f} img/s ({run['img_per_s'] / base:.2f}x naive), micro-batch "
                f"{run['micro_batch']:.0f}, peak {run['peak_gib']:.1f} GiB, {run.get('precision', 'fp32')}",
            )
        )
        section.ok &= bool(run.get("finite_losses", True))
    section.note = f"anchor: NVIDIA DeepLearningExamples ResNet-50 AMP, 1x A100-80G: {ANCHOR_IMG_PER_S} img/s"
    return section


def fp16_path(args: argparse.Namespace, device: torch.device) -> Section:
    """The fp16 step with its GradScaler: the losses stay finite and the scale is a positive power of two."""
    run = trainer(args.model, device, args.image_size, False, args.max_batch, args.warmup, args.steps, "fp16")
    _release(device)
    scale = run["scale"]
    ok = bool(run["finite_losses"]) and scale is not None and scale > 0
    return Section(
        "fp16",
        ok,
        [
            (
                f"{args.model} fp16 + GradScaler",
                f"{run['img_per_s']:.0f} img/s, micro-batch {run['micro_batch']:.0f}, losses finite: "
                f"{run['finite_losses']}, scale after {args.warmup + args.steps} steps: {scale}",
            )
        ],
    )


def _trainer_argv(args: argparse.Namespace, work: Path, data: tuple[Path, Path], epochs: int) -> list[str]:
    train_dir, val_dir = data
    return [
        sys.executable,
        "-m",
        "training",
        "--config",
        str(REPO / "training" / "configs" / "tiny.yaml"),
        f"data.train_dir={train_dir}",
        f"data.val_dir={val_dir}",
        f"checkpoint.dir={work / 'checkpoints'}",
        f"output.dir={work / 'output'}",
        f"train.epochs={epochs}",
        f"train.device={'cuda' if args.device == 'cuda' else 'cpu'}",
        "checkpoint.every_steps=100000",
    ]


def stop_and_resume(args: argparse.Namespace, work: Path) -> Section:
    """`python -m training` stopped by SIGTERM mid-run exits 75 with its checkpoint; the next start resumes at
    that step and completes (exit 0)."""
    from training.sample_data import write_dataset

    section = Section("stop and resume")
    per_class = 16 if args.tiny else 64
    data = write_dataset(work / "data", classes=4, train_per_class=per_class, val_per_class=4, size=32)
    # Long enough on a GPU that the stop lands mid-run (tiny: 2 steps an epoch, 4 epochs).
    epochs = 4 if args.tiny else 200
    stop_after = 2 if args.tiny else 20
    argv = _trainer_argv(args, work, data, epochs)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.tiny:
        env["OMP_NUM_THREADS"] = "1"
    started = time.monotonic()
    first = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert first.stdout is not None
    lines: list[str] = []
    total = reached = 0
    for line in first.stdout:
        lines.append(line.rstrip())
        found = PROGRESS_LINE.search(line)
        if found:
            reached, total = int(found["step"]), int(found["total"])
            if reached >= stop_after and first.poll() is None:
                first.send_signal(signal.SIGTERM)
                break
    first_output = "\n".join(lines) + first.communicate(timeout=args.section_timeout)[0]
    stopped = STOPPED_LINE.search(first_output)
    stopped_step = int(stopped.group(1)) if stopped else None
    first_ok = first.returncode == 75 and stopped_step is not None and stopped_step < total
    section.rows.append(
        (
            "SIGTERM after step " + str(reached),
            f"exit {first.returncode}, stopped at step {stopped_step} of {total} "
            f"({time.monotonic() - started:.1f} s)",
        )
    )
    started = time.monotonic()
    second = subprocess.run(
        argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.section_timeout, check=False
    )
    output = second.stdout + second.stderr
    resumed = RESUMING_LINE.search(output)
    resumed_step = int(resumed.group(1)) if resumed else None
    section.rows.append(
        (
            "started again",
            f"resumed at step {resumed_step}, exit {second.returncode} ({time.monotonic() - started:.1f} s)",
        )
    )
    section.ok = first_ok and resumed_step == stopped_step and second.returncode == 0
    if not section.ok:
        section.note = "trainer output (last lines): " + " | ".join((first_output + output).splitlines()[-8:])
    return section


def _allreduce_rank(rank: int, world: int, backend: str, numel: int, port: int, out: str) -> None:
    """One rank of the allreduce timing (module level: spawned processes import it by name)."""
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    tensor = torch.ones(numel, dtype=torch.float32, device=device)
    timings = []
    for _ in range(8):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        dist.all_reduce(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timings.append(time.perf_counter() - started)
    correct = bool(torch.allclose(tensor[:4].cpu(), torch.full((4,), float(world) ** 8)))
    if rank == 0:
        Path(out).write_text(
            json.dumps({"seconds": sorted(timings[2:])[len(timings[2:]) // 2], "ok": correct})
        )
    dist.destroy_process_group()


def two_ranks(args: argparse.Namespace, work: Path) -> Section:
    """NCCL between 2 GPUs (gloo on the CPU dry run): an allreduce's bus bandwidth, then the trainer."""
    import torch.multiprocessing as mp

    section = Section("two ranks")
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda" and gpus < 2:
        section.note = f"skipped: this machine has {gpus} GPU (NCCL between ranks needs 2 or more)"
        return section
    backend = "nccl" if args.device == "cuda" else "gloo"
    numel = (1 << 16) if args.tiny else (256 << 20) // 4
    out = work / "allreduce.json"
    port = 29500 + os.getpid() % 1000
    mp.spawn(_allreduce_rank, args=(2, backend, numel, port, str(out)), nprocs=2, join=True)
    result = json.loads(out.read_text())
    size = numel * 4
    # nccl-tests' bus bandwidth: algbw x 2(n-1)/n, n = 2 ranks (doc/PERFORMANCE.md).
    busbw = size / result["seconds"] * 2 * (2 - 1) / 2 / 1e9
    section.rows.append(
        (f"{backend} allreduce, 2 ranks, {size / 2**20:.2f} MiB fp32", f"{busbw:.1f} GB/s bus bandwidth")
    )
    section.ok = bool(result["ok"])
    if args.device == "cuda":
        from training.sample_data import write_dataset

        data = write_dataset(work / "ddp-data", classes=4, train_per_class=64, val_per_class=4, size=32)
        argv = [*_trainer_argv(args, work / "ddp", data, 2), "train.processes=2"]
        run = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=args.section_timeout)
        section.rows.append(("python -m training, train.processes=2 (NCCL, DDP)", f"exit {run.returncode}"))
        section.ok &= run.returncode == 0
    return section


def render(env: dict[str, str], sections: list[Section], seconds: float) -> str:
    """The dated section bench/RESULTS.md gets: where, when, each figure, and whether each part held."""
    lines = [
        f"## GPU (`bench/gpu.sh`), {env['date']}: {env['device']}, driver {env['driver']}, "
        f"torch {env['torch']}, CUDA {env['cuda']}",
        "",
        f"Whole check: {seconds:.0f} s. Written by `bench/gpu.sh` itself.",
        "",
        "| part | what | result |",
        "|---|---|---|",
    ]
    for section in sections:
        verdict = "ok" if section.ok else "**FAILED**"
        for label, figure in section.rows or [("", "")]:
            lines.append(f"| {section.name} ({verdict}) | {label} | {figure} |")
        if section.note:
            lines.append(f"| {section.name} | note | {section.note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def write_results(path: Path, text: str) -> None:
    """Insert the new section before the first one, newest first as the file keeps them."""
    old = path.read_text() if path.exists() else "# Trainer benchmarks\n"
    head, marker, rest = old.partition("\n## ")
    path.write_text(f"{head}\n{text}\n{marker.strip()} {rest}" if marker else f"{old}\n{text}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the dry run")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and a few steps (the dry run)")
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--naive-batch", type=int, default=128)
    parser.add_argument(
        "--max-batch", type=int, default=256, help="cap on the auto micro-batch (NVIDIA's 256)"
    )
    parser.add_argument("--compile", action="store_true", help="also the torch.compile'd step (+1-2 min)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the file the dated section goes to")
    parser.add_argument("--no-write", action="store_true", help="print the section, write nothing")
    parser.add_argument("--section-timeout", type=float, default=180.0)
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"a comma-separated subset of {', '.join(PARTS)}"
    )
    args = parser.parse_args(argv)
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    if args.tiny:
        args.model, args.image_size, args.steps, args.warmup = "resnet18", 32, 2, 1
        args.naive_batch = args.max_batch = 4
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench.gpu: torch sees no CUDA device; run it on a GPU instance or with --device cpu --tiny")
        return 1
    torch.backends.cudnn.benchmark = True
    started = time.monotonic()
    env = environment(device)
    print(f"{env['device']}, driver {env['driver']}, torch {env['torch']}, CUDA {env['cuda']}", flush=True)
    sections: list[Section] = []
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as scratch:
        runs: dict[str, Callable[[], Section]] = {
            "throughput": lambda: throughput(args, device),
            "fp16": lambda: fp16_path(args, device),
            "stop-resume": lambda: stop_and_resume(args, Path(scratch) / "stop"),
            "two-ranks": lambda: two_ranks(args, Path(scratch)),
        }
        for name in parts:
            run = runs[name]
            try:
                section = run()
            except Exception as exc:  # one broken part must not hide the others' figures
                section = Section(name, False, note=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            sections.append(section)
            print(
                f"[{'ok' if section.ok else 'FAILED'}] {section.name}: {section.rows} {section.note}",
                flush=True,
            )
    text = render(env, sections, time.monotonic() - started)
    print(text)
    if not args.no_write:
        write_results(args.results, text)
        print(f"written to {args.results}")
    return 0 if all(section.ok for section in sections) else 1


if __name__ == "__main__":
    sys.exit(main())

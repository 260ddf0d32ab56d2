"""`python -m bench scaling`: data-parallel scaling of the built-in trainer on CPU, 1 process vs N.

Each run is the real `python -m training` path: with train.processes > 1 the trainer's own launcher starts
the gloo ranks through torch's elastic engine, so launch, DistributedDataParallel and the sharded loader are
all in what is measured. Both sides train the same generated images with the same model, seed and GLOBAL
batch (each of N ranks takes global/N per step, no accumulation) and one torch thread per process
(OMP_NUM_THREADS, which the elastic agent passes on to its workers): 1 process uses one core, N use N.

Throughput is the trainer's own: its progress log lines give samples/s over every `log_every` steps (global
samples, timed on rank 0, evaluation and checkpoints excluded), and the intervals that hold the first
`warmup_steps` steps are left out (oneDNN primitive creation, DDP's bucket rebuild after its first step).
Rounds are interleaved (1,N then N,1, ...) so drift in the machine's load hits both sides alike; the
speed-up is the median of the per-round ratios and the scaling efficiency is speed-up / N.

A separate measurement times a gloo allreduce of the model's gradient (every trainable parameter, fp32)
between N processes, to set the communication against the compute of a step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "training" / "configs" / "tiny.yaml"

# Steps left out at the start of each run: the first DDP step also rebuilds its gradient buckets, and
# the first few steps of either side create oneDNN primitives and grow the allocator's pools.
WARMUP_STEPS = 4
LOG_EVERY = 4
# A trainer run on 2 cores takes well under a minute; a hung rank must not hold the bench for ever.
RUN_TIMEOUT_S = 1800

# The trainer's progress line (training/progress.py), on rank 0's stderr, with or without "[rank 0] ".
PROGRESS_LINE = re.compile(r"epoch \d+/\d+ step (?P<step>\d+)/\d+\s+loss \S+\s+(?P<rate>[0-9.]+) samples/s")


@dataclass(frozen=True)
class Run:
    """One trainer run: steady-state throughput from its log, and its whole-run figure from metrics.json."""

    processes: int
    samples_per_s: float
    steps_timed: int
    reported_samples_per_s: float  # metrics.json: every step, warm-up included
    load_before: float
    load_after: float


@dataclass(frozen=True)
class Round:
    single: Run
    multi: Run

    @property
    def speedup(self) -> float:
        return self.multi.samples_per_s / self.single.samples_per_s


@dataclass(frozen=True)
class Allreduce:
    """A gloo allreduce of the model's whole gradient between the ranks, timed alone."""

    parameters: int
    megabytes: float
    seconds_median: float
    seconds_min: float
    threads_per_process: int


@dataclass
class Report:
    model: str
    image_size: int
    global_batch: int
    epochs: int
    processes: int
    threads_per_process: int
    warmup_steps: int
    log_every: int
    rounds: list[Round]
    allreduce: Allreduce | None
    single_samples_per_s: float = field(init=False)
    multi_samples_per_s: float = field(init=False)
    speedup: float = field(init=False)
    speedup_min: float = field(init=False)
    speedup_max: float = field(init=False)
    efficiency: float = field(init=False)
    single_step_s: float = field(init=False)
    multi_step_s: float = field(init=False)
    load_min: float = field(init=False)
    load_max: float = field(init=False)

    def __post_init__(self) -> None:
        if not self.rounds:
            raise ValueError("no measured rounds")
        ratios = [r.speedup for r in self.rounds]
        self.single_samples_per_s = statistics.median(r.single.samples_per_s for r in self.rounds)
        self.multi_samples_per_s = statistics.median(r.multi.samples_per_s for r in self.rounds)
        # The median of paired ratios, not a ratio of medians: a load spike skews one pair, not the result.
        self.speedup = statistics.median(ratios)
        self.speedup_min, self.speedup_max = min(ratios), max(ratios)
        self.efficiency = self.speedup / self.processes
        self.single_step_s = self.global_batch / self.single_samples_per_s
        self.multi_step_s = self.global_batch / self.multi_samples_per_s
        loads = [
            x for r in self.rounds for run in (r.single, r.multi) for x in (run.load_before, run.load_after)
        ]
        self.load_min, self.load_max = min(loads), max(loads)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for round_data, measured in zip(data["rounds"], self.rounds, strict=True):
            round_data["speedup"] = measured.speedup
        return data


def steady_throughput(log: str, global_batch: int, warmup_steps: int) -> tuple[float, int]:
    """(samples/s, steps) over the progress intervals after the first `warmup_steps` steps.

    Each line's rate covers the steps since the previous line; an interval is kept only if it starts after
    the warm-up. Total samples over total time (not a mean of rates), so intervals of unequal length weigh
    by their duration.
    """
    samples = seconds = 0.0
    steps = previous = 0
    for match in PROGRESS_LINE.finditer(log):
        step, rate = int(match["step"]), float(match["rate"])
        if previous >= warmup_steps and step > previous and rate > 0:
            interval = (step - previous) * global_batch
            samples += interval
            seconds += interval / rate
            steps += step - previous
        previous = step
    if not steps:
        raise ValueError(f"no progress lines after step {warmup_steps} in the trainer's log")
    return samples / seconds, steps


def run_trainer(
    work: Path,
    data: Path,
    processes: int,
    *,
    model: str,
    image_size: int,
    global_batch: int,
    epochs: int,
    threads: int,
    warmup_steps: int,
    log_every: int,
) -> Run:
    """`python -m training` in a subprocess with `processes` ranks; its steady samples/s from its log."""
    shutil.rmtree(work, ignore_errors=True)  # a fresh checkpoint.dir: a leftover one would be resumed
    command = [
        sys.executable,
        "-m",
        "training",
        "--config",
        str(TINY),
        f"data.train_dir={data / 'train'}",
        f"data.val_dir={data / 'val'}",
        f"checkpoint.dir={work / 'checkpoints'}",
        f"output.dir={work / 'output'}",
        f"model.name={model}",
        f"data.image_size={image_size}",
        f"train.batch_size={global_batch}",
        f"train.micro_batch_size={global_batch // processes}",  # one micro-batch per rank and step
        f"train.epochs={epochs}",
        f"train.processes={processes}",
        f"train.log_every_steps={log_every}",
        "train.deterministic=false",
        "data.num_workers=0",  # loading stays on the rank's own core
        "checkpoint.every_steps=0",
        "checkpoint.every_minutes=0",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    load_before = os.getloadavg()[0]
    done = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
    )
    load_after = os.getloadavg()[0]
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"trainer with {processes} process(es) exited {done.returncode}:\n{log[-3000:]}")
    metrics = json.loads((work / "output" / "metrics.json").read_text())
    if int(metrics["world_size"]) != processes or int(metrics["global_batch"]) != global_batch:
        raise RuntimeError(f"the trainer ran {metrics['world_size']} x {metrics['global_batch']}, not asked")
    samples_per_s, steps = steady_throughput(log, global_batch, warmup_steps)
    return Run(
        processes=processes,
        samples_per_s=samples_per_s,
        steps_timed=steps,
        reported_samples_per_s=float(metrics["samples_per_s"]),
        load_before=load_before,
        load_after=load_after,
    )


def _allreduce_worker(
    rank: int, world: int, store: str, numel: int, repeats: int, threads: int, out: str
) -> None:
    """One rank of the allreduce timing (module level: spawned processes import it by name)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        gradient = torch.ones(numel)
        times = []
        for index in range(repeats + 2):
            dist.barrier()  # every rank starts together: the time is the collective's, not a wait
            started = time.perf_counter()
            dist.all_reduce(gradient)
            if index >= 2:  # the first two set up gloo's pairs and buffers
                times.append(time.perf_counter() - started)
        if rank == 0:
            Path(out).write_text(json.dumps({"seconds": times, "threads": torch.get_num_threads()}))
    finally:
        dist.destroy_process_group()


def trainable_parameters(model: str, classes: int) -> int:
    """The number of gradient elements DDP allreduces each step for this model as the trainer builds it."""
    import torch

    from training.model import build_model

    net = build_model(model, classes, torch.device("cpu"))
    return sum(p.numel() for p in net.parameters() if p.requires_grad)


def allreduce_seconds(numel: int, processes: int, threads: int, repeats: int = 10) -> Allreduce:
    """Median time of a gloo allreduce of `numel` fp32 values between `processes` local processes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="bench-allreduce-") as tmp:
        store, out = Path(tmp) / "store", Path(tmp) / "times.json"
        mp.spawn(
            _allreduce_worker,
            args=(processes, str(store), numel, repeats, threads, str(out)),
            nprocs=processes,
            join=True,
        )
        result = json.loads(out.read_text())
    return Allreduce(
        parameters=numel,
        megabytes=numel * 4 / 1e6,
        seconds_median=statistics.median(result["seconds"]),
        seconds_min=min(result["seconds"]),
        threads_per_process=int(result["threads"]),
    )


def scaling(
    work: Path,
    data: Path,
    *,
    model: str = "resnet18",
    image_size: int = 56,
    global_batch: int = 32,
    epochs: int = 3,
    processes: int = 2,
    rounds: int = 4,
    threads: int = 1,
    warmup_steps: int = WARMUP_STEPS,
    log_every: int = LOG_EVERY,
    warmup_round: bool = True,
    classes: int = 4,
    measure_allreduce: bool = True,
) -> Report:
    """1 process vs `processes`, `rounds` interleaved pairs (after an untimed pair when `warmup_round`)."""
    if global_batch % processes:
        raise ValueError(f"global batch {global_batch} is not divisible by {processes} processes")

    def run(count: int) -> Run:
        return run_trainer(
            work / f"p{count}",
            data,
            count,
            model=model,
            image_size=image_size,
            global_batch=global_batch,
            epochs=epochs,
            threads=threads,
            warmup_steps=warmup_steps,
            log_every=log_every,
        )

    if warmup_round:  # page cache (images, torch's libraries), bytecode: paid before anything is timed
        run(1)
        run(processes)
    measured: list[Round] = []
    for index in range(rounds):
        # 1,N then N,1: whichever side a slow drift in the load favours, it favours both equally often.
        if index % 2:
            multi = run(processes)
            single = run(1)
        else:
            single = run(1)
            multi = run(processes)
        measured.append(Round(single=single, multi=multi))
    gradient = None
    if measure_allreduce:
        gradient = allreduce_seconds(trainable_parameters(model, classes), processes, threads)
    return Report(
        model=model,
        image_size=image_size,
        global_batch=global_batch,
        epochs=epochs,
        processes=processes,
        threads_per_process=threads,
        warmup_steps=warmup_steps,
        log_every=log_every,
        rounds=measured,
        allreduce=gradient,
    )


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> None:
    from datetime import datetime, timezone

    from rich.console import Console
    from rich.table import Table

    from training.sample_data import write_dataset

    parser = argparse.ArgumentParser(prog="python -m bench scaling", description=__doc__)
    parser.add_argument(
        "--rounds", type=int, default=4, help="interleaved pairs (even: as many of each order)"
    )
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--image-size", type=int, default=56)
    parser.add_argument("--batch", type=int, default=32, help="global batch, the same on both sides")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)

    import torch

    console = Console(width=150)
    started = datetime.now(timezone.utc)
    console.print(
        f"{started:%Y-%m-%d %H:%M} UTC  {_cpu_name()}  {os.cpu_count()} CPUs  torch {torch.__version__}  "
        f"load {os.getloadavg()[0]:.2f}"
    )
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        work = Path(tmp)
        data = work / "data"
        write_dataset(data, classes=4, train_per_class=128, val_per_class=8, size=64)
        report = scaling(
            work,
            data,
            model=args.model,
            image_size=args.image_size,
            global_batch=args.batch,
            epochs=args.epochs,
            processes=args.processes,
            rounds=args.rounds,
            threads=args.threads,
        )
    n = report.processes
    table = Table(title=f"data-parallel scaling on CPU, 1 vs {n} processes (python -m training, gloo)")
    for column in ("round", "1 process samples/s", f"{n} processes samples/s", "speed-up", "load 1-min"):
        table.add_column(column)
    for index, r in enumerate(report.rounds, 1):
        table.add_row(
            str(index),
            f"{r.single.samples_per_s:.1f}",
            f"{r.multi.samples_per_s:.1f}",
            f"{r.speedup:.2f}x",
            f"{min(r.single.load_before, r.multi.load_before):.2f}-"
            f"{max(r.single.load_after, r.multi.load_after):.2f}",
        )
    table.add_row(
        "median",
        f"{report.single_samples_per_s:.1f} ({report.single_step_s * 1000:.0f} ms/step)",
        f"{report.multi_samples_per_s:.1f} ({report.multi_step_s * 1000:.0f} ms/step)",
        f"{report.speedup:.2f}x ({report.speedup_min:.2f}-{report.speedup_max:.2f}); "
        f"efficiency {report.efficiency:.0%}",
        f"{report.load_min:.2f}-{report.load_max:.2f}",
    )
    console.print(table)
    console.print(
        f"{report.model}, {report.image_size} px, global batch {report.global_batch} "
        f"({report.global_batch // n} per rank with {n}), {report.epochs} epochs of 512 images, "
        f"{report.threads_per_process} torch thread(s) per process; steady state after step "
        f"{report.warmup_steps}, from the trainer's log every {report.log_every} steps"
    )
    if report.allreduce is not None:
        a = report.allreduce
        ideal = report.single_step_s / n  # the compute of a step if it split perfectly over the ranks
        console.print(
            f"gloo allreduce of the gradient ({a.parameters / 1e6:.2f} M params, {a.megabytes:.1f} MB fp32) "
            f"between {n} processes alone: median {a.seconds_median * 1000:.1f} ms (min "
            f"{a.seconds_min * 1000:.1f}); step with {n}: {report.multi_step_s * 1000:.0f} ms vs "
            f"{ideal * 1000:.0f} ms for perfect scaling: {(report.multi_step_s - ideal) * 1000:.0f} ms lost"
        )
    if args.json:
        args.json.write_text(json.dumps(report.as_dict(), indent=2))

"""The training loop: wires data, model, precision, batch plan, checkpoints and stop requests together."""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from training import distributed as dist_utils
from training.artifacts import write_artifacts
from training.batch_size import cuda_step_probe, fits, search_micro_batch
from training.checkpoint import CheckpointManager, PersisterFactory, resume_position, state_from_bytes
from training.checkpoint_policy import InterruptionRate
from training.config import Config, ConfigError
from training.data import (
    Batch,
    BatchPlan,
    EvalDataset,
    ResumableBatchSampler,
    SeededImageFolder,
    SkippedFiles,
    eval_loader,
    loader_options,
    train_loader,
    train_transform,
)
from training.determinism import (
    capture_rng,
    micro_batch_seed,
    restore_rng,
    seed_micro_batch,
    use_deterministic_kernels,
)
from training.distributed import World
from training.faults import fault_point
from training.gate import wait_for_start_gate
from training.launch import note_step
from training.metrics import EpochResult, History
from training.model import build_model
from training.precision import PrecisionPlan, choose_precision, resolve_device
from training.progress import ProgressReporter
from training.resume import check_resumable, load_scaler, saved_context, source_hash
from training.stop import AutoDeadline, Deadline, StopRequest
from training.tracker import NO_TRACKER, Tracker, epoch_metrics, open_tracker, progress_metrics, run_id
from trainstack_job.context import CheckpointContext, environment_context
from trainstack_job.contract import ExitCode, JobEnv
from trainstack_job.layout import step_dir_name

log = logging.getLogger("training")

# Without a memory probe (CPU), "auto" means this many samples per micro-batch.
CPU_AUTO_MICRO_BATCH = 64

# Devices with fused SGD/AdamW kernels in torch (and GradScaler support for them).
FUSED_OPTIMIZER_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class WarmLoader:
    """What a gated start built before the gate: the training loader of the config's batch plan, its
    workers started and one batch read through it."""

    plan: BatchPlan
    sampler: ResumableBatchSampler
    loader: Any


@dataclass
class TrainState:
    """Where the optimisation is: saved with every checkpoint, restored exactly."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    samples_seen: int = 0
    wall_seconds: float = 0.0
    epoch_loss_sum: float = 0.0
    epoch_correct: float = 0.0
    epoch_count: float = 0.0


def make_optimizer(model: nn.Module, config: Config) -> torch.optim.Optimizer:
    t = config.train
    # No weight decay on norm layers and biases: the usual recipe for CNNs and ViTs alike.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # Fused: one kernel pass over each parameter instead of one per term (weight decay, momentum,
    # Nesterov), each of which allocates a model-sized temporary: resnet18's SGD step 30 -> 5 ms on CPU.
    fused = all(p.device.type in FUSED_OPTIMIZER_DEVICES for p in decay + no_decay) or None
    if t.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=t.lr, fused=fused)
    return torch.optim.SGD(groups, lr=t.lr, momentum=t.momentum, nesterov=t.momentum > 0, fused=fused)


def warmup_cosine(warmup_steps: int, total_steps: int) -> Any:
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def plan_batches(
    config: Config,
    world: World,
    device: torch.device,
    saved: dict[str, Any] | None,
    probe: Any,
) -> BatchPlan:
    """Global batch from the checkpoint (the optimisation continues as started), else the config."""
    t = config.train
    global_batch: int | None = (
        int(saved["global_batch"]) if saved else (t.batch_size if isinstance(t.batch_size, int) else None)
    )
    if saved and isinstance(t.batch_size, int) and t.batch_size != global_batch:
        log.warning(
            "train.batch_size=%d differs from the checkpoint's %d; continuing with %d so the run stays one "
            "optimisation (start a new checkpoint.dir to change it)",
            t.batch_size,
            global_batch,
            global_batch,
        )
    if global_batch is not None and global_batch % world.size:
        raise ConfigError(
            [f"train.batch_size: {global_batch} is not divisible by the {world.size} processes"]
        )
    per_rank = global_batch // world.size if global_batch is not None else None
    wanted: int | None = t.micro_batch_size if isinstance(t.micro_batch_size, int) else None
    if saved and saved.get("world_size") == world.size and wanted is None:
        wanted = int(saved["micro_batch"])  # same arithmetic as the interrupted life, if it fits here
    if wanted is not None and per_rank is not None and per_rank % wanted:
        raise ConfigError([f"train.micro_batch_size: {wanted} must divide the per-process batch {per_rank}"])
    if device.type == "cuda":
        if wanted is None or not fits(probe, wanted):
            if wanted is not None:
                log.warning("micro-batch %d does not fit this GPU; searching for one that does", wanted)
            wanted = search_micro_batch(probe, per_rank)
            log.info("largest micro-batch that fits with a safety margin: %d", wanted)
    elif wanted is None:
        cap = CPU_AUTO_MICRO_BATCH if per_rank is None else min(per_rank, CPU_AUTO_MICRO_BATCH)
        wanted = max(d for d in range(1, cap + 1) if per_rank is None or per_rank % d == 0)
    if global_batch is None:
        global_batch = wanted * world.size
    return BatchPlan(global_batch=global_batch, world_size=world.size, micro_batch=wanted)


class Trainer:
    """One life of a training job: restore, train until done or asked to stop, checkpoint, report."""

    def __init__(
        self,
        config: Config,
        stop: StopRequest | None = None,
        *,
        started: float | None = None,
        persister_factory: PersisterFactory | None = None,
    ) -> None:
        # When this process started (time.monotonic), for the standby's warm-up time; imports included
        # when the caller measured from its own start.
        self._started = time.monotonic() if started is None else started
        self.config = config
        # What uploads checkpoint.dir to checkpoint.uri when the trainer runs by hand (`python -m
        # bootstrap.standalone` gives the agent's persister); None under the agent, which uploads itself.
        self._persister_factory = persister_factory
        t = config.train
        use_deterministic_kernels(t.deterministic)
        device = resolve_device(t.device)
        self.world = dist_utils.init_world(device.type)
        self.device = torch.device("cuda", self.world.local_rank) if device.type == "cuda" else device
        # `auto` on a CPU follows the agent's device profile (a simulated T4 trains in fp16, an L4 in bf16).
        self.precision: PrecisionPlan = choose_precision(
            t.precision, self.device, os.environ.get(JobEnv.PRECISION.value)
        )
        self.train_set = SeededImageFolder(
            config.data.train_dir, train_transform(config.data.image_size), t.seed
        )
        self.val_set = EvalDataset(config.data.val_dir, config.data.image_size)
        self.skipped_files = SkippedFiles(
            config.data.max_bad_fraction,
            {"train": len(self.train_set), "val": len(self.val_set)},
            {"train": config.data.train_dir, "val": config.data.val_dir},
        )
        self.num_classes = len(self.train_set.classes)
        torch.manual_seed(t.seed)  # identical initial weights on every rank and every life
        self.raw_model = build_model(config.model.name, self.num_classes, self.device)
        self.optimizer = make_optimizer(self.raw_model, config)
        self.scaler = self.precision.grad_scaler()
        # Made at restore time, not here: a gated standby must not touch checkpoint.dir (the manager creates
        # it and clears half-written steps) while the agent may still be refreshing it.
        self._checkpoints: CheckpointManager | None = None
        self.stop = stop or StopRequest(t.stop_file, t.checkpoint_request_file)
        self.state = TrainState()
        # The running epoch sums live on the device between checkpoints: reading them into the state's
        # floats every step would wait for the device every step (a GPU sync per `float()`).
        self._epoch_loss = torch.zeros((), dtype=torch.float64)
        self._epoch_correct = torch.zeros((), dtype=torch.float64)
        self.history = History()
        self.config_hash = config.optimisation_hash()
        self.output_dir = Path(config.output.dir)
        self._restored_from = ""  # the checkpoint.dir restored from (maybe another machine's), for the log
        self._context: CheckpointContext | None = None
        self.tracker: Tracker = NO_TRACKER  # opened once restored (training/tracker.py)

    @property
    def checkpoints(self) -> CheckpointManager:
        assert self._checkpoints is not None, "checkpoints are opened at restore time"
        return self._checkpoints

    # -- setup ---------------------------------------------------------------------------------------

    def _restore(self) -> dict[str, Any] | None:
        """The newest checkpoint any rank can see, loaded once and, with several ranks, sent to the others
        over the process group: on several machines each sees only its own checkpoint.dir (only the main
        rank writes checkpoints, so after a run over two machines only the main rank's has the newest)."""
        if not self.world.distributed:
            found = self.checkpoints.restore()
            if found is None:
                return None
            self._restored_from = str(self.checkpoints.root)
            self._warn_if_config_changed(found.manifest.get("config_hash"), found.step)
            return found.load_state()
        # One look per machine (its ranks share its checkpoint.dir: hashing state.pt once is enough); the
        # main rank's look also consults checkpoint.uri when the trainer persists by itself.
        found = None
        if self.world.is_main:
            found = self.checkpoints.restore()
        elif self.world.local_rank == 0:
            found = self.checkpoints.restore_local()
        step = found.step if found is not None else -1
        newest = dist_utils.max_across(self.world, [step], self.device)[0]
        if newest < 0:
            return None  # no rank has a checkpoint: a fresh start everywhere
        holds = found is not None and found.step == newest
        source = dist_utils.min_across(
            self.world, [self.world.rank if holds else self.world.size], self.device
        )[0]
        # The state file's bytes, not the loaded dict: every rank then loads them weights-only (a checkpoint
        # is data, never code), and torch's object broadcast cannot unpickle tensors here anyway (its
        # legacy-load path fails on UntypedStorage in torch 2.14).
        payload: tuple[bytes, Any, str] | None = None
        if found is not None and self.world.rank == source:
            payload = (found.state_bytes(), found.manifest.get("config_hash"), str(self.checkpoints.root))
        received = dist_utils.broadcast_object(self.world, payload, src=source)
        assert isinstance(received, tuple)  # the source rank always sends one
        data, config_hash, where = received
        state = state_from_bytes(data)
        del data, received, payload  # one copy of the state in memory, not three
        self._restored_from = where if source == 0 else f"{where} on rank {source}'s machine"
        if source != 0 and self.world.is_main:
            log.info(
                "checkpoint step %d is not in this machine's %s: rank %d sent it over the process group",
                newest,
                self.checkpoints.root,
                source,
            )
        self._warn_if_config_changed(config_hash, newest)
        return state

    def _wait_at_start_gate(self, probe: Any) -> tuple[bool, WarmLoader | None]:
        """A gated start: warm up, then wait until the agent removes the gate (True) or a stop comes while it
        is still there (False: exit 75, nothing written; a standby is not the job's writer).

        The wait comes after the process group's init and holds no collective open: each rank polls the file
        on its own, so no gloo/NCCL timeout runs however long it waits (a timeout only covers an operation in
        flight), and the elastic launcher has no deadline for running ranks (its rendezvous formed before it
        started them). Waiting before init would be as safe, but then ranks could not agree on a stop that
        races the gate's removal; here one collective after the wait makes them all take the same way."""
        gate = Path(self.config.train.start_gate_file)
        warm: WarmLoader | None = None
        if not self.stop.stop_requested():
            warm = self._warm_loader(probe)
            if self.world.is_main:
                log.info(
                    "standby: warm (model built, %s) in %.1fs; waiting for the start gate %s",
                    "first batch loaded"
                    if warm is not None
                    else "no batch loaded: the config's batch plan "
                    "does not fit this machine, the checkpoint's decides",
                    time.monotonic() - self._started,
                    gate,
                )
        waiting = time.monotonic()
        opened = wait_for_start_gate(gate, self.stop.stop_requested)
        if dist_utils.any_rank(self.world, [not opened], self.device)[0]:
            if self.world.is_main:
                log.warning(
                    "standby: stopped on %s while waiting for the start gate; exit %d without writing a "
                    "checkpoint (a standby never writes the job's steps)",
                    self.stop.reason(),
                    ExitCode.STOPPED,
                )
            return False, warm
        if self.world.is_main:
            log.info("standby: start gate opened after %.1fs; restoring", time.monotonic() - waiting)
        return True, warm

    def _warm_loader(self, probe: Any) -> WarmLoader | None:
        """The config's training loader with one batch read through it (workers started, files in the page
        cache, decoders loaded), leaving every RNG as it was: the restore decides what is trained."""
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            try:
                # The checkpoint's global batch may differ from the config's (it wins after the restore);
                # the plan is only a guess here, and one that cannot be made just skips the batch.
                plan = plan_batches(self.config, self.world, self.device, None, probe)
            except ConfigError:
                return None
            sampler = ResumableBatchSampler(
                len(self.train_set), plan, self.world.rank, self.config.train.seed
            )
            if sampler.steps_per_epoch == 0:
                return None  # the restore's plan reports it
            self._position_warm_sampler(sampler)
            loader = train_loader(
                self.train_set,
                sampler,
                loader_options(self.config, self.world.size, on_gpu=self.device.type == "cuda"),
            )
            # Read and dropped: an unreadable file in it is recorded when training reads it again.
            next(iter(loader))
        return WarmLoader(plan, sampler, loader)

    def _position_warm_sampler(self, sampler: ResumableBatchSampler) -> None:
        """Put the warm-up batch where the newest checkpoint in checkpoint.dir resumes (the agent restores it
        before the gate): a streamed dataset's shards there and the read-ahead's next ones are fetched while
        the standby waits, not after the hand-over. Only the data order's position: no state is loaded and
        every RNG is left as it was. Without a checkpoint (or one past this plan's epoch) the warm-up reads
        from the start, as before; a checkpoint of another batch plan (the restore adopts it) has the warm-up
        read other samples than the job will next: a wasted prefetch, never a change to what is trained."""
        position = resume_position(Path(self.config.checkpoint.dir))
        if position is None:
            return
        epoch, batch = position
        if batch >= sampler.steps_per_epoch or epoch >= self.config.train.epochs:
            return
        sampler.set_position(epoch, batch)
        if self.world.is_main:
            log.info(
                "standby: warming the data at the newest checkpoint's position (epoch %d, batch %d)",
                epoch + 1,
                batch,
            )

    def _warn_if_config_changed(self, config_hash: Any, step: int) -> None:
        if self.world.is_main and config_hash != self.config_hash:
            log.warning(
                "the config changed since checkpoint step %d in %s was written; resuming with the new one",
                step,
                self._restored_from,
            )

    def context(self) -> CheckpointContext:
        """This life's context, saved with every checkpoint (the batch plan must be made: it is part of it).
        The same for the whole life: the data, code and device do not change under a running trainer."""
        if self._context is None:
            env = environment_context(os.environ, [Path(self.config.data.train_dir).parent])
            on_gpu = self.device.type == "cuda"
            gpu_model, gpu_count = env.gpu_model, env.gpu_count
            if on_gpu and gpu_model is None:
                gpu_model, gpu_count = torch.cuda.get_device_name(self.device), torch.cuda.device_count()
            self._context = CheckpointContext(
                job_id=env.job_id,
                code_hash=env.code_hash or source_hash(),
                dataset_version=env.dataset_version,
                instance_type=env.instance_type,
                device=self.device.type,
                gpu_model=gpu_model,
                gpu_count=gpu_count,
                emulated=not on_gpu and (gpu_model is not None or self.precision.emulated),
                precision=self.precision.precision,
                loss_scaling=self.precision.needs_scaler,
                world_size=self.world.size,
                global_batch=self.plan.global_batch,
                micro_batch=self.plan.micro_batch,
                accumulation=self.plan.accumulation,
                torch=str(torch.__version__),  # a str: TorchVersion does not load weights-only
                cuda=torch.version.cuda if on_gpu else None,
                model=self.config.model.name,
                optimizer=type(self.optimizer).__name__,
            )
        return self._context

    def _precision_line(self) -> str:
        """`precision fp16 (device profile g4dn.xlarge: 1x T4; emulated: fp32 math ...)`: which and why."""
        plan, context = self.precision, self.context()
        why = plan.source
        if plan.source == "the device profile":
            gpus = f"{context.gpu_count or 1}x {context.gpu_model}"
            why = f"device profile {context.instance_type or '?'}: {gpus}"
        return f"precision {plan.precision} ({'; '.join(filter(None, [why, plan.emulation()]))})"

    def _load(self, saved: dict[str, Any]) -> None:
        # Checked before anything is loaded: a refused checkpoint leaves no half-loaded model behind.
        before, now = saved_context(saved), self.context()
        check_resumable(saved, before, now, self.raw_model.state_dict(), self.train_set.classes)
        self.raw_model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        scaler_note = load_scaler(self.scaler, saved)
        changed = before.differences(now)
        if self.world.is_main and (changed or scaler_note):
            log.info(
                "checkpoint %s (%s) resumes as %s: %s",
                step_dir_name(int(saved["train"]["global_step"])),
                before.describe(),
                now.describe(),
                ", ".join([*changed, scaler_note] if scaler_note else changed),
            )
        self.state = TrainState(**saved["train"])
        self.history = History.from_state(saved["history"])
        restore_rng(saved["rng"])
        self.skipped_files.load_state(saved.get("skipped_files"))

    def _snapshot(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
        self._fold_epoch_sums()
        return {
            "model": self.raw_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": capture_rng(),
            "train": vars(self.state).copy(),
            "history": self.history.to_state(),
            "batch": {
                "global_batch": self.plan.global_batch,
                "micro_batch": self.plan.micro_batch,
                "accumulation": self.plan.accumulation,
                "world_size": self.world.size,
            },
            "precision": self.precision.precision,
            "context": self.context().to_dict(),
            "classes": self.train_set.classes,
            "skipped_files": self.skipped_files.to_state(),
        }

    # -- the loop ------------------------------------------------------------------------------------

    def run(self) -> int:
        self.stop.install()
        code: int = ExitCode.FAILED
        try:
            code = self._run()
            return code
        finally:
            self.tracker.close(code)
            self.stop.uninstall()
            if self._checkpoints is not None:
                self._checkpoints.close()
            dist_utils.shutdown(self.world)

    def _run(self) -> int:
        config, t = self.config, self.config.train
        probe = None
        if self.device.type == "cuda":
            probe = cuda_step_probe(
                self.raw_model,
                lambda m: make_optimizer(m, config),
                config.data.image_size,
                self.num_classes,
                self.precision.autocast,
                self.device,
            )
        model: nn.Module = self.raw_model
        if config.model.compile:
            # Lazy (it compiles at the first forward), and the restore below loads into the same parameters:
            # wrapped here so a gated standby is set up as for training.
            model = torch.compile(model)  # type: ignore[assignment]
        warm: WarmLoader | None = None
        if (
            t.start_gate_file
            and dist_utils.any_rank(self.world, [Path(t.start_gate_file).exists()], self.device)[0]
        ):
            # Decided together: a gate removed between two ranks' looks must not leave one rank waiting in
            # the gate's collective below while the other is already restoring.
            opened, warm = self._wait_at_start_gate(probe)
            if not opened:
                return ExitCode.STOPPED
        # Not earlier: a standby's minutes at the gate are not the job's training time.
        life_started = time.monotonic()
        self._checkpoints = CheckpointManager(
            config.checkpoint.dir, config.checkpoint.uri, config.checkpoint.keep, self._persister_factory
        )
        saved = self._restore()
        if warm is not None and saved is None:
            # A fresh job: the warm-up's plan is this one (on a GPU its micro-batch search is not run twice).
            self.plan = warm.plan
        else:
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                self.plan = plan_batches(
                    config, self.world, self.device, saved["batch"] if saved else None, probe
                )
        options = loader_options(config, self.world.size, on_gpu=self.device.type == "cuda")
        if warm is not None and warm.plan == self.plan:
            # The warm loader's workers are kept: the epoch loop's set_position + iter() restart them at the
            # restored position and drop what they prefetched for the warm-up.
            sampler, loader = warm.sampler, warm.loader
        else:
            sampler = ResumableBatchSampler(len(self.train_set), self.plan, self.world.rank, t.seed)
            loader = train_loader(self.train_set, sampler, options)
        del warm
        steps_per_epoch = sampler.steps_per_epoch
        if steps_per_epoch == 0:
            raise ConfigError(
                [
                    f"train.batch_size: {self.plan.global_batch} exceeds the {len(self.train_set)} "
                    "training images; lower it"
                ]
            )
        total_steps = steps_per_epoch * t.epochs
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(round(t.warmup_epochs * steps_per_epoch), total_steps)
        )
        if saved is not None:
            self._load(saved)
            scheduler.load_state_dict(saved["scheduler"])
            log.info(
                "resuming at step %d (epoch %d) from %s; to start over, delete that folder (and output.dir) "
                "or set checkpoint.dir to a new one",
                self.state.global_step,
                self.state.epoch + 1,
                self._restored_from,
            )
        self._epoch_loss = torch.tensor(self.state.epoch_loss_sum, dtype=torch.float64, device=self.device)
        self._epoch_correct = torch.tensor(self.state.epoch_correct, dtype=torch.float64, device=self.device)
        if self.world.distributed:
            model = DistributedDataParallel(
                model, device_ids=[self.device] if self.device.type == "cuda" else None
            )
        val_loader = eval_loader(
            self.val_set, self.plan.micro_batch, self.world.rank, self.world.size, options
        )
        progress = ProgressReporter(
            self.output_dir if self.world.is_main else None,
            epochs=t.epochs,
            total_steps=total_steps,
            log_every=t.log_every_steps,
            device=self.device,
            num_workers=options["num_workers"],
            world_size=self.world.size,
            # What each life's samples/s is measured for: the stack's throughput table per type and family.
            precision=self.precision.precision,
            model=self.config.model.name,
        )
        if self.world.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            log.info(
                "%s on %s x%d, %s, global batch %d = %d process(es) x %d accumulation x %d micro-batch, "
                "%d steps/epoch",
                config.model.name,
                self.device.type,
                self.world.size,
                self._precision_line(),
                self.plan.global_batch,
                self.world.size,
                self.plan.accumulation,
                self.plan.micro_batch,
                steps_per_epoch,
            )
        self.tracker = open_tracker(
            config.tracking,
            run=run_id(os.environ, config.checkpoint.dir),
            restored_step=self.state.global_step,
            output_dir=self.output_dir,
            is_main=self.world.is_main,
            params=config.to_dict(),
        )
        criterion = nn.CrossEntropyLoss(label_smoothing=t.label_smoothing)
        every = config.checkpoint.every_minutes
        deadline = (
            AutoDeadline(InterruptionRate.from_env(os.environ), announce=self.world.is_main)
            if every == "auto"
            else Deadline(every)
        )
        # What is alive now (torch, the model, the loaders' file lists, the tracker) lives as long as the
        # run. Frozen, it is out of the collector's full collections, which would otherwise walk all of it
        # again every few hundred steps on the thread that feeds the GPU (0.2-0.4 s each with torch loaded),
        # and the loaders' forked workers do not copy the pages such a walk writes to. Garbage is collected
        # first, so no cycle that is garbage already is kept for the run.
        gc.collect()
        gc.freeze()
        model.train()
        if dist_utils.any_rank(self.world, [self.stop.stop_requested()], self.device)[0]:
            # Asked to stop while starting up: nothing new to save beyond what was restored.
            return self._stop(scheduler, life_started)
        while self.state.epoch < t.epochs:
            sampler.set_position(self.state.epoch, self.state.step_in_epoch)
            batches = iter(loader)
            interval_loss = torch.zeros((), dtype=torch.float64, device=self.device)
            interval_steps = 0
            progress.resume()
            while self.state.step_in_epoch < steps_per_epoch:
                wait, loss_sum, correct = self._optimizer_step(model, criterion, batches, scheduler)
                s = self.state
                s.global_step += 1
                s.step_in_epoch += 1
                s.samples_seen += self.plan.global_batch
                interval_loss += loss_sum
                interval_steps += 1
                progress.record_step(wait, self.plan.global_batch)
                self._accumulate_epoch(loss_sum, correct)
                if progress.due(s.global_step):
                    mean = dist_utils.sum_across(
                        self.world, [float(interval_loss) / interval_steps], self.device
                    )[0]
                    mean /= self.world.size
                    if self.world.is_main:
                        report = progress.report(epoch=s.epoch + 1, step=s.global_step, loss=mean)
                        lr = float(scheduler.get_last_lr()[0])
                        self.tracker.log(s.global_step, progress_metrics(mean, report, lr))
                        self.history.step_losses.append((s.global_step, mean))
                    interval_loss.zero_()
                    interval_steps = 0
                epoch_done = s.step_in_epoch == steps_per_epoch
                if epoch_done:
                    progress.pause()
                    # Not through DDP: its per-forward buffer broadcast would hang on uneven val shards.
                    self._finish_epoch(
                        model.module if isinstance(model, DistributedDataParallel) else model, val_loader
                    )
                    progress.resume()
                outcome = self._maybe_checkpoint(scheduler, deadline, progress, life_started)
                if outcome is not None:
                    return outcome
                if epoch_done:
                    break
        return self._complete(scheduler, progress, life_started)

    def _optimizer_step(
        self,
        model: nn.Module,
        criterion: nn.Module,
        batches: Iterator[Batch],
        scheduler: torch.optim.lr_scheduler.LRScheduler,
    ) -> tuple[float, torch.Tensor, torch.Tensor]:
        """One optimizer step over `accumulation` micro-batches; returns (loader wait, loss sum, correct)."""
        plan, seed, step = self.plan, self.config.train.seed, self.state.global_step
        wait = 0.0
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = torch.zeros((), dtype=torch.float64, device=self.device)
        channels_last = self.device.type == "cuda"
        for k in range(plan.accumulation):
            fetch_started = time.perf_counter()
            images, targets, unreadable = next(batches)
            wait += time.perf_counter() - fetch_started
            self.skipped_files.record("train", unreadable, self.state.epoch)
            if not len(targets):
                raise self.skipped_files.no_readable_image("train")
            images = images.to(self.device, non_blocking=True)
            if channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            targets = targets.to(self.device, non_blocking=True)
            micro_index = self.world.rank * plan.accumulation + k
            seed_micro_batch(micro_batch_seed(seed, step, micro_index), self.device)
            last = k == plan.accumulation - 1
            # Gradients are all-reduced once per optimizer step, on the last micro-batch only.
            sync = (
                contextlib.nullcontext()
                if last or not isinstance(model, DistributedDataParallel)
                else model.no_sync()
            )
            with sync:
                with self.precision.autocast():
                    logits = model(images)
                    loss = criterion(logits, targets)
                self.scaler.scale(loss / plan.accumulation).backward()
            loss_sum += loss.detach().double() / plan.accumulation
            correct += (logits.detach().argmax(dim=1) == targets).sum().double()
            fault_point("micro-batch", step=step, micro=k, rank=self.world.rank)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        self._check_bad_data("train")
        return wait, loss_sum, correct

    def _check_bad_data(self, split: str) -> None:
        """BadDataError (exit 65) on every rank at once when this pass over `split` met too many unreadable
        files; ranks read disjoint shards of a pass, so the sum over ranks is the pass's count."""
        count = self.skipped_files.pass_count(split)
        if self.world.distributed:
            count = round(dist_utils.sum_across(self.world, [float(count)], self.device)[0])
        self.skipped_files.check(split, count)

    def _skipped_files_summary(self) -> dict[str, Any]:
        """metrics.json's `skipped_files`, with the files every rank met (call on all ranks)."""
        if self.world.distributed:
            states: list[Any] = [None] * self.world.size
            torch.distributed.all_gather_object(states, self.skipped_files.to_state())
            for state in states:
                self.skipped_files.load_state(state)
        summary = self.skipped_files.summary()
        if self.world.is_main and any(split["count"] for split in summary.values()):
            log.warning(
                "skipped unreadable images: %s; listed in metrics.json",
                ", ".join(f"{name} {split['count']}" for name, split in summary.items()),
            )
        return summary

    def _accumulate_epoch(self, loss_sum: torch.Tensor, correct: torch.Tensor) -> None:
        # float64 additions in the same order as Python floats would do them: the same sums, no sync.
        self._epoch_loss += loss_sum
        self._epoch_correct += correct
        self.state.epoch_count += self.plan.per_rank

    def _fold_epoch_sums(self) -> None:
        """Copy the device-side epoch sums into the state's floats (a checkpoint mid-epoch carries them)."""
        self.state.epoch_loss_sum = float(self._epoch_loss)
        self.state.epoch_correct = float(self._epoch_correct)

    def _finish_epoch(self, model: nn.Module, val_loader: Any) -> None:
        self._fold_epoch_sums()
        s = self.state
        loss_sum, correct, count = dist_utils.sum_across(
            self.world, [s.epoch_loss_sum * self.plan.per_rank, s.epoch_correct, s.epoch_count], self.device
        )
        val_loss, val_accuracy = self._evaluate(model, val_loader)
        result = EpochResult(
            epoch=s.epoch + 1,
            step=s.global_step,
            train_loss=loss_sum / max(count, 1),
            train_accuracy=correct / max(count, 1),
            val_loss=val_loss,
            val_accuracy=val_accuracy,
        )
        self.history.epochs.append(result)
        self.tracker.log(result.step, epoch_metrics(result))
        if self.world.is_main:
            log.info(
                "epoch %d done: train loss %.4f acc %.3f  val loss %.4f acc %.3f",
                result.epoch,
                result.train_loss,
                result.train_accuracy,
                result.val_loss,
                result.val_accuracy,
            )
        s.epoch += 1
        s.step_in_epoch = 0
        s.epoch_loss_sum = s.epoch_correct = s.epoch_count = 0.0
        self._epoch_loss.zero_()
        self._epoch_correct.zero_()

    @torch.no_grad()
    def _evaluate(self, model: nn.Module, val_loader: Any) -> tuple[float, float]:
        model.eval()
        loss_sum = correct = count = 0.0
        for images, targets, unreadable in val_loader:
            self.skipped_files.record("val", unreadable, self.state.epoch)
            if not len(targets):
                continue
            images = images.to(self.device, non_blocking=True)
            if self.device.type == "cuda":
                images = images.contiguous(memory_format=torch.channels_last)
            targets = targets.to(self.device, non_blocking=True)
            with self.precision.autocast():
                logits = model(images)
            loss_sum += float(nn.functional.cross_entropy(logits.float(), targets, reduction="sum"))
            correct += float((logits.argmax(dim=1) == targets).sum())
            count += len(targets)
        model.train()
        loss_sum, correct, count = dist_utils.sum_across(self.world, [loss_sum, correct, count], self.device)
        self._check_bad_data("val")
        return loss_sum / max(count, 1), correct / max(count, 1)

    # -- checkpoints and endings -----------------------------------------------------------------------

    def _save(self, scheduler: torch.optim.lr_scheduler.LRScheduler, life_started: float) -> float:
        """Save on the main rank; returns the seconds training waited for it (0 elsewhere, or when this step
        is saved already)."""
        if not self.world.is_main or self.checkpoints.latest_saved_step == self.state.global_step:
            return 0.0
        self.tracker.flush()  # what the run has up to this step survives this life: no gap after a resume
        started = time.monotonic()
        state = self._snapshot(scheduler)
        state["train"]["wall_seconds"] = self.state.wall_seconds + time.monotonic() - life_started
        self.checkpoints.save(
            state,
            step=self.state.global_step,
            epoch=self.state.epoch,
            world_size=self.world.size,
            config_hash=self.config_hash,
            context=self.context(),
            step_in_epoch=self.state.step_in_epoch,
        )
        return time.monotonic() - started

    def _maybe_checkpoint(
        self,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        deadline: Deadline,
        progress: ProgressReporter,
        life_started: float,
    ) -> int | None:
        every = self.config.checkpoint.every_steps
        stop, requested, timed = dist_utils.any_rank(
            self.world,
            [self.stop.stop_requested(), self.stop.checkpoint_requested(), deadline.due()],
            self.device,
        )
        periodic = every > 0 and self.state.global_step % every == 0
        if not (stop or requested or timed or periodic):
            return None
        progress.pause()
        waited = self._save(scheduler, life_started)
        deadline.reset()
        if isinstance(deadline, AutoDeadline):
            # Every rank takes the main rank's measurement, so all agree on the next deadline.
            waited = dist_utils.sum_across(self.world, [waited], self.device)[0]
            if waited > 0:
                deadline.measured(waited)
        if requested and self.world.is_main:
            if not self.checkpoints.wait_uploaded():
                log.warning(
                    "checkpoint at step %d requested but not yet confirmed in S3", self.state.global_step
                )
            self.stop.clear_checkpoint_request()
            log.info("checkpoint at step %d saved on request", self.state.global_step)
        if stop:
            return self._stop(scheduler, life_started)
        progress.resume()
        return None

    def _stop(self, scheduler: torch.optim.lr_scheduler.LRScheduler, life_started: float) -> int:
        note_step(self.state.global_step)  # the launcher reports where the ranks stopped
        self._save(scheduler, life_started)
        code = ExitCode.STOPPED
        if self.world.is_main:
            step, reason = self.state.global_step, self.stop.reason()
            if not self.checkpoints.remote_uri:
                log.warning(
                    "stopped at step %d on %s; checkpoint saved in %s for the agent to persist, exit %d",
                    step,
                    reason,
                    self.checkpoints.root,
                    ExitCode.STOPPED,
                )
            elif self.checkpoints.finish():
                log.warning(
                    "stopped at step %d on %s; checkpoint confirmed, exit %d", step, reason, ExitCode.STOPPED
                )
            else:
                # Exit 75 promises a confirmed checkpoint: say the truth with a failure instead.
                log.error(
                    "stopped at step %d on %s, but the checkpoint is NOT confirmed in %s "
                    "(S3 confirmed step %s); exit %d",
                    step,
                    reason,
                    self.checkpoints.remote_uri,
                    self.checkpoints.confirmed_remote_step,
                    ExitCode.FAILED,
                )
                code = ExitCode.FAILED
        codes = dist_utils.sum_across(self.world, [float(code != ExitCode.STOPPED)], self.device)
        dist_utils.barrier(self.world)
        return ExitCode.FAILED if codes[0] else ExitCode.STOPPED

    def _complete(
        self, scheduler: torch.optim.lr_scheduler.LRScheduler, progress: ProgressReporter, life_started: float
    ) -> int:
        note_step(self.state.global_step)
        self._save(scheduler, life_started)
        skipped_files = self._skipped_files_summary()
        if self.world.is_main:
            if not self.checkpoints.finish():
                log.warning(
                    "the final checkpoint is not confirmed in %s; the results below are complete anyway",
                    self.checkpoints.remote_uri,
                )
            summary = {
                "steps": self.state.global_step,
                "epochs": self.state.epoch,
                "global_batch": self.plan.global_batch,
                "micro_batch": self.plan.micro_batch,
                "accumulation": self.plan.accumulation,
                "world_size": self.world.size,
                "precision": self.precision.precision,
                "model": self.config.model.name,
                "classes": self.train_set.classes,
                **progress.summary(),
                "wall_seconds": self.state.wall_seconds + time.monotonic() - life_started,
                "checkpoints": self.checkpoints.timings.as_dict(),
                "skipped_files": skipped_files,
            }
            write_artifacts(self.raw_model, self.history, summary, self.output_dir, self.config.output.uri)
            log.info("training complete: %d steps; results in %s", self.state.global_step, self.output_dir)
        dist_utils.barrier(self.world)
        return ExitCode.COMPLETED

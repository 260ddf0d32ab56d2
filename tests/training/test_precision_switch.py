"""A checkpoint crosses GPUs of another precision (an L4's bf16 life, a T4's fp16 replacement) and carries its
context; what cannot be adapted (another model, another optimizer) is refused in one line with exit 2.

In-process: the trainer's own save (`_snapshot`) and load (`_load`) around one real optimizer step per life
(`_optimizer_step`: autocast, the scaled backward, the scaler's step and update) prove each of the six
precision switches at ~1 s each; three short trainer launches prove what only a process shows (the agent's
variables reaching the trainer, the exit code of a refused resume).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import training.precision
from tests.training.conftest import Dataset
from training.checkpoint import state_from_bytes
from training.config import Config, load_config
from training.data import Batch
from training.loop import Trainer, plan_batches
from training.precision import choose_precision
from training.resume import ResumeRefusedError
from trainstack_job.contract import JobEnv

from .conftest import FAST, TINY

PRECISIONS = ("bf16", "fp16", "fp32")
PAIRS = [(a, b) for a in PRECISIONS for b in PRECISIONS if a != b]
PROFILE_VARS = [v.value for v in (JobEnv.PRECISION, JobEnv.GPU_MODEL, JobEnv.GPU_COUNT, JobEnv.INSTANCE_TYPE)]


@pytest.fixture(autouse=True)
def no_agent_profile(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """These tests decide the profile themselves; a variable of the shell running pytest must not."""
    for name in (*PROFILE_VARS, JobEnv.JOB_ID.value, JobEnv.CODE_HASH.value, JobEnv.DATA_DIR.value):
        monkeypatch.delenv(name, raising=False)
    yield


def config(dataset: Dataset, tmp: str, *overrides: str) -> Config:
    return load_config(
        TINY,
        [
            *dataset.overrides(),
            *FAST,
            # Global torch flags stay as the other tests in this worker expect them.
            "train.deterministic=false",
            f"checkpoint.dir={tmp}/checkpoints",
            f"output.dir={tmp}/output",
            *overrides,
        ],
    )


def one_step(trainer: Trainer, scheduler: torch.optim.lr_scheduler.LRScheduler, seed: int) -> None:
    """One optimizer step of the trainer's own code on random images: autocast, the scaled backward over
    the accumulation's micro-batches, the scaler's step and update."""
    generator = torch.Generator().manual_seed(seed)
    micro = trainer.plan.micro_batch
    batches = iter(
        [
            Batch(torch.randn(micro, 3, 32, 32, generator=generator), torch.randint(0, 4, (micro,)), [])
            for _ in range(trainer.plan.accumulation)
        ]
    )
    trainer._optimizer_step(trainer.raw_model, nn.CrossEntropyLoss(), batches, scheduler)


def trainer_with_one_step(cfg: Config) -> tuple[Trainer, torch.optim.lr_scheduler.LRScheduler]:
    """A trainer as `_run` sets one up (plan, scheduler), after one optimizer step of its precision."""
    trainer = Trainer(cfg)
    trainer.plan = plan_batches(cfg, trainer.world, trainer.device, None, None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda step: 1.0)
    one_step(trainer, scheduler, seed=0)
    trainer.state.global_step = 1  # what the loop counts after the step
    return trainer, scheduler


def saved_state(trainer: Trainer, scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    """The snapshot as a checkpoint file carries it: through torch.save and the weights-only load."""
    import io

    buffer = io.BytesIO()
    torch.save(trainer._snapshot(scheduler), buffer)
    return state_from_bytes(buffer.getvalue())


@pytest.mark.parametrize(("before", "after"), PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_every_precision_switch_resumes_with_the_loss_scaler_handled(
    image_folders: Dataset, tmp_path: object, before: str, after: str, caplog: pytest.LogCaptureFixture
) -> None:
    first, scheduler = trainer_with_one_step(
        config(image_folders, str(tmp_path), f"train.precision={before}")
    )
    saved = saved_state(first, scheduler)
    assert saved["context"]["precision"] == before
    assert bool(saved["scaler"]) is (before == "fp16"), "only an fp16 life saves a scaler state"

    second = Trainer(config(image_folders, str(tmp_path), f"train.precision={after}"))
    second.plan = plan_batches(second.config, second.world, second.device, saved["batch"], None)
    with caplog.at_level(logging.INFO, logger="training"):
        second._load(saved)
    line = next(r.getMessage() for r in caplog.records if "resumes as" in r.getMessage())
    assert f"precision {before} -> {after}" in line

    scaler = second.scaler.state_dict()
    if after == "fp16" and before != "fp16":
        assert scaler["scale"] == 65536.0 and "fresh fp16 loss scaler" in line
    elif after != "fp16" and before == "fp16":
        assert scaler == {} and "loss scaler dropped" in line
    else:
        assert scaler == {}
    for mine, theirs in zip(second.raw_model.state_dict().values(), saved["model"].values(), strict=True):
        assert torch.equal(mine, theirs)
    # And it trains on: one more step in the new precision, finite weights.
    one_step(second, torch.optim.lr_scheduler.LambdaLR(second.optimizer, lambda step: 1.0), seed=1)
    assert all(torch.isfinite(p).all() for p in second.raw_model.parameters())


def test_fp16_to_fp16_keeps_the_scale_the_run_had_settled_on(
    image_folders: Dataset, tmp_path: object
) -> None:
    first, scheduler = trainer_with_one_step(config(image_folders, str(tmp_path), "train.precision=fp16"))
    first.scaler.update(1024.0)  # as if a few overflows had backed it off
    saved = saved_state(first, scheduler)
    second = Trainer(config(image_folders, str(tmp_path), "train.precision=fp16"))
    second.plan = plan_batches(second.config, second.world, second.device, saved["batch"], None)
    second._load(saved)
    assert second.scaler.get_scale() == 1024.0


def test_real_fp16_autocast_round_trip_where_the_cpu_has_no_fp16_kernels_is_forced(
    image_folders: Dataset, tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The emulation aside (a CPU without fp16 kernels computes in fp32): torch's real fp16 autocast on the
    CPU with its GradScaler saves a state a bf16 life drops and an fp16 life restores."""
    monkeypatch.setattr(training.precision, "cpu_has_kernels", lambda precision: True)
    first, scheduler = trainer_with_one_step(config(image_folders, str(tmp_path), "train.precision=fp16"))
    assert not first.precision.emulated
    saved = saved_state(first, scheduler)
    assert saved["scaler"]["scale"] > 0
    back = Trainer(config(image_folders, str(tmp_path), "train.precision=fp16"))
    back.plan = plan_batches(back.config, back.world, back.device, saved["batch"], None)
    back._load(saved)
    assert back.scaler.state_dict() == saved["scaler"]


def test_auto_on_a_cpu_follows_the_device_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert choose_precision("auto", cpu).precision == "fp32"
    assert choose_precision("auto", cpu, "fp16").precision == "fp16"
    assert choose_precision("auto", cpu, "bf16").source == "the device profile"
    assert choose_precision("fp32", cpu, "fp16").precision == "fp32", "an explicit precision wins"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert choose_precision("auto", torch.device("cuda"), "fp16").precision == "bf16", "a GPU asks itself"


def test_another_model_and_optimizer_are_refused_in_one_line_naming_both_contexts(
    image_folders: Dataset, tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal is a ConfigError (exit 2, permanent: the agent stops the job). The issue's replay with
    real processes — an L4 bf16 life stopped with exit 75, a T4 fp16 replacement resuming it under the real
    agent — is `make demo`'s story, asserted by tests/bootstrap/test_demo_queue.py."""
    monkeypatch.setenv(JobEnv.GPU_MODEL.value, "L4")
    monkeypatch.setenv(JobEnv.GPU_COUNT.value, "1")
    monkeypatch.setenv(JobEnv.PRECISION.value, "bf16")
    first, scheduler = trainer_with_one_step(config(image_folders, str(tmp_path)))
    saved = saved_state(first, scheduler)
    monkeypatch.setenv(JobEnv.GPU_MODEL.value, "T4")
    monkeypatch.setenv(JobEnv.PRECISION.value, "fp16")
    other = Trainer(
        config(image_folders, str(tmp_path), "model.name=resnet18", "train.optimizer=adamw", "train.lr=0.001")
    )
    other.plan = plan_batches(other.config, other.world, other.device, saved["batch"], None)
    before = [p.clone() for p in other.raw_model.parameters()]
    with pytest.raises(ResumeRefusedError) as refused:
        other._load(saved)
    (line,) = refused.value.problems
    assert "\n" not in line
    assert line.startswith(
        "checkpoint step-1 (mobilenet_v3_small, SGD, bf16 on 1x L4 (emulated on cpu)) cannot resume in this "
        "run (resnet18, AdamW, fp16 on 1x T4 (emulated on cpu)): the model's parameters differ"
    ), line
    assert "the optimizer differs (SGD in the checkpoint, AdamW here)" in line
    assert "set model.name=mobilenet_v3_small and train.optimizer=sgd to continue it" in line
    assert all(torch.equal(a, b) for a, b in zip(before, other.raw_model.parameters(), strict=True)), (
        "nothing is loaded from a refused checkpoint"
    )

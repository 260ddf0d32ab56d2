"""The heart of the product: interrupted, restarted runs end bit-for-bit where an uninterrupted one does.

The lives of each job here are forked from a server that has imported the trainer once
(tests/forkserver.py): each is its own process, killed and signalled by pid like `python -m
training`, without paying ~3.7 CPU-seconds of torch imports per life. The baseline they end on is a real
`python -m training` process (tests/training/conftest.py).
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import training.resume
from tests.conftest import MotoServer
from tests.forkserver import ForkedLife
from tests.training.conftest import STEPS_PER_EPOCH, TOTAL_STEPS, MakeRun, Run
from tests.training.lives import Lives
from training.config import ConfigError
from training.resume import (
    ResumeRefusedError,
    check_resumable,
    load_scaler,
    optimizer_name,
    saved_context,
    source_hash,
)
from trainstack_job.context import CheckpointContext

EXIT_STOPPED = 75
EVERY_STEPS = 3  # conftest FAST: checkpoint.every_steps=3


def wait_until(process: ForkedLife, condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
    """Poll until `condition` holds or the process exits; kill it and fail naming `what` if neither happens
    in time."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and not condition():
        if time.monotonic() > deadline:
            process.kill()
            process.wait(timeout=30)
            pytest.fail(f"the trainer neither exited nor showed {what} within {timeout}s")
        time.sleep(0.02)


def latest(checkpoints: Path) -> dict[str, object]:
    found: dict[str, object] = json.loads((checkpoints / "latest.json").read_text())
    return found


def assert_same_model(run: Run, baseline: Run) -> None:
    assert run.model.read_bytes() == baseline.model.read_bytes(), f"{run.model} differs from the baseline"


@pytest.mark.slow(seconds=25)
def test_stops_signals_a_checkpoint_request_and_a_replacement_from_s3_resume_bitwise_exact(
    make_run: MakeRun, baseline: Run, aws: MotoServer, lives: Lives
) -> None:
    """One job through every way a stop or a save is asked for, with a spot replacement in the middle,
    resumed after each and ending on the baseline.

    Lives: the agent's stop file present at start (stops at step 0, before training); SIGTERM mid-
    accumulation; SIGTERM in an epoch's last step and its last micro-batch (a step boundary), upload
    confirmed; the local disk lost, a replacement restoring from S3 alone and reading with another loader
    worker count (as an instance with another core count would), stopped by the stop file appearing
    mid-training as on a spot notice; then a checkpoint request file, saved at the next step boundary,
    deleted, and the job completes with its results in S3. One job rather than several: each life costs
    CPU and the suite must stay under 5 minutes. The stop and request files and the loader worker count are
    config keys outside the optimisation, so changing them between lives changes nothing, which the final
    comparison shows."""
    import boto3

    boto3.client("s3").create_bucket(Bucket="job")
    # Run by hand with checkpoint.uri: bootstrap/standalone.py gives the trainer the agent's persister.
    run = replace(
        make_run("checkpoint.uri=s3://job/checkpoints", "output.uri=s3://job/results"),
        module="bootstrap.standalone",
    )
    stop_file = run.root / "STOP"
    stop_file.parent.mkdir(parents=True, exist_ok=True)
    stop_file.touch()
    run = replace(run, args=[*run.args, f"train.stop_file={stop_file}"])
    code, output = lives.life(run, env=aws.env())
    assert code == EXIT_STOPPED, output
    assert latest(run.checkpoints)["step"] == 0
    assert "stopped at step 0 on stop file" in output
    stop_file.unlink()

    # Resumed from that step-0 checkpoint, stopped by SIGTERM twice: mid-accumulation (micro-batch 0 of 2),
    # then in the epoch's last step, in its last micro-batch (at a step boundary). Either way the step in
    # flight is finished, then saved.
    for step, micro in [(1, 0), (STEPS_PER_EPOCH - 1, 1)]:
        code, output = lives.life(run, env=aws.env(), fault=f"sigterm:micro-batch:step={step},micro={micro}")
        assert code == EXIT_STOPPED, output
        assert "checkpoint confirmed, exit 75" in output, output
        assert latest(run.checkpoints) | {"written_at": None} == {
            "step": step + 1,
            "epoch": 0 if step + 1 < STEPS_PER_EPOCH else 1,  # the epoch's last step saves after evaluation
            "dir": f"step-{step + 1}",
            "written_at": None,
        }, output
        assert not run.model.exists()
    resumed = STEPS_PER_EPOCH
    s3 = boto3.client("s3")
    uploaded = json.loads(s3.get_object(Bucket="job", Key="checkpoints/latest.json")["Body"].read())
    assert uploaded["step"] == resumed and uploaded["dir"] == f"step-{resumed}"

    # Spot interruption: the replacement instance starts with an empty disk and restores from S3 alone, with
    # two loader workers (the lives so far read in the main process; the last one reads with one worker).
    # Then the agent's stop file appears mid-training, as on a spot notice. It appears at a moment set by
    # the trainer's own progress, not by a poll racing it (however fast or loaded this machine is): the stop
    # file is a link to the manifest of the next periodic checkpoint, which exists once that checkpoint is
    # committed. That boundary checked for a stop before saving, so the next one sees it and stops there.
    shutil.rmtree(run.checkpoints)
    periodic = (resumed // EVERY_STEPS + 1) * EVERY_STEPS
    assert periodic + 1 < TOTAL_STEPS, "the stop must land mid-training"
    stop_file.symlink_to(run.checkpoints / f"step-{periodic}" / "manifest.json")
    code, output = lives.life(replace(run, args=[*run.args, "data.num_workers=2"]), env=aws.env())
    assert code == EXIT_STOPPED, output
    assert f"restored checkpoint from S3 (step={resumed} uri=s3://job/checkpoints)" in output
    stopped = latest(run.checkpoints)["step"]
    assert stopped == periodic + 1, output
    assert f"stopped at step {stopped} on stop file" in output
    stop_file.unlink()

    # The last life finds a checkpoint request: it saves at its first step boundary and carries on.
    # keep=10 so that checkpoint is not pruned before it is looked at; the log line names its step, which
    # tells it from a periodic checkpoint when that step happens to be one (12, 15) or the last.
    request = run.root / "CHECKPOINT"
    request.touch()
    run = replace(
        run,
        args=[
            *run.args,
            "data.num_workers=1",
            f"train.checkpoint_request_file={request}",
            "checkpoint.keep=10",
        ],
    )
    code, output = lives.life(run, env=aws.env())
    assert code == 0, output
    assert not request.exists()
    assert (run.checkpoints / f"step-{stopped + 1}" / "manifest.json").exists()
    assert f"checkpoint at step {stopped + 1} saved on request" in output
    assert_same_model(run, baseline)
    results = s3.list_objects_v2(Bucket="job", Prefix="results/")["Contents"]
    assert sorted(item["Key"] for item in results) == [
        "results/curves.png",
        "results/metrics.json",
        "results/model.pt",
    ]


@pytest.mark.slow(seconds=8)
def test_resume_after_sigkills_during_checkpoint_writes_and_at_random_is_bitwise_exact(
    make_run: MakeRun, baseline: Run, lives: Lives
) -> None:
    """One job killed with SIGKILL three times: twice in the step-6 checkpoint's write, then at a random
    moment of training, then completed.

    The moments each kill covers:
    - after the state file is written and before the manifest (between the checkpoint's files; a kill
      inside torch.save leaves the same thing, a staging directory without a manifest): that half-written
      directory is never loaded, the next life resumes at step 3. The steps trained since step 3 are lost
      with it, as in any kill mid-training.
    - after the directory is renamed into place and before latest.json names it (during the `latest`
      update; latest.json itself is replaced atomically): the complete directory is what the next life
      resumes from, step 6, although latest.json still names step 3.
    - a random moment after training has started: several steps and, every third step, a checkpoint write,
      windows no fault point names.
    Three kills rather than more: each life costs CPU and the suite must stay under 5 minutes; both named
    faults hit step 6, which leaves ten steps for the random kill to land in."""
    run = make_run()
    code, output = lives.life(run, fault="sigkill:checkpoint-state-written:step=6")
    assert code == -signal.SIGKILL, output
    assert latest(run.checkpoints)["step"] == 3
    code, output = lives.life(run, fault="sigkill:checkpoint-dir-committed:step=6")
    assert code == -signal.SIGKILL, output
    assert "resuming at step 3 " in output
    assert (run.checkpoints / "step-6" / "manifest.json").exists() and latest(run.checkpoints)["step"] == 3

    progress = run.output / "progress.json"
    progress.unlink(missing_ok=True)
    process = lives.popen(run)
    wait_until(process, progress.exists, "its first progress report")
    # Training has started (its first log line): kill at a random moment of the next half second, which on
    # this job spans several steps and, every third step, a checkpoint write. No count of kills is asserted:
    # whether this life is still running then depends on the machine's speed (the rest of the job takes
    # about 2 s here), and a life that finished first is a fine end too.
    time.sleep(random.Random(20261129).uniform(0.0, 0.5))
    process.kill()
    output, _ = process.communicate(timeout=30)
    assert process.returncode in (-signal.SIGKILL, 0), output
    assert "resuming at step 6 " in output, output
    lives.finish(run)
    assert_same_model(run, baseline)


def test_progress_json_has_the_agent_fields(baseline: Run) -> None:
    progress = json.loads((baseline.output / "progress.json").read_text())
    assert progress["step"] == progress["total_steps"] == TOTAL_STEPS
    assert progress["epoch"] == progress["epochs"] == 2
    for key in ("loss", "samples_per_s", "data_wait_fraction", "eta_s", "updated_at"):
        assert key in progress
    assert 0 <= progress["data_wait_fraction"] <= 1
    # What the life's samples/s was measured for (the stack's throughput table, per type and model family).
    assert progress["precision"] in ("fp32", "bf16", "fp16") and progress["model"] == "mobilenet_v3_small"


def test_completed_run_writes_loadable_artifacts(baseline: Run) -> None:
    import torch

    state = torch.load(baseline.model, weights_only=True)
    assert "classifier.3.weight" in state and state["classifier.3.weight"].shape[0] == 4
    metrics = json.loads((baseline.output / "metrics.json").read_text())
    assert metrics["steps"] == TOTAL_STEPS and len(metrics["epochs"]) == 2
    assert {"train_loss", "val_loss", "train_accuracy", "val_accuracy"} <= set(metrics["final"])
    assert metrics["checkpoints"]["count"] >= 1
    assert (baseline.output / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    latest = json.loads((baseline.checkpoints / "latest.json").read_text())
    assert set(latest) == {"step", "epoch", "dir", "written_at"} and latest["step"] == TOTAL_STEPS


# -- what a checkpoint can resume as (training/resume.py), in-process ---------------------------------------

BEFORE = CheckpointContext(model="resnet18", optimizer="SGD", precision="bf16", device="cpu", world_size=1)


def checkpoint_of(model: nn.Module, optimizer: torch.optim.Optimizer, **extra: object) -> dict[str, object]:
    """A trainer state as training/loop.py saves it: model, optimizer, position, classes."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "train": {"global_step": 12, "sample": 96},
        "classes": ["a", "b", "c"],
        **extra,
    }


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def refusal(
    saved: dict[str, object],
    model: nn.Module,
    before: CheckpointContext = BEFORE,
    now: CheckpointContext = BEFORE,
    classes: tuple[str, ...] = ("a", "b", "c"),
) -> str:
    """The one line a refused resume says (the test fails if it is not refused)."""
    with pytest.raises(ResumeRefusedError) as refused:
        check_resumable(saved, before, now, model.state_dict(), list(classes))
    assert isinstance(refused.value, ConfigError)  # exit 2: permanent, the agent stops the job
    (line,) = refused.value.problems
    return line


def test_the_same_model_and_optimizer_resume_whatever_else_changed() -> None:
    """Precision, device, world size and batch changes are adapted, never refused."""
    model = nn.Linear(4, 3)
    now = CheckpointContext(model="resnet18", optimizer="SGD", precision="fp16", gpu_model="L4", world_size=4)
    check_resumable(checkpoint_of(model, sgd(model)), BEFORE, now, model.state_dict(), ["a", "b", "c"])


def test_another_models_shapes_are_refused_naming_a_tensor_the_count_the_classes_and_the_fix() -> None:
    """Another model is refused in one line: a tensor, the count, the classes, the fix."""
    saved = checkpoint_of(nn.Linear(4, 3), sgd(nn.Linear(4, 3)))
    model = nn.Linear(4, 5)
    now = CheckpointContext(model="mobilenet_v3_small", optimizer="SGD", precision="fp32", device="cpu")
    line = refusal(saved, model, now=now, classes=("a", "b", "c", "d", "e"))
    assert line == (
        f"checkpoint step-12 ({BEFORE.describe()}) cannot resume in this run ({now.describe()}): "
        "the model's parameters differ (2 tensor(s), e.g. weight [3, 4] in the checkpoint, [5, 4] here); "
        "the dataset has 5 classes, the checkpoint 3 (data.train_dir); "
        "set model.name=resnet18 to continue it, or start a new job (a new checkpoint.dir, or a new "
        "trainstack job without resumeFrom) to train this one from scratch"
    )


def test_a_tensor_missing_from_the_checkpoint_is_named_and_counted_with_the_extra_ones() -> None:
    """A tensor only this model has is named first; the count adds the checkpoint's extras."""
    saved_model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2), nn.ReLU(), nn.Linear(2, 2))
    line = refusal(checkpoint_of(saved_model, sgd(saved_model)), model)
    assert "the model's parameters differ (6 tensor(s), e.g. 1.weight is not in the checkpoint)" in line


def test_a_tensor_only_the_checkpoint_has_is_named_when_nothing_else_differs() -> None:
    """A checkpoint with parameters this model does not have: that tensor is named."""
    saved_model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model = nn.Sequential(nn.Linear(4, 4))
    line = refusal(checkpoint_of(saved_model, sgd(saved_model)), model)
    assert "the model's parameters differ (2 tensor(s), e.g. 1.weight is not in this model)" in line
    # Same class count: nothing said about the dataset; the same model name: no model.name fix.
    assert "classes" not in line and "set model.name" not in line
    assert "): the model's parameters differ" in line and "; start a new job (" in line


def test_the_class_count_is_only_compared_when_the_checkpoint_lists_its_classes() -> None:
    """An older state without "classes" is refused for its parameters alone."""
    saved = checkpoint_of(nn.Linear(4, 3), sgd(nn.Linear(4, 3)))
    del saved["classes"]
    line = refusal(saved, nn.Linear(4, 5), classes=("a", "b", "c", "d", "e"))
    assert "classes" not in line


def test_another_optimizer_is_refused_with_the_one_that_continues_it() -> None:
    """SGD's state cannot drive AdamW: refused, with train.optimizer=sgd as the fix."""
    model = nn.Linear(4, 3)
    now = CheckpointContext(model="resnet18", optimizer="AdamW", precision="bf16", device="cpu")
    line = refusal(checkpoint_of(model, sgd(model)), model, now=now)
    assert line == (
        f"checkpoint step-12 ({BEFORE.describe()}) cannot resume in this run ({now.describe()}): "
        "the optimizer differs (SGD in the checkpoint, AdamW here); set train.optimizer=sgd to continue it, "
        "or start a new job (a new checkpoint.dir, or a new trainstack job without resumeFrom) to train this "
        "one from scratch"
    )


def test_the_fixes_are_joined_when_both_model_and_optimizer_differ() -> None:
    """Both fixes in one line, and an older checkpoint's optimizer read from its state."""
    saved_model = nn.Linear(4, 3)
    saved = checkpoint_of(saved_model, torch.optim.AdamW(saved_model.parameters()))
    before = CheckpointContext(model="resnet18")
    now = CheckpointContext(model="vit_b_16", optimizer="SGD")
    line = refusal(saved, nn.Linear(4, 5), before=before, now=now)
    assert "the optimizer differs (AdamW in the checkpoint, SGD here)" in line
    assert "set model.name=resnet18 and train.optimizer=adamw to continue it, or start a new job" in line


def test_an_optimizer_unknown_on_either_side_is_not_refused() -> None:
    """Only two known, different optimizers are refused: an unknown one is not a reason."""
    model = nn.Linear(4, 3)
    saved = checkpoint_of(model, torch.optim.Adagrad(model.parameters()))
    for now in (CheckpointContext(optimizer="SGD"), CheckpointContext(optimizer=None)):
        check_resumable(saved, CheckpointContext(), now, model.state_dict(), ["a", "b", "c"])
    check_resumable(checkpoint_of(model, sgd(model)), BEFORE, CheckpointContext(), model.state_dict(), [])


def test_a_checkpoint_without_a_step_is_named_with_a_question_mark() -> None:
    """A state whose step is not a number still gets its one line."""
    model = nn.Linear(4, 3)
    saved = checkpoint_of(model, sgd(model))
    saved["train"] = {"global_step": "12"}
    assert refusal(saved, nn.Linear(4, 5)).startswith("checkpoint ? (")
    del saved["train"]
    assert refusal(saved, nn.Linear(4, 5)).startswith("checkpoint ? (")


def test_the_optimizer_is_told_by_the_hyper_parameters_only_its_class_keeps() -> None:
    """betas: AdamW; momentum with dampening: SGD; anything else, or no param groups: unknown."""
    params = list(nn.Linear(2, 2).parameters())
    assert optimizer_name(torch.optim.AdamW(params).state_dict()) == "AdamW"
    assert optimizer_name(torch.optim.SGD(params, lr=0.1).state_dict()) == "SGD"
    assert optimizer_name(torch.optim.RMSprop(params, momentum=0.9).state_dict()) is None  # no dampening
    assert optimizer_name(torch.optim.Adagrad(params).state_dict()) is None
    assert optimizer_name({}) is None
    assert optimizer_name({"param_groups": []}) is None
    assert optimizer_name({"param_groups": ["betas"]}) is None


def test_a_recorded_context_is_the_checkpoints_context() -> None:
    """A state that carries its context is read as recorded, whatever the rest of the state says."""
    recorded = CheckpointContext(model="resnet18", optimizer="SGD", precision="fp16", world_size=8)
    saved = {"context": recorded.to_dict(), "precision": "bf16", "batch": {"world_size": 1}}
    assert saved_context(saved) == recorded


def test_an_older_checkpoints_context_is_read_from_its_state() -> None:
    """Before contexts: precision, loss scaling, batch arithmetic and optimizer come from the state."""
    model = nn.Linear(2, 2)
    saved = {
        "precision": "fp16",
        "scaler": {"scale": 1024.0},
        "batch": {"world_size": 2, "global_batch": 64, "micro_batch": 8, "accumulation": 4},
        "optimizer": torch.optim.AdamW(model.parameters()).state_dict(),
    }
    assert saved_context(saved) == CheckpointContext(
        precision="fp16",
        loss_scaling=True,
        world_size=2,
        global_batch=64,
        micro_batch=8,
        accumulation=4,
        optimizer="AdamW",
    )


def test_an_older_checkpoint_that_says_little_has_little_context() -> None:
    """No batch, no scaler state, a precision that is not a name: unknown, not guessed."""
    assert saved_context({"precision": 16, "scaler": {}}) == CheckpointContext(loss_scaling=False)
    assert saved_context({"context": "not a mapping"}) == CheckpointContext(loss_scaling=False)


def test_an_fp16_life_keeps_the_scale_an_fp16_checkpoint_settled_on() -> None:
    """fp16 -> fp16: the saved scale and growth tracker are loaded, and nothing is said."""
    saved_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    saved_scaler.load_state_dict({**saved_scaler.state_dict(), "_growth_tracker": 7})
    scaler = torch.amp.GradScaler("cpu")
    assert load_scaler(scaler, {"scaler": saved_scaler.state_dict()}) == ""
    assert scaler.state_dict() == saved_scaler.state_dict()


def test_an_fp16_life_from_a_checkpoint_without_a_scaler_starts_a_fresh_one_and_says_so() -> None:
    """bf16/fp32 -> fp16: this life's scaler keeps its initial scale, and the resume line says so."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    fresh = scaler.state_dict()
    without: list[dict[str, object]] = [{"scaler": {}}, {}]
    for saved in without:
        note = load_scaler(scaler, saved)
        assert note == "fresh fp16 loss scaler (scale 65536; the checkpoint has none)"
        assert scaler.state_dict() == fresh


def test_a_life_that_does_not_scale_drops_the_checkpoints_scaler_saying_so() -> None:
    """fp16 -> bf16/fp32: the saved scaler state is dropped; with none saved there is nothing to say."""
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    saved = {"scaler": torch.amp.GradScaler("cpu").state_dict()}
    assert load_scaler(scaler, saved) == (
        "the checkpoint's fp16 loss scaler dropped (this precision does not scale the loss)"
    )
    assert scaler.state_dict() == {} and not scaler.is_enabled()
    assert load_scaler(scaler, {"scaler": {}}) == ""
    assert load_scaler(scaler, {}) == ""


def write_sources(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_source_hash_tells_the_trainers_code_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any change to training/ or trainstack_job/'s Python files changes the hash; nothing else."""
    monkeypatch.setattr(training.resume, "_ROOT", tmp_path)
    compute = source_hash.__wrapped__
    sources = {"training/a.py": "x = 1\n", "training/b.py": "y = 2\n", "trainstack_job/c.py": "z = 3\n"}
    write_sources(tmp_path, sources)
    first = compute()
    assert first.startswith("source:") and len(first) == len("source:") + 16
    int(first.removeprefix("source:"), 16)
    assert compute() == first
    # Not the trainer's code: other files, other folders.
    write_sources(tmp_path, {"training/notes.txt": "n", "bootstrap/d.py": "w = 4\n", "training/sub/e.py": ""})
    assert compute() == first
    seen = {first}
    for change in (
        {"training/a.py": "x = 2\n"},
        {"trainstack_job/c.py": "z = 4\n"},
        {"training/aa.py": "x = 2\n"},
    ):
        write_sources(tmp_path, change)
        changed = compute()
        assert changed not in seen, change
        seen.add(changed)
    # A file renamed with its content unchanged is other code too (the name is imported).
    (tmp_path / "training" / "b.py").rename(tmp_path / "training" / "b2.py")
    assert compute() not in seen


def test_the_source_hash_is_computed_once_per_process() -> None:
    """The trainer's own code does not change while it runs: one hash, the same each time asked."""
    assert source_hash() is source_hash()

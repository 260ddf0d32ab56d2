"""One experiment-tracker run per job across its lives (training/tracker.py): a TensorBoard run stopped for a
spot notice, killed inside a checkpoint write and completed has every step exactly once; the MLflow and W&B
runs are found again and skip what a dead life logged; a missing package is one line naming the fix; and a
trainer without tracking imports none of the trackers."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest

import training.tracker
from tests.training.conftest import REPO, STEPS_PER_EPOCH, TOTAL_STEPS, MakeRun
from tests.training.lives import EXIT_STOPPED, Lives
from tests.waiting import wait_until
from training.config import ConfigError, TrackingConfig, build_config
from training.metrics import EpochResult
from training.tracker import (
    NO_TRACKER,
    MlflowTracker,
    WandbTracker,
    epoch_metrics,
    flat_params,
    open_tracker,
    run_id,
)
from trainstack_job.contract import ExitCode, JobEnv

JOB_ID = "resnet-1a2b3c4d"


def scalar_steps(log_dir: Path, tag: str) -> list[int]:
    """The steps of `tag` as TensorBoard shows them: every event file of the run, replays purged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return [event.step for event in events.Scalars(tag)]


def mlflow_steps(store: str, tag: str) -> dict[str, list[int]]:
    """Each MLflow run of the experiment, by name, with the steps of `tag` in its history."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("exp")
    assert experiment is not None
    return {
        run.info.run_name: sorted(m.step for m in client.get_metric_history(run.info.run_id, tag))
        for run in client.search_runs([experiment.experiment_id])
    }


def event_files(log_dir: Path) -> list[Path]:
    return sorted(log_dir.glob("events.out.tfevents.*"))


def next_second_after(path: Path) -> None:
    """Until the wall clock has left the second an event file is named after: TensorBoard reads a run's files
    in name order, and a name starts with its creation second (lives of a real job are minutes apart)."""
    created = int(path.name.split(".")[3])
    wait_until(lambda: int(time.time()) > created, 5, f"the second after {path.name}")


@pytest.mark.slow(seconds=15)
def test_a_tensorboard_run_across_a_spot_stop_and_a_kill_mid_checkpoint_has_every_step_once(
    make_run: MakeRun, lives: Lives, tmp_path: Path
) -> None:
    """Life 1 stops on a spot notice (SIGTERM) at step 5 with a checkpoint. Life 2 resumes at 5 and is killed
    while it writes the step-9 checkpoint: its steps 6-9 (and step 8's evaluation) are already in its event
    file, flushed before the checkpoint, but only checkpoint 6 is committed. Life 3 resumes at 6 and trains
    7-9 again: the run shows them once (purge_step), with no step missing and one run folder."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("torch.utils.tensorboard")
    store = tmp_path / "tensorboard"
    run = make_run("tracking.backend=tensorboard", f"tracking.uri={store}")
    env = {JobEnv.JOB_ID.value: JOB_ID}
    log_dir = store / JOB_ID

    code, output = lives.life(run, env, fault="sigterm:micro-batch:step=4,micro=0")
    assert code == EXIT_STOPPED, output
    assert f"tracking: tensorboard run {JOB_ID}, from step 1" in output
    assert scalar_steps(log_dir, "train/loss") == [1, 2, 3, 4, 5]

    next_second_after(event_files(log_dir)[-1])
    code, output = lives.life(run, env, fault="sigkill:checkpoint-state-written:step=9")
    assert code == -signal.SIGKILL, output
    assert f"tracking: tensorboard run {JOB_ID}, resumed after step 5" in output
    # What the dead life left: steps up to the checkpoint it was writing, the epoch's evaluation at step 8.
    assert scalar_steps(log_dir, "train/loss") == list(range(1, 10))
    assert scalar_steps(log_dir, "eval/accuracy") == [STEPS_PER_EPOCH]

    next_second_after(event_files(log_dir)[-1])
    code, output = lives.life(run, env)
    assert code == 0, output
    assert "resuming at step 6 " in output and "resumed after step 6" in output

    assert [p.name for p in store.iterdir()] == [JOB_ID], "one run, whatever the number of lives"
    assert len(event_files(log_dir)) == 3  # one file per life: the replay of 7-9 is in the third
    assert scalar_steps(log_dir, "train/loss") == list(range(1, TOTAL_STEPS + 1))
    for tag in ("train/samples_per_s", "train/lr", "train/data_wait_fraction"):
        assert scalar_steps(log_dir, tag) == list(range(1, TOTAL_STEPS + 1)), tag
    assert scalar_steps(log_dir, "eval/accuracy") == [STEPS_PER_EPOCH, TOTAL_STEPS]


@pytest.mark.slow(seconds=15)
def test_an_mlflow_run_in_a_file_store_across_a_spot_stop_and_a_kill_mid_checkpoint_has_every_step_once(
    make_run: MakeRun, lives: Lives, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same three lives with MLflow: one run, named and tagged with the job id; the third life finds
    steps 7-9 in the run already and logs from step 10; the run ends FINISHED."""
    pytest.importorskip("mlflow")
    store = f"file:{tmp_path / 'mlruns'}"
    run = make_run("tracking.backend=mlflow", f"tracking.uri={store}", "tracking.project=exp")
    # MLflow 3 refuses a file store unless asked (it wants a database); a test needs no server.
    env = {JobEnv.JOB_ID.value: JOB_ID, "MLFLOW_ALLOW_FILE_STORE": "true"}
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for the reads below

    code, output = lives.life(run, env, fault="sigterm:micro-batch:step=4,micro=0")
    assert code == EXIT_STOPPED, output
    assert mlflow_steps(store, "train/loss") == {JOB_ID: [1, 2, 3, 4, 5]}
    code, output = lives.life(run, env, fault="sigkill:checkpoint-state-written:step=9")
    assert code == -signal.SIGKILL, output
    code, output = lives.life(run, env)
    assert code == 0, output
    assert "steps 7-9 are in the run already" in output

    assert mlflow_steps(store, "train/loss") == {JOB_ID: list(range(1, TOTAL_STEPS + 1))}
    assert mlflow_steps(store, "eval/accuracy") == {JOB_ID: [STEPS_PER_EPOCH, TOTAL_STEPS]}


def test_a_missing_tracker_package_stops_the_trainer_with_one_line_naming_the_key_and_the_install(
    make_run: MakeRun, lives: Lives
) -> None:
    if training.tracker.importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    code, output = lives.life(make_run("tracking.backend=wandb"), {JobEnv.JOB_ID.value: JOB_ID})
    assert code == ExitCode.CONFIG_ERROR, output
    (line,) = [line for line in output.splitlines() if "tracking.backend" in line]
    assert "tracking.backend: wandb needs the wandb package" in line
    assert "pip install wandb" in line and "tracking.backend: none" in line


@pytest.mark.parametrize(
    ("backend", "package"), [("tensorboard", "tensorboard"), ("mlflow", "mlflow-skinny")]
)
def test_each_backend_names_the_package_that_provides_it(
    backend: str, package: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On every rank, the main one and the others alike: no rank trains on while another has stopped."""
    monkeypatch.setattr(training.tracker.importlib.util, "find_spec", lambda name: None)
    for is_main in (True, False):
        with pytest.raises(ConfigError) as caught:
            open_tracker(
                TrackingConfig(backend=backend),  # type: ignore[arg-type]
                run=JOB_ID,
                restored_step=0,
                output_dir=tmp_path,
                is_main=is_main,
            )
        (problem,) = caught.value.problems
        assert problem.startswith(f"tracking.backend: {backend} needs the {package} package")
        assert f"pip install {package} there" in problem


@pytest.mark.slow(seconds=5)
def test_tracking_is_off_by_default_and_a_trainer_without_it_imports_no_tracker() -> None:
    """In a fresh interpreter: the whole trainer imported, its tracker opened as the default config says."""
    script = (
        "import sys, pathlib\n"
        "import training.__main__, training.loop\n"
        "from training.config import build_config\n"
        "from training.tracker import NO_TRACKER, open_tracker\n"
        "config = build_config({})\n"
        "tracker = open_tracker(config.tracking, run='x', restored_step=0, output_dir=pathlib.Path('.'),"
        " is_main=True)\n"
        "assert tracker is NO_TRACKER\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorboard', 'mlflow', 'wandb')"
        " or m.startswith('torch.utils.tensorboard')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    assert build_config({}).tracking.backend == "none"


def test_only_the_main_rank_logs(tmp_path: Path) -> None:
    tracking = TrackingConfig(backend="tensorboard")
    assert open_tracker(tracking, run="x", restored_step=0, output_dir=tmp_path, is_main=False) is NO_TRACKER
    assert not (tmp_path / "tensorboard").exists()


def test_the_run_id_is_the_job_id_and_by_hand_one_per_checkpoint_folder(tmp_path: Path) -> None:
    assert run_id({JobEnv.JOB_ID.value: JOB_ID}, "checkpoints") == JOB_ID
    by_hand = run_id({}, str(tmp_path / "checkpoints"))
    assert by_hand == run_id({}, str(tmp_path / "a" / ".." / "checkpoints"))
    assert by_hand != run_id({}, str(tmp_path / "other"))
    assert by_hand.startswith("local-")


def test_the_tracking_section_is_checked_like_any_other_and_does_not_change_the_optimisation_hash() -> None:
    with pytest.raises(ConfigError) as caught:
        build_config({"tracking": {"backend": "tensorbord"}})
    assert caught.value.problems[0].startswith("tracking.backend: expected 'none' | 'tensorboard'")
    tracked = build_config({"tracking": {"backend": "mlflow", "uri": "http://127.0.0.1:5000"}})
    assert tracked.optimisation_hash() == build_config({}).optimisation_hash()


# -- MLflow and W&B against in-memory fakes of their clients: the resume logic, not the services ----------


class FakeMlflowClient:
    """MlflowClient's calls the tracker makes, over one dict of runs (what a tracking server keeps)."""

    runs: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init__(self, tracking_uri: str | None = None) -> None:
        self.tracking_uri = tracking_uri

    def get_experiment_by_name(self, name: str) -> Any:
        return types.SimpleNamespace(experiment_id="1") if name == "exp" else None

    def create_experiment(self, name: str) -> str:
        raise AssertionError("the experiment exists")

    def search_runs(self, experiments: list[str], filter_string: str, max_results: int) -> list[Any]:
        assert filter_string.startswith("tags.`trainstack.run_id` = ")
        wanted = filter_string.split("= ")[1].strip("'")
        return [
            types.SimpleNamespace(info=types.SimpleNamespace(run_id=key))
            for key, run in self.runs.items()
            if run["tags"].get("trainstack.run_id") == wanted
        ][:max_results]

    def create_run(self, experiment_id: str, tags: Mapping[str, str], run_name: str) -> Any:
        key = f"mlflow-{len(self.runs)}"
        self.runs[key] = {
            "tags": dict(tags),
            "name": run_name,
            "metrics": [],
            "params": {},
            "status": "RUNNING",
        }
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id=key))

    def update_run(self, run_id: str, status: str) -> None:
        self.runs[run_id]["status"] = status

    def set_terminated(self, run_id: str, status: str) -> None:
        self.runs[run_id]["status"] = status

    def get_metric_history(self, run_id: str, key: str) -> list[Any]:
        return [m for m in self.runs[run_id]["metrics"] if m.key == key]

    def log_batch(self, run_id: str, metrics: list[Any] = (), params: list[Any] = ()) -> None:  # type: ignore[assignment]
        self.runs[run_id]["metrics"].extend(metrics)
        self.runs[run_id]["params"].update({p.key: p.value for p in params})


def fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **attributes: Any) -> None:
    module = types.ModuleType(name)
    vars(module).update(attributes)
    monkeypatch.setitem(sys.modules, name, module)
    real = training.tracker.importlib.util.find_spec
    monkeypatch.setattr(
        training.tracker.importlib.util,
        "find_spec",
        lambda wanted: module if wanted == name else real(wanted),
    )


@pytest.fixture()
def fake_mlflow(monkeypatch: pytest.MonkeyPatch) -> type[FakeMlflowClient]:
    FakeMlflowClient.runs = {}
    fake_module(monkeypatch, "mlflow", MlflowClient=FakeMlflowClient)
    metric = lambda key, value, timestamp, step: types.SimpleNamespace(key=key, value=value, step=step)  # noqa: E731
    param = lambda key, value: types.SimpleNamespace(key=key, value=value)  # noqa: E731
    monkeypatch.setitem(sys.modules, "mlflow.entities", types.SimpleNamespace(Metric=metric, Param=param))
    return FakeMlflowClient


def mlflow_life(restored: int, steps: range, exit_code: int) -> MlflowTracker:
    tracker = MlflowTracker(
        TrackingConfig(backend="mlflow", project="exp"), JOB_ID, restored, {"train": {"lr": 0.1}}
    )
    for step in steps:
        tracker.log(step, {"train/loss": 1.0 / step})
    tracker.close(exit_code)
    return tracker


def test_an_mlflow_run_is_found_again_by_the_job_id_and_the_replayed_steps_are_not_logged_twice(
    fake_mlflow: type[FakeMlflowClient],
) -> None:
    first = mlflow_life(0, range(1, 6), ExitCode.STOPPED)
    (run,) = fake_mlflow.runs.values()
    assert run["name"] == JOB_ID and run["params"] == {"train.lr": "0.1"} and run["status"] == "SCHEDULED"
    # Life 2 resumes at 5, logs 6-9 and dies (a kill: no close) with only checkpoint 6 committed.
    second = MlflowTracker(TrackingConfig(backend="mlflow", project="exp"), JOB_ID, 5, {})
    assert second.run_id == first.run_id and run["status"] == "RUNNING"
    for step in range(6, 10):
        second.log(step, {"train/loss": 1.0 / step})
    third = mlflow_life(6, range(7, 17), ExitCode.COMPLETED)
    assert third.run_id == first.run_id and len(fake_mlflow.runs) == 1
    assert [m.step for m in run["metrics"]] == list(range(1, 17))
    assert run["status"] == "FINISHED"


def test_an_mlflow_life_that_fails_marks_the_run_failed(fake_mlflow: type[FakeMlflowClient]) -> None:
    mlflow_life(0, range(1, 3), ExitCode.FAILED)
    assert [run["status"] for run in fake_mlflow.runs.values()] == ["FAILED"]


class FakeWandbRun:
    def __init__(self, steps: list[int], **init: Any) -> None:
        self.init = init
        self.logged = steps
        self.resumed = bool(steps)
        self.step = steps[-1] + 1 if steps else 0
        self.ended: list[str] = []

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        assert step >= self.step, "W&B drops a step lower than the run's"
        self.logged.append(step)
        self.step = step + 1

    def mark_preempting(self) -> None:
        self.ended.append("preempting")

    def finish(self, exit_code: int) -> None:
        self.ended.append(f"finish {exit_code}")


def test_a_wandb_run_resumes_by_the_job_id_and_skips_the_steps_it_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stored: list[int] = []
    runs: list[FakeWandbRun] = []

    def init(**kwargs: Any) -> FakeWandbRun:
        runs.append(FakeWandbRun(stored, **kwargs))
        return runs[-1]

    fake_module(monkeypatch, "wandb", init=init)
    tracking = TrackingConfig(backend="wandb", project="p", entity="team")
    first = WandbTracker(tracking, JOB_ID, 0, {})
    for step in range(1, 6):
        first.log(step, {"train/loss": 1.0})
    first.close(ExitCode.STOPPED)
    second = WandbTracker(tracking, JOB_ID, 5, {})
    for step in range(6, 10):  # killed after step 9; checkpoint 6 is the newest committed
        second.log(step, {"train/loss": 1.0})
    third = WandbTracker(tracking, JOB_ID, 6, {})
    for step in range(7, 17):
        third.log(step, {"train/loss": 1.0})
    third.close(ExitCode.COMPLETED)
    assert stored == list(range(1, 17))
    assert {(r.init["id"], r.init["resume"], r.init["project"], r.init["entity"]) for r in runs} == {
        (JOB_ID, "allow", "p", "team")
    }
    assert runs[0].ended == ["preempting", "finish 0"] and runs[2].ended == ["finish 0"]


def test_the_epoch_metrics_and_mlflow_params_are_named_as_the_charts_show_them() -> None:
    result = EpochResult(
        epoch=1, step=8, train_loss=1.5, train_accuracy=0.25, val_loss=1.25, val_accuracy=0.5
    )
    assert epoch_metrics(result) == {
        "epoch/train_loss": 1.5,
        "epoch/train_accuracy": 0.25,
        "eval/loss": 1.25,
        "eval/accuracy": 0.5,
    }
    assert flat_params({"train": {"lr": 0.1, "epochs": 2}, "x": "y"}) == {
        "train.lr": "0.1",
        "train.epochs": "2",
        "x": "y",
    }


def test_under_the_agent_a_tensorboard_run_lives_in_the_jobs_results_in_s3_and_reads_back_whole(
    aws: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Event files on the instance's disk die with it at a spot interruption: under the agent
    (TRAINSTACK_RESULTS_URI) the default folder is the job's results prefix in S3, and two lives, the second
    replaying steps 4-5 after a kill, read back from there as one run with each step once."""
    import boto3

    boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="tracker-results")
    results = "s3://tracker-results/jobs/resnet-1a2b3c4d/results/"
    monkeypatch.setenv(JobEnv.RESULTS_URI.value, results)
    assert training.tracker.default_tensorboard_root(tmp_path) == results + "tensorboard"
    assert training.tracker.default_tensorboard_root(tmp_path, env={}) == str(tmp_path / "tensorboard")
    for restored, last in ((0, 5), (3, 8)):  # the first life logged 1-5, its last checkpoint was step 3
        life = training.tracker.TensorBoardTracker(
            TrackingConfig(backend="tensorboard"), "resnet-1a2b3c4d", restored, tmp_path
        )
        assert life.log_dir == results + "tensorboard/resnet-1a2b3c4d"
        for step in range(restored + 1, last + 1):
            life.log(step, {"train/loss": 1.0 / step})
        life.close(0)
    assert not (tmp_path / "tensorboard").exists(), "nothing on the instance's disk"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = EventAccumulator(results + "tensorboard/resnet-1a2b3c4d")
    run.Reload()
    assert [event.step for event in run.Scalars("train/loss")] == list(range(1, 9))

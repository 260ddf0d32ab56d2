"""One experiment-tracker run per job across its lives (training/tracker.py): a TensorBoard run stopped for a
spot notice, killed inside a checkpoint write and completed has every step exactly once; the MLflow and W&B
runs are found again and skip what a dead life logged; a missing package is one line naming the fix; and a
trainer without tracking imports none of the trackers."""

from __future__ import annotations

import logging
import re
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
from tests.tools import require_module
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
    progress_metrics,
    run_id,
)
from trainstack_job.contract import ExitCode, JobEnv
from trainstack_job.records import Progress

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
    require_module("tensorboard", "the trainer's TensorBoard run is read back from its event files")
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
    require_module("mlflow", "the trainer's MLflow run is read back from a file store")
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
    # The dev venv has no wandb (only the tracking-wandb extra brings it): the trainer finds it missing.
    assert training.tracker.importlib.util.find_spec("wandb") is None, "uninstall wandb to run this test"
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


def test_the_run_id_by_hand_is_local_and_twelve_hex_digits_as_the_docs_say(tmp_path: Path) -> None:
    assert re.fullmatch(r"local-[0-9a-f]{12}", run_id({}, str(tmp_path / "checkpoints")))
    assert run_id({JobEnv.JOB_ID.value: "  "}, str(tmp_path)).startswith("local-"), "a blank job id is none"


def test_each_progress_line_becomes_the_train_charts_the_docs_name() -> None:
    report = Progress(step=4, loss=0.5, samples_per_s=812.5, data_wait_fraction=0.125).to_json()
    assert progress_metrics(0.5, report, 0.01) == {
        "train/loss": 0.5,
        "train/samples_per_s": 812.5,
        "train/data_wait_fraction": 0.125,
        "train/lr": 0.01,
    }


def test_tracking_none_opens_no_tracker_on_any_rank(tmp_path: Path) -> None:
    for is_main in (True, False):
        tracker = open_tracker(
            TrackingConfig(backend="none"), run=JOB_ID, restored_step=3, output_dir=tmp_path, is_main=is_main
        )
        assert tracker is NO_TRACKER
        tracker.log(4, {"train/loss": 1.0})
        tracker.flush()
        tracker.close(ExitCode.COMPLETED)
    assert list(tmp_path.iterdir()) == []


def scalars(log_dir: Path | str, tag: str) -> list[tuple[int, float]]:
    """The (step, value) points of `tag` as TensorBoard shows them, replays purged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def tracking_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("tracking:")]


def test_by_hand_a_tensorboard_run_is_in_the_output_folder_and_a_resumed_life_replaces_what_it_replays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No tracking.uri and no agent: `<output.dir>/tensorboard/<run>`. Life 1 logs 1-5 and dies with
    checkpoint 3; life 2 trains 4-8 again (other numbers here, to tell them apart): the run shows life 2's."""
    require_module("tensorboard", "TensorBoard's event files are what this checks")
    monkeypatch.delenv(JobEnv.RESULTS_URI.value, raising=False)
    output = tmp_path / "output"
    tracking = TrackingConfig(backend="tensorboard")
    with caplog.at_level(logging.INFO, logger="training"):
        for restored, last, scale in ((0, 5, 1.0), (3, 8, 2.0)):
            life = open_tracker(tracking, run=JOB_ID, restored_step=restored, output_dir=output, is_main=True)
            for step in range(restored + 1, last + 1):
                life.log(step, {"train/loss": scale * step})
            life.flush()
            life.close(ExitCode.COMPLETED)
    assert tracking_lines(caplog) == [
        f"tracking: tensorboard run {JOB_ID}, from step 1",
        f"tracking: tensorboard run {JOB_ID}, resumed after step 3",
    ]
    assert [p.name for p in output.iterdir()] == ["tensorboard"]
    assert scalars(output / "tensorboard" / JOB_ID, "train/loss") == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        *((step, 2.0 * step) for step in range(4, 9)),
    ]


def test_a_tensorboard_run_is_in_the_folder_tracking_uri_names_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the folder's name, with or without its trailing slash; an absolute folder stays absolute."""
    require_module("tensorboard", "TensorBoard's event files are what this checks")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    folder = tmp_path / "Team-Runs" / "EXP-X"
    life = open_tracker(
        TrackingConfig(backend="tensorboard", uri=f"{folder}/"),
        run=JOB_ID,
        restored_step=0,
        output_dir=tmp_path / "output",
        is_main=True,
    )
    for step in (1, 2, 3):
        life.log(step, {"train/loss": 1.0})
    life.close(ExitCode.COMPLETED)
    assert [p.name for p in folder.iterdir()] == [JOB_ID]
    assert [step for step, _ in scalars(folder / JOB_ID, "train/loss")] == [1, 2, 3]
    assert list(elsewhere.iterdir()) == [] and not (tmp_path / "output").exists()


# -- MLflow and W&B against in-memory fakes of their clients: the resume logic, not the services ----------


class FakeMlflowClient:
    """MlflowClient's calls the tracker makes, over what a tracking server keeps: its experiments by name and
    its runs; and the tracking URI each client was opened with."""

    experiments: ClassVar[dict[str, str]] = {}
    runs: ClassVar[dict[str, dict[str, Any]]] = {}
    uris: ClassVar[list[str | None]] = []
    # What set_terminated raises (the server gone away), or None.
    terminate_error: ClassVar[Exception | None] = None

    def __init__(self, tracking_uri: str | None = None) -> None:
        self.uris.append(tracking_uri)

    def get_experiment_by_name(self, name: str) -> Any:
        found = self.experiments.get(name)
        return types.SimpleNamespace(experiment_id=found) if found else None

    def create_experiment(self, name: str) -> str:
        assert name not in self.experiments, "MLflow refuses a second experiment of the same name"
        self.experiments[name] = str(len(self.experiments) + 1)
        return self.experiments[name]

    def search_runs(self, experiment_ids: list[str], filter_string: str, max_results: int) -> list[Any]:
        # MLflow's file and SQL stores compare max_results with their limit: None is a TypeError there.
        if not isinstance(max_results, int) or max_results < 1:
            raise TypeError(f"max_results must be a positive int, not {max_results!r}")
        assert filter_string.startswith("tags.`trainstack.run_id` = ")
        wanted = filter_string.split("= ")[1].strip("'")
        searched = set(experiment_ids)
        return [
            types.SimpleNamespace(info=types.SimpleNamespace(run_id=key))
            for key, run in self.runs.items()
            if run["experiment_id"] in searched and run["tags"].get("trainstack.run_id") == wanted
        ][:max_results]

    def create_run(self, experiment_id: str, tags: Mapping[str, str], run_name: str) -> Any:
        key = f"mlflow-{len(self.runs)}"
        self.runs[key] = {
            "experiment_id": experiment_id,
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
        if self.terminate_error is not None:
            raise self.terminate_error
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
    """A tracking server with experiment "exp" and no run; MLFLOW_TRACKING_URI unset."""
    monkeypatch.setattr(FakeMlflowClient, "experiments", {"exp": "1"})
    monkeypatch.setattr(FakeMlflowClient, "runs", {})
    monkeypatch.setattr(FakeMlflowClient, "uris", [])
    monkeypatch.setattr(FakeMlflowClient, "terminate_error", None)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    fake_module(monkeypatch, "mlflow", MlflowClient=FakeMlflowClient)
    metric = lambda key, value, timestamp, step: types.SimpleNamespace(  # noqa: E731
        key=key, value=value, timestamp=timestamp, step=step
    )
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
    fake_mlflow: type[FakeMlflowClient], caplog: pytest.LogCaptureFixture
) -> None:
    first = mlflow_life(0, range(1, 6), ExitCode.STOPPED)
    (run,) = fake_mlflow.runs.values()
    assert run["name"] == JOB_ID and run["params"] == {"train.lr": "0.1"} and run["status"] == "SCHEDULED"
    assert run["experiment_id"] == fake_mlflow.experiments["exp"]
    # Life 2 resumes at 5, logs 6-9 and dies (a kill: no close) with only checkpoint 6 committed.
    second = MlflowTracker(TrackingConfig(backend="mlflow", project="exp"), JOB_ID, 5, {})
    assert second.run_id == first.run_id and run["status"] == "RUNNING"
    for step in range(6, 10):
        second.log(step, {"train/loss": 1.0 / step})
    with caplog.at_level(logging.INFO, logger="training"):
        third = mlflow_life(6, range(7, 17), ExitCode.COMPLETED)
    assert tracking_lines(caplog) == [
        "tracking: steps 7-9 are in the run already (logged by the life that wrote them); "
        "logging from step 10"
    ]
    assert third.run_id == first.run_id and len(fake_mlflow.runs) == 1
    assert [m.step for m in run["metrics"]] == list(range(1, 17))
    assert run["status"] == "FINISHED"


def test_an_mlflow_life_that_fails_marks_the_run_failed(fake_mlflow: type[FakeMlflowClient]) -> None:
    mlflow_life(0, range(1, 3), ExitCode.FAILED)
    assert [run["status"] for run in fake_mlflow.runs.values()] == ["FAILED"]


def test_mlflow_points_carry_their_value_and_the_wall_clock_time_in_milliseconds(
    fake_mlflow: type[FakeMlflowClient],
) -> None:
    before = int(time.time() * 1000)
    mlflow_life(0, range(1, 4), ExitCode.COMPLETED)
    after = int(time.time() * 1000) + 1
    (run,) = fake_mlflow.runs.values()
    assert [(m.key, m.step, m.value) for m in run["metrics"]] == [
        ("train/loss", step, 1.0 / step) for step in (1, 2, 3)
    ]
    assert all(before <= m.timestamp <= after for m in run["metrics"]), [m.timestamp for m in run["metrics"]]


def test_an_mlflow_run_goes_to_tracking_uri_else_mlflow_tracking_uri_else_mlflows_default(
    fake_mlflow: type[FakeMlflowClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    tracking = TrackingConfig(backend="mlflow", project="exp")
    MlflowTracker(tracking, JOB_ID, 0, {})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5001")
    MlflowTracker(tracking, JOB_ID, 0, {})
    MlflowTracker(TrackingConfig(backend="mlflow", project="exp", uri="http://127.0.0.1:5000"), JOB_ID, 0, {})
    assert fake_mlflow.uris == [None, "http://127.0.0.1:5001", "http://127.0.0.1:5000"]


def test_an_mlflow_run_of_a_new_project_creates_its_experiment_and_is_found_there_again(
    fake_mlflow: type[FakeMlflowClient],
) -> None:
    tracking = TrackingConfig(backend="mlflow", project="cifar-sweeps")
    first = MlflowTracker(tracking, JOB_ID, 0, {})
    assert set(fake_mlflow.experiments) == {"exp", "cifar-sweeps"}
    second = MlflowTracker(tracking, JOB_ID, 0, {})
    (run,) = fake_mlflow.runs.values()
    assert second.run_id == first.run_id
    assert run["experiment_id"] == fake_mlflow.experiments["cifar-sweeps"]
    assert run["tags"] == {"trainstack.run_id": JOB_ID}
    # The same job id in the other experiment is another run.
    other = MlflowTracker(TrackingConfig(backend="mlflow", project="exp"), JOB_ID, 0, {})
    assert other.run_id != first.run_id and len(fake_mlflow.runs) == 2


def test_an_mlflow_run_a_life_died_in_before_its_first_step_is_logged_from_step_1(
    fake_mlflow: type[FakeMlflowClient], caplog: pytest.LogCaptureFixture
) -> None:
    """Life 1 created the run and was killed before step 1: life 2 (restored step 0) skips nothing, and a
    life resumed exactly at the run's last step says nothing about skipping."""
    MlflowTracker(TrackingConfig(backend="mlflow", project="exp"), JOB_ID, 0, {})
    with caplog.at_level(logging.INFO, logger="training"):
        mlflow_life(0, range(1, 4), ExitCode.STOPPED)
        mlflow_life(3, range(4, 6), ExitCode.COMPLETED)
    (run,) = fake_mlflow.runs.values()
    assert [m.step for m in run["metrics"]] == [1, 2, 3, 4, 5]
    assert not [line for line in tracking_lines(caplog) if "already" in line]


def test_a_failed_status_update_leaves_the_lifes_outcome_and_says_which_run(
    fake_mlflow: type[FakeMlflowClient], caplog: pytest.LogCaptureFixture
) -> None:
    fake_mlflow.terminate_error = ConnectionError("connection refused")
    with caplog.at_level(logging.WARNING, logger="training"):
        tracker = mlflow_life(0, range(1, 3), ExitCode.FAILED)
    assert tracking_lines(caplog) == [
        f"tracking: could not mark MLflow run {tracker.run_id} FAILED: connection refused"
    ]


def test_open_tracker_opens_the_mlflow_run_with_the_configs_params_once(
    fake_mlflow: type[FakeMlflowClient], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tracking = TrackingConfig(backend="mlflow", project="exp")
    params = {"train": {"lr": 0.1, "epochs": 2}}
    with caplog.at_level(logging.INFO, logger="training"):
        first = open_tracker(
            tracking, run=JOB_ID, restored_step=0, output_dir=tmp_path, is_main=True, params=params
        )
        first.log(1, {"train/loss": 1.0})
        first.close(ExitCode.STOPPED)
        second = open_tracker(tracking, run=JOB_ID, restored_step=1, output_dir=tmp_path, is_main=True)
        second.log(1, {"train/loss": 5.0})  # already in the run
        second.log(2, {"train/loss": 0.5})
        second.close(ExitCode.COMPLETED)
    (run,) = fake_mlflow.runs.values()
    assert run["name"] == JOB_ID and run["tags"] == {"trainstack.run_id": JOB_ID}
    assert run["params"] == {"train.lr": "0.1", "train.epochs": "2"}
    assert [(m.step, m.value) for m in run["metrics"]] == [(1, 1.0), (2, 0.5)]
    assert run["status"] == "FINISHED"
    assert tracking_lines(caplog) == [
        f"tracking: mlflow run {JOB_ID}, from step 1",
        f"tracking: mlflow run {JOB_ID}, resumed after step 1",
    ]
    assert list(tmp_path.iterdir()) == []


class FakeWandbRun:
    """A wandb Run: `step` is the next step it takes, lower ones it drops."""

    def __init__(self, history: list[tuple[int, dict[str, float]]], resumed: bool, **init: Any) -> None:
        self.init = init
        self.id = init["id"]
        self.history = history
        self.resumed = resumed
        self.step = history[-1][0] + 1 if history else 0
        self.ended: list[str] = []
        self.finish_error: Exception | None = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        assert step >= self.step, "W&B drops a step lower than the run's"
        self.history.append((step, dict(metrics)))
        self.step = step + 1

    def mark_preempting(self) -> None:
        self.ended.append("preempting")

    def finish(self, exit_code: int) -> None:
        if self.finish_error is not None:
            raise self.finish_error
        self.ended.append(f"finish {exit_code}")


class FakeWandb:
    """wandb.init over what W&B keeps: each run's logged steps and metrics, by run id."""

    def __init__(self) -> None:
        self.runs: dict[str, list[tuple[int, dict[str, float]]]] = {}
        self.lives: list[FakeWandbRun] = []

    def init(self, **kwargs: Any) -> FakeWandbRun:
        assert kwargs["resume"] == "allow"
        resumed = kwargs["id"] in self.runs
        self.lives.append(FakeWandbRun(self.runs.setdefault(kwargs["id"], []), resumed, **kwargs))
        return self.lives[-1]

    def steps(self, run: str) -> list[int]:
        return [step for step, _ in self.runs[run]]


@pytest.fixture()
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> FakeWandb:
    wandb = FakeWandb()
    fake_module(monkeypatch, "wandb", init=wandb.init)
    return wandb


def test_a_wandb_run_resumes_by_the_job_id_and_skips_the_steps_it_has(fake_wandb: FakeWandb) -> None:
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
    assert fake_wandb.steps(JOB_ID) == list(range(1, 17))
    assert {
        (r.init["id"], r.init["resume"], r.init["project"], r.init["entity"]) for r in fake_wandb.lives
    } == {(JOB_ID, "allow", "p", "team")}
    runs = fake_wandb.lives
    assert runs[0].ended == ["preempting", "finish 0"] and runs[2].ended == ["finish 0"]


def test_open_tracker_opens_the_wandb_run_named_after_the_job_with_the_config_and_its_metrics(
    fake_wandb: FakeWandb, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tracking = TrackingConfig(backend="wandb", project="p")
    params = {"train": {"lr": 0.1}}
    with caplog.at_level(logging.INFO, logger="training"):
        first = open_tracker(
            tracking, run=JOB_ID, restored_step=0, output_dir=tmp_path, is_main=True, params=params
        )
        first.log(1, {"train/loss": 0.5, "train/lr": 0.1})
        first.close(ExitCode.STOPPED)
        second = open_tracker(tracking, run=JOB_ID, restored_step=1, output_dir=tmp_path, is_main=True)
        second.log(2, {"train/loss": 0.25})
        second.close(ExitCode.COMPLETED)
    assert fake_wandb.runs == {JOB_ID: [(1, {"train/loss": 0.5, "train/lr": 0.1}), (2, {"train/loss": 0.25})]}
    first_init, second_init = (life.init for life in fake_wandb.lives)
    assert first_init["name"] == JOB_ID and first_init["config"] == params
    assert first_init["entity"] is None, "empty: the API key's default entity"
    assert second_init["config"] == {}
    assert tracking_lines(caplog) == [
        f"tracking: wandb run {JOB_ID}, from step 1",
        f"tracking: wandb run {JOB_ID}, resumed after step 1",
    ]


def test_a_wandb_run_a_life_died_in_before_its_first_step_is_logged_from_step_1(
    fake_wandb: FakeWandb,
) -> None:
    tracking = TrackingConfig(backend="wandb", project="p")
    WandbTracker(tracking, JOB_ID, 0, {})  # killed before step 1: the run exists, empty
    second = WandbTracker(tracking, JOB_ID, 0, {})
    for step in (1, 2):
        second.log(step, {"train/loss": 1.0})
    assert fake_wandb.lives[1].resumed and fake_wandb.steps(JOB_ID) == [1, 2]


def test_a_failed_wandb_life_finishes_the_run_with_its_exit_code_and_a_finish_error_is_one_warning(
    fake_wandb: FakeWandb, caplog: pytest.LogCaptureFixture
) -> None:
    tracking = TrackingConfig(backend="wandb", project="p")
    failed = WandbTracker(tracking, JOB_ID, 0, {})
    failed.close(ExitCode.DATA_ERROR)
    assert fake_wandb.lives[0].ended == [f"finish {int(ExitCode.DATA_ERROR)}"]
    unreachable = WandbTracker(tracking, JOB_ID, 0, {})
    fake_wandb.lives[1].finish_error = ConnectionError("upload stalled")
    with caplog.at_level(logging.WARNING, logger="training"):
        unreachable.close(ExitCode.COMPLETED)
    assert tracking_lines(caplog) == [f"tracking: could not finish W&B run {JOB_ID}: upload stalled"]


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
    # TensorBoard reads a run's files in name order: <time>.<host>.<pid>.<writer number>. Two lives in one
    # second of one process (here, never on instances) would sort by that number as text, "10" before "9":
    # the count starts again so that the lives' files sort in the order they were written.
    from tensorboard.summary.writer import event_file_writer

    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(0))
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


def test_a_tensorboard_run_under_an_s3_tracking_uri_has_its_files_right_under_that_prefix(
    aws: Any, tmp_path: Path
) -> None:
    """`s3://bucket/prefix/` and the run folder join with one slash: S3 keys are not paths, and a `//` would
    be another prefix, which TensorBoard pointed at `s3://bucket/prefix` would not show."""
    import boto3

    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket="team-runs")
    life = open_tracker(
        TrackingConfig(backend="tensorboard", uri="s3://team-runs/tensorboard/"),
        run=JOB_ID,
        restored_step=0,
        output_dir=tmp_path,
        is_main=True,
    )
    life.log(1, {"train/loss": 1.0})
    life.close(ExitCode.COMPLETED)
    keys = [item["Key"] for item in s3.list_objects_v2(Bucket="team-runs").get("Contents", [])]
    # The life's event file (and the folder's marker object that TensorBoard's makedirs writes), nothing else.
    assert {key.rsplit("/", 1)[0] for key in keys} == {f"tensorboard/{JOB_ID}"}, keys
    assert any(key.startswith(f"tensorboard/{JOB_ID}/events.out.tfevents.") for key in keys), keys
    assert [step for step, _ in scalars(f"s3://team-runs/tensorboard/{JOB_ID}", "train/loss")] == [1]


def test_an_mlflow_life_killed_during_an_evaluation_leaves_no_gap_the_replay_logs_its_eval(
    fake_mlflow: type[FakeMlflowClient],
) -> None:
    """Skipped per metric, not per step: a life killed while it evaluated epoch 1 logged step 8's train/*
    points but not its eval/*; the next life, resumed at checkpoint 6, replays steps 7-8 and its eval/* at
    step 8 reaches the run once, its train/* points not a second time."""
    tracking = TrackingConfig(backend="mlflow", project="exp")
    killed = MlflowTracker(tracking, JOB_ID, 0, {})
    for step in range(1, 9):
        killed.log(step, {"train/loss": 1.0 / step})
    replay = MlflowTracker(tracking, JOB_ID, 6, {})
    for step in (7, 8):
        replay.log(step, {"train/loss": 1.0 / step})
    replay.log(8, {"eval/accuracy": 0.5, "eval/loss": 0.7})
    (run,) = fake_mlflow.runs.values()
    assert [m.step for m in run["metrics"] if m.key == "eval/accuracy"] == [8]
    assert [m.step for m in run["metrics"] if m.key == "train/loss"] == list(range(1, 9))

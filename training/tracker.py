"""One experiment-tracker run per job, whatever the number of lives: TensorBoard, MLflow or W&B.

The run's id is the job's id (TRAINSTACK_JOB_ID), so every life of a job writes into the same run, and each
life logs from the step its checkpoint restored. A step is in the run once: the steps a dead life logged after
its last checkpoint are trained again by the next life, and

- TensorBoard: the new life's event file starts with `purge_step = restored step + 1`, which makes every
  reader (TensorBoard, EventAccumulator) drop the older files' events from that step on: the replay replaces
  them;
- MLflow and W&B keep what they already have: on resume the tracker reads the run's last logged step
  (MLflow: the metric histories; W&B: `run.step`) and skips the replayed steps up to it (the trainer resumes
  bit for bit, so they are the same numbers).

Metrics are flushed before every checkpoint is written, so nothing up to a checkpoint's step can be lost with
the life that wrote it (no gap). Only the main rank logs. The backends' packages are imported only when the
config asks for one, so the trainer starts without any of them installed.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from training.config import ConfigError, TrackingConfig
from training.metrics import EpochResult
from trainstack_job.contract import ExitCode, JobEnv

log = logging.getLogger("training")

# The MLflow tag that names a run's job: the run is found again by it on every life.
RUN_ID_TAG = "trainstack.run_id"
# backend -> (module imported, package to install)
PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow-skinny"),
    "wandb": ("wandb", "wandb"),
}


class Tracker(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def flush(self) -> None: ...

    def close(self, exit_code: int) -> None: ...


class NoTracker:
    """Tracking off, or a rank other than the main one: nothing logged, nothing imported."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self, exit_code: int) -> None:
        pass


NO_TRACKER = NoTracker()


def run_id(env: Mapping[str, str], checkpoint_dir: str) -> str:
    """The job's id under the agent; by hand, one per checkpoint folder (the lives of a job by hand share it):
    `local-<hash of its absolute path>`. Both are lowercase letters, digits and dashes, which every backend
    takes as a run id."""
    job_id = env.get(JobEnv.JOB_ID.value, "").strip()
    if job_id:
        return job_id
    digest = hashlib.sha256(str(Path(checkpoint_dir).resolve()).encode()).hexdigest()[:12]
    return f"local-{digest}"


def progress_metrics(loss: float, report: Mapping[str, Any], lr: float) -> dict[str, float]:
    """What each progress line says (training/progress.py), as the run's charts."""
    return {
        "train/loss": loss,
        "train/samples_per_s": float(report["samples_per_s"]),
        "train/data_wait_fraction": float(report["data_wait_fraction"]),
        "train/lr": lr,
    }


def epoch_metrics(result: EpochResult) -> dict[str, float]:
    return {
        "epoch/train_loss": result.train_loss,
        "epoch/train_accuracy": result.train_accuracy,
        "eval/loss": result.val_loss,
        "eval/accuracy": result.val_accuracy,
    }


def flat_params(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"train": {"lr": 0.1}}` -> `{"train.lr": "0.1"}`: MLflow's params are flat strings."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(flat_params(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)
    return flat


def _installed(backend: str) -> str:
    """The backend's module name (not imported), or a one-line ConfigError naming the key and the install."""
    module, package = PACKAGES[backend]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            [
                f"tracking.backend: {backend} needs the {package} package, which {sys.executable} lacks; "
                f"pip install {package} there, or set tracking.backend: none"
            ]
        )
    return module


def _require(backend: str) -> Any:
    return importlib.import_module(_installed(backend))


def open_tracker(
    tracking: TrackingConfig,
    *,
    run: str,
    restored_step: int,
    output_dir: Path,
    is_main: bool,
    params: Mapping[str, Any] | None = None,
) -> Tracker:
    """The run `run` of the configured backend, resumed after `restored_step` (0: a fresh job)."""
    if tracking.backend == "none":
        return NO_TRACKER
    if not is_main:
        # Every rank refuses a missing package at the same point, so no rank waits in a collective for the
        # main rank that has stopped.
        _installed(tracking.backend)
        return NO_TRACKER
    if tracking.backend == "tensorboard":
        tracker: Tracker = TensorBoardTracker(tracking, run, restored_step, output_dir)
    elif tracking.backend == "mlflow":
        tracker = MlflowTracker(tracking, run, restored_step, params or {})
    else:
        tracker = WandbTracker(tracking, run, restored_step, params or {})
    log.info(
        "tracking: %s run %s, %s",
        tracking.backend,
        run,
        f"resumed after step {restored_step}" if restored_step else "from step 1",
    )
    return tracker


def default_tensorboard_root(output_dir: Path, env: Mapping[str, str] | None = None) -> str:
    """Under the agent, the job's results prefix in S3 (TRAINSTACK_RESULTS_URI): event files on the
    instance's disk would die with it at the next spot interruption, and the run would lose every earlier
    life's points. Run by hand: `<output.dir>/tensorboard`."""
    results = (os.environ if env is None else env).get(JobEnv.RESULTS_URI.value, "").strip()
    if results.startswith("s3://"):
        return results.rstrip("/") + "/tensorboard"
    return str(output_dir / "tensorboard")


class TensorBoardTracker:
    """Event files in `<root>/<run>/`, a new file per life; the root is tracking.uri, else the job's results
    in S3, else output.dir/tensorboard (torch's SummaryWriter writes s3:// through TensorBoard's boto3)."""

    def __init__(self, tracking: TrackingConfig, run: str, restored_step: int, output_dir: Path) -> None:
        _require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        root = tracking.uri or default_tensorboard_root(output_dir)
        self.log_dir = f"{root.rstrip('/')}/{run}"
        # Readers drop every event of the earlier files from purge_step on: the steps this life trains again.
        self._writer = SummaryWriter(log_dir=self.log_dir, purge_step=restored_step + 1)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self, exit_code: int) -> None:
        self._writer.close()


class _SkipLogged:
    """Steps up to `last_logged` are already in the run (a dead life's, replayed by this one): skipped."""

    last_logged = 0

    def _new(self, step: int) -> bool:
        return step > self.last_logged


class MlflowTracker(_SkipLogged):
    """The run tagged `trainstack.run_id=<run>` (named <run>) in experiment `tracking.project`, found again on
    every life; `tracking.uri` or MLFLOW_TRACKING_URI says where the server is, and its credentials come
    from the environment (MLFLOW_TRACKING_TOKEN, or _USERNAME/_PASSWORD, through the job's `secrets:`)."""

    # What the trainer logs, read back on resume: per metric, its last step in the run. Per metric, not per
    # step: a life killed during an epoch's evaluation logged that step's train/* but not its eval/*, which
    # the replay logs.
    KEYS = (
        "train/loss",
        "train/samples_per_s",
        "train/data_wait_fraction",
        "train/lr",
        "epoch/train_loss",
        "epoch/train_accuracy",
        "eval/loss",
        "eval/accuracy",
    )

    def __init__(
        self, tracking: TrackingConfig, run: str, restored_step: int, params: Mapping[str, Any]
    ) -> None:
        mlflow = _require("mlflow")
        # Per metric, its last step already in the run (none in a new run).
        self._logged: dict[str, int] = {}
        self._entities = importlib.import_module("mlflow.entities")
        uri = tracking.uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        self._client = mlflow.MlflowClient(tracking_uri=uri)
        experiment = self._client.get_experiment_by_name(tracking.project)
        experiment_id = (
            experiment.experiment_id if experiment else self._client.create_experiment(tracking.project)
        )
        found = self._client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{run}'", max_results=1
        )
        if found:
            self.run_id = found[0].info.run_id
            self._client.update_run(self.run_id, status="RUNNING")
            self._logged = {
                key: max((m.step for m in self._client.get_metric_history(self.run_id, key)), default=0)
                for key in self.KEYS
            }
            self.last_logged = max(self._logged.values())
        else:
            created = self._client.create_run(experiment_id, tags={RUN_ID_TAG: run}, run_name=run)
            self.run_id = created.info.run_id
            params_list = [self._entities.Param(k, v) for k, v in flat_params(params).items()]
            self._client.log_batch(self.run_id, params=params_list)
        if restored_step < self.last_logged:
            log.info(
                "tracking: steps %d-%d are in the run already (logged by the life that wrote them); "
                "logging from step %d",
                restored_step + 1,
                self.last_logged,
                self.last_logged + 1,
            )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        batch = [
            self._entities.Metric(key, float(value), now, step)
            for key, value in metrics.items()
            if step > self._logged.get(key, 0)
        ]
        if batch:
            self._client.log_batch(self.run_id, metrics=batch)  # synchronous: nothing to flush

    def flush(self) -> None:
        pass

    def close(self, exit_code: int) -> None:
        # SCHEDULED: stopped for another life to resume, not finished.
        statuses: dict[int, str] = {ExitCode.COMPLETED: "FINISHED", ExitCode.STOPPED: "SCHEDULED"}
        status = statuses.get(exit_code, "FAILED")
        try:
            self._client.set_terminated(self.run_id, status=status)
        except Exception as exc:  # the life's outcome stands: the next life sets the run RUNNING again
            log.warning("tracking: could not mark MLflow run %s %s: %s", self.run_id, status, exc)


class WandbTracker(_SkipLogged):
    """wandb.init(id=<run>, resume="allow"): the same run on every life; WANDB_API_KEY comes from the job's
    `secrets:`, `tracking.project`/`tracking.entity` say where the run lives."""

    def __init__(
        self, tracking: TrackingConfig, run: str, restored_step: int, params: Mapping[str, Any]
    ) -> None:
        wandb = _require("wandb")
        self._run = wandb.init(
            id=run,
            name=run,
            resume="allow",
            project=tracking.project,
            entity=tracking.entity or None,
            config=dict(params),
        )
        # W&B's step is the next one it takes; a resumed run refuses lower ones, so they are skipped here.
        self.last_logged = max(0, int(self._run.step) - 1) if self._run.resumed else 0

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._new(step):
            self._run.log(dict(metrics), step=step)

    def flush(self) -> None:
        pass  # W&B's own service process uploads in the background

    def close(self, exit_code: int) -> None:
        try:
            if exit_code == ExitCode.STOPPED:
                self._run.mark_preempting()  # W&B shows it as preempted, waiting for its next life
            ended_well = exit_code in (ExitCode.COMPLETED, ExitCode.STOPPED)
            self._run.finish(exit_code=0 if ended_well else exit_code)
        except Exception as exc:  # the life's outcome stands whatever W&B says
            log.warning("tracking: could not finish W&B run %s: %s", self._run.id, exc)

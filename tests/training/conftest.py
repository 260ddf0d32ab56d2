"""Fixtures for trainer tests: a generated image dataset and a helper that runs `python -m training`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.once import built_once
from training.sample_data import write_dataset

if TYPE_CHECKING:
    from tests.forkserver import ForkServer
    from tests.training.lives import Lives

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "training" / "configs" / "tiny.yaml"

# Small and fast on 2 shared cores: 8 steps per epoch, 2 micro-batches per step, a 6 MB checkpoint.
FAST = [
    "model.name=mobilenet_v3_small",
    "train.epochs=2",
    "train.batch_size=16",
    "train.micro_batch_size=8",
    "train.log_every_steps=1",
    "checkpoint.every_steps=3",
    "checkpoint.every_minutes=0",
]
STEPS_PER_EPOCH = 8  # 4 classes x 32 images / batch 16
TOTAL_STEPS = 16


# Every trainer a test starts; `reap_trainers` kills the ones still running when the test ends.
_STARTED: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def reap_trainers() -> Iterator[None]:
    """No trainer outlives its test, whatever way the test ended (failure, timeout)."""
    yield
    while _STARTED:
        process = _STARTED.pop()
        if process.poll() is None:
            process.kill()
            process.communicate()


@dataclass(frozen=True)
class Dataset:
    train_dir: Path
    val_dir: Path

    def overrides(self) -> list[str]:
        return [f"data.train_dir={self.train_dir}", f"data.val_dir={self.val_dir}"]


@pytest.fixture(scope="session")
def image_folders(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    def build(root: Path) -> None:
        write_dataset(root, classes=4, train_per_class=32, val_per_class=8, size=32)

    root = built_once(tmp_path_factory, "images", build)
    return Dataset(root / "train", root / "val")


@dataclass(frozen=True)
class Run:
    """Paths of one job (shared by every life of it) and the command that runs a life."""

    root: Path
    args: list[str]
    # `python -m <module>`: the trainer alone, or bootstrap.standalone, which gives it the agent's persister
    # for checkpoint.uri.
    module: str = "training"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def output(self) -> Path:
        return self.root / "output"

    @property
    def model(self) -> Path:
        return self.output / "model.pt"

    def command(self) -> list[str]:
        return [sys.executable, "-m", self.module, "--config", str(TINY), *self.args]

    def popen(self, env: dict[str, str] | None = None, fault: str = "") -> subprocess.Popen[str]:
        full_env = {**os.environ, **(env or {})}
        full_env.pop("TRAINSTACK_FAULT", None)
        if fault:
            full_env["TRAINSTACK_FAULT"] = fault
        process = subprocess.Popen(
            self.command(),
            cwd=REPO,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        _STARTED.append(process)
        return process

    def life(
        self, env: dict[str, str] | None = None, fault: str = "", timeout: float = 180
    ) -> tuple[int, str]:
        process = self.popen(env, fault)
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # A hung life fails the test and never outlives it.
            process.kill()
            output, _ = process.communicate()
            pytest.fail(f"{self.root}: a trainer life ran past {timeout}s\n{output[-3000:]}")
        return process.returncode, output


MakeRun = Callable[..., Run]


def make_run_factory(base: Path, dataset: Dataset) -> MakeRun:
    counter = iter(range(10**6))

    def make(*extra: str, name: str = "") -> Run:
        root = base / (name or f"run{next(counter)}")
        args = [
            *dataset.overrides(),
            *FAST,
            f"checkpoint.dir={root / 'checkpoints'}",
            f"output.dir={root / 'output'}",
            *extra,
        ]
        return Run(root, args)

    return make


@pytest.fixture()
def make_run(tmp_path: Path, image_folders: Dataset) -> MakeRun:
    return make_run_factory(tmp_path, image_folders)


@pytest.fixture(scope="session")
def baseline(tmp_path_factory: pytest.TempPathFactory, image_folders: Dataset) -> Run:
    """One uninterrupted run of the FAST job: the reference every interrupted run must match bit for bit.
    One per session, not one per xdist worker: a trainer life is ~5 s of CPU."""

    def build(folder: Path) -> None:
        code, output = make_run_factory(folder, image_folders)(name="run").life()
        assert code == 0, output

    return make_run_factory(built_once(tmp_path_factory, "baseline", build), image_folders)(name="run")


@pytest.fixture()
def lives(fork_server: ForkServer) -> Iterator[Lives]:
    """Trainer lives forked from the worker's fork server (tests/conftest.py, tests/training/lives.py); none
    outlives its test."""
    from tests.training.lives import Lives

    started = Lives(fork_server)
    yield started
    started.reap()


def hash_counter(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The files training/streaming.py hashes from now on, in order."""
    import training.streaming

    hashed: list[Path] = []
    real_hash = training.streaming.sha256_file

    def counted(path: Path) -> str:
        hashed.append(path)
        return real_hash(path)

    monkeypatch.setattr(training.streaming, "sha256_file", counted)
    return hashed

"""The training loop's own housekeeping, in-process: what it sets up is out of the garbage collector's full
collections for the run, and what its steps make is still collected."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest

from tests.training.conftest import Dataset
from training.config import load_config
from training.loop import Trainer

from .conftest import FAST, TINY


def in_a_generation(obj: object) -> bool:
    """Whether a full collection walks `obj` (a frozen object is in none of the three generations)."""
    return any(any(o is obj for o in gc.get_objects(generation)) for generation in range(3))


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_set_up_is_frozen_before_the_first_step_and_a_steps_garbage_cycle_is_still_collected(
    image_folders: Dataset, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, collector_alone: None
) -> None:
    # collector_alone: the worker's own freezing (demo/collector.py) would otherwise freeze the model at the
    # loop's gc.collect() too, and this test would pass without the loop's freeze.
    config = load_config(
        TINY,
        [
            *image_folders.overrides(),
            *FAST,
            "train.epochs=1",
            "train.deterministic=false",  # global torch flags stay as the worker's other tests expect them
            f"checkpoint.dir={tmp_path}/checkpoints",
            f"output.dir={tmp_path}/output",
        ],
    )
    trainer = Trainer(config)
    seen: dict[str, Any] = {}
    step = Trainer._optimizer_step

    def first_step_looks(self: Trainer, *args: Any) -> Any:
        if not seen:
            seen["model walked by full collections"] = in_a_generation(self.raw_model)
            seen["optimizer walked by full collections"] = in_a_generation(self.optimizer)
            garbage = _Cycle()
            seen["cycle"] = weakref.ref(garbage)
            seen["cycle walked by full collections"] = in_a_generation(garbage)
            del garbage
        return step(self, *args)

    monkeypatch.setattr(Trainer, "_optimizer_step", first_step_looks)
    assert in_a_generation(trainer.raw_model), "before the loop starts, the model is not frozen yet"

    assert trainer.run() == 0

    assert seen["model walked by full collections"] is False
    assert seen["optimizer walked by full collections"] is False
    assert seen["cycle walked by full collections"] is True
    gc.collect()
    assert seen["cycle"]() is None, "a cycle made during the steps was not collected"

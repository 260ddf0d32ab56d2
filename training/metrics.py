"""Training history kept in every checkpoint and written as `metrics.json` at the end."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class EpochResult:
    epoch: int
    step: int
    train_loss: float
    train_accuracy: float
    val_loss: float
    val_accuracy: float


@dataclass
class History:
    epochs: list[EpochResult] = field(default_factory=list)
    # (step, mean training loss since the previous log line): the fine-grained curve.
    step_losses: list[tuple[int, float]] = field(default_factory=list)

    def to_state(self) -> dict[str, Any]:
        return {
            "epochs": [asdict(e) for e in self.epochs],
            "step_losses": [list(p) for p in self.step_losses],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> History:
        return cls(
            epochs=[EpochResult(**e) for e in state.get("epochs", [])],
            step_losses=[(int(s), float(v)) for s, v in state.get("step_losses", [])],
        )


def write_metrics(path: Path, history: History, summary: dict[str, Any]) -> None:
    final = asdict(history.epochs[-1]) if history.epochs else {}
    document = {
        "final": final,
        **summary,
        "epochs": [asdict(e) for e in history.epochs],
        "step_losses": [list(p) for p in history.step_losses],
    }
    path.write_text(json.dumps(document, indent=2))

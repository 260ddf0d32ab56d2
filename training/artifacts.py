"""The job's results: model.pt, metrics.json and the curves PNG, in output.dir and output.uri."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.metrics import History, write_metrics
from training.plots import plot_curves
from training.store import S3Prefix

log = logging.getLogger(__name__)

MODEL = "model.pt"
METRICS = "metrics.json"
CURVES = "curves.png"


def write_artifacts(
    model: nn.Module, history: History, summary: dict[str, Any], output_dir: Path, output_uri: str
) -> list[Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    tmp = output_dir / f".{MODEL}.tmp"
    # A plain state_dict: loadable with torch.load(weights_only=True) and no trainstack code.
    torch.save(model.state_dict(), tmp)
    tmp.replace(output_dir / MODEL)
    write_metrics(output_dir / METRICS, history, summary)
    plot_curves(history, output_dir / CURVES)
    paths = [output_dir / MODEL, output_dir / METRICS, output_dir / CURVES]
    if output_uri:
        remote = S3Prefix(output_uri)
        for path in paths:
            remote.upload_file(path, path.name)
        log.info("results uploaded to %s", remote.uri)
    return paths

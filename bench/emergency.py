"""Emergency checkpoint: save and confirm a ResNet-50 + momentum checkpoint to a local S3 endpoint."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import boto3
import torch
from torchvision import models

from bootstrap.standalone import s3_persister
from training.checkpoint import CheckpointManager


def emergency_checkpoint_seconds() -> dict[str, float]:
    from demo.moto_server import moto_server

    saved_env = {
        k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    }
    try:
        with moto_server() as endpoint:
            os.environ |= {
                "AWS_ENDPOINT_URL": endpoint,
                "AWS_ACCESS_KEY_ID": "bench",
                "AWS_SECRET_ACCESS_KEY": "bench",
                "AWS_DEFAULT_REGION": "us-east-1",
            }
            boto3.client("s3").create_bucket(Bucket="bench")
            model = models.resnet50(num_classes=1000)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            model(torch.randn(2, 3, 64, 64)).sum().backward()
            optimizer.step()  # allocates the momentum buffers: the ~200 MB a real checkpoint carries
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            with tempfile.TemporaryDirectory() as tmp:
                # A trainer run by hand with checkpoint.uri: the agent's persister (bootstrap/standalone.py).
                manager = CheckpointManager(
                    Path(tmp), "s3://bench/checkpoints", keep=2, persister_factory=s3_persister
                )
                started = time.perf_counter()
                directory = manager.save(state, step=1, epoch=0, world_size=1, config_hash="bench")
                saved = time.perf_counter()
                manager.wait_uploaded()
                confirmed = time.perf_counter()
                size = (directory / "state.pt").stat().st_size
                manager.close()
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return {
        "checkpoint_mb": size / 1e6,
        "local_save_s": saved - started,
        "upload_confirmed_s": confirmed - saved,
        "total_s": confirmed - started,
    }

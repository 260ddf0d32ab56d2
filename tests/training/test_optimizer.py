"""The optimizer recipe: fused kernels where torch has them, no weight decay on norms and biases."""

from __future__ import annotations

import torch
from torch import nn

from training.config import Config
from training.loop import make_optimizer


def test_cpu_optimizers_are_fused_and_split_decay_groups() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    for name in ("sgd", "adamw"):
        config = Config()
        config.train.optimizer = name
        optimizer = make_optimizer(model, config)
        assert all(group["fused"] for group in optimizer.param_groups)
        decay, no_decay = optimizer.param_groups
        assert [p.ndim for p in decay["params"]] == [4] and no_decay["weight_decay"] == 0.0
        model(torch.randn(2, 3, 8, 8)).sum().backward()
        optimizer.step()

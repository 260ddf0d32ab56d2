"""Build any torchvision classification model by name, sized to the data's classes."""

from __future__ import annotations

import torch
from torch import nn
from torchvision import models

from training.config import ConfigError


def classification_model_names() -> list[str]:
    return sorted(models.list_models(module=models))


def build_model(name: str, num_classes: int, device: torch.device) -> nn.Module:
    """A freshly initialised model on `device`; channels_last on GPU, where convolutions run faster in it."""
    if name not in classification_model_names():
        raise ConfigError(
            [
                f"model.name: {name!r} is not a torchvision classification model; try resnet50, resnet18, "
                "mobilenet_v3_small, efficientnet_b0, convnext_tiny or vit_b_16"
            ]
        )
    model = models.get_model(name, weights=None, num_classes=num_classes)
    model = model.to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    return model

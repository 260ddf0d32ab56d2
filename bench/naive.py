"""The seeds' training loop, as written there: the baseline the trainer must beat."""

from __future__ import annotations

import time

import torch
from torch import nn
from torchvision import datasets, models
from torchvision import transforms as T  # noqa: N812 - the seeds' spelling

from training.data import IMAGENET_MEAN, IMAGENET_STD


def naive_step_ends(
    train_dir: str, model_name: str, image_size: int, batch_size: int, steps: int
) -> list[float]:
    """fp32, default DataLoader (no workers), no checkpoints: `time.perf_counter()` at the end of each of
    `steps` optimizer steps. Nothing but taking the timestamp is added to the seeds' loop."""
    torch.manual_seed(0)
    transform = T.Compose(
        [
            T.RandomResizedCrop(image_size),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    dataset = datasets.ImageFolder(train_dir, transform=transform)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True)
    model = models.get_model(model_name, weights=None, num_classes=len(dataset.classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    model.train()
    ends: list[float] = []
    while len(ends) < steps:
        for images, targets in loader:
            loss = criterion(model(images), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ends.append(time.perf_counter())
            if len(ends) == steps:
                break
    return ends

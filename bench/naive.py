"""The seeds' training loop, as written there: the baseline the trainer must beat."""

from __future__ import annotations

import time

import torch
from torch import nn
from torchvision import datasets, models
from torchvision import transforms as T  # noqa: N812 - the seeds' spelling

from training.data import IMAGENET_MEAN, IMAGENET_STD


def naive_samples_per_s(
    train_dir: str, model_name: str, image_size: int, batch_size: int, steps: int
) -> float:
    """fp32, default DataLoader (no workers), no checkpoints: samples/s over `steps` optimizer steps."""
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
    done = samples = 0
    started = time.perf_counter()
    while done < steps:
        for images, targets in loader:
            loss = criterion(model(images), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            samples += len(images)
            done += 1
            if done == steps:
                break
    return samples / (time.perf_counter() - started)

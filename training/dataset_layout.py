"""Check the ImageFolder layout of the train and val folders before any heavy import.

Also the one definition of a hidden path, shared by the trainer, the instance's dataset sync and
`trainstack data push`; this module imports nothing heavy (no torch) so all three can use it.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePath, PurePosixPath

from training.config import Config, ConfigError
from trainstack_job.shards import INDEX_NAME

# Folders that archivers and notebooks leave next to the data: never images, never classes.
HIDDEN_FOLDERS = frozenset({"__MACOSX"})


class BadDataError(Exception):
    """Too many images of a split cannot be decoded: a permanent problem of the dataset (exit 65)."""


def is_hidden(relative_path: str | PurePath) -> bool:
    """Whether any component of a path relative to the dataset (or an S3 key under `data/`) is hidden:
    starts with '.' (.DS_Store, .ipynb_checkpoints, ._x.jpg AppleDouble files) or is `__MACOSX`."""
    text = str(relative_path).replace(os.sep, "/")
    return any(
        (part.startswith(".") and part not in {".", ".."}) or part in HIDDEN_FOLDERS
        for part in PurePosixPath(text).parts
    )


def class_folders(root: Path) -> list[str]:
    return sorted(entry.name for entry in os.scandir(root) if entry.is_dir() and not is_hidden(entry.name))


def _has_visible_file(folder: Path) -> bool:
    for _current, dirs, files in os.walk(folder, followlinks=True):
        # Pruned in place: os.walk then skips hidden folders such as .ipynb_checkpoints entirely.
        dirs[:] = [d for d in dirs if not is_hidden(d)]
        if any(not is_hidden(name) for name in files):
            return True
    return False


def check_data_dirs(config: Config) -> None:
    """Fail with one line per problem if the train/val folders are missing, empty or disagree on classes."""
    problems = data_dir_problems(config)
    if problems:
        raise ConfigError(problems)


def data_dir_problems(config: Config) -> list[str]:
    """One line per problem with the train/val folders: missing, empty or disagreeing on classes."""
    problems: list[str] = []
    found: dict[str, list[str]] = {}
    for key, value in (("data.train_dir", config.data.train_dir), ("data.val_dir", config.data.val_dir)):
        if not value:
            problems.append(f"{key}: not set; point it at an ImageFolder directory (<dir>/<class>/<image>)")
            continue
        root = Path(value)
        if value.startswith("s3://") or (root / INDEX_NAME).is_file():
            continue  # a shard index: training/streaming.py reads and checks it when the trainer opens it
        if not root.is_dir():
            problems.append(f"{key}: {root} does not exist; create it or fix the path")
            continue
        classes = class_folders(root)
        if not classes:
            problems.append(f"{key}: {root} has no class folders; expected {root}/<class>/<image files>")
            continue
        empty = [c for c in classes if not _has_visible_file(root / c)]
        if empty:
            problems.append(f"{key}: class folders without images in {root}: {', '.join(empty)}")
        found[key] = classes
    if len(found) == 2 and found["data.train_dir"] != found["data.val_dir"]:
        only_train = sorted(set(found["data.train_dir"]) - set(found["data.val_dir"]))
        only_val = sorted(set(found["data.val_dir"]) - set(found["data.train_dir"]))
        problems.append(
            "data.val_dir: class folders differ from data.train_dir "
            f"(only in train: {only_train or '-'}; only in val: {only_val or '-'}); make them match"
        )
    return problems

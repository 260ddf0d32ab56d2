"""Write a small generated ImageFolder dataset (coloured shapes per class) for demos, tests and benches."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

# numpy, not torch: the demo and `python -m training.sample_data` need no 2 s torch import to write PNGs.


def _image(label: int, num_classes: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """Noise with a square whose colour and position depend on the class: learnable, not trivial."""
    image = rng.integers(0, 96, (size, size, 3), dtype=np.uint8)
    side = size // 2
    offset = int(rng.integers(0, size - side + 1))
    hue = np.array([(label * 97) % 256, (label * 53 + 80) % 256, (label * 151 + 160) % 256], dtype=np.uint8)
    top = (label * size // max(1, num_classes)) % (size - side + 1)
    image[top : top + side, offset : offset + side] = hue
    return image


def write_dataset(
    root: Path,
    *,
    classes: int = 4,
    train_per_class: int = 64,
    val_per_class: int = 16,
    size: int = 32,
    seed: int = 0,
) -> tuple[Path, Path]:
    """Create root/train/<class>/*.png and root/val/<class>/*.png; returns (train_dir, val_dir)."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for label in range(classes):
            folder = root / split / f"class_{label}"
            folder.mkdir(parents=True, exist_ok=True)
            for index in range(count):
                Image.fromarray(_image(label, classes, size, rng)).save(folder / f"{index:05d}.png")
    return root / "train", root / "val"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m training.sample_data", description=__doc__)
    parser.add_argument("root", type=Path, help="output folder; gets train/ and val/")
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--train-per-class", type=int, default=64)
    parser.add_argument("--val-per-class", type=int, default=16)
    parser.add_argument("--size", type=int, default=32)
    args = parser.parse_args()
    train, val = write_dataset(
        args.root,
        classes=args.classes,
        train_per_class=args.train_per_class,
        val_per_class=args.val_per_class,
        size=args.size,
    )
    print(f"wrote {train} and {val}")


if __name__ == "__main__":
    main()

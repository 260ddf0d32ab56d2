"""Config errors: one line per problem, naming the key and the fix; the CLI exits 2 without a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.training.conftest import REPO, TINY, Dataset
from training.config import ConfigError, load_config
from training.dataset_layout import check_data_dirs


def problems(*overrides: str, config: Path = TINY) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(config, list(overrides))
    return caught.value.problems


def test_tiny_and_default_configs_are_valid() -> None:
    tiny = load_config(TINY)
    assert tiny.train.deterministic and tiny.data.image_size == 32
    default = load_config(REPO / "training" / "configs" / "default.yaml")
    assert default.model.name == "resnet50" and default.train.micro_batch_size == "auto"


def test_dotted_overrides_are_typed_like_yaml() -> None:
    config = load_config(
        TINY, ["train.lr=0.01", "train.batch_size=auto", "checkpoint.uri=s3://b/p", "output.uri="]
    )
    assert config.train.lr == 0.01 and config.train.batch_size == "auto"
    assert config.checkpoint.uri == "s3://b/p" and config.output.uri == ""


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.lrr=0.1", "train.lrr: unknown key"),
        ("trian.lr=0.1", "trian: unknown section"),
        ("train.epochs=three", "train.epochs: expected int, got 'three'"),
        ("train.batch_size=large", "train.batch_size: expected int or 'auto'"),
        ("train.precision=fp8", "train.precision: expected 'auto' | 'bf16' | 'fp16' | 'fp32'"),
        ("train.deterministic=maybe", "train.deterministic: expected bool"),
        ("train.lr=0", "train.lr: must be positive"),
        ("checkpoint.keep=0", "checkpoint.keep: must be at least 1"),
        ("checkpoint.uri=bucket/prefix", "checkpoint.uri: must look like s3://bucket/prefix"),
        ("model=resnet18", "model: must be a mapping"),
    ],
)
def test_each_bad_value_is_one_line_naming_the_key(override: str, expected: str) -> None:
    found = problems(override)
    assert len(found) == 1 and found[0].startswith(expected), found
    assert "\n" not in found[0]


def test_every_problem_is_reported_at_once() -> None:
    assert len(problems("train.lrr=1", "train.epochs=x", "data.image_size=4")) == 3


def test_missing_and_empty_data_dirs_name_the_key(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    config = load_config(
        TINY, [f"data.train_dir={tmp_path / 'missing'}", f"data.val_dir={tmp_path / 'empty'}"]
    )
    with pytest.raises(ConfigError) as caught:
        check_data_dirs(config)
    assert caught.value.problems == [
        f"data.train_dir: {tmp_path / 'missing'} does not exist; create it or fix the path",
        f"data.val_dir: {empty} has no class folders; expected {empty}/<class>/<image files>",
    ]


def test_class_folders_differing_between_train_and_val(tmp_path: Path) -> None:
    for split, classes in (("train", ["cat", "dog"]), ("val", ["cat", "fox"])):
        for name in classes:
            (tmp_path / split / name).mkdir(parents=True)
            (tmp_path / split / name / "0.png").write_bytes(b"")
    config = load_config(TINY, [f"data.train_dir={tmp_path / 'train'}", f"data.val_dir={tmp_path / 'val'}"])
    with pytest.raises(ConfigError) as caught:
        check_data_dirs(config)
    [problem] = caught.value.problems
    assert problem.startswith("data.val_dir: class folders differ from data.train_dir")
    assert "only in train: ['dog']" in problem and "only in val: ['fox']" in problem


def test_cli_prints_one_line_per_problem_and_exits_2(image_folders: Dataset) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "training",
            "--config",
            str(TINY),
            *image_folders.overrides(),
            "train.epochs=-1",
            "train.optimiser=adam",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2, result.stderr
    assert lines[0] == "config error: train.epochs: must be at least 1, got -1" or lines[1].startswith(
        "config error: train.epochs"
    )
    assert any(line.startswith("config error: train.optimiser: unknown key") for line in lines)
    assert "Traceback" not in result.stderr


def test_cli_names_a_missing_config_file(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "training", "--config", str(tmp_path / "nope.yaml")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    missing = tmp_path / "nope.yaml"
    assert result.stderr.strip() == (
        f"config error: --config {missing}: cannot read (No such file or directory); "
        "pass an existing YAML file"
    )

"""The trainer's YAML config: typed sections, dotted overrides and one-line errors naming the key."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from trainstack_job.text import not_utf8


class ConfigError(Exception):
    """One or more config problems, each a single line naming the key and the fix.

    `config` is what could be built anyway (bad keys at their defaults), so later checks such as the data
    folders can still run and every problem is reported in one run.
    """

    def __init__(self, problems: list[str], config: Config | None = None) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems
        self.config = config


@dataclass
class DataConfig:
    train_dir: str = ""
    val_dir: str = ""
    image_size: int = 224
    # "auto": on GPU every core but one per process, up to 8; on CPU an eighth of the cores.
    num_workers: int | Literal["auto"] = "auto"
    prefetch_factor: int = 4
    # Undecodable images of a split tolerated (skipped and listed in metrics.json) before the job stops with
    # exit 65: a fraction of the split's size.
    max_bad_fraction: float = 0.01
    # A split given as shards (train_dir / val_dir naming a shard index, s3://.../train/shards.json, or a
    # folder holding one: `trainstack data push DIR --format shards`) is streamed through this cache: empty
    # = $TRAINSTACK_DATA_CACHE (the agent's NVMe scratch), else the temp folder. Bounded at cache_gb; the
    # next read_ahead_shards shards are fetched (at once, up to 4) while the current ones are read (a network
    # limited per connection wants more: python -m bench.streaming --throttle-mbps); samples are shuffled
    # within windows of shuffle_window_shards shards (part of the order: changing it changes the run).
    cache_dir: str = ""
    cache_gb: float = 50.0
    read_ahead_shards: int = 2
    shuffle_window_shards: int = 4


@dataclass
class ModelConfig:
    name: str = "resnet50"
    compile: bool = False


@dataclass
class TrainConfig:
    epochs: int = 10
    # The global batch (all ranks, all accumulation steps): what the optimisation sees.
    batch_size: int | Literal["auto"] = 256
    # Per-device batch; "auto" = the largest that fits, gradient accumulation makes up the rest.
    micro_batch_size: int | Literal["auto"] = "auto"
    lr: float = 0.1
    optimizer: Literal["sgd", "adamw"] = "sgd"
    momentum: float = 0.9
    weight_decay: float = 5e-5
    label_smoothing: float = 0.1
    warmup_epochs: float = 1.0
    seed: int = 0
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    deterministic: bool = False
    log_every_steps: int = 50
    # Processes on this machine: "auto" = one per visible GPU (1 on CPU); each is a DDP rank.
    processes: int | Literal["auto"] = "auto"
    stop_file: str = ""
    checkpoint_request_file: str = ""
    # A standby's gate: while this file exists at start, the trainer warms up (model, optimizer, loaders, one
    # batch) and waits; once it is gone it restores the newest checkpoint and trains. Empty: no gate.
    start_gate_file: str = ""


@dataclass
class CheckpointConfig:
    dir: str = "checkpoints"
    uri: str = ""
    every_steps: int = 1000
    # "auto": Young/Daly from the measured checkpoint time and the interruption rate (checkpoint_policy.py).
    every_minutes: float | Literal["auto"] = 15.0
    keep: int = 3


@dataclass
class OutputConfig:
    dir: str = "output"
    uri: str = ""


@dataclass
class TrackingConfig:
    """An experiment tracker (training/tracker.py): one run per job, resumed by every life. Off by default."""

    backend: Literal["none", "tensorboard", "mlflow", "wandb"] = "none"
    # TensorBoard: the log folder or s3:// prefix (default: the job's results in S3 under the agent, else
    # <output.dir>/tensorboard); MLflow: the tracking URI (default MLFLOW_TRACKING_URI). W&B takes its server
    # from its own WANDB_* variables.
    uri: str = ""
    # The MLflow experiment or the W&B project.
    project: str = "trainstack"
    # The W&B entity (team); empty: the API key's default.
    entity: str = ""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def optimisation_hash(self) -> str:
        """Hash of what decides the numbers (not paths or worker counts), recorded in each manifest."""
        relevant = self.to_dict()
        relevant["data"] = {"image_size": self.data.image_size}
        if self.data.shuffle_window_shards != DataConfig.shuffle_window_shards:
            # A streamed dataset's order depends on it (training/streaming.py); at its default it is left out,
            # so the hash of every config from before streaming stays what its checkpoints recorded.
            relevant["data"]["shuffle_window_shards"] = self.data.shuffle_window_shards
        relevant["train"] = {
            k: v
            for k, v in relevant["train"].items()
            if k
            not in {
                "log_every_steps",
                "stop_file",
                "checkpoint_request_file",
                "start_gate_file",
                "device",
                "processes",
            }
        }
        del relevant["checkpoint"], relevant["output"], relevant["tracking"]
        return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


_SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "output": OutputConfig,
    "tracking": TrackingConfig,
}


def _type_name(annotation: Any) -> str:
    if get_origin(annotation) is Literal:
        return " | ".join(repr(a) for a in get_args(annotation))
    if get_origin(annotation) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(annotation))
    return getattr(annotation, "__name__", str(annotation))


def _coerce(value: Any, annotation: Any) -> tuple[bool, Any]:
    """(ok, value) for value against a field annotation; ints are accepted where floats are."""
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        for arm in get_args(annotation):
            ok, coerced = _coerce(value, arm)
            if ok:
                return True, coerced
        return False, value
    if origin is Literal:
        return value in get_args(annotation), value
    if annotation is bool:
        return isinstance(value, bool), value
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if annotation is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if annotation is str:
        if value is None:
            return True, ""
        return isinstance(value, str), value
    raise TypeError(f"unsupported config annotation {annotation!r}")


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[leaf] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`train.lr=0.01` -> ("train.lr", 0.01); the value is read as YAML so types match the file's."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError([f"override {text!r}: expected dotted.key=value, e.g. train.epochs=3"])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def apply_overrides(tree: Mapping[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of `tree` with `dotted.key=value` overrides set, exactly as the command line applies them."""
    result = copy.deepcopy(dict(tree))
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(result, key, value)
    return result


def _did_you_mean(section: str, key: str) -> str:
    # A key put in the wrong section (`train.image_size`), else the closest key, this section's first.
    for name, cls in _SECTIONS.items():
        if any(f.name == key for f in dataclasses.fields(cls)):
            return f"did you mean {name}.{key}?"
    for candidates in (
        [section],
        [name for name in _SECTIONS if name != section],
    ):
        dotted = {
            f.name: f"{name}.{f.name}" for name in candidates for f in dataclasses.fields(_SECTIONS[name])
        }
        close = difflib.get_close_matches(key, dotted, n=1)
        if close:
            return f"did you mean {dotted[close[0]]}?"
    return ""


def build_config(tree: dict[str, Any]) -> Config:
    """Validate a nested mapping into a Config; every problem is collected, one line each."""
    problems: list[str] = []
    sections: dict[str, Any] = {}
    for name, value in tree.items():
        if name not in _SECTIONS:
            close = difflib.get_close_matches(str(name), _SECTIONS, n=1)
            hint = f"did you mean {close[0]}?" if close else f"expected one of {', '.join(_SECTIONS)}"
            problems.append(f"{name}: unknown section; {hint}")
        elif value is not None and not isinstance(value, dict):
            problems.append(f"{name}: must be a mapping of keys, got {type(value).__name__}")
    for name, cls in _SECTIONS.items():
        given = tree.get(name) or {}
        if not isinstance(given, dict):
            continue
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = {}
        for key, value in given.items():
            if key not in hints:
                hint = _did_you_mean(name, str(key)) or f"known keys in {name}: {', '.join(hints)}"
                problems.append(f"{name}.{key}: unknown key; {hint}")
                continue
            ok, coerced = _coerce(value, hints[key])
            if not ok:
                problems.append(
                    f"{name}.{key}: expected {_type_name(hints[key])}, got {value!r} ({type(value).__name__})"
                )
                continue
            kwargs[key] = coerced
        sections[name] = cls(**kwargs)
    # Keys with a bad type keep their default here, so range checks still report every other problem.
    config = Config(**sections)
    problems.extend(_check_values(config))
    if problems:
        raise ConfigError(problems, config)
    return config


def _check_values(c: Config) -> list[str]:
    problems: list[str] = []

    def at_least(key: str, value: float, low: float) -> None:
        if value < low:
            problems.append(f"{key}: must be at least {low:g}, got {value:g}")

    at_least("data.image_size", c.data.image_size, 16)
    at_least("data.prefetch_factor", c.data.prefetch_factor, 1)
    if not 0 <= c.data.max_bad_fraction <= 1:
        problems.append(f"data.max_bad_fraction: must be in [0, 1], got {c.data.max_bad_fraction:g}")
    if isinstance(c.data.num_workers, int):
        at_least("data.num_workers", c.data.num_workers, 0)
    if c.data.cache_gb <= 0:
        problems.append(f"data.cache_gb: must be positive, got {c.data.cache_gb:g}")
    at_least("data.read_ahead_shards", c.data.read_ahead_shards, 0)
    at_least("data.shuffle_window_shards", c.data.shuffle_window_shards, 1)
    at_least("train.epochs", c.train.epochs, 1)
    if isinstance(c.train.batch_size, int):
        at_least("train.batch_size", c.train.batch_size, 1)
    if isinstance(c.train.processes, int):
        at_least("train.processes", c.train.processes, 1)
    if isinstance(c.train.micro_batch_size, int):
        at_least("train.micro_batch_size", c.train.micro_batch_size, 1)
    if c.train.lr <= 0:
        problems.append(f"train.lr: must be positive, got {c.train.lr:g}")
    at_least("train.weight_decay", c.train.weight_decay, 0)
    at_least("train.warmup_epochs", c.train.warmup_epochs, 0)
    at_least("train.log_every_steps", c.train.log_every_steps, 1)
    if not 0 <= c.train.label_smoothing < 1:
        problems.append(f"train.label_smoothing: must be in [0, 1), got {c.train.label_smoothing:g}")
    at_least("checkpoint.every_steps", c.checkpoint.every_steps, 0)
    if c.checkpoint.every_minutes != "auto":
        at_least("checkpoint.every_minutes", c.checkpoint.every_minutes, 0)
    at_least("checkpoint.keep", c.checkpoint.keep, 1)
    for key, uri in (("checkpoint.uri", c.checkpoint.uri), ("output.uri", c.output.uri)):
        if uri and not is_s3_uri(uri):
            problems.append(
                f"{key}: must look like s3://bucket/prefix (bucket: 3-63 lowercase letters, digits, dots, "
                f"hyphens), got {uri!r}"
            )
    if not c.checkpoint.dir:
        problems.append("checkpoint.dir: must name a local directory")
    if not c.output.dir:
        problems.append("output.dir: must name a local directory")
    problems.extend(_start_gate_problems(c))
    return problems


def _start_gate_problems(c: Config) -> list[str]:
    """The gate must be a file of its own outside the folders the agent rewrites: the agent refreshes
    checkpoint.dir and uploads output.dir while the trainer waits, and a gate that is also the stop or
    checkpoint-request file would stop or checkpoint a standby (which must never write a step)."""
    gate = c.train.start_gate_file
    if not gate:
        return []
    problems: list[str] = []
    path = Path(os.path.normpath(gate))
    for key, other in (
        ("train.stop_file", c.train.stop_file),
        ("train.checkpoint_request_file", c.train.checkpoint_request_file),
    ):
        if other and Path(os.path.normpath(other)) == path:
            problems.append(
                f"train.start_gate_file: {gate!r} is also {key}; give the start gate a file of its own"
            )
    for key, folder in (("checkpoint.dir", c.checkpoint.dir), ("output.dir", c.output.dir)):
        if folder and path.is_relative_to(os.path.normpath(folder)):
            problems.append(
                f"train.start_gate_file: {gate!r} is inside {key} {folder!r}, which the agent rewrites; "
                "put the gate beside it"
            )
    return problems


# S3's bucket naming rules, checked here so a malformed URI is a config error and not a failed upload later.
_S3_URI = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$")


def is_s3_uri(uri: str) -> bool:
    return bool(_S3_URI.match(uri))


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a YAML config file, apply `dotted.key=value` overrides and validate the result."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            [f"--config {path}: cannot read ({exc.strerror}); pass an existing YAML file"]
        ) from None
    except UnicodeDecodeError as exc:  # a file saved in another encoding, or not text at all
        raise ConfigError([f"--config {path}: {not_utf8(exc)}"]) from None
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError([f"--config {path}{where}: not valid YAML; fix the syntax there"]) from None
    if not isinstance(tree, dict):
        raise ConfigError([f"--config {path}: must be a YAML mapping of sections (data, model, train, ...)"])
    return build_config(apply_overrides(tree, overrides or []))

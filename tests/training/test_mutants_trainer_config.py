"""The trainer's config (training/config.py): the promises `make mutate` found untested. Every bad value is
one line naming the key and its bound, a value at the bound is accepted, every problem is reported in one
run, and the optimisation hash a checkpoint records changes with what decides the numbers and only with
that. In memory: no trainer, no data folders, no S3."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from training.config import (
    Config,
    ConfigError,
    TrainConfig,
    apply_overrides,
    build_config,
    is_s3_uri,
    load_config,
    parse_override,
)


def refusals(tree: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as refused:
        build_config(tree)
    return refused.value.problems


def section(dotted: str, value: Any) -> dict[str, Any]:
    name, key = dotted.split(".")
    return {name: {key: value}}


# key, the last value accepted at its bound, the first refused beyond it, and the one line refusing it.
BOUNDS = [
    ("data.image_size", 16, 15, "data.image_size: must be at least 16, got 15"),
    ("data.prefetch_factor", 1, 0, "data.prefetch_factor: must be at least 1, got 0"),
    ("data.num_workers", 0, -1, "data.num_workers: must be at least 0, got -1"),
    ("data.max_bad_fraction", 0, -0.01, "data.max_bad_fraction: must be in [0, 1], got -0.01"),
    ("data.max_bad_fraction", 1, 1.01, "data.max_bad_fraction: must be in [0, 1], got 1.01"),
    ("train.epochs", 1, 0, "train.epochs: must be at least 1, got 0"),
    ("train.batch_size", 1, 0, "train.batch_size: must be at least 1, got 0"),
    ("train.processes", 1, 0, "train.processes: must be at least 1, got 0"),
    ("train.micro_batch_size", 1, 0, "train.micro_batch_size: must be at least 1, got 0"),
    ("train.lr", 1e-9, 0, "train.lr: must be positive, got 0"),
    ("train.lr", 1e-9, -0.5, "train.lr: must be positive, got -0.5"),
    ("train.weight_decay", 0, -0.5, "train.weight_decay: must be at least 0, got -0.5"),
    ("train.warmup_epochs", 0, -1, "train.warmup_epochs: must be at least 0, got -1"),
    ("train.log_every_steps", 1, 0, "train.log_every_steps: must be at least 1, got 0"),
    ("train.label_smoothing", 0, -0.1, "train.label_smoothing: must be in [0, 1), got -0.1"),
    ("train.label_smoothing", 0.99, 1, "train.label_smoothing: must be in [0, 1), got 1"),
    ("checkpoint.every_steps", 0, -1, "checkpoint.every_steps: must be at least 0, got -1"),
    ("checkpoint.every_minutes", 0, -1, "checkpoint.every_minutes: must be at least 0, got -1"),
    ("checkpoint.keep", 1, 0, "checkpoint.keep: must be at least 1, got 0"),
    ("checkpoint.uri", "s3://abc", "s3://ab", "checkpoint.uri: must look like s3://bucket/prefix (bucket: "
     "3-63 lowercase letters, digits, dots, hyphens), got 's3://ab'"),
    ("output.uri", "s3://" + "b" * 63 + "/results", "s3://" + "b" * 64 + "/results", "output.uri: must look "
     "like s3://bucket/prefix (bucket: 3-63 lowercase letters, digits, dots, hyphens), got 's3://" + "b" * 64
     + "/results'"),
    ("checkpoint.dir", "c", "", "checkpoint.dir: must name a local directory"),
    ("output.dir", "o", "", "output.dir: must name a local directory"),
]  # fmt: skip


@pytest.mark.parametrize("key, edge, beyond, line", BOUNDS)
def test_a_value_at_its_bound_is_accepted_and_one_beyond_is_one_line_naming_the_key(
    key: str, edge: Any, beyond: Any, line: str
) -> None:
    name, field = key.split(".")
    assert getattr(getattr(build_config(section(key, edge)), name), field) == edge
    assert refusals(section(key, beyond)) == [line]


@pytest.mark.parametrize(
    "key", ["data.num_workers", "train.batch_size", "train.processes", "train.micro_batch_size"]
)
def test_auto_is_accepted_where_a_count_can_be_chosen_for_the_machine(key: str) -> None:
    name, field = key.split(".")
    assert getattr(getattr(build_config(section(key, "auto")), name), field) == "auto"


def test_checkpoints_every_auto_minutes_are_accepted() -> None:
    assert build_config(section("checkpoint.every_minutes", "auto")).checkpoint.every_minutes == "auto"


def test_every_bad_value_is_reported_in_one_run_with_what_could_be_built() -> None:
    tree = {
        "data": {"image_size": 8, "max_bad_fraction": 2},
        "train": {"epochs": 0, "lr": -1, "label_smoothing": 1.5, "log_every_steps": 0, "seed": "x"},
        "checkpoint": {"keep": 0, "dir": ""},
        "output": {"dir": "", "uri": "http://x"},
    }
    with pytest.raises(ConfigError) as refused:
        build_config(tree)
    assert refused.value.problems == [
        "train.seed: expected int, got 'x' (str)",
        "data.image_size: must be at least 16, got 8",
        "data.max_bad_fraction: must be in [0, 1], got 2",
        "train.epochs: must be at least 1, got 0",
        "train.lr: must be positive, got -1",
        "train.log_every_steps: must be at least 1, got 0",
        "train.label_smoothing: must be in [0, 1), got 1.5",
        "checkpoint.keep: must be at least 1, got 0",
        "output.uri: must look like s3://bucket/prefix (bucket: 3-63 lowercase letters, digits, dots, "
        "hyphens), got 'http://x'",
        "checkpoint.dir: must name a local directory",
        "output.dir: must name a local directory",
    ]
    assert str(refused.value) == "\n".join(refused.value.problems)
    # What could be built anyway: the bad seed at its default, the other keys as given, for the folder checks.
    built = refused.value.config
    assert built is not None and built.train.seed == 0 and built.data.image_size == 8


def test_every_section_and_key_is_checked_past_a_bad_one() -> None:
    assert refusals({"data": [1], "train": {"lrr": 1, "epochs": 0}, "output": {"dir": ""}}) == [
        "data: must be a mapping of keys, got list",
        "train.lrr: unknown key; did you mean train.lr?",
        "train.epochs: must be at least 1, got 0",
        "output.dir: must name a local directory",
    ]


def test_a_section_that_is_not_a_mapping_or_unknown_is_named_once() -> None:
    assert refusals({"train": [1, 2], "data": None}) == ["train: must be a mapping of keys, got list"]
    assert refusals({"zzz": {}}) == [
        "zzz: unknown section; expected one of data, model, train, checkpoint, output"
    ]
    assert refusals({"checkpont": {}}) == ["checkpont: unknown section; did you mean checkpoint?"]


def test_an_unknown_key_names_the_closest_key_of_its_section_first_then_of_the_others() -> None:
    assert refusals(section("checkpoint.kep", 3)) == [
        "checkpoint.kep: unknown key; did you mean checkpoint.keep?"
    ]
    # No close key in train: the closest in another section.
    assert refusals(section("train.prefetch_facter", 3)) == [
        "train.prefetch_facter: unknown key; did you mean data.prefetch_factor?"
    ]
    assert refusals(section("output.zzz", 1)) == ["output.zzz: unknown key; known keys in output: dir, uri"]


def test_values_are_typed_as_the_trainer_uses_them() -> None:
    config = build_config(
        {"train": {"lr": 1, "stop_file": None, "precision": "bf16"}, "data": {"max_bad_fraction": 0}}
    )
    # An integer where a float is expected arrives as a float; null for a path is "no file".
    assert type(config.train.lr) is float and config.train.lr == 1.0
    assert type(config.data.max_bad_fraction) is float
    assert config.train.stop_file == "" and config.train.precision == "bf16"
    # A bool is not a number, and a number is not a bool or a string.
    assert refusals(section("train.epochs", True)) == ["train.epochs: expected int, got True (bool)"]
    assert refusals(section("train.lr", False)) == ["train.lr: expected float, got False (bool)"]
    assert refusals(section("train.deterministic", 1)) == ["train.deterministic: expected bool, got 1 (int)"]
    assert refusals(section("model.name", 5)) == ["model.name: expected str, got 5 (int)"]
    assert refusals(section("checkpoint.every_minutes", "soon")) == [
        "checkpoint.every_minutes: expected float or 'auto', got 'soon' (str)"
    ]


# -- the start gate (a standby's) -----------------------------------------------------------------------


def gate(**train: str) -> dict[str, Any]:
    return {"train": train, "checkpoint": {"dir": "ckpt"}, "output": {"dir": "out"}}


def test_the_start_gate_is_a_file_of_its_own_beside_the_folders_the_agent_rewrites() -> None:
    assert (
        build_config(gate(start_gate_file="ckpt-gate", stop_file="stop")).train.start_gate_file == "ckpt-gate"
    )
    assert refusals(gate(start_gate_file="./stop", stop_file="stop")) == [
        "train.start_gate_file: './stop' is also train.stop_file; give the start gate a file of its own"
    ]
    assert refusals(gate(start_gate_file="ask", checkpoint_request_file="x/../ask")) == [
        "train.start_gate_file: 'ask' is also train.checkpoint_request_file; give the start gate a file of "
        "its own"
    ]
    assert refusals(gate(start_gate_file="ckpt/gate")) == [
        "train.start_gate_file: 'ckpt/gate' is inside checkpoint.dir 'ckpt', which the agent rewrites; put "
        "the gate beside it"
    ]
    assert refusals(gate(start_gate_file="out/./gate")) == [
        "train.start_gate_file: 'out/./gate' is inside output.dir 'out', which the agent rewrites; put the "
        "gate beside it"
    ]


def test_no_start_gate_needs_no_file_of_its_own() -> None:
    assert build_config(gate(stop_file="", checkpoint_request_file="")).train.start_gate_file == ""


# -- overrides and files ---------------------------------------------------------------------------------


def test_an_override_is_read_as_yaml_and_a_malformed_one_names_the_form() -> None:
    assert parse_override(" train.lr = 0.5") == ("train.lr", 0.5)
    assert parse_override("train.stop_file=") == ("train.stop_file", "")
    assert parse_override("train.stop_file=  ") == ("train.stop_file", "")
    assert parse_override("train.stop_file=[open") == ("train.stop_file", "[open")
    assert parse_override("train.batch_size=auto") == ("train.batch_size", "auto")
    assert parse_override("train.stop_file=/tmp/a=b") == ("train.stop_file", "/tmp/a=b")
    for text in ("train.lr", "=3", " =3"):
        with pytest.raises(ConfigError) as refused:
            parse_override(text)
        assert refused.value.problems == [
            f"override {text!r}: expected dotted.key=value, e.g. train.epochs=3"
        ]


def test_overrides_set_nested_keys_on_a_copy() -> None:
    tree: dict[str, Any] = {"train": {"lr": 0.1}, "model": "resnet"}
    result = apply_overrides(tree, ["train.epochs=2", "model.name=vit", "output.dir=o"])
    assert result == {"train": {"lr": 0.1, "epochs": 2}, "model": {"name": "vit"}, "output": {"dir": "o"}}
    assert tree == {"train": {"lr": 0.1}, "model": "resnet"}


def test_a_config_file_that_cannot_be_used_is_one_line_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "absent.yaml"
    broken = tmp_path / "broken.yaml"
    broken.write_text("train:\n  lr: [1\n")
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n")
    for path, line in (
        (missing, f"--config {missing}: cannot read (No such file or directory); pass an existing YAML file"),
        (broken, f"--config {broken} line 3: not valid YAML; fix the syntax there"),
        (listed, f"--config {listed}: must be a YAML mapping of sections (data, model, train, ...)"),
    ):
        with pytest.raises(ConfigError) as refused:
            load_config(path)
        assert refused.value.problems == [line]
    # Not text YAML reads: a control character (no line to point at), another encoding than UTF-8.
    bell = tmp_path / "bell.yaml"
    bell.write_text("train:\n  lr: 1\x07\n")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("# réglages\ntrain: {lr: 1}\n".encode("latin-1"))
    for path, line in (
        (bell, f"--config {bell}: not valid YAML; fix the syntax there"),
        (latin, f"--config {latin}: not UTF-8 text (byte 3: invalid continuation byte); save it as UTF-8"),
    ):
        with pytest.raises(ConfigError) as refused:
            load_config(path)
        assert refused.value.problems == [line]
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty, ["train.epochs=2"]) == Config(train=TrainConfig(epochs=2))


def test_s3_uris_follow_the_bucket_naming_rules() -> None:
    assert is_s3_uri("s3://my-bucket.v2/prefix/") and is_s3_uri("s3://abc")
    for uri in (
        "s3://-bucket/p",
        "s3://bucket-/p",
        "s3://Bucket/p",
        "s3://bu_cket",
        "S3://bucket",
        "s3://bucket:p",
    ):
        assert not is_s3_uri(uri), uri


# -- what a checkpoint records ------------------------------------------------------------------------------


def test_to_dict_holds_every_section_and_builds_the_same_config() -> None:
    config = build_config({"train": {"lr": 0.5, "batch_size": "auto"}, "model": {"name": "vit_b_16"}})
    tree = config.to_dict()
    assert list(tree) == ["data", "model", "train", "checkpoint", "output"]
    assert tree["train"]["lr"] == 0.5 and tree["model"] == {"name": "vit_b_16", "compile": False}
    assert build_config(tree) == config


# Recorded in every checkpoint's manifest; a resume compares it with its own and warns when they differ, so
# the hash of a config must not change between versions (a checkpoint written before would warn).
DEFAULT_HASH = "36d47e45b238890a"


def test_the_default_configs_hash_is_stable_across_versions() -> None:
    assert Config().optimisation_hash() == DEFAULT_HASH


# What does not decide the numbers: paths, worker counts, logging, the agent's files, the device.
SAME = [
    "data.train_dir=/elsewhere",
    "data.val_dir=/v",
    "data.num_workers=3",
    "data.prefetch_factor=9",
    "data.max_bad_fraction=0.5",
    "train.log_every_steps=7",
    "train.stop_file=/s",
    "train.checkpoint_request_file=/c",
    "train.start_gate_file=/g",
    "train.device=cpu",
    "train.processes=4",
    "checkpoint.dir=/d",
    "checkpoint.uri=s3://bucket/p",
    "checkpoint.every_steps=5",
    "checkpoint.every_minutes=auto",
    "checkpoint.keep=9",
    "output.dir=/o",
    "output.uri=s3://bucket/o",
]
# What does: one per key.
DIFFERENT = [
    "data.image_size=64",
    "model.name=vit_b_16",
    "model.compile=true",
    "train.epochs=11",
    "train.batch_size=128",
    "train.micro_batch_size=8",
    "train.lr=0.2",
    "train.optimizer=adamw",
    "train.momentum=0.5",
    "train.weight_decay=0.1",
    "train.label_smoothing=0",
    "train.warmup_epochs=2",
    "train.seed=1",
    "train.precision=bf16",
    "train.deterministic=true",
]


@pytest.mark.parametrize("override", SAME)
def test_what_does_not_decide_the_numbers_leaves_the_hash_alone(override: str) -> None:
    assert build_config(apply_overrides({}, [override])).optimisation_hash() == DEFAULT_HASH


@pytest.mark.parametrize("override", DIFFERENT)
def test_what_decides_the_numbers_changes_the_hash(override: str) -> None:
    changed = build_config(apply_overrides({}, [override])).optimisation_hash()
    assert changed != DEFAULT_HASH and len(changed) == 16 and int(changed, 16) >= 0

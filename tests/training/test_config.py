"""The trainer's config (training/config.py) and its errors: one line per problem, naming the key and the fix;
the CLI exits 2 without a traceback. At the end, the config in memory: bounds, overrides, the hash."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import MotoServer
from tests.training.conftest import REPO, TINY, Dataset
from training.__main__ import remote_uri_problems
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
        TINY, ["train.lr=0.01", "train.batch_size=auto", "checkpoint.uri=s3://job/p", "output.uri="]
    )
    assert config.train.lr == 0.01 and config.train.batch_size == "auto"
    assert config.checkpoint.uri == "s3://job/p" and config.output.uri == ""


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.lrr=0.1", "train.lrr: unknown key; did you mean train.lr?"),
        ("train.epocs=3", "train.epocs: unknown key; did you mean train.epochs?"),
        ("train.image_size=64", "train.image_size: unknown key; did you mean data.image_size?"),
        ("train.zzz=1", "train.zzz: unknown key; known keys in train: epochs, batch_size"),
        ("trian.lr=0.1", "trian: unknown section; did you mean train?"),
        ("train.epochs=three", "train.epochs: expected int, got 'three'"),
        ("train.batch_size=large", "train.batch_size: expected int or 'auto'"),
        ("train.precision=fp8", "train.precision: expected 'auto' | 'bf16' | 'fp16' | 'fp32'"),
        ("train.deterministic=maybe", "train.deterministic: expected bool"),
        ("train.lr=0", "train.lr: must be positive"),
        ("checkpoint.keep=0", "checkpoint.keep: must be at least 1"),
        ("checkpoint.uri=bucket/prefix", "checkpoint.uri: must look like s3://bucket/prefix"),
        ("output.uri=s3://", "output.uri: must look like s3://bucket/prefix"),
        ("output.uri=s3:/job/results", "output.uri: must look like s3://bucket/prefix"),
        ("output.uri=s3://Job_Bucket/results", "output.uri: must look like s3://bucket/prefix"),
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


def _trainer(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m training --config TINY args` that also reports whether torch was imported by the end."""
    script = textwrap.dedent(
        f"""
        import sys
        from training.__main__ import main
        code = main({["--config", str(TINY), *args]!r})
        print("torch imported:", "torch" in sys.modules)
        sys.exit(code)
        """
    )
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


def test_config_and_data_folder_problems_are_reported_in_one_run(
    tmp_path: Path, image_folders: Dataset
) -> None:
    missing = tmp_path / "missing"
    result = _trainer(
        "train.epocs=3",
        f"data.train_dir={missing}",
        f"data.val_dir={image_folders.val_dir}",
        "data.image_size=4",
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "config error: train.epocs: unknown key; did you mean train.epochs?",
        "config error: data.image_size: must be at least 16, got 4",
        f"config error: data.train_dir: {missing} does not exist; create it or fix the path",
    ]
    assert result.stdout.strip() == "torch imported: False"


def test_a_key_with_a_bad_value_is_reported_once_not_again_as_a_missing_folder(
    image_folders: Dataset,
) -> None:
    result = _trainer("data.train_dir=5", f"data.val_dir={image_folders.val_dir}")
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["config error: data.train_dir: expected str, got 5 (int)"]


def test_a_missing_output_bucket_is_a_config_error_before_torch_is_imported(
    aws: MotoServer, image_folders: Dataset
) -> None:
    import boto3

    boto3.client("s3").create_bucket(Bucket="job")
    result = _trainer(
        *image_folders.overrides(),
        "checkpoint.uri=s3://job/checkpoints",
        "output.uri=s3://no-such-bucket/results",
        env=aws.env(),
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "config error: output.uri: bucket no-such-bucket does not exist (s3://no-such-bucket/results); "
        "create it or point output.uri at an existing bucket"
    ]
    assert result.stdout.strip() == "torch imported: False"


def test_a_missing_checkpoint_bucket_is_named_too(aws: MotoServer, image_folders: Dataset) -> None:
    result = _trainer(*image_folders.overrides(), "checkpoint.uri=s3://gone/checkpoints", env=aws.env())
    assert result.returncode == 2
    assert result.stderr.startswith("config error: checkpoint.uri: bucket gone does not exist")


def test_a_denied_bucket_names_the_key_and_the_permissions() -> None:
    import boto3
    from botocore.stub import Stubber

    client = boto3.client("s3", endpoint_url="http://127.0.0.1:9")
    config = load_config(TINY, ["output.uri=s3://theirs/results"])
    with Stubber(client) as stub:
        stub.add_client_error("list_objects_v2", "AccessDenied", "Access Denied", 403)
        [problem] = remote_uri_problems(config, client)
    assert problem.startswith("output.uri: access to s3://theirs/results denied (AccessDenied); allow")
    assert problem.endswith("or fix output.uri")


def test_an_unreachable_s3_is_a_transient_failure_in_one_line(image_folders: Dataset) -> None:
    # A port bound here and not listening: connections are refused at once, and while the socket is open
    # no other process can take the port and answer.
    with socket.socket() as reserved:
        reserved.bind(("127.0.0.1", 0))
        env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{reserved.getsockname()[1]}"}
        result = _trainer(*image_folders.overrides(), "output.uri=s3://job/results", env=env)
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith("error: output.uri: could not check s3://job/results (")
    assert line.endswith("a network or credentials problem, the next start retries")
    assert result.stdout.strip() == "torch imported: False"


def test_a_checkpoint_s3_refuses_at_restore_is_one_line_not_a_traceback(
    image_folders: Dataset, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run by hand with checkpoint.uri, a restore S3 refuses (bootstrap/persist.py: CheckpointRefusedError)
    ends the trainer with its one line naming the object and the fix, exit 1, as the agent reports it."""
    import training.loop
    from bootstrap.persist import CheckpointRefusedError
    from training.__main__ import main

    refusal = "s3://job/ckpt/step-5/state.bin: S3 refused to read it (AccessDenied) and no older checkpoint"

    class RefusedTrainer:
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise CheckpointRefusedError(refusal)

    monkeypatch.setattr(training.loop, "Trainer", RefusedTrainer)
    assert main(["--config", str(TINY), *image_folders.overrides()]) == 1
    assert capsys.readouterr().err.splitlines() == [f"error: {refusal}"]


# == the config in memory: each key's bounds, every problem in one run, the hash a checkpoint records ========
# Every bad value is one line naming the key and its bound, a value at the bound is accepted, every problem
# is reported in one run, and the optimisation hash a checkpoint records changes with what decides the
# numbers and only with that. No trainer, no data folders, no S3.


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
        "zzz: unknown section; expected one of data, model, train, checkpoint, output, tracking"
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
    assert list(tree) == ["data", "model", "train", "checkpoint", "output", "tracking"]
    assert tree["train"]["lr"] == 0.5 and tree["model"] == {"name": "vit_b_16", "compile": False}
    assert build_config(tree) == config


# Recorded in every checkpoint's manifest; a resume compares it with its own and warns when they differ, so
# the hash of a config must not change between versions (a checkpoint written before would warn).
DEFAULT_HASH = "36d47e45b238890a"


def test_the_default_configs_hash_is_stable_across_versions() -> None:
    assert Config().optimisation_hash() == DEFAULT_HASH


def test_a_streamed_orders_window_is_in_the_hash_by_its_value_stably_across_versions() -> None:
    """The shuffle window decides a streamed dataset's order: each value hashes apart, and as recorded in
    the checkpoints written with it (pinned, like the default's)."""
    configs = {w: build_config(apply_overrides({}, [f"data.shuffle_window_shards={w}"])) for w in (8, 16)}
    hashes = {window: config.optimisation_hash() for window, config in configs.items()}
    assert hashes == {8: "59c0a20d73dfaa28", 16: "7e27fea9ad3a4b87"}


# What does not decide the numbers: paths, worker counts, logging, the agent's files, the device.
SAME = [
    "data.train_dir=/elsewhere",
    "data.val_dir=/v",
    "data.num_workers=3",
    "data.prefetch_factor=9",
    "data.max_bad_fraction=0.5",
    "data.cache_dir=/cache",
    "data.cache_gb=7",
    "data.read_ahead_shards=5",
    "data.shuffle_window_shards=4",  # its default: configs from before streaming keep their hash
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
    "data.shuffle_window_shards=8",
]


@pytest.mark.parametrize("override", SAME)
def test_what_does_not_decide_the_numbers_leaves_the_hash_alone(override: str) -> None:
    assert build_config(apply_overrides({}, [override])).optimisation_hash() == DEFAULT_HASH


@pytest.mark.parametrize("override", DIFFERENT)
def test_what_decides_the_numbers_changes_the_hash(override: str) -> None:
    changed = build_config(apply_overrides({}, [override])).optimisation_hash()
    assert changed != DEFAULT_HASH and len(changed) == 16 and int(changed, 16) >= 0


@pytest.mark.parametrize(
    "override, line",
    [
        ("data.cache_gb=0", "data.cache_gb: must be positive, got 0"),
        ("data.cache_gb=-1", "data.cache_gb: must be positive, got -1"),
        ("data.read_ahead_shards=-1", "data.read_ahead_shards: must be at least 0, got -1"),
        ("data.shuffle_window_shards=0", "data.shuffle_window_shards: must be at least 1, got 0"),
    ],
)
def test_streaming_settings_out_of_range_are_one_line(override: str, line: str) -> None:
    with pytest.raises(ConfigError) as refused:
        build_config(apply_overrides({}, [override]))
    assert refused.value.problems == [line]


@pytest.mark.parametrize(
    "key, value", [("cache_gb", 0.5), ("read_ahead_shards", 0), ("shuffle_window_shards", 1)]
)
def test_the_smallest_streaming_settings_are_accepted(key: str, value: float) -> None:
    """Half a GB of cache (a small disk), no read-ahead, one shard's window: slow, never wrong."""
    config = build_config(apply_overrides({}, [f"data.{key}={value}"]))
    assert getattr(config.data, key) == value

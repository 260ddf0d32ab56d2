"""Config errors: one line per problem, naming the key and the fix; the CLI exits 2 without a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import MotoServer
from tests.training.conftest import REPO, TINY, Dataset
from training.__main__ import remote_uri_problems
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

"""Caught at preview: the trainer config named by trainstack:trainingConfig is checked by the trainer's own
validator (without torch), and a stack of several instances is refused before anything is created."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.config import REPO_ROOT, StackConfig, StackConfigError, parse_stack_config
from tests.infra.program import example_config, run_stack

TYPO = {"train": {"epocs": 3}}


def _job(tmp_path: Path, job: dict[str, Any]) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _parse(**raw: Any) -> StackConfig:
    return parse_stack_config(raw, region="us-east-1", project="trainstack", stack="dev")


def _problem_lines(**raw: Any) -> list[str]:
    with pytest.raises(StackConfigError) as error:
        _parse(**raw)
    return [line for line in str(error.value).splitlines() if line.startswith("  - ")]


def test_a_typo_in_the_training_config_fails_preview_naming_the_file_the_key_and_the_fix(
    tmp_path: Path,
) -> None:
    job = _job(tmp_path, TYPO)
    assert _problem_lines(trainingConfig=str(job)) == [
        f"  - trainstack:trainingConfig: {job}: train.epocs: unknown key; did you mean train.epochs?"
    ]


def test_a_key_in_the_wrong_section_is_pointed_to_the_right_one(tmp_path: Path) -> None:
    [line] = _problem_lines(trainingConfig=str(_job(tmp_path, {"train": {"image_size": 64}})))
    assert line.endswith("train.image_size: unknown key; did you mean data.image_size?")


def test_every_training_config_problem_is_one_line_in_the_same_report(tmp_path: Path) -> None:
    job = _job(tmp_path, {"train": {"epocs": 3, "lr": -1, "precision": "fp8"}, "modle": {"name": "x"}})
    lines = _problem_lines(trainingConfig=str(job), alertEmail="nope")
    assert len(lines) == 5
    assert sum(f"trainstack:trainingConfig: {job}: " in line for line in lines) == 4
    assert any("modle: unknown section; did you mean model?" in line for line in lines)
    assert any("trainstack:alertEmail:" in line for line in lines)


def test_a_file_inside_the_repository_is_named_relative_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("infra.config.jobs.REPO_ROOT", tmp_path)  # where the job files are read
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "job.yaml").write_text(yaml.safe_dump(TYPO))
    [line] = _problem_lines(trainingConfig="configs/job.yaml")
    assert line.startswith("  - trainstack:trainingConfig: configs/job.yaml: train.epocs: unknown key")


def test_paths_the_agent_overrides_need_not_exist_or_be_valid_at_preview(tmp_path: Path) -> None:
    job = {
        "data": {"train_dir": "/no/such/train", "val_dir": "/no/such/val"},
        "train": {"stop_file": "/no/such/STOP", "checkpoint_request_file": "/no/CHECKPOINT", "processes": 0},
        "checkpoint": {"dir": "", "uri": "not-a-uri"},
        "output": {"dir": "", "uri": "s3://Not_A_Bucket"},
    }
    config = _parse(trainingConfig=str(_job(tmp_path, job)))
    assert config.job == job  # embedded as written: the agent applies its own values on the instance


def test_the_shipped_trainer_configs_pass_preview() -> None:
    for name in ("default.yaml", "tiny.yaml"):
        assert _parse(trainingConfig=f"training/configs/{name}").job


def test_preview_validation_runs_without_importing_torch(tmp_path: Path) -> None:
    job = _job(tmp_path, TYPO)
    script = textwrap.dedent(
        f"""
        import sys
        from infra.config import StackConfigError, parse_stack_config
        try:
            parse_stack_config({{"trainingConfig": {str(job)!r}}}, region="r", project="p", stack="s")
        except StackConfigError as error:
            assert "did you mean train.epochs?" in str(error), error
        else:
            raise SystemExit("the typo was not caught")
        print("torch imported:", "torch" in sys.modules)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "torch imported: False"


def test_the_program_stops_at_preview_on_a_training_config_typo(tmp_path: Path) -> None:
    config = {**example_config(), "trainstack:trainingConfig": str(_job(tmp_path, TYPO))}
    with pytest.raises(StackConfigError, match=r"train\.epocs: unknown key; did you mean train\.epochs\?"):
        run_stack(config)


@pytest.mark.parametrize(("count", "least"), [("2", "1"), ("8", "8")])
def test_several_instances_train_the_built_in_trainer_together(count: str, least: str) -> None:
    config = _parse(instanceCount=count, minNodes=least, trainingConfig="training/configs/tiny.yaml")
    assert (config.instance_count, config.min_nodes, config.multi_node) == (int(count), int(least), True)


def test_a_users_job_on_several_instances_is_refused_with_what_to_do_instead() -> None:
    [line] = _problem_lines(instanceCount="2", job="examples/charlm/job.yaml")
    assert line.startswith(
        "  - trainstack:instanceCount: 2 nodes with trainstack:job: a user's job runs on one"
    )
    assert "multi-GPU type" in line and "g6.12xlarge" in line
    assert line.endswith("(e.g. `pulumi config set trainstack:instanceCount 1`)")


def test_min_nodes_above_the_instance_count_is_refused() -> None:
    [line] = _problem_lines(instanceCount="2", minNodes="3")
    assert line.startswith("  - trainstack:minNodes: must be between 1 and 2, got 3")


def test_a_global_batch_that_cannot_split_over_every_node_count_is_refused_at_preview(tmp_path: Path) -> None:
    job = _job(tmp_path, {"train": {"batch_size": 32}})
    [line] = _problem_lines(instanceCount="3", trainingConfig=str(job))
    assert line.startswith(
        "  - trainstack:minNodes: train.batch_size 32 of trainstack:trainingConfig does not"
    )
    assert "split over 3 node(s)" in line and "use a multiple of 6, or raise minNodes" in line
    assert line.endswith("(e.g. `pulumi config set trainstack:minNodes 3`)")
    assert _parse(instanceCount="2", trainingConfig=str(job)).instance_count == 2


def test_zero_instances_are_refused() -> None:
    [line] = _problem_lines(instanceCount="0")
    assert "trainstack:instanceCount: must be between 1 and 64, got 0" in line

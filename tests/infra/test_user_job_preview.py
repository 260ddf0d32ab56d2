"""`trainstack:job`: a user's job file is validated at preview by the agent's own parser and bundled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from bootstrap.agent_config import AgentConfig
from infra.config import StackConfig, StackConfigError, parse_stack_config
from infra.defaultjob import submit_stack_job
from infra.fleet import agent_config


def _parse(**raw: Any) -> StackConfig:
    return parse_stack_config(raw, region="us-east-1", project="trainstack", stack="dev")


def _problems(**raw: Any) -> list[str]:
    with pytest.raises(StackConfigError) as error:
        _parse(**raw)
    return [line for line in str(error.value).splitlines() if line.startswith("  - ")]


def _job_dir(tmp_path: Path, text: str) -> Path:
    (tmp_path / "train.py").write_text("print('training')\n")
    (tmp_path / "job.yaml").write_text(text)
    return tmp_path / "job.yaml"


def test_a_valid_job_file_reaches_the_jobs_record_and_loads_into_the_agents_config(tmp_path: Path) -> None:
    job = _job_dir(tmp_path, "name: mine\ncommand: [python, train.py, --steps, 10]\nenv: {SEED: 1}\n")
    config = _parse(job=str(job))
    assert config.user_job is not None and config.user_job_dir == tmp_path.resolve()
    # The job travels in its record in the queue; the agent lays the record's `agent` fields over its own.
    fields = submit_stack_job(config, "2026-01-01T00:00:00Z").record["agent"]
    assert fields["user_job"] == {
        "name": "mine",
        "command": ["python", "train.py", "--steps", "10"],
        "workdir": ".",
        "requirements": None,
        "env": {"SEED": "1"},
        "data": {"sync": True},
        "checkpoint": {"keep": 3},
    }
    bootstrap = agent_config(
        config, bucket="trainstack-dev-1", topic_arn="arn:aws:sns:us-east-1:1:t", log_group="/l"
    )
    loaded = AgentConfig.from_mapping({**yaml.safe_load(bootstrap.to_yaml()), **fields})
    assert (loaded.user_job, loaded.job_id, loaded.job_name) == (
        fields["user_job"],
        fields["job_id"],
        "mine",
    )


def test_every_problem_of_a_bad_job_file_fails_preview_naming_the_key(tmp_path: Path) -> None:
    job = _job_dir(
        tmp_path,
        "name: Mine!\ncommand: python train.py\ncheckpoint: {keep: 0}\nenv: {TRAINSTACK_X: 1}\n",
    )
    lines = _problems(job=str(job))
    text = "\n".join(lines)
    for key in ("name:", "command:", "checkpoint.keep:", "env.TRAINSTACK_X:"):
        assert f"trainstack:job: {job}: {key}" in text, key
    assert all(line.count("\n") == 0 for line in lines)


def test_a_missing_requirements_file_or_job_file_fails_preview(tmp_path: Path) -> None:
    job = _job_dir(tmp_path, "name: mine\ncommand: [python, train.py]\nrequirements: requirements.txt\n")
    assert any("requirements.txt does not exist" in line for line in _problems(job=str(job)))
    assert any("cannot read the job file" in line for line in _problems(job=str(tmp_path / "nope.yaml")))


def test_a_typo_in_the_jobs_script_fails_preview_in_one_line_with_the_likely_name(tmp_path: Path) -> None:
    job = _job_dir(tmp_path, "name: mine\ncommand: [python, trian.py]\n")
    assert _problems(job=str(job)) == [
        f"  - trainstack:job: {job}: command: trian.py is not in {tmp_path}; did you mean train.py?"
    ]


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("[python, -u, -W, ignore, trian.py]", "trian.py is not in {dir}; did you mean train.py?"),
        ("[python, -m, trian]", "python -m trian: trian is not in {dir} and the job has no requirements"),
        ("[bash, -eo, pipefail, rn.sh]", "rn.sh is not in {dir}; did you mean run.sh?"),
        ("[sh, lib/rn.sh]", "lib/rn.sh is not in {dir}; did you mean lib/run.sh?"),
        ("[./rn.sh, --fast]", "./rn.sh is not in {dir}"),
    ],
)
def test_a_script_or_module_missing_from_the_jobs_folder_fails_preview(
    tmp_path: Path, command: str, expected: str
) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "run.sh").write_text("echo\n")
    (tmp_path / "run.sh").write_text("echo\n")
    job = _job_dir(tmp_path, f"name: mine\ncommand: {command}\n")
    (line,) = _problems(job=str(job))
    assert line.startswith(f"  - trainstack:job: {job}: command: ")
    assert expected.format(dir=tmp_path) in line


@pytest.mark.parametrize(
    "command",
    [
        "[python, train.py, --steps, 10]",
        "[python3, -u, lib/train.py]",
        "[bash, run.sh]",
        "[./run.sh]",
        '[bash, -c, "python trian.py"]',  # a shell's own code: not parsed
        "[python, -c, 'print(1)']",
        "[python, -m, training, train.epochs=1]",  # the code bundle's packages are on PYTHONPATH
        "[python, -m, torch.distributed.run, --nproc-per-node, '2', train.py]",
        "[python, -m, json.tool]",  # the standard library
        "[python, /opt/elsewhere/train.py]",  # absolute: the instance's business
        "[torchrun, --nproc-per-node, '2', trian.py]",  # a PATH command: its arguments are its own
        "[/usr/bin/env, python, x.py]",
    ],
)
def test_scripts_in_the_folder_modules_the_instance_has_and_path_commands_pass(
    tmp_path: Path, command: str
) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "train.py").write_text("")
    (tmp_path / "run.sh").write_text("echo\n")
    job = _job_dir(tmp_path, f"name: mine\ncommand: {command}\n")
    assert _parse(job=str(job)).user_job is not None


def test_a_module_the_jobs_requirements_may_install_passes(tmp_path: Path) -> None:
    (tmp_path / "requirements.txt").write_text("scikit-learn\n")
    spec = "name: mine\ncommand: [python, -m, sklearn.cli]\nrequirements: requirements.txt\n"
    job = _job_dir(tmp_path, spec)
    assert _parse(job=str(job)).user_job is not None

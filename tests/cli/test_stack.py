"""Which stack, its config and its outputs: defaults from Pulumi.yaml, errors naming the key and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from trainstack.errors import CliError
from trainstack.stack import Stack

from .conftest import REPO, STACK, write_project

OUTPUTS = {
    "region": "eu-west-1",
    "bucket_name": "trainstack-dev-data",
    "group_name": "g",
    "instance_count": 2,
}


def _fake_pulumi(bin_dir: Path, *, stack: str = "dev", outputs: dict | None = None, fail: str = "") -> None:
    """A `pulumi` on PATH that answers the three commands the CLI runs, as the real one prints them."""
    bin_dir.mkdir(exist_ok=True)
    config = {
        "aws:region": {"value": "eu-west-1", "secret": False},
        "trainstack:instanceTypes": {"value": '["g5.xlarge"]', "objectValue": ["g5.xlarge"], "secret": False},
    }
    script = bin_dir / "pulumi"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ -n "{fail}" ]; then echo "error: {fail}" >&2; exit 255; fi\n'
        'case "$1 $2" in\n'
        f'  "stack --show-name") echo {stack} ;;\n'
        f"  \"stack output\") printf '%s\\n' '{json.dumps(OUTPUTS if outputs is None else outputs)}' ;;\n"
        f"  \"config --json\") printf '%s\\n' '{json.dumps(config)}' ;;\n"
        "esac\n"
    )
    script.chmod(0o755)


def test_stack_file_values_override_the_project_schema_defaults(tmp_path: Path):
    write_project(tmp_path, {"aws:region": "eu-west-1", "trainstack:instanceCount": 3})
    schema = yaml.safe_load((REPO / "Pulumi.yaml").read_text())["config"]

    config = Stack(STACK, project_dir=tmp_path).config

    assert config.region == "eu-west-1"
    assert config.instance_count == 3
    # Not set in the stack file: the default the Pulumi program also applies.
    assert list(config.instance_types) == schema["instanceTypes"]["default"]
    assert config.ami_parameter == schema["amiParameter"]["default"]


def test_the_only_stack_file_names_the_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no pulumi CLI to ask
    write_project(tmp_path, {"aws:region": "us-west-2"})
    assert Stack(project_dir=tmp_path).config.stack == STACK


def test_outside_the_project_directory_says_to_pass_cwd(tmp_path: Path):
    (tmp_path / "Pulumi.dev.yaml").write_text("config:\n  aws:region: us-west-2\n")
    with pytest.raises(
        CliError, match=r"no Pulumi.yaml in .*: run trainstack in the project directory or pass --cwd"
    ):
        _ = Stack("dev", project_dir=tmp_path).config


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"trainstack:instanceCount": 0}, r"trainstack:instanceCount must be an integer ≥ 1, got 0"),
        ({"trainstack:instanceCount": "two"}, r"trainstack:instanceCount must be an integer ≥ 1, got 'two'"),
        ({"trainstack:instanceTypes": []}, r"trainstack:instanceTypes must be a non-empty list"),
        ({"trainstack:onDemandBaseCapacity": -1}, r"trainstack:onDemandBaseCapacity must be an integer ≥ 0"),
    ],
)
def test_bad_config_names_the_file_and_the_key(tmp_path: Path, values: dict, message: str):
    write_project(tmp_path, values)
    with pytest.raises(CliError, match=rf"Pulumi.{STACK}.yaml: {message}"):
        _ = Stack(STACK, project_dir=tmp_path).config


def test_broken_yaml_names_the_file_and_line(tmp_path: Path):
    write_project(tmp_path, {})
    (tmp_path / "Pulumi.dev.yaml").write_text("config:\n  aws:region: [unclosed\n")
    with pytest.raises(CliError, match=r"Pulumi.dev.yaml line \d+: not valid YAML"):
        _ = Stack("dev", project_dir=tmp_path).config


def test_outputs_come_from_pulumi_stack_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    _fake_pulumi(tmp_path / "bin")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    stack = Stack(project_dir=tmp_path)
    assert stack.name == "dev"
    assert stack.outputs.bucket == "trainstack-dev-data"
    assert stack.outputs.instance_count == 2


def test_config_falls_back_to_pulumi_config_json_without_a_stack_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    shutil.copyfile(REPO / "Pulumi.yaml", tmp_path / "Pulumi.yaml")
    _fake_pulumi(tmp_path / "bin")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    config = Stack("dev", project_dir=tmp_path).config
    assert config.region == "eu-west-1"
    assert config.instance_types == ("g5.xlarge",)


def test_a_stack_never_deployed_says_to_run_pulumi_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    _fake_pulumi(tmp_path / "bin", outputs={})
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(CliError, match=r"stack 'dev' has no outputs yet: run `pulumi up` first"):
        _ = Stack("dev", project_dir=tmp_path).outputs


def test_an_unknown_stack_passes_on_pulumis_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    _fake_pulumi(tmp_path / "bin", fail="no stack named 'prod' found")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(
        CliError, match=r"cannot read outputs of stack 'prod': error: no stack named 'prod' found; "
    ):
        _ = Stack("prod", project_dir=tmp_path).outputs


def test_without_the_pulumi_cli_the_outputs_file_is_the_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(CliError, match=r"pulumi CLI not found on PATH: install it .* or pass --outputs FILE"):
        _ = Stack("dev", project_dir=tmp_path).outputs
    with pytest.raises(CliError, match=r"no stack selected in .*: pass --stack NAME"):
        _ = Stack(project_dir=tmp_path).name


def test_a_missing_output_names_it(tmp_path: Path):
    saved = tmp_path / "outputs.json"
    saved.write_text(json.dumps({"bucket_name": "b"}))
    outputs = Stack("dev", project_dir=tmp_path, outputs_file=saved).outputs
    with pytest.raises(
        CliError, match=rf"stack output 'group_name' is missing from {saved}: run `pulumi up`"
    ):
        _ = outputs.group_name

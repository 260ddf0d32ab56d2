"""Which stack, its config and its outputs: defaults from Pulumi.yaml, errors naming the key and the fix."""

from __future__ import annotations

import contextvars
import json
import shutil
from pathlib import Path
from typing import Any

import pulumi
import pytest
import yaml

from infra.config import StackConfig as ProgramConfig
from infra.config import StackConfigError, load_stack_config
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
    write_project(tmp_path, {"aws:region": "eu-west-1", "trainstack:instanceCount": 2})
    schema = yaml.safe_load((REPO / "Pulumi.yaml").read_text())["config"]

    config = Stack(STACK, project_dir=tmp_path).config

    assert config.region == "eu-west-1"
    assert config.instance_count == 2
    # Not set in the stack file: the default the Pulumi program also applies.
    assert list(config.instance_types) == schema["instanceTypes"]["default"]
    assert config.ami_parameter == schema["amiParameter"]["default"]
    assert config.settings is not None and config.settings.stall_timeout_minutes == 30


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
        ({"trainstack:instanceCount": 0}, r"trainstack:instanceCount: must be between 1 and 64, got 0 \("),
        ({"trainstack:instanceCount": "two"}, r"trainstack:instanceCount: must be an integer, got 'two' \("),
        ({"trainstack:instanceTypes": []}, r"trainstack:instanceTypes: is empty; the group needs"),
        ({"trainstack:onDemandBaseCapacity": -1}, r"trainstack:onDemandBaseCapacity: must be between 0 and"),
        ({"trainstack:maxCostUsd": "lots"}, r"trainstack:maxCostUsd: 'lots' is not a positive USD amount"),
    ],
)
def test_bad_config_is_one_line_naming_the_file_and_the_key(tmp_path: Path, values: dict, message: str):
    write_project(tmp_path, values)
    with pytest.raises(CliError, match=rf"^{tmp_path}/Pulumi.{STACK}.yaml: {message}") as error:
        _ = Stack(STACK, project_dir=tmp_path).config
    assert "\n" not in str(error.value)
    assert "(e.g. `pulumi config set trainstack:" in str(error.value)


def test_every_bad_key_gets_its_own_line(tmp_path: Path):
    write_project(tmp_path, {"trainstack:instanceCount": 0, "trainstack:instanceCont": 2})
    with pytest.raises(CliError) as error:
        _ = Stack(STACK, project_dir=tmp_path).config
    lines = str(error.value).splitlines()
    keys = [line.split(": ", 2)[1] for line in lines]
    assert keys == ["trainstack:instanceCont", "trainstack:instanceCount"]
    assert all(line.startswith(f"{tmp_path}/Pulumi.{STACK}.yaml: ") for line in lines)
    assert "did you mean 'instanceCount'?" in lines[0]


def test_a_missing_region_is_left_to_region_flag_and_doctor(tmp_path: Path):
    write_project(tmp_path, {"trainstack:instanceCount": 1})
    assert Stack(STACK, project_dir=tmp_path).config.region is None


def test_broken_yaml_names_the_file_and_line(tmp_path: Path):
    write_project(tmp_path, {})
    (tmp_path / "Pulumi.dev.yaml").write_text("config:\n  aws:region: [unclosed\n")
    with pytest.raises(CliError, match=r"Pulumi.dev.yaml line \d+: not valid YAML"):
        _ = Stack("dev", project_dir=tmp_path).config


def test_a_stack_file_that_is_not_utf8_names_the_file_and_the_fix(tmp_path: Path):
    write_project(tmp_path, {})
    (tmp_path / "Pulumi.dev.yaml").write_bytes("config:\n  # r\xe9gion\n".encode("latin-1"))
    with pytest.raises(CliError, match=r"Pulumi.dev.yaml: not UTF-8 text \(byte \d+: .*\); save it as UTF-8"):
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


def _program_reads(values: dict[str, Any], stack: str = STACK) -> ProgramConfig:
    """What `pulumi up` reads: the engine hands the program every value as a string (JSON for lists)."""
    encoded = {key: value if isinstance(value, str) else json.dumps(value) for key, value in values.items()}

    def read() -> ProgramConfig:
        pulumi.runtime.set_mocks(_NoResources(), project="trainstack", stack=stack, preview=True)
        pulumi.runtime.set_all_config(encoded)
        try:
            return load_stack_config()
        finally:
            pulumi.runtime.set_all_config({})

    return contextvars.Context().run(read)


class _NoResources(pulumi.runtime.Mocks):
    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str | None, dict[str, Any]]:
        raise AssertionError("reading the config registers nothing")

    def call(self, args: pulumi.runtime.MockCallArgs) -> dict[str, Any]:  # type: ignore[override]
        raise AssertionError("reading the config calls nothing")


def _example_stacks() -> list[tuple[str, dict[str, Any]]]:
    """The repository's example stack (Pulumi.dev.yaml) and that stack running each example job."""
    dev = dict(yaml.safe_load((REPO / "Pulumi.dev.yaml").read_text())["config"])
    jobs = sorted(REPO.glob("examples/*/job.yaml"))
    assert jobs, "no example job under examples/"
    return [("dev", dev)] + [
        (path.parent.name, {**dev, "trainstack:job": str(path.relative_to(REPO))}) for path in jobs
    ]


@pytest.mark.parametrize(("name", "values"), _example_stacks(), ids=[n for n, _ in _example_stacks()])
def test_the_cli_reads_every_key_as_the_program_does(tmp_path: Path, name: str, values: dict[str, Any]):
    write_project(tmp_path, values)

    cli = Stack(STACK, project_dir=tmp_path).config
    program = _program_reads(values)

    assert cli.settings == program
    assert (cli.instance_count, cli.instance_types, cli.max_cost_usd) == (
        program.instance_count,
        program.instance_types,
        program.max_cost_usd,
    )


def test_the_cli_refuses_a_bad_value_with_the_programs_own_line(tmp_path: Path):
    values = {"aws:region": "us-east-1", "trainstack:instanceCount": 1, "trainstack:rootVolumeSizeGb": 20}
    write_project(tmp_path, values)

    with pytest.raises(StackConfigError) as preview:
        _program_reads(values)
    with pytest.raises(CliError) as cli:
        _ = Stack(STACK, project_dir=tmp_path).config

    (problem,) = preview.value.problems
    assert problem.startswith("trainstack:rootVolumeSizeGb: must be between 100 and 16384, got 20")
    assert str(cli.value) == f"{tmp_path}/Pulumi.{STACK}.yaml: {problem}"


def test_a_secret_value_is_left_to_preview_never_read_as_ciphertext(tmp_path: Path):
    write_project(tmp_path, {"aws:region": "us-east-1", "trainstack:alertEmail": {"secure": "v1:AAAA"}})
    config = Stack(STACK, project_dir=tmp_path).config
    assert config.settings is not None and config.settings.alert_email == ""


def test_the_ops_cli_reads_the_stack_config_without_the_pulumi_sdk(tmp_path: Path):
    """The base install (boto3, pyyaml, rich) has no Pulumi SDK: reading the config through the program's
    schema must not import it (only `pulumi up` needs the engine)."""
    import subprocess
    import sys

    write_project(tmp_path, {"trainstack:instanceCount": 2})
    probe = (
        "import builtins, sys\n"
        "real = builtins.__import__\n"
        "def guarded(name, *a, **k):\n"
        "    if name.split('.')[0] in {'pulumi', 'pulumi_aws', 'torch'}:\n"
        "        raise ImportError(f'{name} is not installed')\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guarded\n"
        "from pathlib import Path\n"
        "from trainstack.stack import Stack\n"
        f"print(Stack({STACK!r}, project_dir=Path({str(tmp_path)!r})).config.instance_count)\n"
    )
    shown = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert shown.stdout.split() == ["2"]

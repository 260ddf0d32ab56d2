"""Which stack, its config (`Pulumi.<stack>.yaml`) and its outputs (`pulumi stack output --json`)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from trainstack.errors import CliError
from trainstack_job.contract import StackOutput

NAMESPACE = "trainstack"
PULUMI_INSTALL = "https://www.pulumi.com/docs/iac/download-install/"

Runner = Callable[[Sequence[str], Path], "subprocess.CompletedProcess[str]"]


def run_pulumi(argv: Sequence[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the pulumi CLI (never with --show-secrets: the CLI needs no secret)."""
    if shutil.which("pulumi") is None:
        raise CliError(f"pulumi CLI not found on PATH: install it ({PULUMI_INSTALL}) or pass --outputs FILE")
    return subprocess.run(["pulumi", *argv], cwd=cwd, capture_output=True, text=True, check=False)


@dataclass(frozen=True)
class StackConfig:
    """The config keys the CLI needs; defaults come from Pulumi.yaml's schema, as for the Pulumi program."""

    stack: str
    source: str
    region: str | None
    instance_types: tuple[str, ...]
    instance_count: int
    on_demand_base_capacity: int
    on_demand_percentage_above_base: int
    ami_parameter: str
    ami_id: str

    @property
    def uses_on_demand(self) -> bool:
        return self.on_demand_base_capacity > 0 or self.on_demand_percentage_above_base > 0

    @classmethod
    def from_values(cls, stack: str, values: Mapping[str, Any], source: str) -> StackConfig:
        """Validate namespaced values (`trainstack:instanceCount`...); every error names its key and file."""

        def get(key: str) -> Any:
            if values.get(key) is None:
                raise CliError(
                    f"{source}: no value for {key} and no default in Pulumi.yaml: "
                    f"`pulumi config set {key} VALUE`, or run trainstack from the project directory (--cwd)"
                )
            return values[key]

        types = get(f"{NAMESPACE}:instanceTypes")
        if isinstance(types, str):
            # `pulumi config --json` may hand an array back as its JSON text.
            try:
                types = json.loads(types)
            except json.JSONDecodeError:
                types = None
        if not isinstance(types, list) or not types or not all(isinstance(t, str) and t for t in types):
            raise CliError(
                f"{source}: {NAMESPACE}:instanceTypes must be a non-empty list of instance types, "
                f"e.g. `pulumi config set --path '{NAMESPACE}:instanceTypes[0]' g6.xlarge`"
            )
        region = values.get("aws:region")
        if region is not None and not isinstance(region, str):
            raise CliError(f"{source}: aws:region must be a string: `pulumi config set aws:region us-east-1`")
        return cls(
            stack=stack,
            source=source,
            region=region or None,
            instance_types=tuple(types),
            instance_count=_integer(
                get(f"{NAMESPACE}:instanceCount"), f"{NAMESPACE}:instanceCount", source, minimum=1
            ),
            on_demand_base_capacity=_integer(
                get(f"{NAMESPACE}:onDemandBaseCapacity"), f"{NAMESPACE}:onDemandBaseCapacity", source
            ),
            on_demand_percentage_above_base=_integer(
                get(f"{NAMESPACE}:onDemandPercentageAboveBase"),
                f"{NAMESPACE}:onDemandPercentageAboveBase",
                source,
            ),
            ami_parameter=str(get(f"{NAMESPACE}:amiParameter")),
            ami_id=str(get(f"{NAMESPACE}:amiId")),
        )


def _integer(raw: Any, key: str, source: str, *, minimum: int = 0) -> int:
    try:
        number = int(raw)
    except (TypeError, ValueError):
        number = minimum - 1
    if isinstance(raw, bool) or number < minimum:
        raise CliError(
            f"{source}: {key} must be an integer ≥ {minimum}, got {raw!r}: `pulumi config set {key} N`"
        )
    return number


@dataclass(frozen=True)
class StackOutputs:
    """`pulumi stack output --json` as read; `require` names the missing output and the fix."""

    values: Mapping[str, Any]
    source: str

    def require(self, name: StackOutput) -> Any:
        value = self.values.get(name.value)
        if value is None or value == "":
            raise CliError(
                f"stack output '{name.value}' is missing from {self.source}: "
                "run `pulumi up` to update the stack"
            )
        return value

    def text(self, name: StackOutput) -> str:
        return str(self.require(name))

    def prefix(self, name: StackOutput) -> str:
        """A bucket prefix output (`data_prefix`...), always ending with '/'."""
        value = self.text(name)
        return value if value.endswith("/") else value + "/"

    @property
    def region(self) -> str | None:
        value = self.values.get(StackOutput.REGION.value)
        return str(value) if value else None

    @property
    def bucket(self) -> str:
        return self.text(StackOutput.BUCKET_NAME)

    @property
    def group_name(self) -> str:
        return self.text(StackOutput.GROUP_NAME)

    @property
    def instance_count(self) -> int:
        return int(self.require(StackOutput.INSTANCE_COUNT))

    @property
    def instance_types(self) -> list[str]:
        value = self.require(StackOutput.INSTANCE_TYPES)
        return [str(t) for t in value] if isinstance(value, list) else [str(value)]


class Stack:
    """One Pulumi stack of this project, read lazily so `doctor` needs no outputs and `status` no config."""

    def __init__(
        self,
        name: str | None = None,
        *,
        project_dir: Path = Path(),
        outputs_file: Path | None = None,
        runner: Runner = run_pulumi,
    ) -> None:
        self._name = name
        self.project_dir = project_dir
        self.outputs_file = outputs_file
        self._run = runner

    @cached_property
    def name(self) -> str:
        if self._name:
            return self._name
        stack_files = sorted(self.project_dir.glob("Pulumi.*.yaml"))
        if shutil.which("pulumi") is not None:
            result = self._run(["stack", "--show-name"], self.project_dir)
            if result.returncode == 0 and result.stdout.strip():
                return result.stdout.strip()
        if len(stack_files) == 1:
            return stack_files[0].name.removeprefix("Pulumi.").removesuffix(".yaml")
        raise CliError(
            f"no stack selected in {self.project_dir.resolve()}: pass --stack NAME "
            "or run `pulumi stack select NAME`"
        )

    @cached_property
    def config(self) -> StackConfig:
        stack_file = self.project_dir / f"Pulumi.{self.name}.yaml"
        values = self._project_defaults()
        if stack_file.is_file():
            document = _load_yaml(stack_file)
            raw = document.get("config") or {}
            if not isinstance(raw, dict):
                raise CliError(f"{stack_file}: 'config' must be a mapping of key: value")
            values.update({self._namespaced(k): v for k, v in raw.items()})
            return StackConfig.from_values(self.name, values, str(stack_file))
        if shutil.which("pulumi") is None:
            raise CliError(
                f"no stack config: {stack_file} does not exist; create it with "
                f"`pulumi stack init {self.name}` "
                "and `pulumi config set aws:region us-east-1`, or pass --stack"
            )
        result = self._run(["config", "--json", "--stack", self.name], self.project_dir)
        if result.returncode != 0:
            raise CliError(f"`pulumi config --json --stack {self.name}` failed: {_first_line(result.stderr)}")
        for key, entry in _load_json(result.stdout, "pulumi config --json").items():
            if isinstance(entry, dict):
                values[self._namespaced(key)] = entry.get("objectValue", entry.get("value"))
        return StackConfig.from_values(self.name, values, f"pulumi config (stack {self.name})")

    @cached_property
    def outputs(self) -> StackOutputs:
        if self.outputs_file is not None:
            if not self.outputs_file.is_file():
                raise CliError(
                    f"--outputs {self.outputs_file}: no such file; write it with "
                    "`pulumi stack output --json > FILE`"
                )
            values = _load_json(self.outputs_file.read_text(encoding="utf-8"), str(self.outputs_file))
            source = str(self.outputs_file)
        else:
            result = self._run(["stack", "output", "--json", "--stack", self.name], self.project_dir)
            if result.returncode != 0:
                raise CliError(
                    f"cannot read outputs of stack '{self.name}': {_first_line(result.stderr)}; "
                    "check `pulumi stack ls` and pass --stack NAME"
                )
            values = _load_json(result.stdout, "pulumi stack output --json")
            source = f"stack '{self.name}'"
        if not values:
            raise CliError(f"{source} has no outputs yet: run `pulumi up` first")
        return StackOutputs(values, source)

    def _project_defaults(self) -> dict[str, Any]:
        """Defaults from Pulumi.yaml's typed config schema, so the CLI and the program agree on them."""
        project_file = self.project_dir / "Pulumi.yaml"
        if not project_file.is_file():
            raise CliError(
                f"no Pulumi.yaml in {self.project_dir.resolve()}: run trainstack in the project directory "
                "or pass --cwd DIR"
            )
        schema = _load_yaml(project_file).get("config") or {}
        defaults: dict[str, Any] = {}
        if isinstance(schema, dict):
            for key, entry in schema.items():
                if isinstance(entry, dict):
                    if "default" in entry or "value" in entry:
                        defaults[self._namespaced(key)] = entry.get("default", entry.get("value"))
                else:
                    defaults[self._namespaced(key)] = entry
        return defaults

    @staticmethod
    def _namespaced(key: str) -> str:
        return key if ":" in key else f"{NAMESPACE}:{key}"


def _load_yaml(path: Path) -> dict[str, Any]:
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise CliError(f"{path}{where}: not valid YAML; fix the syntax and retry") from None
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise CliError(f"{path}: expected a YAML mapping at the top level")
    return document


def _load_json(text: str, source: str) -> dict[str, Any]:
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise CliError(f"{source}: not valid JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(document, dict):
        raise CliError(f"{source}: expected a JSON object of output name to value")
    return document


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else "no error message"

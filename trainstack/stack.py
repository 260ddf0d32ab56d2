"""Which stack, its config (`Pulumi.<stack>.yaml`) and its outputs (`pulumi stack output --json`)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from trainstack.errors import CliError
from trainstack_job.contract import StackOutput
from trainstack_job.text import not_utf8

if TYPE_CHECKING:
    from infra.config import StackConfig as ProgramConfig

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
    """The stack's config as the Pulumi program reads it (infra/config/'s schema, Pulumi.yaml's defaults),
    and the file it was read from; the fields are what the CLI's commands use, `settings` is everything."""

    stack: str
    source: str
    region: str | None
    instance_types: tuple[str, ...]
    instance_count: int
    on_demand_base_capacity: int
    on_demand_percentage_above_base: int
    ami_parameter: str
    ami_id: str
    expected_hours: float | None = None
    max_cost_usd: float | None = None
    # The program's own typed config; None only for a config built by hand (tests).
    settings: ProgramConfig | None = None

    @property
    def uses_on_demand(self) -> bool:
        return self.on_demand_base_capacity > 0 or self.on_demand_percentage_above_base > 0

    @classmethod
    def from_values(
        cls, stack: str, values: Mapping[str, Any], source: str, *, project: str = NAMESPACE
    ) -> StackConfig:
        """Parse namespaced values (`trainstack:instanceCount`...) with the program's schema; each problem is
        one line naming the file and the key, as `pulumi preview` words it."""
        # Imported here: the schema pulls in the Pulumi SDK, which commands reading only outputs never need.
        from infra.config import StackConfigError, read_stack_config

        try:
            # aws:region may be missing here: `--region` stands for it (`trainstack doctor` says so).
            settings = read_stack_config(values, project=project, stack=stack, require_region=False)
        except StackConfigError as error:
            raise CliError("\n".join(f"{source}: {problem}" for problem in error.problems)) from None
        return cls(
            stack=stack,
            source=source,
            region=settings.region or None,
            instance_types=settings.instance_types,
            instance_count=settings.instance_count,
            on_demand_base_capacity=settings.on_demand_base_capacity,
            on_demand_percentage_above_base=settings.on_demand_percentage_above_base,
            ami_parameter=settings.ami_parameter,
            ami_id=settings.ami_id,
            expected_hours=settings.expected_hours,
            max_cost_usd=settings.max_cost_usd,
            settings=settings,
        )


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

    @property
    def max_concurrent_jobs(self) -> int:
        """trainstack:maxConcurrentJobs; 0 (no stack-wide limit) for a stack from before it."""
        value = self.values.get(StackOutput.MAX_CONCURRENT_JOBS.value)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

    @property
    def pools(self) -> dict[str, dict[str, Any]]:
        """Every pool: name -> {group_name, instance_types, max_instances, default}. A stack from before pools
        (no `pools` output) has its one group, as the pool `default`."""
        value = self.values.get(StackOutput.POOLS.value)
        if isinstance(value, dict) and value:
            return {str(k): dict(v) for k, v in value.items() if isinstance(v, dict)}
        return {
            "default": {
                "group_name": self.group_name,
                "instance_types": self.instance_types,
                "max_instances": self.instance_count,
                "default": True,
            }
        }


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
            # A secret (`pulumi config set --secret`) is ciphertext here: the CLI never decrypts one, so it is
            # left to `pulumi preview` and read here as not set.
            values.update({self._namespaced(k): v for k, v in raw.items() if not _is_secret(v)})
            return StackConfig.from_values(self.name, values, str(stack_file), project=self._project_name)
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
            if isinstance(entry, dict) and not entry.get("secret"):
                values[self._namespaced(key)] = entry.get("objectValue", entry.get("value"))
        source = f"pulumi config (stack {self.name})"
        return StackConfig.from_values(self.name, values, source, project=self._project_name)

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

    @cached_property
    def _project(self) -> dict[str, Any]:
        project_file = self.project_dir / "Pulumi.yaml"
        if not project_file.is_file():
            raise CliError(
                f"no Pulumi.yaml in {self.project_dir.resolve()}: run trainstack in the project directory "
                "or pass --cwd DIR"
            )
        return _load_yaml(project_file)

    @property
    def _project_name(self) -> str:
        """The project's name (physical names start with it), as the program gets it from Pulumi.yaml."""
        name = self._project.get("name")
        return name if isinstance(name, str) and name else NAMESPACE

    def _project_defaults(self) -> dict[str, Any]:
        """Defaults from Pulumi.yaml's typed config schema, as the Pulumi engine hands them to the program."""
        schema = self._project.get("config") or {}
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


def _is_secret(value: Any) -> bool:
    """A stack file's encrypted value: `{secure: <ciphertext>}`."""
    return isinstance(value, dict) and set(value) == {"secure"}


def _load_yaml(path: Path) -> dict[str, Any]:
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:  # saved in another encoding, or not a text file at all
        raise CliError(f"{path}: {not_utf8(error)}") from None
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

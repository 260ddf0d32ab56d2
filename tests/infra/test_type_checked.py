"""mypy checks every pulumi_aws call infra/ makes: argument names and types against the provider's stubs.

A cold mypy run skips the provider's ~250 other services (pyproject.toml, [tool.mypy.overrides]): following
them all was half of `make test`'s type checks. A service infra/ starts to use must join the list, or its
calls would silently be typed `Any`; this test says which."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pulumi_aws

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest's own dependency on 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def _checked_modules() -> set[str]:
    overrides = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]
    return {
        module
        for override in overrides
        if override.get("follow_imports") == "normal"
        for module in override["module"]
        if module.startswith("pulumi_aws")
    }


def unchecked_uses(source: str, checked: set[str]) -> set[str]:
    """`aws.<name>` uses in `source` (pulumi_aws imported as aws) whose module mypy would skip."""
    missing = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "aws":
            value = getattr(pulumi_aws, node.attr)
            if isinstance(value, type(pulumi_aws)) or type(value).__name__ == "_LazyModule":
                needed = f"pulumi_aws.{node.attr}.*"  # a service package: aws.ec2.Vpc
            else:
                needed = value.__module__  # a top-level function: aws.get_partition()
            if needed not in checked:
                missing.add(needed)
    return missing


def test_every_pulumi_aws_service_infra_uses_is_type_checked() -> None:
    checked = _checked_modules()
    sources = sorted((ROOT / "infra").rglob("*.py"))
    assert any("import pulumi_aws as aws" in path.read_text() for path in sources)
    missing = {use for path in sources for use in unchecked_uses(path.read_text(), checked)}
    assert not missing, (
        f"add {sorted(missing)} to the pulumi_aws list in pyproject.toml [tool.mypy.overrides]"
    )


def test_a_service_or_function_outside_the_list_is_named() -> None:
    checked = _checked_modules()
    source = "import pulumi_aws as aws\naws.rds.Instance('db')\naws.get_region()\naws.ec2.Vpc('v')\n"
    assert unchecked_uses(source, checked) == {"pulumi_aws.rds.*", "pulumi_aws.get_region"}

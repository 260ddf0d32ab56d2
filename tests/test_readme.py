"""The README is the user's manual: its commands and config reference must match the project."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_config_reference_lists_every_stack_key_with_its_type() -> None:
    schema = yaml.safe_load((ROOT / "Pulumi.yaml").read_text())["config"]
    rows = {
        match.group(1): match.group(2)
        for match in re.finditer(r"^\| `trainstack:(\w+)` \| ([^|]+) \|", README, re.MULTILINE)
    }
    assert set(rows) == set(schema), "README's config table and Pulumi.yaml's config block differ"
    for key, spec in schema.items():
        assert rows[key].strip().startswith(spec["type"]), f"trainstack:{key} has type {spec['type']}"


def test_ci_runs_exactly_the_readme_test_command() -> None:
    assert "make test" in README and "make demo" in README
    ci = (ROOT / ".ci" / "run").read_text()
    lines = [line.strip() for line in ci.splitlines()]
    commands = [line for line in lines if line and not line.startswith("#")]
    assert commands[-1] == "make test"


def test_makefile_targets_named_in_the_readme_exist() -> None:
    makefile = (ROOT / "Makefile").read_text()
    for target in re.findall(r"^make (\w+)", README, re.MULTILINE):
        assert re.search(rf"^{target}:", makefile, re.MULTILINE), f"README names `make {target}`"

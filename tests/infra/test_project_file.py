"""Pulumi.yaml and the example stack agree with infra/config/: same keys, types and defaults."""

from __future__ import annotations

from typing import Any

import yaml

from infra.config import DEFAULTS, NAMESPACE, POOLS_KEY, parse_stack_config
from tests.infra.program import REPO_ROOT, example_config

_TYPES: dict[str, type | tuple[type, ...]] = {"string": str, "integer": int, "boolean": bool, "array": list}


def _project() -> dict[str, Any]:
    return yaml.safe_load((REPO_ROOT / "Pulumi.yaml").read_text())


def test_project_runs_infra_with_the_repository_virtualenv() -> None:
    project = _project()
    assert project["name"] == NAMESPACE
    assert project["main"] == "infra/"
    assert project["runtime"] == {"name": "python", "options": {"toolchain": "pip", "virtualenv": ".venv"}}
    requirements = (REPO_ROOT / "infra" / "requirements.txt").read_text()
    for package in ("pulumi", "pulumi-aws", "pyyaml"):
        assert any(line.startswith(package) for line in requirements.splitlines()), package


def test_every_config_key_is_typed_described_and_defaulted_like_config_py() -> None:
    schema = _project()["config"]
    assert set(schema) == set(DEFAULTS)
    for key, declaration in schema.items():
        assert declaration["description"], key
        assert isinstance(declaration["default"], _TYPES[declaration["type"]]), key
        assert declaration["default"] == DEFAULTS[key], key
        if declaration["type"] == "array":
            assert declaration["items"] == {"type": "string"}, key


def test_pools_are_left_out_of_the_typed_schema_and_said_so() -> None:
    """trainstack:pools is a list of mappings, which Pulumi.yaml's schema cannot type: declared there, Pulumi
    would refuse every stack that sets it; its comment says where it is validated instead."""
    assert POOLS_KEY not in _project()["config"] and POOLS_KEY not in DEFAULTS
    assert f"`{NAMESPACE}:{POOLS_KEY}`" in (REPO_ROOT / "Pulumi.yaml").read_text()


def test_example_stack_sets_only_known_keys_and_validates() -> None:
    config = example_config()
    keys = {key.split(":", 1)[1] for key in config if key.startswith(f"{NAMESPACE}:")}
    assert keys <= set(DEFAULTS)
    assert config["aws:region"]
    raw = {key.split(":", 1)[1]: value for key, value in config.items() if key.startswith(f"{NAMESPACE}:")}
    parsed = parse_stack_config(raw, region=config["aws:region"], project=NAMESPACE, stack="dev")
    assert parsed.instance_types == tuple(DEFAULTS["instanceTypes"])
    assert parsed.job, "the example stack's trainer config must not be empty"

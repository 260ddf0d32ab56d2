"""Fixtures for the Pulumi program tests: the example stack run once per module under mocks."""

from __future__ import annotations

import pytest

from tests.infra.program import StackRun, example_config, run_stack


@pytest.fixture(scope="module")
def example_stack() -> StackRun:
    """The example stack (Pulumi.dev.yaml) as the program registers it."""
    return run_stack()


@pytest.fixture(scope="module")
def private_stack() -> StackRun:
    """The example stack with private subnets behind a NAT gateway."""
    return run_stack({**example_config(), "trainstack:privateSubnets": True})

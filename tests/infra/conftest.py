"""Fixtures for the Pulumi program tests: the example stack run once per process under mocks, each module
reading its own copy."""

from __future__ import annotations

import pytest

from tests.infra.program import StackRun, shared_run


@pytest.fixture(scope="module")
def example_stack() -> StackRun:
    """The example stack (Pulumi.dev.yaml) as the program registers it."""
    return shared_run()


@pytest.fixture(scope="module")
def private_stack() -> StackRun:
    """The example stack with private subnets behind a NAT gateway."""
    return shared_run({"trainstack:privateSubnets": True})

"""Fixtures for agent tests: the embedded stack in moto, a simulated IMDS, and an agent wired to both."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bootstrap.eventlog import EventLog
from bootstrap.lifecycle import InstanceLife
from demo.imds import ImdsSimulator, SimulatedInstance
from demo.stack import LocalStack, create_stack

FAKE_TRAINER = [sys.executable, str(Path(__file__).with_name("fake_trainer.py"))]


@pytest.fixture()
def stack(aws: Any) -> LocalStack:
    """A fresh stack (bucket, key, topic, log group, group with one instance) in the reset moto server."""
    return create_stack(name="trainstack-test")


@pytest.fixture()
def imds(stack: LocalStack, monkeypatch: pytest.MonkeyPatch) -> Iterator[ImdsSimulator]:
    """IMDS for the group's instance; the agent finds it through AWS_EC2_METADATA_SERVICE_ENDPOINT."""
    instance_id = stack.instance_ids()[0]
    simulator = ImdsSimulator(
        SimulatedInstance(instance_id=instance_id), lifecycle_state=stack.lifecycle_state
    )
    simulator.start()
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", simulator.endpoint)
    yield simulator
    simulator.stop()


def upload_dataset(stack: LocalStack, files: int = 6) -> None:
    s3 = stack.client("s3")
    for i in range(files):
        split = "train" if i % 3 else "val"
        s3.put_object(
            Bucket=stack.bucket, Key=f"data/{split}/class_{i % 2}/{i:03d}.png", Body=bytes([i]) * 100
        )


@pytest.fixture()
def make_life(stack: LocalStack, imds: ImdsSimulator, tmp_path: Path) -> Callable[..., InstanceLife]:
    """Build an in-process agent for one life; `fake` steers the test-double trainer."""
    upload_dataset(stack)
    lives = iter(range(1, 100))

    def build(
        fake: dict[str, Any] | None = None,
        trainer: list[str] | None = None,
        state_poll_seconds: float = 0.5,
        **config: Any,
    ) -> InstanceLife:
        scratch = tmp_path / f"instance-{next(lives)}"
        values: dict[str, Any] = {
            "poll_seconds": 0.2,
            "scratch_dir": str(scratch),
            "job": {"fake": fake or {}},
        }
        values.update(config)
        return InstanceLife(
            stack.agent_config(**values),
            log=EventLog(),
            trainer_command=trainer or FAKE_TRAINER,
            identity_wait_seconds=2,
            # No wait for a drain hook: no test here terminates the instance, and the wait polls every 2 s
            # (python -m demo covers the terminating path end to end).
            release_wait_seconds=0,
            state_poll_seconds=state_poll_seconds,
            tick_seconds=0.1,
        )

    return build

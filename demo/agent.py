"""`python -m demo.agent --config FILE`: the real agent for a simulated instance, with simulated spot prices.

moto prices every spot instance at a fraction of a cent, so the demo's cost line would read $0.00; the
agent takes its price lookup as a collaborator, and here it gets typical figures instead.

With TRAINSTACK_DEMO_TRAINER_PYTHON set (the test suite sets it, `make demo` does not), the built-in trainer
is started with that interpreter instead of this one: the suite's stand-in that forks each life from a
process that has imported torch already (tests/forkpython.py), so a story's lives cost their training, not
another ~3.7 CPU-seconds of imports each. A user's job still gets its own interpreter and venv.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from functools import partial

from bootstrap import agent, jobuser, supervisor
from bootstrap.lifecycle import InstanceLife
from bootstrap.trainer import default_trainer_command

# Simulated spot prices in USD per hour: typical us-east-1 figures of 2025, 50-70% below on-demand
# (on-demand: g4dn.xlarge 0.526, g6.xlarge 0.805, g5.xlarge 1.006, g6e.xlarge 1.861). Real prices move
# with the market and differ per zone; `trainstack prices` shows today's.
SIMULATED_SPOT_USD_PER_HOUR = {
    "g4dn.xlarge": 0.22,
    "g6.xlarge": 0.38,
    "g5.xlarge": 0.44,
    "g6e.xlarge": 0.83,
}


def simulated_spot_price(instance_type: str, az: str) -> float | None:
    """The same figure in every zone; None (cost unknown, as on AWS) for a type not listed."""
    return SIMULATED_SPOT_USD_PER_HOUR.get(instance_type)


TRAINER_PYTHON_ENV = "TRAINSTACK_DEMO_TRAINER_PYTHON"


def trainer_command_with(python: str) -> Callable[[int], list[str]]:
    """The built-in trainer's command (bootstrap.trainer.default_trainer_command) with `python` first."""

    def command(gpu_count: int) -> list[str]:
        return [python, *default_trainer_command(gpu_count)[1:]]

    return command


def main(argv: list[str] | None = None) -> int:
    # The agent's own entry point, unchanged but for the price lookup its InstanceLife gets (and, in the test
    # suite, the interpreter its built-in trainer starts with).
    agent.InstanceLife = partial(InstanceLife, price_lookup=simulated_spot_price)  # type: ignore[misc,assignment]
    python = os.environ.pop(TRAINER_PYTHON_ENV, "")
    # Not where the job runs as its own user: the stand-in and its socket are the test's, and the job user
    # may open neither. The lives are then real processes, as in `make demo`.
    if python and not jobuser.detect().isolated:
        supervisor.default_trainer_command = trainer_command_with(python)  # type: ignore[assignment]
    return agent.main(argv)


if __name__ == "__main__":
    sys.exit(main())

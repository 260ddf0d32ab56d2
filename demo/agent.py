"""`python -m demo.agent --config FILE`: the real agent for a simulated instance, with simulated spot prices.

moto prices every spot instance at a fraction of a cent, so the demo's cost line would read $0.00; the
agent takes its price lookup as a collaborator, and here it gets typical figures instead.
"""

from __future__ import annotations

import sys
from functools import partial

from bootstrap import agent
from bootstrap.lifecycle import InstanceLife

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


def main(argv: list[str] | None = None) -> int:
    # The agent's own entry point, unchanged but for the price lookup its InstanceLife gets.
    agent.InstanceLife = partial(InstanceLife, price_lookup=simulated_spot_price)  # type: ignore[misc,assignment]
    return agent.main(argv)


if __name__ == "__main__":
    sys.exit(main())

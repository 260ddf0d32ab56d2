"""`python -m bootstrap.agent --config FILE`: run one instance life and exit (0 = nothing left to do here)."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from types import FrameType

from bootstrap.agent_config import DEFAULT_PATH, AgentConfig, AgentConfigError
from bootstrap.lifecycle import InstanceLife

# The agent's own exit status for an unreadable agent config, as argparse exits on bad usage; not a job's
# exit code (trainstack_job.contract.ExitCode), which only the agent reads.
EXIT_BAD_CONFIG = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bootstrap.agent", description=__doc__)
    parser.add_argument(
        "--config", type=Path, default=DEFAULT_PATH, help=f"agent config (default {DEFAULT_PATH})"
    )
    parser.add_argument(
        "--give-up",
        action="store_true",
        help="record the failure, notify and scale the group to zero (systemd OnFailure)",
    )
    args = parser.parse_args(argv)
    try:
        config = AgentConfig.load(args.config)
    except AgentConfigError as exc:
        print(f"trainstack agent: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    life = InstanceLife(config)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        life.request_shutdown()

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        result = life.give_up() if args.give_up else life.run()
    except Exception as exc:
        # Unexpected (S3 or the group unreachable for minutes): one line, then systemd starts the next
        # life, and the ledger counts this one as failed when it finds it still marked running.
        life.log.event("failed", "agent stopped by an unexpected error", error=f"{type(exc).__name__}: {exc}")
        return 1
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())

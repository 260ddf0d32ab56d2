"""`python -m bootstrap.agent --config FILE`: run this instance's lives, then exit (0 = nothing left to do).

One life per job: when a job ends and the stack's queue holds another, the next life takes it in this same
process, on the same instance, with its scratch disk and synced dataset (no reboot); a job whose code is
not this agent's replaces the process with its own (bootstrap/pinned.py). The group goes to zero only when
the queue is empty (docs/internals.md, "The job queue").
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from types import FrameType

from botocore.exceptions import BotoCoreError, ClientError

from bootstrap.agent_config import DEFAULT_PATH, AgentConfig, AgentConfigError
from bootstrap.errors import one_line
from bootstrap.lifecycle import InstanceLife, LifeResult

# The agent's own exit status for an unreadable agent config, as argparse exits on bad usage; not a job's
# exit code (trainstack_job.contract.ExitCode), which only the agent reads.
EXIT_BAD_CONFIG = 2


class Lives:
    """This instance's lives, one after the other while the queue gives it jobs; `current` is the one a
    SIGTERM stops."""

    def __init__(self, first: InstanceLife) -> None:
        self.current = first
        self._shutdown = False

    def run(self) -> LifeResult:
        while True:
            result = self.current.run()
            # A SIGTERM (the instance is going away) between two lives: no next life starts here; the next
            # boot finds the job in the queue.
            if result.next_job is None or self._shutdown:
                return result
            self.current.log.event(
                "queue",
                "next life on this instance: the next queued job, no reboot",
                ended_job=self.current.config.job_id,
                next_job=result.next_job,
            )
            self.current = self.current.successor(again=result.again)
            if self._shutdown:  # the signal came while the next life was being made
                self.current.request_shutdown()

    def request_shutdown(self) -> None:
        """From the SIGTERM handler: only flags are set (the life's sentinel thread acts)."""
        self._shutdown = True
        self.current.request_shutdown()


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
    lives = Lives(InstanceLife(config))

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        lives.request_shutdown()

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        result = lives.current.give_up() if args.give_up else lives.run()
    except (BotoCoreError, ClientError) as exc:
        # AWS unreachable or refusing for minutes (every call retried first): not a bug, one line, then
        # systemd starts the next life, and the ledger counts this one as failed when it finds it still
        # marked running.
        lives.current.log.event("failed", "agent stopped: AWS unreachable or refusing", error=one_line(exc))
        return 1
    except Exception as exc:
        # Every per-job fault is a job outcome (bootstrap/lifecycle.py): reaching here is an agent bug.
        lives.current.report_agent_bug(exc)
        return 1
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())

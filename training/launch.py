"""Start one trainer process per device and keep the exit-code contract (0 / 75 / failure) for the group.

torchrun reports any non-zero worker exit, 75 included, as its own exit 1 with a traceback, and kills
workers 30 s after its own SIGTERM: too little for an S3 upload. This launcher forwards stop signals,
waits for every rank to finish its checkpoint, and exits 75 only if every rank did.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from types import FrameType

log = logging.getLogger("training")

EXIT_STOPPED = 75
# After one rank fails the others are stuck in a collective; give them this long, then kill them.
FAILURE_GRACE_SECONDS = 30.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def group_exit_code(codes: list[int]) -> int:
    if all(code == 0 for code in codes):
        return 0
    if all(code == EXIT_STOPPED for code in codes):
        return EXIT_STOPPED
    return next((code for code in codes if code not in (0, EXIT_STOPPED) and code > 0), 1)


def launch(argv: list[str], processes: int) -> int:
    """Run `python -m training argv` as `processes` ranks on this machine; returns the group's exit code."""
    port = _free_port()
    children: list[subprocess.Popen[bytes]] = []
    for rank in range(processes):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(processes),
            "LOCAL_WORLD_SIZE": str(processes),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        children.append(subprocess.Popen([sys.executable, "-m", "training", *argv], env=env))

    def forward(signum: int, _frame: FrameType | None) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        failed_at: float | None = None
        while any(child.poll() is None for child in children):
            codes = [child.returncode for child in children if child.returncode is not None]
            if failed_at is None and any(code not in (0, EXIT_STOPPED) for code in codes):
                failed_at = time.monotonic()
                log.error("a trainer rank failed; stopping the others")
                forward(signal.SIGTERM, None)
            if failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_SECONDS:
                for child in children:
                    if child.poll() is None:
                        child.kill()
            time.sleep(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return group_exit_code([child.returncode for child in children])

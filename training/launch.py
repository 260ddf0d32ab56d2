"""One trainer rank per device through PyTorch's elastic engine (torch.distributed.launcher), with the job
contract kept for the group: 0 = every rank completed, 75 = every rank stopped with its checkpoint, else 1.

The engine's defaults clash with that contract, so they are set through its API:
- it reports a worker's exit 75 as a failure and then kills the other ranks, even one still finishing its
  clean stop: so a rank under this launcher records its real exit code in RANK_STATUS_DIR and exits 0
  after a clean stop (`rank_exit`); the launcher reads the codes back. Real failures still exit non-zero,
  so the engine stops the group as it should, and their codes come from ChildFailedError;
- on SIGTERM it kills workers after 30 s: it is told not to handle SIGTERM/SIGINT at all
  (`signals_to_handle`), this launcher forwards them to its process group instead, and each rank stops at its
  next step boundary, commits its checkpoint and exits 75; `shutdown_timeout` covers the rest of the notice;
- it restarts failed workers: `max_restarts=0`, since the agent (not the launcher) decides about another life.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
import uuid
from pathlib import Path
from types import FrameType

from trainstack_job.contract import ExitCode

log = logging.getLogger("training")

# Of the 120 s spot notice: the agent itself kills the job at its own deadline before this.
SHUTDOWN_TIMEOUT_SECONDS = 110
# Only signals nobody sends in normal operation stay with the engine.
ENGINE_SIGNALS = "SIGHUP,SIGQUIT"
# Where each rank leaves its real exit code (set by `launch` for its ranks only).
RANK_STATUS_DIR = "TRAINSTACK_RANK_STATUS_DIR"


def rank_exit(code: int) -> int:
    """A rank's process exit status: its real code recorded for the launcher, and 0 for the engine after a
    clean stop (75), which it would otherwise treat as a failure and answer by killing the other ranks."""
    directory = os.environ.get(RANK_STATUS_DIR)
    if not directory:
        return code
    (Path(directory) / f"rank-{os.environ.get('RANK', '0')}").write_text(str(int(code)))
    return int(ExitCode.COMPLETED) if code == ExitCode.STOPPED else code


def _recorded(directory: Path, processes: int) -> dict[int, int]:
    codes = {}
    for rank in range(processes):
        try:
            codes[rank] = int((directory / f"rank-{rank}").read_text())
        except (OSError, ValueError):
            continue
    return codes


def _children() -> list[int]:
    """This process's child processes (the engine starts one per rank), from /proc."""
    pids: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        try:
            pids += [int(pid) for pid in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids


def group_exit_code(codes: list[int]) -> int:
    """The group's exit code from its ranks' (0 for ranks that completed)."""
    if all(code == ExitCode.COMPLETED for code in codes):
        return int(ExitCode.COMPLETED)
    if all(code == ExitCode.STOPPED for code in codes):
        return int(ExitCode.STOPPED)
    failed = [code for code in codes if code not in (ExitCode.COMPLETED, ExitCode.STOPPED)]
    # A permanent failure (config, data) wins so the agent stops the job instead of retrying.
    for permanent in (ExitCode.DATA_ERROR, ExitCode.CONFIG_ERROR):
        if permanent in failed:
            return int(permanent)
    return next((code for code in failed if code > 0), int(ExitCode.FAILED))


def launch(argv: list[str], processes: int) -> int:
    """Run `python -m training argv` as `processes` ranks on this machine; returns the group's exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=processes,
        run_id=f"trainstack-{uuid.uuid4().hex[:8]}",
        # torchrun --standalone: a c10d store on a free local port, no external rendezvous service.
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.5,
        start_method="spawn",
        signals_to_handle=ENGINE_SIGNALS,
        shutdown_timeout=SHUTDOWN_TIMEOUT_SECONDS,
    )
    forwarded = {"done": False}

    def forward(signum: int, _frame: FrameType | None) -> None:
        # Each rank catches the signal itself and stops at its next step boundary with a checkpoint.
        if not forwarded["done"]:
            forwarded["done"] = True
            log.warning("%s received: asking every rank to stop", signal.Signals(signum).name)
            for pid in _children():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    with tempfile.TemporaryDirectory(prefix="trainstack-ranks-") as status_dir:
        os.environ[RANK_STATUS_DIR] = status_dir  # the engine starts the ranks with this environment
        failures: dict[int, int] = {}
        try:
            elastic_launch(config, sys.executable)("-m", "training", *argv)
        except ChildFailedError as exc:
            failures = {rank: failure.exitcode for rank, failure in exc.failures.items()}
        finally:
            os.environ.pop(RANK_STATUS_DIR, None)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        # A rank's own record wins over how the engine saw it end (a killed rank has none).
        recorded = _recorded(Path(status_dir), processes)
        codes = [recorded.get(rank, failures.get(rank, int(ExitCode.FAILED))) for rank in range(processes)]
    code = group_exit_code(codes)
    if code not in (ExitCode.COMPLETED, ExitCode.STOPPED):
        log.error("trainer ranks exited %s; group exit %d", codes, code)
    return code

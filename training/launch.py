"""Trainer ranks through PyTorch's elastic engine (torch.distributed.launcher): one rank per device on this
machine, and with a node rendezvous (NodeRendezvous) one data-parallel job over several machines, each
machine's launcher joining the same c10d rendezvous. The job contract is kept for the group: 0 = every
rank completed, 75 = every rank stopped with its checkpoint, else 1.

The engine's defaults clash with that contract, so they are set through its API:
- it reports a worker's exit 75 as a failure and then kills the other ranks, even one still finishing its
  clean stop: so a rank under this launcher records its real exit code (and the step it ended at) in
  RANK_STATUS_DIR and exits 0 after a clean stop (`rank_exit`); the launcher reads the records back. Real
  failures still exit non-zero, so the engine stops the group as it should, and their codes come from
  ChildFailedError;
- on SIGTERM it kills workers after 30 s: it is told not to handle SIGTERM/SIGINT at all
  (`signals_to_handle`), this launcher forwards them to its ranks instead, and each rank stops at its next
  step boundary, commits its checkpoint and exits 75; `shutdown_timeout` covers the rest of the notice.
  While the launcher is still waiting in the rendezvous no rank runs, so a stop then ends it at once (75);
- it restarts failed workers: `max_restarts=0`, since the agent (not the launcher) decides about another life.
  It still restarts them when a node joins a running group (a membership change): the ranks get SIGTERM,
  stop at a step boundary with their checkpoint, and the next round's ranks restore it (training/loop.py).

Rank records are keyed by global rank, which on another node is not 0..processes-1, and a membership
change starts a new round with new ranks: the rendezvous handler is wrapped (`_TrackedRendezvous`) so the
launcher knows when a round forms and sets the previous round's records aside. Each rank also marks that it
started (`rank_started`): a generation whose ranks ran here is reported as trained however it ends (the
store lost, a rank killed), never as a rendezvous that never formed (docs/multi-node.md, "Faults without a
word").
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from trainstack_job.contract import ExitCode, JobEnv, NodeExit

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import (
        RendezvousHandler,
        RendezvousInfo,
        RendezvousParameters,
    )

log = logging.getLogger("training")

# Of the 120 s spot notice: the agent itself kills the job at its own deadline before this.
SHUTDOWN_TIMEOUT_SECONDS = 110
# Only signals nobody sends in normal operation stay with the engine.
ENGINE_SIGNALS = "SIGHUP,SIGQUIT"
# Where each rank leaves its real exit code (set by `launch` for its ranks only).
RANK_STATUS_DIR = "TRAINSTACK_RANK_STATUS_DIR"
# How long a node rendezvous waits for the minimum of nodes unless TRAINSTACK_RDZV_JOIN_TIMEOUT says.
JOIN_TIMEOUT_SECONDS = 900.0
# Once the minimum of nodes is there, how long the rendezvous still admits more before it forms: nodes the
# agent started together join the same round instead of forcing a restart a moment later.
LAST_CALL_SECONDS = 3.0
# How long one operation on the rendezvous store may wait (torch's default is 60 s). Every node that a round
# counted writes its rank information the moment the round closes, so normal operation waits milliseconds; a
# node that quits between being counted and writing it (a stop while joining) would otherwise hold the others
# for the whole 60 s before they can regroup. The engine's own waits (the join window, the exit barrier) have
# their own timeouts and are not shortened by this.
STORE_READ_TIMEOUT_SECONDS = 10
# Multi-node, the store host only: the file descriptor of a listening TCP socket on the endpoint's port, which
# the rendezvous store serves on. Whoever chose the endpoint bound port 0 and kept the socket listening, so
# the port is never free between being published and being served (a port probed free, closed and bound
# again later can be taken in between). Unset, the store binds the endpoint's port itself.
LISTEN_FD_ENV = "TRAINSTACK_RDZV_LISTEN_FD"
# The rendezvous backend name under which `_TrackedRendezvous` wraps torch's c10d handler.
TRACKED_BACKEND = "trainstack-c10d"


@dataclass(frozen=True)
class RankRecord:
    """What a rank left for its launcher: its real exit code, the step it ended at, the group's size."""

    code: int
    step: int | None = None
    world_size: int | None = None


class _LastStep:
    """The step this rank's Trainer last reached, for its exit record (set through `note_step`)."""

    step: int | None = None


def note_step(step: int) -> None:
    """The Trainer's current step, recorded by `rank_exit` so the launcher can report where ranks stopped."""
    _LastStep.step = int(step)


def rank_started() -> None:
    """Under this launcher, a rank says it started: its node's generation trained, however it ends (a rank
    killed, the store lost), and is never reported as a rendezvous that never formed."""
    directory = os.environ.get(RANK_STATUS_DIR)
    if directory:
        (Path(directory) / f"started-{os.environ.get('RANK', '0')}").touch()


def rank_exit(code: int) -> int:
    """A rank's process exit status: its real code (and step) recorded for the launcher, and 0 for the engine
    after a clean stop (75), which it would otherwise treat as a failure and answer by killing the other
    ranks."""
    directory = os.environ.get(RANK_STATUS_DIR)
    if not directory:
        return code
    world_size = os.environ.get("WORLD_SIZE", "")
    record = {
        "code": int(code),
        "step": _LastStep.step,
        "world_size": int(world_size) if world_size.isdigit() else None,
    }
    (Path(directory) / f"rank-{os.environ.get('RANK', '0')}").write_text(json.dumps(record))
    return int(ExitCode.COMPLETED) if code == ExitCode.STOPPED else code


def _recorded(directory: Path) -> dict[int, RankRecord]:
    """Every rank record in `directory`, by global rank (a half-written one is skipped: the engine's view of
    that rank is used instead)."""
    records = {}
    for path in directory.glob("rank-*"):
        try:
            rank = int(path.name.removeprefix("rank-"))
            raw = json.loads(path.read_text())
            records[rank] = RankRecord(int(raw["code"]), raw.get("step"), raw.get("world_size"))
        except (OSError, ValueError, TypeError, KeyError):
            continue
    return records


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


# -- the node rendezvous ------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeRendezvous:
    """This node's part in a multi-node job's rendezvous, as the agent set it (trainstack_job JobEnv)."""

    endpoint: str  # "address:port" of the c10d store host of this generation
    run_id: str
    min_nodes: int
    max_nodes: int
    is_host: bool
    local_addr: str | None  # what the other nodes reach this one by; None: torch uses the FQDN
    join_timeout: float = JOIN_TIMEOUT_SECONDS
    last_call_timeout: float = LAST_CALL_SECONDS
    exit_file: Path | None = None
    listen_fd: int | None = None  # LISTEN_FD_ENV: the store host's listening socket

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.endpoint.rpartition(":")
        return host.strip("[]"), int(port)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NodeRendezvous | None:
        """The rendezvous the agent asked for, or None (one machine) when TRAINSTACK_RDZV_ENDPOINT is unset;
        ValueError with one line naming the variable when a value is malformed."""
        env = os.environ if env is None else env
        endpoint = env.get(JobEnv.RDZV_ENDPOINT.value, "").strip()
        if not endpoint:
            return None
        host, _, port = endpoint.rpartition(":")
        if not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{JobEnv.RDZV_ENDPOINT.value}={endpoint!r}: expected address:port")
        run_id = env.get(JobEnv.RDZV_ID.value, "").strip()
        if not run_id:
            raise ValueError(f"{JobEnv.RDZV_ID.value} must be set with {JobEnv.RDZV_ENDPOINT.value}")
        is_host = env.get(JobEnv.RDZV_HOST.value, "0").strip()
        if is_host not in ("0", "1"):
            raise ValueError(f"{JobEnv.RDZV_HOST.value}={is_host!r}: expected 1 or 0")
        min_nodes, max_nodes = _node_bounds(env.get(JobEnv.NNODES.value, "1:1"))
        join = env.get(JobEnv.RDZV_JOIN_TIMEOUT.value, "").strip()
        try:
            join_timeout = float(join) if join else JOIN_TIMEOUT_SECONDS
        except ValueError:
            join_timeout = -1.0
        if not (join_timeout > 0 and math.isfinite(join_timeout)):
            raise ValueError(f"{JobEnv.RDZV_JOIN_TIMEOUT.value}={join!r}: expected seconds > 0")
        exit_file = env.get(JobEnv.NODE_EXIT_FILE.value, "").strip()
        listen_fd = env.get(LISTEN_FD_ENV, "").strip()
        if listen_fd and not (listen_fd.isdigit() and is_host == "1"):
            raise ValueError(
                f"{LISTEN_FD_ENV}={listen_fd!r}: expected a file descriptor, on the store host only"
            )
        return cls(
            endpoint=endpoint,
            run_id=run_id,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            is_host=is_host == "1",
            local_addr=env.get(JobEnv.NODE_ADDR.value, "").strip() or None,
            join_timeout=join_timeout,
            exit_file=Path(exit_file) if exit_file else None,
            listen_fd=int(listen_fd) if listen_fd else None,
        )


def _node_bounds(value: str) -> tuple[int, int]:
    """ "min:max" (or one number for both), as torchrun --nnodes."""
    low, _, high = value.strip().partition(":")
    high = high or low
    if not (low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
        raise ValueError(f"{JobEnv.NNODES.value}={value!r}: expected min:max with 1 <= min <= max")
    return int(low), int(high)


class _StopBeforeRanks(BaseException):
    """A stop signal while waiting in the rendezvous. A BaseException, like KeyboardInterrupt, so none of
    the engine's `except Exception` clauses swallows it on its way out of `elastic_launch`."""


class _StoreUnreachableError(Exception):
    """The rendezvous store host did not accept connections within the join timeout."""


@dataclass
class _Round:
    """One rendezvous round of this node: its group rank once formed, its ranks' records once ended."""

    group_rank: int | None = None
    nodes: int | None = None
    records: dict[int, RankRecord] = field(default_factory=dict)


class _Rounds:
    """What the launcher knows about its rendezvous rounds. Only the main thread touches it: the engine's
    agent loop and the signal handlers both run there."""

    def __init__(self, status_dir: Path) -> None:
        self.status_dir = status_dir
        self.joining = True  # before or inside a rendezvous: no rank of this node runs
        self.trained = False  # a rank of this node started in some round of this launch
        self.stop_signal: int | None = None
        self.current = _Round()
        self.previous: _Round | None = None  # the last round whose ranks ran, before a membership change

    def ranks_started(self) -> bool:
        """Whether a rank of this node ever started in this launch (rank_started's markers, kept here)."""
        for path in self.status_dir.glob("started-*"):
            path.unlink(missing_ok=True)
            self.trained = True
        return self.trained

    def entering(self) -> None:
        self.ranks_started()
        if self.stop_signal is not None:
            # A stop forwarded to the ranks raced a membership change: do not start another round.
            raise _StopBeforeRanks
        if self.current.group_rank is not None:
            # The engine stopped this round's ranks for a membership change; their records stay its own.
            self.current.records = _recorded(self.status_dir)
            for path in self.status_dir.glob("rank-*"):
                path.unlink(missing_ok=True)
            self.previous, self.current = self.current, _Round()
        self.joining = True

    def formed(self, info: RendezvousInfo) -> None:
        self.current.group_rank, self.current.nodes = info.rank, info.world_size
        self.joining = False


# Rounds of each launch in progress in this process, by run id (the registered handler creator finds its
# launch's through the parameters it is given), and the listening socket of those that host the store.
_LAUNCHES: dict[str, _Rounds] = {}
_LISTENERS: dict[str, int] = {}


def _tracked_handler(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

    c10d = RendezvousParameters(
        "c10d",
        params.endpoint,
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        **params.config,
    )
    listen_fd = _LISTENERS.get(params.run_id)
    if listen_fd is None:
        inner = rendezvous_handler_registry.create_handler(c10d)
    else:
        inner = _handler_on_listener(c10d, listen_fd)
    return _make_tracked(inner, _LAUNCHES[params.run_id])


def _handler_on_listener(params: RendezvousParameters, listen_fd: int) -> RendezvousHandler:
    """torch's c10d handler (as its registry builds it) with its store served on the listening socket this
    launcher was handed (LISTEN_FD_ENV) instead of binding the endpoint's port anew."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    host, _, port = params.endpoint.rpartition(":")
    store = TCPStore(
        host.strip("[]"),
        int(port),
        is_master=True,
        multi_tenant=True,
        timeout=timedelta(seconds=params.get_as_int("read_timeout", STORE_READ_TIMEOUT_SECONDS) or 60),
        master_listen_fd=listen_fd,
    )
    return create_handler(store, C10dRendezvousBackend(store, params.run_id), params)


def _make_tracked(inner: RendezvousHandler, rounds: _Rounds) -> RendezvousHandler:
    """torch's c10d handler, telling `rounds` when this node enters a rendezvous and when it forms."""
    from torch.distributed.elastic.rendezvous import RendezvousHandler

    class _TrackedRendezvous(RendezvousHandler):
        def get_backend(self) -> str:
            return TRACKED_BACKEND

        @property
        def use_agent_store(self) -> bool:
            return bool(inner.use_agent_store)

        def next_rendezvous(self) -> RendezvousInfo:
            rounds.entering()
            info = inner.next_rendezvous()
            rounds.formed(info)
            return info

        def is_closed(self) -> bool:
            return bool(inner.is_closed())

        def set_closed(self) -> None:
            inner.set_closed()

        def num_nodes_waiting(self) -> int:
            return int(inner.num_nodes_waiting())

        def get_run_id(self) -> str:
            return str(inner.get_run_id())

        def shutdown(self) -> bool:
            return bool(inner.shutdown())

    return _TrackedRendezvous()


def _register_tracked_backend() -> None:
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous, rendezvous_handler_registry

    # Registering the same creator again is a no-op for the registry.
    rendezvous_handler_registry.register(TRACKED_BACKEND, _tracked_handler)
    if callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        dynamic_rendezvous.get_method_name = event_method_name


def event_method_name(depth: int = 2) -> str:
    """The name torch's rendezvous gives each of its events: the method `depth` frames up (the one that
    records the event), as torch's own `get_method_name` finds it. Torch's calls `inspect.stack()` twice,
    which reads the source of every frame on the stack and searches every loaded module for each: about
    80 ms of CPU per event with torch loaded, a dozen events per node per rendezvous round, paid before
    torch checks whether anything logs its events at all (nothing does, by default). The frame's code
    name is the same name, read in microseconds."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # a stack shorter than `depth`
        return "no_method_name"


def _wait_for_store(nodes: NodeRendezvous) -> None:
    """Until the store host accepts a connection, within the join timeout; raises _StoreUnreachableError.

    torch's store client retries a refused connection inside C++ code, where no Python signal handler runs:
    a stop during that wait would go unanswered for its whole timeout. This Python loop answers at once, and
    gives a host that boots later than this node the whole join timeout rather than the store's 60 s.
    """
    host, port = nodes.host_port
    deadline = time.monotonic() + nodes.join_timeout
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, left))):
                return
        except OSError as exc:
            if left <= 0:
                raise _StoreUnreachableError(
                    f"the rendezvous store {nodes.endpoint} did not answer within {nodes.join_timeout:g} s "
                    f"({exc})"
                ) from None
        time.sleep(max(0.0, min(0.5, deadline - time.monotonic())))


def _describe(exc: BaseException) -> str:
    """One line about a rendezvous error (torch's timeout error has no message of its own)."""
    lines = str(exc).strip().splitlines()
    if isinstance(exc, _StoreUnreachableError):
        return lines[0]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _launch_config(processes: int, nodes: NodeRendezvous | None, run_id: str) -> Any:
    from torch.distributed.launcher.api import LaunchConfig

    common: dict[str, Any] = {
        "nproc_per_node": processes,
        "run_id": run_id,
        "rdzv_backend": TRACKED_BACKEND,
        "max_restarts": 0,
        "monitor_interval": 0.5,
        "start_method": "spawn",
        "signals_to_handle": ENGINE_SIGNALS,
        "shutdown_timeout": SHUTDOWN_TIMEOUT_SECONDS,
    }
    if nodes is None:
        # torchrun --standalone: a c10d store on a free local port, no external rendezvous service.
        return LaunchConfig(min_nodes=1, max_nodes=1, rdzv_endpoint="localhost:0", **common)
    return LaunchConfig(
        min_nodes=nodes.min_nodes,
        max_nodes=nodes.max_nodes,
        rdzv_endpoint=nodes.endpoint,
        rdzv_configs={
            "is_host": nodes.is_host,
            # torch reads these as whole seconds.
            "join_timeout": max(1, math.ceil(nodes.join_timeout)),
            "last_call_timeout": max(1, math.ceil(nodes.last_call_timeout)),
            "read_timeout": STORE_READ_TIMEOUT_SECONDS,
        },
        local_addr=nodes.local_addr,
        **common,
    )


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    """os.environ with `values` (the engine starts the ranks with this process's environment)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def rank_threads(processes: int, env: Mapping[str, str], cpus: int | None) -> dict[str, str]:
    """OMP_NUM_THREADS for the ranks: the machine's cores shared out, unless the user set it.

    torch starts one intra-op thread per core in every process: two CPU ranks on two cores would each run
    two threads and fight at every barrier (measured 6-10x slower in bench/RESULTS.md, "1 -> 2 processes").
    torchrun sets 1 for the same reason; this engine API does not, so the launcher does. On GPUs the
    ranks' CPU work (data loading, the optimizer's bookkeeping) gets its share too."""
    if processes <= 1 or env.get("OMP_NUM_THREADS"):
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (cpus or 1) // processes))}


def launch(
    argv: list[str],
    processes: int,
    nodes: NodeRendezvous | None = None,
    *,
    stopped: Callable[[], str | None] | None = None,
    module: str = "training",
) -> int:
    """Run `python -m <module> argv` as `processes` ranks on this machine, alone or (with `nodes`) as this
    node's part of a multi-node group; returns the exit code of this node's ranks, and with
    `nodes.exit_file` writes what they did there (NodeExit). `stopped` names a stop signal the caller
    caught before this launcher took SIGTERM/SIGINT over (its imports take a moment). `module` is the
    launcher's own entry point (`training`, or bootstrap.standalone, which gives the ranks a persister)."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    _register_tracked_backend()
    run_id = nodes.run_id if nodes else f"trainstack-{uuid.uuid4().hex[:8]}"
    config = _launch_config(processes, nodes, run_id)

    with tempfile.TemporaryDirectory(prefix="trainstack-ranks-") as status_dir:
        rounds = _Rounds(Path(status_dir))

        def forward(signum: int, _frame: FrameType | None) -> None:
            if rounds.stop_signal is not None:
                return
            rounds.stop_signal = signum
            name = signal.Signals(signum).name
            if rounds.joining:
                # No rank runs, so the last checkpoint is still the job's state: nothing to save.
                waiting = "for the other nodes" if nodes is not None else "in the rendezvous"
                log.warning("%s received while waiting %s; exit %d", name, waiting, ExitCode.STOPPED)
                raise _StopBeforeRanks
            # Each rank catches the signal itself and stops at its next step boundary with a checkpoint.
            log.warning("%s received: asking every rank to stop", name)
            for pid in _children():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)

        env = {RANK_STATUS_DIR: status_dir, **rank_threads(processes, os.environ, os.cpu_count())}
        if nodes is not None:
            # Without the engine's shared store every round publishes its rank 0's address afresh: with it a
            # node that was rank 0 before a membership change keeps pointing its ranks at its own old store.
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        _LAUNCHES[run_id] = rounds
        if nodes is not None and nodes.listen_fd is not None:
            _LISTENERS[run_id] = nodes.listen_fd
        failures: dict[int, int] = {}
        rendezvous_error: str | None = None
        crashed = False
        try:
            try:
                caught = stopped() if stopped is not None else None
                if caught:
                    rounds.stop_signal = signal.Signals[caught]
                    log.warning("%s received before training started; exit %d", caught, ExitCode.STOPPED)
                    raise _StopBeforeRanks
                with _env(env):
                    if nodes is not None:
                        log.info(
                            "joining rendezvous %s at %s%s: %d-%d nodes, %d process(es) on this one",
                            nodes.run_id,
                            nodes.endpoint,
                            " (hosting its store)" if nodes.is_host else "",
                            nodes.min_nodes,
                            nodes.max_nodes,
                            processes,
                        )
                    if nodes is not None and not nodes.is_host:
                        _wait_for_store(nodes)
                    elastic_launch(config, sys.executable)("-m", module, *argv)
            except ChildFailedError as exc:
                failures = {rank: failure.exitcode for rank, failure in exc.failures.items()}
            except (RendezvousError, DistError, _StoreUnreachableError) as exc:
                # Store errors (DistError) outside the ranks are the rendezvous's too: a host gone, a port
                # taken.
                rendezvous_error = _describe(exc)
            except Exception:
                log.exception("the elastic launcher failed")
                crashed = True
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
                _LAUNCHES.pop(run_id, None)
                _LISTENERS.pop(run_id, None)
        except _StopBeforeRanks:
            # Raised by `forward` in the rendezvous (or, rarely, while the lines above handled its end).
            pass
        rounds.ranks_started()  # read before the folder goes
        if rounds.current.group_rank is not None:
            rounds.current.records = _recorded(Path(status_dir))
    return _finish(rounds, failures, processes, nodes, rendezvous_error, crashed)


def _finish(
    rounds: _Rounds,
    failures: dict[int, int],
    processes: int,
    nodes: NodeRendezvous | None,
    rendezvous_error: str | None,
    crashed: bool,
) -> int:
    """The node's exit code from its last round that ran ranks, logged and written to the node exit file."""
    ran = rounds.current.group_rank is not None
    last = rounds.current if ran else rounds.previous
    # A rank's own record wins over how the engine saw it end (a killed rank has none).
    codes = {rank: failure for rank, failure in failures.items()} if ran else {}
    records = last.records if last else {}
    codes |= {rank: record.code for rank, record in records.items()}
    if ran and len(codes) < processes:
        # A rank of this node that left neither a record nor an engine failure did not end cleanly.
        code = group_exit_code([*codes.values(), int(ExitCode.FAILED)])
    elif ran:
        code = group_exit_code(list(codes.values()))
    else:
        code = int(ExitCode.STOPPED) if rounds.stop_signal is not None else int(ExitCode.FAILED)
    rendezvous_failed = False
    # Ranks of this node ran in the generation: whatever ended it (a rank killed, the store lost, a timeout)
    # it trained, and is never reported as never formed.
    trained = rounds.ranks_started() or bool(codes) or rounds.previous is not None
    if rendezvous_error is not None:
        # Exit 1, but the agent retries in a new generation instead of counting a failure, unless ranks of
        # this node ran (then the generation was lost, which the agent handles as such).
        rendezvous_failed = not trained
        code = int(ExitCode.FAILED)
        where = (
            f"{nodes.run_id} at {nodes.endpoint} ({nodes.min_nodes}:{nodes.max_nodes} nodes, join timeout "
            f"{nodes.join_timeout:g} s)"
            if nodes
            else "on this machine"
        )
        log.error("the rendezvous %s failed: %s; exit %d", where, rendezvous_error, ExitCode.FAILED)
    elif crashed:
        code = int(ExitCode.FAILED)
    elif code not in (ExitCode.COMPLETED, ExitCode.STOPPED):
        log.error("trainer ranks exited %s; group exit %d", dict(sorted(codes.items())), code)
    if nodes is not None and nodes.exit_file is not None:
        steps = [record.step for record in records.values() if record.step is not None]
        sizes = [record.world_size for record in records.values() if record.world_size is not None]
        if not sizes and last is not None and last.nodes is not None:
            sizes = [last.nodes * processes]  # no record: as many ranks on every node as on this one
        NodeExit(
            exit_code=code,
            ranks=codes,
            stopped_step=max(steps) if steps else None,
            rank0_here=last is not None and last.group_rank == 0,
            rendezvous_failed=rendezvous_failed,
            world_size=max(sizes) if sizes else None,
            trained=trained,
            ended_by=rendezvous_error,
        ).write(nodes.exit_file)
    return code

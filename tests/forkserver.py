"""Process lives forked from one interpreter that has already imported what they import (torch, ...).

A trainer life started as `python -m training` spends ~3.7 of its ~5 CPU-seconds importing torch and
torchvision, a Lightning job's life ~5 of its ~6 importing Lightning; a resume test runs several lives of one
job. Here one server process pays the imports once, then forks a child per life that runs what `python
ARGV...` runs (`-m module` as runpy's run_module, a script as run_path, both as `__main__`), with the life's
own argv, environment, working directory and output file. Each life is still its own process: the test
kills or signals it by pid, it ends by the interpreter's own shutdown (atexit, thread joins) or by the
signal, and its exit status reaches the test as `Popen.returncode` would (negative for a signal).

What a fork does not reproduce, and who covers it instead: a stop during the interpreter's start and its
imports (tests/training/test_startup.py starts real processes, and `make demo` runs the stories' lives as
real processes); a per-process hash seed (the lives of one server share it: the baseline the trainer's
resume tests compare with is a real `python -m training` process, so a result that depended on string
hashing would differ from it); the code the life's PYTHONPATH names first (a demo instance's unpacked
bundle): the server's modules are the repository's, which the bundle is a copy of. A `sitecustomize` on the
life's PYTHONPATH does run, as `site` runs it, but after the server's imports rather than before them (the
multi-node stories' hooks, tests/bootstrap/multinode_harness.py, patch what is imported already).

The server (`python -m tests.forkserver FD LISTENING PYTHON MODULE...`) imports MODULE..., then reads one
JSON request per message on the SOCK_SEQPACKET socket FD ({"argv", "env", "cwd", "log", "status", "fds"},
with the file descriptors the life inherits under the numbers "fds" names, as Popen's pass_fds), answers
{"pid"}, and writes each child's status as JSON ({"returncode"}) to the request's status file once it has
reaped it. It exits when the test closes its end.

It also accepts, on the listening SOCK_SEQPACKET socket LISTENING (bound at a path beside PYTHON), what starts
`python` itself: a stand-in process (tests/forkpython.py, run by the executable PYTHON, `ForkServer.python`)
sends the same request with its own stdio among the descriptors, gets {"pid"}, and on the same connection
{"returncode"} once the life is reaped; if the stand-in's connection closes first (it was killed), the server
kills the life and every process under it. Every life's `sys.executable` is PYTHON, so the ranks torch's
launcher starts from a forked life are forked too (each rank otherwise imports torch again). A stand-in's
life is the server's child, not the stand-in's: `ForkServer.tree` finds a whole tree for a test that
signals one (the server names each running life in a file under the stand-in's pid).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from demo.instance import children_by_parent, descendants

REPO = Path(__file__).resolve().parents[1]
# What every trainer life imports (an S3 life its persister too, a launcher torch's elastic engine, a
# completed job pyplot, with the Agg backend training/plots.py picks: MPLBACKEND below), and an agent life
# (the multi-node stories start their agents forked too).
TRAINER_MODULES = (
    "bootstrap.agent",
    "bootstrap.lifecycle",
    "matplotlib.pyplot",
    "training.launch",
    "training.loop",
    "training.store",
    "bootstrap.persist",
    "torch.distributed.launcher.api",
    "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
)
# The folder (beside the stand-in) where the server names each stand-in's life.
LIVES = "lives"
# A request (its environment included) fits in one message of this size.
MESSAGE_BYTES = 1 << 20
MAX_FDS = 8
# How long a start may wait for the server's answer: the first waits for its imports too (torch, ...), on a
# loaded 2-core machine; past it the test fails naming the server, not by the global timeout.
START_TIMEOUT_S = 180.0

# -- the test side ------------------------------------------------------------------------------------------

_RUNNING: list[ForkServer] = []


def running_pids() -> list[int]:
    """The pids of this process's fork servers that run now (bench/suitecost.py reads their CPU)."""
    return [server._process.pid for server in _RUNNING]


class ForkedLife:
    """The parts of `subprocess.Popen` the tests use, for a life forked by the server."""

    def __init__(self, pid: int, log: Path, status: Path) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._log = log
        self._status = status

    def poll(self) -> int | None:
        if self.returncode is None and self._status.exists():
            self.returncode = int(json.loads(self._status.read_text())["returncode"])
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked life {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # once reaped, the pid may be another process's
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        return self._log.read_text(errors="replace"), None


class ForkServer:
    """One server process that has imported `modules`; `start` forks a life from it. Its environment is
    this process's: what the libraries read once at import (OMP_NUM_THREADS) is the same in every life.
    MPLBACKEND=Agg makes a preloaded pyplot the one training/plots.py gets (it selects Agg itself)."""

    def __init__(self, modules: tuple[str, ...]) -> None:
        self._folder = Path(tempfile.mkdtemp(prefix="trainstack-forkserver-"))
        self.python = self._folder / "python"
        # One file per stand-in whose life runs, named by the stand-in's pid, holding the life's (`tree`).
        self._lives = self._folder / LIVES
        self._lives.mkdir()
        write_stand_in(self.python, self._folder / "socket")
        # Bound here, before the server's imports: a stand-in started meanwhile waits in the backlog.
        listening = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listening.bind(str(self._folder / "socket"))
        listening.listen(64)
        self._socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs, listening:
            self._process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.forkserver",
                    str(theirs.fileno()),
                    str(listening.fileno()),
                    str(self.python),
                    *modules,
                ],
                cwd=REPO,
                env={key: value for key, value in os.environ.items() if key != "TRAINSTACK_FAULT"}
                | {"MPLBACKEND": "Agg"},
                pass_fds=(theirs.fileno(), listening.fileno()),
            )
        self._socket.settimeout(START_TIMEOUT_S)
        self._count = 0
        _RUNNING.append(self)

    def start(
        self, argv: list[str], env: dict[str, str], cwd: Path, log: Path, pass_fds: tuple[int, ...] = ()
    ) -> ForkedLife:
        """`python *argv` in `cwd` with exactly `env`, its stdout and stderr written to `log`, inheriting
        `pass_fds` under the same numbers."""
        self._count += 1
        status = log.with_name(f"{log.name}.status-{self._count}")
        request = {
            "argv": argv,
            "env": env,
            "cwd": str(cwd),
            "log": str(log),
            "status": str(status),
            "fds": list(pass_fds),
        }
        socket.send_fds(self._socket, [json.dumps(request).encode()], list(pass_fds))
        try:
            reply = self._socket.recv(MESSAGE_BYTES)
        except TimeoutError:
            raise RuntimeError(f"the fork server started no life within {START_TIMEOUT_S} s") from None
        if not reply:
            raise RuntimeError(f"the fork server exited ({self._process.poll()}) before starting a life")
        return ForkedLife(int(json.loads(reply)["pid"]), log, status)

    def life_of(self, pid: int) -> int | None:
        """The life a stand-in process (`pid`) stands for, while it runs; None for any other process."""
        try:
            return int((self._lives / str(pid)).read_text())
        except (OSError, ValueError):
            return None

    def tree(self, pid: int) -> list[int]:
        """`pid` and every process under it, as a test that signals a whole tree needs it: the life a stand-in
        stands for counts as under the stand-in (it is the server's child), and so does all it started. One
        read of /proc and of the server's names, however many stand-ins the tree holds."""
        children = children_by_parent()
        for file in self._lives.iterdir():
            with contextlib.suppress(OSError, ValueError):
                children.setdefault(int(file.name), []).append(int(file.read_text()))
        return [pid, *descendants(pid, children)]

    def close(self) -> None:
        _RUNNING.remove(self)
        self._socket.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        shutil.rmtree(self._folder, ignore_errors=True)


def write_stand_in(path: Path, server: Path) -> None:
    """The executable that stands in for `python` (tests/forkpython.py): this interpreter, isolated and
    without site-packages (it needs the standard library only), asking the server at `server` for the life."""
    path.write_text(
        f"#!{sys.executable} -IS\n"
        "import sys\n"
        f"sys.path.insert(0, {str(REPO / 'tests')!r})\n"
        "import forkpython\n"
        f"forkpython.main({str(server)!r})\n"
    )
    path.chmod(0o755)


@contextlib.contextmanager
def serving(*modules: str) -> Iterator[ForkServer]:
    server = ForkServer(modules)
    try:
        yield server
    finally:
        server.close()


# -- the server side --------------------------------------------------------------------------------------


def _write_status(path: str, returncode: int) -> None:
    staging = Path(f"{path}.tmp")
    staging.write_text(json.dumps({"returncode": returncode}))
    staging.replace(path)  # the test never reads half a status


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _child(request: dict[str, Any], sockets: list[socket.socket], fds: list[int]) -> None:
    """In the forked child: become the life, then run `python *argv`. Never returns: its SystemExit goes up
    through the server's frames to the interpreter's own shutdown, as the program's would."""
    for held in sockets:
        held.close()
    # Received descriptors may sit on the numbers others are to be given: move them all out of the way first.
    moved = [os.dup(received) for received in fds]
    for received in fds:
        os.close(received)
    for fd, number in zip(moved, request["fds"], strict=True):
        os.dup2(fd, number)
        os.close(fd)
        os.set_inheritable(number, True)
    if "log" not in request:
        # A stand-in's life: its own session, as the agent and torch start theirs, and its blocked signals.
        os.setsid()
        signal.pthread_sigmask(signal.SIG_SETMASK, [signal.Signals(s) for s in request["blocked"]])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "log" in request:
        output = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(output)
        nothing = os.open(os.devnull, os.O_RDONLY)
        os.dup2(nothing, 0)
        os.close(nothing)
    # What this life starts as `python` (torch's launcher: its ranks) is forked from here too.
    sys.executable = request.get("executable") or sys.executable
    argv: list[str] = request["argv"]
    sys.orig_argv = [sys.executable, *argv]  # what an agent re-executes itself with (bootstrap/pinned.py)
    _run_sitecustomize(request["env"].get("PYTHONPATH", ""))
    if argv and argv[0] == "-m" and len(argv) > 1:
        sys.argv = ["-m", *argv[2:]]  # run_module sets argv[0] to the module's file, as python -m does
        sys.path[0] = str(Path.cwd())  # as python -m has it
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv and argv[0] == "-c" and len(argv) > 1:
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""  # as python -c has it
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    elif argv and not argv[0].startswith("-"):
        sys.argv = list(argv)
        sys.path[0] = str(Path(argv[0]).resolve().parent)
        runpy.run_path(argv[0], run_name="__main__")
    else:
        # An interpreter option would have to change an interpreter that has started already: say so, as
        # python says of a bad option (exit 2), rather than run something else.
        sys.stderr.write(
            f"tests/forkserver.py: a forked life runs `-m MODULE`, `-c CODE` or a script, not {argv[:2]}; "
            "start this one as a process of its own\n"
        )
        sys.exit(2)
    sys.exit(0)


def _run_sitecustomize(pythonpath: str) -> None:
    """What `site` does at a real interpreter's start: run the first `sitecustomize.py` on the life's
    PYTHONPATH (the multi-node stories hook their launchers that way, tests/bootstrap/multinode_harness.py).
    It runs after the server's imports, not before them: a hook must patch what is imported already."""
    for entry in filter(None, pythonpath.split(os.pathsep)):
        path = Path(entry) / "sitecustomize.py"
        if path.is_file():
            spec = importlib.util.spec_from_file_location("sitecustomize", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules["sitecustomize"] = module
            spec.loader.exec_module(module)
            return


def _kill_tree(pid: int) -> None:
    """SIGKILL to `pid` and every process under it (torch starts each rank in a session of its own)."""
    for each in [*descendants(pid), pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, signal.SIGKILL)


def _answer(connection: socket.socket, message: dict[str, int]) -> None:
    with contextlib.suppress(OSError):  # a stand-in already gone hears nothing
        connection.send(json.dumps(message).encode())


def serve(control: socket.socket, listener: socket.socket, stand_in: str) -> None:
    status_files: dict[int, str] = {}  # pid -> status file, for the test's own lives
    stand_ins: dict[socket.socket, int | None] = {}  # connection -> its life's pid (None: not asked yet)
    lives = Path(stand_in).parent / LIVES
    named: dict[int, Path] = {}  # life -> the file naming it under its stand-in's pid (ForkServer.life_of)

    def ended(life: int) -> None:
        if (file := named.pop(life, None)) is not None:
            file.unlink(missing_ok=True)

    while True:
        readable, _, _ = select.select([control, listener, *stand_ins], [], [], 0.05)  # and reap every 50 ms
        while status_files or any(pid is not None for pid in stand_ins.values()):
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in status_files:
                _write_status(status_files.pop(pid), _returncode(status))
                continue
            ended(pid)
            for connection, life in list(stand_ins.items()):
                if life == pid:
                    _answer(connection, {"returncode": _returncode(status)})
                    connection.close()
                    del stand_ins[connection]
        for ready in readable:
            if ready is listener:
                connection, _ = listener.accept()
                stand_ins[connection] = None
                continue
            if ready is not control and ready not in stand_ins:
                continue  # answered and closed above
            message, fds, _, _ = socket.recv_fds(ready, MESSAGE_BYTES, MAX_FDS * 4)
            if ready is control and not message:
                return  # the test process is done or gone; its lives are reaped by its own fixtures
            if ready is not control and not message:
                # The stand-in is gone before its life: killed, as the life and all under it now are.
                life = stand_ins.pop(ready)
                ready.close()
                if life is not None:
                    _kill_tree(life)
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(life, 0)
                    ended(life)
                continue
            request = json.loads(message)
            request.setdefault("executable", stand_in)
            pid = os.fork()
            if pid == 0:
                _child(request, [control, listener, *stand_ins], fds)
            for fd in fds:
                os.close(fd)
            if ready is control:
                status_files[pid] = request["status"]
                control.send(json.dumps({"pid": pid}).encode())
            else:
                stand_ins[ready] = pid
                named[pid] = lives / str(request["pid"])
                staging = named[pid].with_suffix(".tmp")
                staging.write_text(str(pid))
                staging.replace(named[pid])  # a test never reads half a pid
                _answer(ready, {"pid": pid})


if __name__ == "__main__":
    # The lives' imports, paid once here; nothing more: no logging set up, no thread started (a fork
    # copies only the thread that forks).
    for module in sys.argv[4:]:
        importlib.import_module(module)
    # Everything imported so far lives as long as the server and every life: out of the collector's sight,
    # as Python's gc docs advise before fork() without exec(). Otherwise each full collection in a life walks
    # the ~400,000 objects of torch, matplotlib and the rest again (0.19 s each, measured) and writes to every
    # page it walks, so the copy-on-write copies them.
    gc.collect()
    gc.freeze()
    serve(socket.socket(fileno=int(sys.argv[1])), socket.socket(fileno=int(sys.argv[2])), sys.argv[3])

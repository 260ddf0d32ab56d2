"""`python ARGS...` as a process forked from the worker's fork server (tests/forkserver.py), for the places
that start `python` themselves: the demo's agents start the built-in trainer through it
(TRAINSTACK_DEMO_TRAINER_PYTHON, demo/agent.py), and torch's launcher starts a forked life's ranks through it
(the life's `sys.executable`).

The fork server writes a small executable per worker that runs `main(SOCKET)` under `python -I -S` (the
standard library only: it starts in milliseconds). It stands in for the process it asked the server to
fork, so that whoever started it sees what a `python` process would show:
- the life gets this process's argv, environment, working directory, open file descriptors (stdin, stdout,
  stderr and any inherited one, under the same numbers) and blocked signals, in a session of its own (as
  the agent and torch start theirs);
- a signal sent to this process reaches the life (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2);
- this process exits with the life's exit status, or dies of the same signal;
- if this process is killed (SIGKILL to it or its group), the server kills the life and everything it
  started, as the agent's kill of a process group and its cgroup would.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
MESSAGE_BYTES = 1 << 20


def _open_fds() -> list[int]:
    """This process's open file descriptors, as the life should inherit them (listing /proc/self/fd opens
    one more, which is closed again by the time it is checked)."""
    found = []
    for name in os.listdir("/proc/self/fd"):  # noqa: PTH208 - pathlib's import costs the stand-in's start
        fd = int(name)
        try:
            os.fstat(fd)
        except OSError:
            continue
        found.append(fd)
    return sorted(found)


def main(server: str) -> None:
    life: list[int] = []
    early: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if not life:
            early.append(signum)  # sent on once the life exists
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(life[0], signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    # What the starter blocked (the agent blocks SIGTERM until the trainer's handler exists) the life blocks;
    # this process takes everything so that it can pass it on, and the life keeps it pending meanwhile.
    blocked = signal.pthread_sigmask(signal.SIG_SETMASK, [])
    fds = _open_fds()
    control = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    control.connect(server)
    request = {
        "pid": os.getpid(),  # the server records which life stands behind this process (ForkServer.tree)
        "argv": sys.argv[1:],
        "env": dict(os.environ),
        "cwd": os.getcwd(),  # noqa: PTH109 - as above
        "fds": fds,
        "blocked": sorted(int(s) for s in blocked),
    }
    socket.send_fds(control, [json.dumps(request).encode()], fds)
    for fd in fds:
        if fd > 2:
            os.close(fd)  # the life holds them now: a listening socket must not stay open here too
    reply = control.recv(MESSAGE_BYTES)
    if not reply:
        sys.stderr.write(f"forkpython: the fork server at {server} exited before starting the life\n")
        os._exit(1)
    life.append(int(json.loads(reply)["pid"]))
    for waiting in early:
        forward(waiting, None)
    status = control.recv(MESSAGE_BYTES)
    if not status:
        sys.stderr.write(f"forkpython: the fork server at {server} exited before the life ended\n")
        os._exit(1)
    code = int(json.loads(status)["returncode"])
    if code < 0:
        # Die of the same signal, as the process it stands for did.
        with contextlib.suppress(OSError):  # SIGKILL and SIGSTOP have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)

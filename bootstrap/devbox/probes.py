"""What the dev box's users are doing now: sessions from /proc, busy kernels from Jupyter, the GPU from NVML.

Every probe answers "none" rather than failing: a probe that cannot see is no reason to keep a box billing,
and none of them may stop the watcher from sampling the others.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path

from bootstrap.devbox.idle import Sample
from bootstrap.gpumetrics import gpu_utilization_percent

# Session Manager starts one of these per session (shell, port forward, the SSH ProxyCommand's tunnel).
SSM_SESSION_WORKER = "ssm-session-worker"
# Jupyter Server (jpserver-*) and classic Notebook (nbserver-*) runtime files: port, base URL and token.
JUPYTER_RUNTIME_GLOBS = ("jpserver-*.json", "nbserver-*.json")
JUPYTER_RUNTIME_DIR = Path(".local/share/jupyter/runtime")


def _command_lines(proc: Path) -> Iterable[list[str]]:
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # the process ended between the listing and the read
        if raw:
            yield [part.decode(errors="replace") for part in raw.rstrip(b"\0").split(b"\0")]


def count_ssm_sessions(proc: Path = Path("/proc")) -> int:
    return sum(1 for argv in _command_lines(proc) if Path(argv[0]).name == SSM_SESSION_WORKER)


def count_ssh_sessions(proc: Path = Path("/proc")) -> int:
    """sshd's per-login process titles itself `sshd: USER@pts/N` or `sshd: USER@notty` (rsync, VS Code's
    server, PyCharm); OpenSSH 9.8+ names it `sshd-session: USER@...`. The listener (`sshd: /usr/sbin/sshd
    -D [listener] ...`) and a login still authenticating (`sshd: USER [priv]`) carry no `@`."""
    count = 0
    for argv in _command_lines(proc):
        title = " ".join(argv)
        if title.startswith(("sshd: ", "sshd-session: ")) and "@" in title.split(":", 1)[1]:
            count += 1
    return count


def _runtime_files(homes: Iterable[Path]) -> list[Path]:
    found: list[Path] = []
    for home in homes:
        folder = home / JUPYTER_RUNTIME_DIR
        for pattern in JUPYTER_RUNTIME_GLOBS:
            found += sorted(folder.glob(pattern))
    return found


def _busy_kernels_of(runtime: Path, timeout_s: float) -> int:
    try:
        server = json.loads(runtime.read_text(encoding="utf-8"))
        port = int(server["port"])
        base = str(server.get("base_url") or "/")
        token = str(server.get("token") or "")
    except (OSError, ValueError, KeyError, TypeError):
        return 0  # a stale or half-written runtime file: that server reports nothing
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{base.rstrip('/')}/api/kernels",
        headers={"Authorization": f"token {token}"} if token else {},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            kernels = json.loads(response.read().decode())
    except (urllib.error.URLError, OSError, ValueError):
        return 0  # the server is gone (its runtime file outlived it) or refuses the token
    if not isinstance(kernels, list):
        return 0
    return sum(
        1 for kernel in kernels if isinstance(kernel, dict) and kernel.get("execution_state") == "busy"
    )


def count_busy_kernels(homes: Iterable[Path], timeout_s: float = 2.0) -> int:
    """Kernels executing a cell now, over every Jupyter server whose runtime file is in a user's home. An
    open but idle notebook is not use: a browser tab left open must not keep the GPU billing."""
    return sum(_busy_kernels_of(runtime, timeout_s) for runtime in _runtime_files(homes))


def user_homes(root: Path = Path("/")) -> list[Path]:
    return [root / "root", *sorted((root / "home").glob("*"))]


def sampler(
    proc: Path = Path("/proc"),
    homes: Callable[[], Iterable[Path]] = user_homes,
    gpu: Callable[[], float | None] = gpu_utilization_percent,
    clock: Callable[[], float] = time.monotonic,
) -> Callable[[], Sample]:
    """A function that takes one sample of this machine."""

    def sample() -> Sample:
        return Sample(
            at=clock(),
            ssm_sessions=count_ssm_sessions(proc),
            ssh_sessions=count_ssh_sessions(proc),
            busy_kernels=count_busy_kernels(homes()),
            gpu_percent=gpu(),
        )

    return sample

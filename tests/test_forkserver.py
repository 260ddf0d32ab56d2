"""The fork server's stand-in for `python` (tests/forkpython.py): whoever starts it sees a `python` process.

The demo stories' agents and torch's launcher start lives through it, and the stories' promises (a stop
reaches the trainer, exit 75 is read as a stop, a killed trainer leaves nothing running) hold only if the
stand-in passes signals, exit statuses, descriptors and kills on as a real process would."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.forkserver import ForkServer, serving

LIFE = """
import json, os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
def stop(signum, frame):
    out.with_suffix(".signal").write_text(str(signum))
    sys.exit(75)
signal.signal(signal.SIGTERM, stop)
blocked = sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
what = {"argv": sys.argv[1:], "cwd": os.getcwd(), "env": os.environ.get("LIFE_VALUE"), "pid": os.getpid(),
        "executable": sys.executable, "blocked": blocked, "sid": os.getsid(0), "orig_argv": sys.orig_argv,
        "hooked": getattr(sys.modules.get("sitecustomize"), "HOOKED", None)}
if len(sys.argv) > 3:
    os.write(int(sys.argv[3]), b"through the inherited descriptor")
print("life says hello", flush=True)
mode = sys.argv[2]
if mode == "child":
    child = __import__("subprocess").Popen(["sleep", "300"], start_new_session=True)
    what["child"] = child.pid
elif mode == "nested":
    what["child"] = __import__("subprocess").Popen(
        [sys.executable, __file__, str(out.with_suffix(".grandchild")), "wait"]).pid
elif mode == "python":
    grandchild = __import__("subprocess").run(
        [sys.executable, __file__, str(out.with_suffix(".grandchild")), "exit-4"], check=False)
    what["grandchild_exit"] = grandchild.returncode
out.write_text(json.dumps(what))
if mode.startswith("exit-"):
    sys.exit(int(mode[5:]))
if mode == "die":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "python":
    sys.exit(0)
time.sleep(300)
"""


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    with serving("json") as started:
        yield started


@pytest.fixture()
def life_script(tmp_path: Path) -> Path:
    script = tmp_path / "life.py"
    script.write_text(LIFE)
    return script


def wait_for(path: Path, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.02)
    return path.read_text()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return False  # a zombie: dead, not yet reaped
    return True


def test_the_life_gets_argv_cwd_env_stdout_and_an_inherited_descriptor_and_its_exit_status_comes_back(
    server: ForkServer, life_script: Path, tmp_path: Path
) -> None:
    out = tmp_path / "life.json"
    reading, writing = os.pipe()
    process = subprocess.Popen(
        [str(server.python), str(life_script), str(out), "exit-3", str(writing)],
        cwd=tmp_path,
        env={**os.environ, "LIFE_VALUE": "given"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        pass_fds=(writing,),
        text=True,
    )
    os.close(writing)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 3, output
    assert "life says hello" in output
    assert os.read(reading, 100) == b"through the inherited descriptor"
    os.close(reading)
    what = __import__("json").loads(out.read_text())
    assert what["argv"] == [str(out), "exit-3", str(writing)]
    assert what["cwd"] == str(tmp_path) and what["env"] == "given"
    # A forked life, not the stand-in itself; and in a session of its own, as the agent starts its trainer.
    assert what["pid"] != process.pid and what["sid"] == what["pid"]
    assert what["executable"] == str(server.python)


def test_a_signal_to_the_stand_in_reaches_the_life_and_blocked_signals_stay_blocked_there(
    server: ForkServer, life_script: Path, tmp_path: Path
) -> None:
    out = tmp_path / "life.json"
    # The agent blocks SIGTERM while it starts the trainer (bootstrap/trainer.py, defer_early_signals).
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    try:
        process = subprocess.Popen([str(server.python), str(life_script), str(out), "wait"], cwd=tmp_path)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    what = __import__("json").loads(wait_for(out))
    assert int(signal.SIGTERM) in what["blocked"]
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 75
    assert out.with_suffix(".signal").read_text() == str(int(signal.SIGTERM))


def test_a_life_killed_by_a_signal_kills_the_stand_in_by_the_same_signal(
    server: ForkServer, life_script: Path, tmp_path: Path
) -> None:
    process = subprocess.Popen([str(server.python), str(life_script), str(tmp_path / "life.json"), "die"])
    assert process.wait(timeout=60) == -signal.SIGKILL


def test_killing_the_stand_ins_group_kills_the_life_and_what_it_started_in_a_session_of_its_own(
    server: ForkServer, life_script: Path, tmp_path: Path
) -> None:
    out = tmp_path / "life.json"
    process = subprocess.Popen(
        [str(server.python), str(life_script), str(out), "child"], start_new_session=True
    )
    what = __import__("json").loads(wait_for(out))
    assert alive(what["pid"]) and alive(what["child"])
    os.killpg(process.pid, signal.SIGKILL)  # as the agent kills its trainer (TrainerProcess.kill)
    assert process.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while alive(what["pid"]) or alive(what["child"]):
        assert time.monotonic() < deadline, "the life or its child outlived its killed stand-in"
        time.sleep(0.05)


def test_what_a_life_starts_as_python_is_forked_too(
    server: ForkServer, life_script: Path, tmp_path: Path
) -> None:
    out = tmp_path / "life.json"
    life = subprocess.run([str(server.python), str(life_script), str(out), "python"], timeout=60, check=False)
    assert life.returncode == 0
    what = __import__("json").loads(out.read_text())
    # The grandchild ran through the stand-in (the life's sys.executable) and its exit status came back.
    assert what["grandchild_exit"] == 4
    grandchild = __import__("json").loads(out.with_suffix(".grandchild").read_text())
    assert grandchild["executable"] == str(server.python)


def test_python_dash_c_runs_forked_and_an_interpreter_option_is_refused_in_one_line(
    server: ForkServer, tmp_path: Path
) -> None:
    out = tmp_path / "said"
    code = "import sys, pathlib; pathlib.Path(sys.argv[1]).write_text(f'{__name__} {sys.argv[0]}'); exit(5)"
    ran = subprocess.run([str(server.python), "-c", code, str(out)], timeout=60, check=False)
    assert ran.returncode == 5 and out.read_text() == "__main__ -c"

    refused = subprocess.run(
        [str(server.python), "-X", "importtime", "-c", "pass"],
        timeout=60,
        check=False,
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and "start this one as a process of its own" in refused.stderr


def test_what_the_server_imported_is_frozen_in_a_life_and_the_lifes_own_garbage_is_still_collected(
    server: ForkServer, tmp_path: Path
) -> None:
    out = tmp_path / "said"
    code = (
        "import gc, json, sys, weakref, pathlib\n"
        "class Cycle:\n"
        "    def __init__(self): self.me = self\n"
        "json_walked = any(any(o is json for o in gc.get_objects(g)) for g in range(3))\n"
        "ref = weakref.ref(Cycle()); gc.collect()\n"
        "pathlib.Path(sys.argv[1]).write_text(json.dumps("
        "[gc.get_freeze_count(), json_walked, ref() is None]))\n"
    )
    ran = subprocess.run([str(server.python), "-c", code, str(out)], timeout=60, check=False)
    assert ran.returncode == 0
    frozen, json_walked, cycle_collected = __import__("json").loads(out.read_text())
    # The server imported json (its preload): frozen, so no full collection in a life walks it again.
    assert frozen > 1000 and json_walked is False
    assert cycle_collected is True


def test_a_tree_through_stand_ins_holds_every_life_and_a_sitecustomize_on_pythonpath_runs_in_each(
    server: ForkServer, life_script: Path, tmp_path: Path
) -> None:
    """The multi-node stories freeze and kill whole trees (ForkServer.tree), and hook their launchers and
    ranks through a `sitecustomize` on PYTHONPATH, as `site` loads it in a real interpreter."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text("HOOKED = 'by the hooks folder'\n")
    out = tmp_path / "life.json"
    process = subprocess.Popen(
        [str(server.python), str(life_script), str(out), "nested"],
        env={**os.environ, "PYTHONPATH": f"{tmp_path / 'nothing'}{os.pathsep}{hooks}"},
        start_new_session=True,
    )
    what = __import__("json").loads(wait_for(out))
    grandchild = __import__("json").loads(wait_for(out.with_suffix(".grandchild")))
    assert what["hooked"] == grandchild["hooked"] == "by the hooks folder"
    # What an agent re-executes itself with (bootstrap/pinned.py): the stand-in and the life's own argv.
    assert what["orig_argv"] == [str(server.python), str(life_script), str(out), "nested"]
    # The life is the server's child, not the stand-in's; the tree holds it, its stand-in child, that one's
    # life, and nothing of another tree.
    assert server.life_of(process.pid) == what["pid"] and server.life_of(what["child"]) == grandchild["pid"]
    tree = server.tree(process.pid)
    assert sorted(tree) == sorted([process.pid, what["pid"], what["child"], grandchild["pid"]])
    assert server.life_of(what["pid"]) is None and server.tree(what["child"]) == [
        what["child"],
        grandchild["pid"],
    ]
    for pid in tree:
        os.kill(pid, signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while server.life_of(process.pid) is not None or server.life_of(what["child"]) is not None:
        assert time.monotonic() < deadline, "a reaped life is still named under its stand-in"
        time.sleep(0.05)

"""Issue 34 part 1: two jobs on one instance are kept apart (bootstrap/supervisor.py, bootstrap/jobuser.py,
bootstrap/jobbinding.py claim_scratch, bootstrap/lifecycle.py).

Jobs run one after another on the same instance as the same unprivileged user. Job A must leave nothing that
job B meets: A's credential refresher stops at A's end and its credentials leave the instance (B's file is
its own), A's home, venvs, pip's cache and pip configuration are gone when B takes the scratch folder, and
a process A daemonized (out of its process group; there is no systemd scope here, the fallback the agent
uses without systemd) is killed before B starts. Whatever A's life ends with, an exception included.

As root only: the job runs as a user of its own here, a uid nobody else on the machine has (not `nobody`,
whose other processes the end of a job would kill), so the test can check what that user still runs.
"""

from __future__ import annotations

import grp
import io
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bootstrap import jobuser, supervisor
from bootstrap.agent import Lives
from bootstrap.eventlog import EventLog
from bootstrap.jobuser import JobLaunch, JobUser
from bootstrap.lifecycle import InstanceLife
from demo.imds import ImdsSimulator
from demo.stack import LocalStack
from tests.bootstrap.test_queue_agent import submit
from trainstack_job.jobfile import JobSpec

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="runs the jobs as a user of their own: needs root and setpriv (CI runs it as root)",
)

A, B = "alpha-aaaaaaaa", "bravo-bbbbbbbb"
USER_NAME = "trainstack-test-jobs"

# One script for both jobs: A leaves everything a job can leave behind, B reports what it finds of it.
JOB = r"""
import json, os, subprocess, sys, time
from pathlib import Path

me, report = sys.argv[1], Path(sys.argv[2])
home = Path(os.environ["HOME"])
venv = Path(sys.prefix)
pip_cache = venv.parent / "pip-cache"  # bootstrap/job.py prepare_python: beside the venvs
planted = {
    "home": home / "left-by-a.txt",
    "home pip.conf": home / ".config" / "pip" / "pip.conf",
    "home cache": home / ".cache" / "pip" / "left-by-a",
    "venv": venv / "left-by-a",
    "venv pip.conf": venv / "pip.conf",
    "pip cache": pip_cache / "left-by-a",
    "pip cache pip.conf": pip_cache / ".config" / "pip" / "pip.conf",
    "tmp cache": Path(f"/tmp/trainstack-test-inductor-{os.getuid()}") / "kernel.py",
}


def others():
    # Every live process of this user but this one.
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            status = dict(l.split(":", 1) for l in (entry / "status").read_text().splitlines() if ":" in l)
        except OSError:
            continue
        if int(status["Uid"].split()[0]) == os.getuid() and status["State"].split()[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return found


seen = {"uid": os.getuid(), "config_file": os.environ.get("AWS_CONFIG_FILE"), "venv": str(venv)}
if me == "a":
    for path in planted.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "[global]\nindex-url = https://attacker.invalid/simple\n" if path.name == "pip.conf" else "a\n"
        path.write_text(text)
    quiet = subprocess.DEVNULL
    daemon = subprocess.Popen(
        ["sleep", "1000"], start_new_session=True, stdin=quiet, stdout=quiet, stderr=quiet
    )
    seen["daemon"] = daemon.pid
    (report / "a.json").write_text(json.dumps(seen))
else:
    a = json.loads((report / "a.json").read_text())
    seen["found"] = sorted(name for name, path in planted.items() if path.exists())
    seen["others"] = others()
    seen["a_credentials_left"] = bool(a["config_file"]) and Path(a["config_file"]).parent.exists()
    (report / "b.json").write_text(json.dumps(seen))
    deadline = time.monotonic() + 60
    while not (report / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
"""


def _running_as(uid: int) -> list[int]:
    """Live processes whose real uid is `uid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            lines = (entry / "status").read_text().splitlines()
        except OSError:
            continue
        status = dict(line.split(":", 1) for line in lines if ":" in line)
        if int(status["Uid"].split()[0]) == uid and status["State"].split()[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def _kill_everything_of(user: JobUser) -> None:
    """The test's own clean-up (it must work on code without JobLaunch.end_all too): kill(-1) as `user`,
    which reaches that uid's processes only; the snippet refuses to run as any other uid (as root it would
    end every process on the machine)."""
    assert user.uid not in (0, os.getuid())
    code = (
        f"import os, signal, sys\nif os.getuid() != {user.uid} or os.geteuid() != {user.uid}: sys.exit(3)\n"
        "os.kill(-1, signal.SIGKILL)\n"
    )
    setpriv = [f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups", "--no-new-privs", "--"]
    subprocess.run(["setpriv", *setpriv, sys.executable, "-I", "-S", "-c", code], check=False, timeout=30)


@pytest.fixture()
def job_user() -> Iterator[JobUser]:
    """A uid (and gid) no account, group or process on this machine has; each xdist worker its own range,
    so two workers never share one."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    start = 61_000 + 40 * (int(worker) if worker.isdigit() else 0)
    for uid in range(start, start + 40):
        try:
            pwd.getpwuid(uid)
            continue
        except KeyError:
            pass
        try:
            grp.getgrgid(uid)
            continue
        except KeyError:
            pass
        if not _running_as(uid):
            break
    else:
        pytest.fail("no free uid in the range tried for the job's user: free one, or widen the range")
    user = JobUser(USER_NAME, uid, uid)
    yield user
    _kill_everything_of(user)
    for folder in (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm")):
        for path in folder.glob(f"trainstack-test-inductor-{uid}"):
            shutil.rmtree(path, ignore_errors=True)


@dataclass
class Instance:
    """One instance's folders, readable by the job's user (pytest's own tmp folder is root's alone)."""

    scratch: Path
    code: Path
    report: Path
    credentials: Path
    user: JobUser
    events: list[dict[str, Any]]

    def said(self, containing: str) -> list[dict[str, Any]]:
        return [e for e in self.events if containing in e["message"]]


@pytest.fixture()
def instance(
    stack: LocalStack, imds: ImdsSimulator, job_user: JobUser, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Instance]:
    folders = [Path(tempfile.mkdtemp(prefix=f"trainstack-apart-{name}-")) for name in ("s", "c", "r", "k")]
    for folder in folders:
        folder.chmod(0o755)
    scratch, code, report, credentials = folders
    report.chmod(0o777)  # the jobs write what they saw here: it outlives A's scratch
    (code / "job.py").write_text(JOB)
    (code / "requirements.txt").write_text("# nothing to install: the venv is still the job's own\n")
    # The agent's launch as it is on an instance without systemd: the job's own user, its process group.
    monkeypatch.setattr(jobuser, "_detected", JobLaunch(user=job_user, reason="test"))
    monkeypatch.setattr(supervisor, "CREDENTIALS_DIR", credentials)
    yield Instance(scratch, code, report, credentials, job_user, [])
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def _spec(name: str, which: str, report: Path) -> dict[str, Any]:
    return JobSpec(
        name=name,
        command=("python", "job.py", which, str(report)),
        requirements="requirements.txt",
        data_sync=False,
    ).to_mapping()


def _life(stack: LocalStack, box: Instance, **config: Any) -> InstanceLife:
    log = EventLog(io.StringIO())
    log.add_sink(lambda line: box.events.append(json.loads(line)))
    return InstanceLife(
        stack.agent_config(
            poll_seconds=0.2,
            scratch_dir=str(box.scratch),
            # The stack's own job role, the one its instance role may take.
            job_role_arn=f"arn:aws:iam::123456789012:role/{stack.name}-job",
            **config,
        ),
        log=log,
        identity_wait_seconds=2,
        release_wait_seconds=0,
        state_poll_seconds=0.5,
        tick_seconds=0.1,
        job_root=box.code,
    )


def _refreshers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "job-credentials" and t.is_alive()]


def _wait_for(check: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_job_b_meets_nothing_of_job_a_on_the_same_instance(stack: LocalStack, instance: Instance) -> None:
    box = instance
    submit(stack, A, {}, "2026-12-01T12:00:01.000Z", user_job=_spec("alpha", "a", box.report))
    submit(stack, B, {}, "2026-12-01T12:00:02.000Z", user_job=_spec("bravo", "b", box.report))
    lives = Lives(_life(stack, box, job_id=""))
    running = ThreadPoolExecutor(max_workers=1).submit(lives.run)
    try:
        _wait_for(lambda: (box.report / "b.json").exists() or running.done(), "job B to report")
        assert not running.done(), running.result()
        a = json.loads((box.report / "a.json").read_text())
        b = json.loads((box.report / "b.json").read_text())
        # While B runs: A's refresher has stopped and A's credentials are gone; B's are its own.
        assert len(_refreshers()) == 1, "job A's credential refresher still runs beside job B's"
        assert a["config_file"] and b["config_file"] and a["config_file"] != b["config_file"]
        assert not Path(a["config_file"]).parent.exists() and not b["a_credentials_left"]
        # Nothing of A's home, venv, pip cache, pip.conf or shared-folder cache reaches B.
        assert b["found"] == [], f"job B found what job A left: {b['found']}"
        # A's daemon was killed before B started; B runs alone as the job's user.
        assert a["daemon"] not in _running_as(box.user.uid)
        assert b["others"] == [], "a process job A left running was still there when job B ran"
        assert a["uid"] == b["uid"] == box.user.uid
    finally:
        (box.report / "go").write_text("")
    result = running.result(timeout=120)
    assert result.outcome == "completed"
    assert [e["job_id"] for e in box.said("job bound")] == [A, B]
    assert len(box.said(f"ended 1 process(es) the job left running as {USER_NAME}")) == 1
    # B's end closed B's too: nothing of either job's credentials or processes outlives its life.
    assert _refreshers() == [] and list(box.credentials.iterdir()) == []
    assert _running_as(box.user.uid) == []


def test_a_life_that_ends_in_an_exception_still_ends_its_jobs_processes_and_credentials(
    stack: LocalStack, instance: Instance, monkeypatch: pytest.MonkeyPatch
) -> None:
    box = instance

    def broken(self: InstanceLife, outcome: Any) -> Any:
        raise RuntimeError("the outcome could not be written")

    # Past the life's own catch-all: the exception leaves InstanceLife.run, as an agent bug would.
    monkeypatch.setattr(InstanceLife, "_finish", broken)
    life = _life(stack, box, job_id=A, user_job=_spec("alpha", "a", box.report))
    with pytest.raises(RuntimeError, match="could not be written"):
        life.run()
    a = json.loads((box.report / "a.json").read_text())
    assert a["daemon"] not in _running_as(box.user.uid), "the job's daemon outlived its life"
    assert _running_as(box.user.uid) == []
    assert _refreshers() == [], "the job's credential refresher outlived its life"
    assert a["config_file"] and not Path(a["config_file"]).parent.exists()


def test_the_kill_runs_only_as_the_user_it_was_written_for(job_user: JobUser) -> None:
    """kill(-1) kills whatever its caller may signal: the snippet checks its own uid before it kills, so a
    setpriv that did not switch (or switched to another uid) kills nothing. Checked as the spare user only:
    a check that failed here would reach that user's one `sleep`, never anything else on the machine."""
    quiet = subprocess.DEVNULL
    ids = [f"--reuid={job_user.uid}", f"--regid={job_user.gid}", "--clear-groups", "--"]
    started = subprocess.run(
        ["setpriv", *ids, "setsid", "-f", "sleep", "300"],
        stdin=quiet,
        stdout=quiet,
        stderr=quiet,
        check=True,
        timeout=30,  # setsid -f returns at once, leaving the sleep behind
    )
    assert started.returncode == 0
    _wait_for(lambda: bool(_running_as(job_user.uid)), "the user's sleep to start", timeout=10)
    other = jobuser._KILL_ALL_OF_ME.format(uid=job_user.uid + 1)
    refused = subprocess.run(
        ["setpriv", *ids, sys.executable, "-I", "-S", "-c", other], check=False, timeout=60
    )
    assert refused.returncode == 3 and _running_as(job_user.uid), "the snippet killed as another uid"
    said: list[str] = []
    JobLaunch(user=job_user, reason="test").end_all(said.append)
    assert _running_as(job_user.uid) == []
    assert said == [f"ended 1 process(es) the job left running as {USER_NAME}"]

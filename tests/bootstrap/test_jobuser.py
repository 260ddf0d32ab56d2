"""The job as an unprivileged user with its own credentials (bootstrap/jobuser.py, issue 24 part 2).

The launch is run for real: as root the job becomes `nobody` with no groups and no new privileges, and the
agent still reads its output, signals and kills it; as any other user (CI's runner) the same path runs with
the test's own uid, which checks everything but the uid switch itself. The scope (systemd-run) needs systemd
as PID 1, so its command line and its kill are checked as data. The credentials are taken from moto's STS
and read back through a real botocore credential_process.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import boto3
import pytest

from bootstrap import jobuser
from bootstrap.jobuser import (
    AS_AGENT,
    JOB_USER,
    JobCredentials,
    JobLaunch,
    JobUser,
    detect,
    job_session_policy,
)
from bootstrap.trainer import TrainerPaths, TrainerProcess
from tests.iam.evaluate import Caller, Decision, Request, decide
from tests.tools import require_tool
from trainstack_job.contract import LATEST

REPO = Path(__file__).resolve().parents[2]
ROLE = "arn:aws:iam::123456789012:role/trainstack-dev-job"
JOB = "charlm-1a2b3c4d"


def _target() -> tuple[JobLaunch, bool]:
    """As root: `nobody`, privileged; otherwise this user, unprivileged (no uid switch is possible)."""
    if os.geteuid() == 0:
        nobody = pwd.getpwnam("nobody")
        return JobLaunch(user=JobUser("nobody", nobody.pw_uid, nobody.pw_gid), reason="test"), True
    me = JobUser(pwd.getpwuid(os.getuid()).pw_name, os.getuid(), os.getgid())
    return JobLaunch(user=me, privileged=False, reason="test"), False


# --- the session policy -------------------------------------------------------------------------------------


def test_session_policy_is_the_job_prefix_the_data_and_its_own_stream() -> None:
    document = job_session_policy(
        role_arn=ROLE,
        bucket="trainstack-dev-data",
        job_id=JOB,
        region="eu-west-1",
        log_group="/trainstack/dev",
        log_stream=f"{JOB}/i-0123/job",
    )
    by_sid = {s["Sid"]: s for s in document["Statement"]}
    bucket = "arn:aws:s3:::trainstack-dev-data"
    assert by_sid["ListOwnJobAndData"]["Condition"] == {
        "StringLike": {"s3:prefix": ["data/*", f"jobs/{JOB}/*"]}
    }
    assert by_sid["ReadData"] == {
        "Sid": "ReadData",
        "Effect": "Allow",
        "Action": "s3:GetObject",
        "Resource": f"{bucket}/data/*",
    }
    assert by_sid["ReadWriteOwnJob"]["Resource"] == f"{bucket}/jobs/{JOB}/*"
    assert by_sid["NeverOwnState"]["Effect"] == "Deny"
    assert by_sid["NeverOwnState"]["Resource"] == [
        f"{bucket}/jobs/{JOB}/state/*",
        f"{bucket}/jobs/{JOB}/job.json",
    ]
    assert by_sid["StackKeyThroughS3"]["Condition"] == {
        "StringEquals": {"kms:ViaService": "s3.eu-west-1.amazonaws.com"}
    }
    assert by_sid["OwnLogStream"]["Resource"] == (
        f"arn:aws:logs:eu-west-1:123456789012:log-group:/trainstack/dev:log-stream:{JOB}/i-0123/job"
    )
    # Nothing of the stack's state, nobody else's job, no other service.
    text = json.dumps(document)
    assert '"state/' not in text and "jobs/*" not in text
    assert {a.split(":")[0] for s in document["Statement"] for a in _actions(s)} == {"s3", "kms", "logs"}
    # AssumeRole takes a packed session policy of at most 2,048 characters.
    assert len(json.dumps(document, separators=(",", ":"))) < 2048


def test_the_legacy_job_gets_the_dataset_only_and_a_bad_role_is_refused() -> None:
    document = job_session_policy(
        role_arn=ROLE, bucket="b-data", job_id="legacy", region="us-east-1", log_group="/l", log_stream=None
    )
    assert {s["Sid"] for s in document["Statement"]} == {"ListOwnJobAndData", "ReadData", "StackKeyThroughS3"}
    with pytest.raises(ValueError, match="not an IAM role ARN"):
        job_session_policy(
            role_arn="arn:aws:iam::123:user/x",
            bucket="b",
            job_id=JOB,
            region="r",
            log_group="/l",
            log_stream=None,
        )


def _actions(statement: dict[str, Any]) -> list[str]:
    action = statement["Action"]
    return [action] if isinstance(action, str) else list(action)


def _session_caller(document: dict[str, Any]) -> Caller:
    """The session policy judged on its own, as the job's role session (the role's policy aside)."""
    return Caller("job-session", ROLE, "123456789012", [document])


def _decision(
    document: dict[str, Any], action: str, resource: str, context: dict[str, list[str]]
) -> Decision:
    request = Request(action, resource, context, known=frozenset({"s3:prefix", "kms:viaservice"}))
    return decide(request, _session_caller(document), None, key_policy=False)


def test_the_session_document_alone_grants_the_job_its_own_objects_its_key_use_and_its_stream() -> None:
    """Judged as AWS does, the session policy alone grants the job its own objects, key use and stream."""
    region = "eu-west-1"
    stream = f"{JOB}/i-0123/job"
    document = job_session_policy(
        role_arn=ROLE,
        bucket="b-data",
        job_id=JOB,
        region=region,
        log_group="/trainstack/dev",
        log_stream=stream,
    )
    bucket = "arn:aws:s3:::b-data"
    own = f"{bucket}/jobs/{JOB}"
    key = f"arn:aws:kms:{region}:123456789012:key/1234abcd"
    group = f"arn:aws:logs:{region}:123456789012:log-group:/trainstack/dev"
    via_s3 = {"kms:viaservice": [f"s3.{region}.amazonaws.com"]}
    writes = ("s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload")
    allowed: list[tuple[str, str, dict[str, list[str]]]] = [
        ("s3:ListBucket", bucket, {"s3:prefix": [f"jobs/{JOB}/checkpoints/"]}),
        ("s3:ListBucket", bucket, {"s3:prefix": ["data/train/"]}),
        ("s3:GetObject", f"{bucket}/data/train/0.png", {}),
        ("s3:GetObject", f"{own}/checkpoints/{LATEST}", {}),
        *((action, f"{own}/checkpoints/step-10/model.pt", {}) for action in ("s3:GetObject", *writes)),
        ("kms:Decrypt", key, via_s3),
        ("kms:GenerateDataKey", key, via_s3),
        ("logs:CreateLogStream", f"{group}:log-stream:{stream}", {}),
        ("logs:PutLogEvents", f"{group}:log-stream:{stream}", {}),
    ]
    refused: list[tuple[str, str, dict[str, list[str]]]] = [
        ("s3:ListBucket", bucket, {"s3:prefix": ["jobs/other-00000000/"]}),
        ("s3:ListBucket", bucket, {}),
        ("s3:ListBucket", "arn:aws:s3:::other-bucket", {"s3:prefix": ["data/"]}),
        ("s3:GetObject", "arn:aws:s3:::other-bucket/data/train/0.png", {}),
        ("s3:GetObject", f"{bucket}/jobs/other-00000000/checkpoints/x", {}),
        ("s3:PutObject", f"{bucket}/data/train/0.png", {}),
        *((action, f"{own}/state/ledger.json", {}) for action in writes),
        *((action, f"{own}/job.json", {}) for action in writes),
        *((action, f"{own}/checkpoints/{LATEST}", {}) for action in writes),
        ("kms:Decrypt", key, {"kms:viaservice": [f"ssm.{region}.amazonaws.com"]}),
        ("kms:Decrypt", key, {}),
        ("logs:PutLogEvents", f"{group}:log-stream:{JOB}/i-0123/agent", {}),
        ("s3:DeleteBucket", bucket, {}),
    ]
    for action, resource, context in allowed:
        assert _decision(document, action, resource, context).allowed, (action, resource, context)
    for action, resource, context in refused:
        assert not _decision(document, action, resource, context).allowed, (action, resource, context)
    # The document says why the pointer is not the job's: its denial names the statement.
    pointer = _decision(document, "s3:PutObject", f"{own}/checkpoints/{LATEST}", {})
    assert pointer.reason == "explicitly denied by NeverTheCheckpointPointer"


def test_the_legacy_jobs_session_lists_and_reads_the_dataset_only() -> None:
    """The legacy job has no prefix of its own: its session lists and reads `data/`, and no job's folder."""
    document = job_session_policy(
        role_arn=ROLE, bucket="b-data", job_id="legacy", region="us-east-1", log_group="/l", log_stream=None
    )
    bucket = "arn:aws:s3:::b-data"
    assert _decision(document, "s3:ListBucket", bucket, {"s3:prefix": ["data/"]}).allowed
    assert _decision(document, "s3:GetObject", f"{bucket}/data/x", {}).allowed
    for prefix in ("jobs/", "jobs/legacy/", "state/", ""):
        assert not _decision(document, "s3:ListBucket", bucket, {"s3:prefix": [prefix]}).allowed, prefix
    assert not _decision(document, "s3:GetObject", f"{bucket}/jobs/legacy/x", {}).allowed


@pytest.mark.parametrize(("job_id", "log_stream"), [(JOB, f"{JOB}/i-0123/job"), ("legacy", None)])
def test_the_session_policy_is_a_document_assume_role_accepts(job_id: str, log_stream: str | None) -> None:
    """The session policy is one AssumeRole accepts (else every job start fails): grammar and packed size."""
    document = job_session_policy(
        role_arn=ROLE,
        bucket="b-data",
        job_id=job_id,
        region="us-east-1",
        log_group="/l",
        log_stream=log_stream,
    )
    assert set(document) == {"Version", "Statement"}
    assert document["Version"] in ("2012-10-17", "2008-10-17")
    for statement in document["Statement"]:
        assert {"Sid", "Effect", "Action", "Resource"} <= set(statement) <= {
            "Sid", "Effect", "Action", "Resource", "Condition"
        }  # fmt: skip
        assert re.fullmatch(r"[A-Za-z0-9]+", statement["Sid"]), statement
        assert statement["Effect"] in ("Allow", "Deny"), statement
        assert all(re.fullmatch(r"(s3|kms|logs):[A-Za-z]+", action) for action in _actions(statement))
    assert len(json.dumps(document, separators=(",", ":"))) <= 2048


# --- who the job runs as ------------------------------------------------------------------------------------


def test_without_the_job_user_the_agent_runs_the_job_as_itself_and_says_why() -> None:
    launch = detect("trainstack-no-such-user")
    assert launch.user is None and not launch.isolated
    assert (
        launch.describe()
        == "the job runs as the agent's own user (no user trainstack-no-such-user on this machine)"
    )
    assert launch.wrap(["python", "train.py"], None) == ["python", "train.py"]
    assert launch.inherited_environment({"AWS_SECRET_ACCESS_KEY": "x"}, None) == {
        "AWS_SECRET_ACCESS_KEY": "x"
    }


def test_the_launch_is_detected_and_said_once_per_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobuser, "_detected", None)
    said: list[str] = []
    first = jobuser.job_launch(said.append)
    second = jobuser.job_launch(said.append)
    assert first is second and len(said) == 1
    if first.user is None:
        assert said[0].startswith("the job runs as the agent's own user")


def test_on_an_instance_the_job_is_wrapped_in_a_scope_bound_to_the_agent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(jobuser.shutil, "which", lambda name: f"/usr/bin/{name}")
    launch = JobLaunch(user=JobUser(JOB_USER, 998, 997), scope=True, agent_unit="trainstack-agent.service")
    unit = launch.unit_name()
    assert unit is not None and unit.startswith(f"trainstack-job-{os.getpid()}-") and unit.endswith(".scope")
    assert launch.wrap(["python", "-m", "training"], unit) == [
        "/usr/bin/systemd-run", "--scope", "--quiet", "--collect", f"--unit={unit}",
        "--property=TimeoutStopSec=10",
        "--property=BindsTo=trainstack-agent.service", "--property=Before=trainstack-agent.service",
        "--",
        "/usr/bin/setpriv", "--reuid=998", "--regid=997", "--clear-groups", "--inh-caps=-all",
        "--bounding-set=-all", "--no-new-privs", "--",
        "python", "-m", "training",
    ]  # fmt: skip
    assert "trainstack-job" in launch.describe() and "own systemd scope" in launch.describe()


def test_stopping_kills_the_whole_scope_not_only_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[list[str]] = []
    monkeypatch.setattr(jobuser.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(jobuser.subprocess, "run", lambda argv, **_: ran.append(argv))
    launch = JobLaunch(user=JobUser(JOB_USER, 998, 997), scope=True)
    launch.stop("trainstack-job-1-1.scope")
    launch.stop(None)
    assert ran == [["/usr/bin/systemctl", "kill", "--signal=SIGKILL", "trainstack-job-1-1.scope"]]


def test_the_job_inherits_no_agent_credentials_and_gets_a_home_of_its_own(tmp_path: Path) -> None:
    launch = JobLaunch(user=JobUser(JOB_USER, 998, 997))
    env = launch.inherited_environment(
        {
            "PATH": "/usr/bin",
            "AWS_ACCESS_KEY_ID": "AKIA",
            "AWS_SECRET_ACCESS_KEY": "s",
            "AWS_SESSION_TOKEN": "t",
            "AWS_PROFILE": "admin",
            "AWS_CONTAINER_CREDENTIALS_FULL_URI": "http://169.254.170.2/x",
            "AWS_REGION": "eu-west-1",
            "HOME": "/root",
        },
        tmp_path / "home",
    )
    assert env == {
        "PATH": "/usr/bin",
        "AWS_REGION": "eu-west-1",
        "HOME": str(tmp_path / "home"),
        "USER": JOB_USER,
        "LOGNAME": JOB_USER,
    }


def test_giving_the_job_its_directories_never_follows_its_links(tmp_path: Path) -> None:
    launch, _ = _target()
    assert launch.user is not None
    outside = tmp_path / "agent-secret"
    outside.write_text("root only")
    before = outside.stat()
    output = tmp_path / "output"
    (output / "nested").mkdir(parents=True)
    (output / "nested" / "metrics.json").write_text("{}")
    (output / "nested" / "escape").symlink_to(outside)
    (output / "dir-escape").symlink_to(tmp_path)
    launch.give([output, tmp_path / "home"])
    for path in (output, output / "nested", output / "nested" / "metrics.json", tmp_path / "home"):
        assert (path.stat().st_uid, path.stat().st_gid) == (launch.user.uid, launch.user.gid), path
    assert (output / "nested" / "escape").lstat().st_uid == launch.user.uid
    # The link's target, and the folder a link to a folder names, are untouched.
    assert (outside.stat().st_uid, outside.stat().st_gid) == (before.st_uid, before.st_gid)
    assert tmp_path.stat().st_uid == os.getuid()


PROBE = r"""
import os, pathlib, signal, sys, time
status = dict(l.split(":", 1) for l in pathlib.Path("/proc/self/status").read_text().splitlines() if ":" in l)
print("uid", os.getuid(), "gid", os.getgid(), flush=True)
print("groups", sorted(os.getgroups()), flush=True)
print("nnp", status["NoNewPrivs"].strip(), flush=True)
print("capbnd", status["CapBnd"].strip(), flush=True)
print("home", os.environ.get("HOME"), flush=True)
print("secret", os.environ.get("AWS_SECRET_ACCESS_KEY"), flush=True)
out = pathlib.Path(os.environ["TRAINSTACK_OUTPUT_DIR"])
(out / "written-by-the-job").write_text("ok")
print("wrote", flush=True)
time.sleep(120)
"""


def test_the_job_runs_as_its_user_without_new_privileges_and_the_agent_still_controls_it(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_tool("setpriv", "starts the job as its user with no new privileges (util-linux)")
    launch, switched = _target()
    assert launch.user is not None
    # pytest's own tmp folder is its user's alone (0700): the job user could not even reach its scratch.
    scratch = Path(tempfile.mkdtemp(prefix="trainstack-scratch-"))
    scratch.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(scratch, ignore_errors=True))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "the-agents-own")
    lines: list[str] = []
    paths = TrainerPaths(scratch)
    trainer = TrainerProcess(
        [sys.executable, "-c", PROBE],
        paths,
        {},
        lines.append,
        user_job=True,
        cwd=scratch,
        env=paths.contract_env(with_data=False, restored_step=None),
        launch=launch,
    )
    trainer.start()
    deadline = time.monotonic() + 60
    while "wrote" not in lines and trainer.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "wrote" in lines, lines
    said = dict(line.split(" ", 1) for line in lines if " " in line)
    assert said["uid"] == f"{launch.user.uid} gid {launch.user.gid}"
    assert said["nnp"] == "1"
    assert said["home"] == str(scratch / "home")
    assert said["secret"] == "None", "the agent's credentials leaked into the job"
    assert (paths.output_dir / "written-by-the-job").stat().st_uid == launch.user.uid
    # The streamed dataset's shards are fetched by the job itself, as its user: the cache is that user's.
    assert (paths.shard_cache.stat().st_uid, paths.shard_cache.stat().st_gid) == (
        launch.user.uid,
        launch.user.gid,
    )
    if switched:
        assert said["groups"] == "[]"
        assert int(said["capbnd"], 16) == 0
    # The agent (another uid) still signals its process group and reaps it.
    assert trainer.pid is not None and os.getpgid(trainer.pid) == trainer.pid
    trainer.kill()
    assert trainer.poll() == -9


def test_the_agent_service_and_the_job_user_are_real_on_this_machine_only_as_root() -> None:
    """The detection on this very machine: the user exists only on an instance (job-sandbox.sh)."""
    launch = detect()
    try:
        pwd.getpwnam(JOB_USER)
        exists = True
    except KeyError:
        exists = False
    assert launch.isolated == (exists and os.geteuid() == 0 and jobuser.shutil.which("setpriv") is not None)
    assert AS_AGENT.user is None


def _root_agent(
    monkeypatch: pytest.MonkeyPatch, *, tools: set[str], systemd: bool, cgroup: str | None
) -> None:
    """This process as an agent running as root, with `tools` installed, booted with systemd or not, its
    cgroup file holding `cgroup` (None: unreadable)."""
    is_dir, read_text = Path.is_dir, Path.read_text

    def fake_is_dir(path: Path) -> bool:
        return systemd if str(path) == "/run/systemd/system" else is_dir(path)

    def fake_read_text(path: Path, *args: Any, **kwargs: Any) -> str:
        if str(path) != "/proc/self/cgroup":
            return read_text(path, *args, **kwargs)
        if cgroup is None:
            raise PermissionError(13, "Permission denied", str(path))
        return cgroup

    monkeypatch.setattr(jobuser.os, "geteuid", lambda: 0)
    monkeypatch.setattr(jobuser.shutil, "which", lambda name: f"/usr/bin/{name}" if name in tools else None)
    monkeypatch.setattr(Path, "is_dir", fake_is_dir)
    monkeypatch.setattr(Path, "read_text", fake_read_text)


def _me() -> JobUser:
    entry = pwd.getpwuid(os.getuid())
    return JobUser(entry.pw_name, entry.pw_uid, entry.pw_gid)


def test_as_root_with_setpriv_and_systemd_the_job_runs_as_its_user_in_a_scope_bound_to_the_agents_service(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Root, setpriv and systemd: the job's own user, in a scope bound to the agent's own service."""
    me = _me()
    _root_agent(
        monkeypatch,
        tools={"setpriv", "systemd-run"},
        systemd=True,
        cgroup="0::/system.slice/trainstack-agent.service\n",
    )
    assert detect(me.name) == JobLaunch(
        user=me, scope=True, agent_unit="trainstack-agent.service", reason=f"root, user {me.name}"
    )


@pytest.mark.parametrize(
    ("cgroup", "unit"),
    [
        ("0::/system.slice/outer.service/trainstack-agent.service/sub\n", "trainstack-agent.service"),
        ("12:pids:/user.slice\n0::/user.slice/session-3.scope\n", None),
        (None, None),
    ],
)
def test_the_scope_is_bound_to_the_innermost_service_the_agent_runs_in_or_to_none(
    monkeypatch: pytest.MonkeyPatch, cgroup: str | None, unit: str | None
) -> None:
    """The scope is bound to the agent's innermost service; outside one, or its cgroup unreadable, to none."""
    me = _me()
    _root_agent(monkeypatch, tools={"setpriv", "systemd-run"}, systemd=True, cgroup=cgroup)
    launch = detect(me.name)
    assert launch.scope and launch.agent_unit == unit


@pytest.mark.parametrize(("systemd", "tools"), [(True, {"setpriv"}), (False, {"setpriv", "systemd-run"})])
def test_without_systemd_or_systemd_run_the_job_runs_as_its_user_without_a_scope(
    monkeypatch: pytest.MonkeyPatch, systemd: bool, tools: set[str]
) -> None:
    """Without systemd or systemd-run: the job's own user, no scope, and the agent says setsid escapes."""
    me = _me()
    _root_agent(
        monkeypatch, tools=tools, systemd=systemd, cgroup="0::/system.slice/trainstack-agent.service\n"
    )
    launch = detect(me.name)
    assert launch == JobLaunch(user=me, scope=False, agent_unit=None, reason=f"root, user {me.name}")
    assert launch.describe() == (
        f"the job runs as {me.name} (uid {me.uid}), no new privileges, "
        "without a cgroup (no systemd): setsid escapes"
    )


def test_as_root_without_setpriv_or_not_as_root_the_job_runs_as_the_agent_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The user exists but cannot be switched to: without setpriv, or when the agent is not root."""
    me = _me()
    _root_agent(monkeypatch, tools={"systemd-run"}, systemd=True, cgroup=None)
    launch = detect(me.name)
    assert launch.user is None
    assert launch.describe() == "the job runs as the agent's own user (setpriv (util-linux) is not installed)"
    monkeypatch.setattr(jobuser.os, "geteuid", lambda: 1000)
    launch = detect(me.name)
    assert launch.user is None
    assert launch.describe() == (
        "the job runs as the agent's own user "
        "(the agent is not root, so it cannot start another user's process)"
    )


def test_the_scope_is_said_as_the_jobs_own_and_a_missing_tool_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent's line names the user, its uid and its scope; a tool gone is named when the job starts."""
    launch = JobLaunch(user=JobUser(JOB_USER, 998, 997), scope=True)
    assert launch.describe() == (
        "the job runs as trainstack-job (uid 998), no new privileges, in its own systemd scope"
    )
    monkeypatch.setattr(jobuser.shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"^setpriv is not installed; the job cannot be started as "):
        launch.wrap(["python", "train.py"], None)


def test_as_another_user_than_root_the_job_keeps_its_groups_and_gets_no_new_privileges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unprivileged (a test as its own user), the job keeps the groups it cannot clear, nothing more."""
    monkeypatch.setattr(jobuser.shutil, "which", lambda name: f"/usr/bin/{name}")
    launch = JobLaunch(user=JobUser("me", 1000, 1000), privileged=False)
    assert launch.wrap(["python", "train.py"], None) == [
        "/usr/bin/setpriv", "--reuid=1000", "--regid=1000", "--keep-groups", "--no-new-privs", "--",
        "python", "train.py",
    ]  # fmt: skip


def test_stopping_a_scope_already_gone_is_no_error_and_prints_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Killing a scope already gone neither raises nor writes on the agent's output; it is bounded in time."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "systemctl", 'echo "Failed to kill unit $4: Unit not loaded."; echo oops >&2; exit 1')
    monkeypatch.setattr(jobuser.shutil, "which", lambda name: str(bin_dir / name))
    timeouts: list[Any] = []
    run = subprocess.run

    def bounded(*args: Any, **kwargs: Any) -> Any:
        timeouts.append(kwargs.get("timeout"))
        return run(*args, **kwargs)

    monkeypatch.setattr(jobuser.subprocess, "run", bounded)
    JobLaunch(user=JobUser(JOB_USER, 998, 997), scope=True).stop("trainstack-job-1-1.scope")
    assert capfd.readouterr() == ("", "")
    assert len(timeouts) == 1 and 0 < timeouts[0] <= 60


def test_giving_makes_missing_folders_and_never_follows_a_folder_swapped_for_a_link(tmp_path: Path) -> None:
    """A folder to give is made with its parents; one swapped for a link out is given as the link alone."""
    launch, _ = _target()
    assert launch.user is not None
    outside = tmp_path / "agent-only"
    outside.mkdir()
    (outside / "secret").write_text("root only")
    before = [(p.stat().st_uid, p.stat().st_gid) for p in (outside, outside / "secret")]
    linked = tmp_path / "home"
    linked.symlink_to(outside)
    fresh = tmp_path / "scratch" / "venvs" / "job"
    launch.give([linked, fresh])
    assert fresh.is_dir()
    assert (fresh.stat().st_uid, fresh.stat().st_gid) == (launch.user.uid, launch.user.gid)
    assert linked.lstat().st_uid == launch.user.uid
    assert [(p.stat().st_uid, p.stat().st_gid) for p in (outside, outside / "secret")] == before


def test_an_entry_the_job_removes_while_it_is_given_leaves_the_rest_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry the job removes mid-walk is skipped, and every other entry of its folder is still given."""
    launch = JobLaunch(user=JobUser(JOB_USER, os.getuid(), os.getgid()))
    output = tmp_path / "output"
    (output / "gone").mkdir(parents=True)
    for name in ("a.json", "b.json"):
        (output / name).write_text("{}")
    given: list[str] = []
    chown = os.chown

    def racing_chown(path: Any, uid: int, gid: int, **kwargs: Any) -> None:
        if path == "gone":
            raise FileNotFoundError(2, "No such file or directory", path)
        given.append(str(path))
        chown(path, uid, gid, **kwargs)

    monkeypatch.setattr(jobuser.os, "chown", racing_chown)
    launch.give([output])
    assert sorted(given) == sorted([str(output), "a.json", "b.json"])


# --- between two jobs ---------------------------------------------------------------------------------------


class _Machine:
    """The processes of the job's user as end_all sees them, and what it does to them."""

    def __init__(self, processes: list[set[int]], removed: list[str]) -> None:
        self.processes = processes  # one answer per look, the last one repeated
        self.removed = removed
        self.looks = 0
        self.killed: list[JobUser] = []
        self.swept: list[tuple[int, tuple[Path, ...]]] = []

    def processes_of(self, uid: int) -> set[int]:
        if uid != USER.uid:
            return set()  # nobody else's are the job's
        answer = self.processes[min(self.looks, len(self.processes) - 1)]
        self.looks += 1
        return answer

    def kill(self, user: JobUser) -> None:
        self.killed.append(user)

    def remove(self, uid: int, folders: Any) -> list[str]:
        self.swept.append((uid, tuple(folders)))
        return self.removed


def _machine(monkeypatch: pytest.MonkeyPatch, processes: list[set[int]], removed: list[str]) -> _Machine:
    machine = _Machine(processes, removed)
    monkeypatch.setattr(jobuser, "_processes_of", machine.processes_of)
    monkeypatch.setattr(jobuser, "_kill_every_process_of", machine.kill)
    monkeypatch.setattr(jobuser, "_remove_owned_by", machine.remove)
    return machine


USER = JobUser(JOB_USER, 61_999, 61_999)


def test_between_jobs_what_the_job_left_running_is_killed_and_said(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the job left running is killed as its user and said once gone; the shared folders are swept."""
    machine = _machine(monkeypatch, [{7, 8}, {7, 8}, {8}, {8}, {8}, set()], [])
    said: list[str] = []
    started = time.monotonic()
    JobLaunch(user=USER).end_all(said.append, wait_seconds=20)
    # It goes as soon as the processes are gone, never the whole wait (a loaded machine ends well under).
    assert time.monotonic() - started < 10
    assert machine.killed == [USER] and machine.looks == 7
    assert said == [f"ended 2 process(es) the job left running as {JOB_USER}"]
    assert machine.swept == [(USER.uid, jobuser.SHARED_TEMP)]


def test_a_process_that_outlives_the_wait_is_said_with_its_pids(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process still listed after the full wait (SIGKILL pending) is said with its first ten pids."""
    pids = set(range(112, 100, -1))
    machine = _machine(monkeypatch, [pids], [])
    said: list[str] = []
    started = time.monotonic()
    JobLaunch(user=USER).end_all(said.append, wait_seconds=0.3)
    assert time.monotonic() - started >= 0.3
    assert machine.killed == [USER]
    assert said == [f"12 process(es) of {JOB_USER} not gone yet, SIGKILL pending: {sorted(pids)[:10]}"]


def test_what_the_job_left_in_shared_folders_is_said_and_nothing_when_it_left_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing running: nothing killed; the shared folders' removed entries are said, the first ten."""
    removed = [f"/tmp/torchinductor_{n}" for n in range(12)]
    machine = _machine(monkeypatch, [set()], removed)
    said: list[str] = []
    JobLaunch(user=USER).end_all(said.append)
    assert machine.killed == []
    assert said == [f"removed what the job left in shared folders as {JOB_USER}: {removed[:10]}"]
    machine.removed = []
    said.clear()
    JobLaunch(user=USER).end_all(said.append)
    assert said == []


@pytest.mark.parametrize(
    "launch",
    [
        JobLaunch(),
        JobLaunch(user=USER, privileged=False),
        JobLaunch(user=JobUser("root", 0, 0)),
        JobLaunch(user=JobUser("the-agent", 4242, 4242)),
    ],
    ids=["as-the-agent", "unprivileged", "root", "the-agents-own-uid"],
)
def test_between_jobs_nothing_is_killed_or_removed_unless_the_job_has_a_user_of_its_own(
    monkeypatch: pytest.MonkeyPatch, launch: JobLaunch
) -> None:
    """Unless the job has a user of its own, nothing is killed or removed: it would end the agent or more."""
    monkeypatch.setattr(jobuser.os, "getuid", lambda: 4242)
    machine = _machine(monkeypatch, [{1, 2}], ["/tmp/x"])
    said: list[str] = []
    launch.end_all(said.append)
    assert (machine.looks, machine.killed, machine.swept, said) == (0, [], [], [])


def test_the_processes_of_a_user_are_its_live_ones_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A uid's processes are its live ones: no zombie, no other uid's, none that exits while listed."""
    child = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 30
        status = Path(f"/proc/{child.pid}/status")
        while not status.read_text().split("State:", 1)[1].strip().startswith("Z"):
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.01)
        mine = jobuser._processes_of(os.getuid())
        assert os.getpid() in mine and child.pid not in mine
    finally:
        child.wait(timeout=30)
    assert jobuser._processes_of(61_998) == set()
    # pid 1 comes first in /proc and vanishes meanwhile: the rest is still listed.
    read_text = Path.read_text

    def vanished(path: Path, *args: Any, **kwargs: Any) -> str:
        if str(path) == "/proc/1/status":
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", vanished)
    assert os.getpid() in jobuser._processes_of(os.getuid())


def test_without_proc_no_process_is_found_and_nothing_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """A system without /proc (not Linux) lists no process of anyone rather than failing the job's end."""
    is_dir = Path.is_dir
    monkeypatch.setattr(Path, "is_dir", lambda path: False if str(path) == "/proc" else is_dir(path))
    assert jobuser._processes_of(os.getuid()) == set()


def test_only_what_the_user_owns_directly_in_the_shared_folders_is_removed(tmp_path: Path) -> None:
    """Only what the uid owns in the shared folders goes (a link, never its target); the rest stays."""
    shared = tmp_path / "tmp"
    (shared / "torchinductor").mkdir(parents=True)
    (shared / "torchinductor" / "kernel.py").write_text("x")
    (shared / "cache.bin").write_text("x")
    target = tmp_path / "kept"
    target.write_text("the link's target")
    (shared / "link").symlink_to(target)
    missing = tmp_path / "no-such-folder"
    assert jobuser._remove_owned_by(os.getuid() + 1, [missing, shared]) == []
    assert len(list(shared.iterdir())) == 3
    removed = jobuser._remove_owned_by(os.getuid(), [missing, shared])
    assert sorted(removed) == sorted(str(shared / name) for name in ("torchinductor", "cache.bin", "link"))
    assert list(shared.iterdir()) == [] and target.read_text() == "the link's target"


def test_an_entry_gone_before_its_owner_is_read_leaves_the_others_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry gone before its owner is read is skipped, and the folder's other entries are still removed."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    for name in ("a", "b", "c"):
        (shared / name).write_text("x")
    first = next(shared.iterdir())
    lstat = os.lstat

    def racing_lstat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if Path(path) == first:
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return lstat(path, *args, **kwargs)

    monkeypatch.setattr(jobuser.os, "lstat", racing_lstat)
    removed = jobuser._remove_owned_by(os.getuid(), [shared])
    assert sorted(removed) == sorted(str(shared / name) for name in ("a", "b", "c") if name != first.name)
    assert list(shared.iterdir()) == [first]


def test_every_process_of_the_job_user_is_killed_as_that_user_and_never_as_root(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kill runs as the job's user alone, in a Python that checks its uid first; never as root."""
    monkeypatch.setattr(jobuser.shutil, "which", lambda name: f"/usr/bin/{name}")
    answers = [subprocess.CompletedProcess([], 0, "", "")]
    ran: list[tuple[list[str], dict[str, Any]]] = []

    def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        ran.append((argv, kwargs))
        return answers.pop(0)

    monkeypatch.setattr(jobuser.subprocess, "run", run)
    jobuser._kill_every_process_of(JobUser(JOB_USER, 998, 997))
    ((argv, kwargs),) = ran
    assert argv[:-1] == [
        "/usr/bin/setpriv", "--reuid=998", "--regid=997", "--clear-groups", "--inh-caps=-all",
        "--bounding-set=-all", "--no-new-privs", "--", sys.executable, "-I", "-S", "-c",
    ]  # fmt: skip
    assert kwargs["env"] == {"PATH": os.defpath} and kwargs["cwd"] == "/"
    assert kwargs["capture_output"] and kwargs["text"] and not kwargs["check"]
    assert 0 < kwargs["timeout"] <= 60
    # Run as any uid but 998 the snippet exits 3 before it kills anything.
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    with pytest.raises(SystemExit) as refused:
        exec(argv[-1], {})
    assert refused.value.code == 3 and killed == []
    # Run as 998 itself it kills every process it may signal: kill(-1, SIGKILL).
    monkeypatch.setattr(os, "getuid", lambda: 998)
    monkeypatch.setattr(os, "geteuid", lambda: 998)
    exec(argv[-1], {})
    assert killed == [(-1, signal.SIGKILL)]
    monkeypatch.undo()
    monkeypatch.setattr(jobuser.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(jobuser.subprocess, "run", run)

    answers.append(
        subprocess.CompletedProcess([], 1, "", "Traceback\nPermissionError: [Errno 1] " + "x" * 300)
    )
    with pytest.raises(RuntimeError) as failed:
        jobuser._kill_every_process_of(JobUser(JOB_USER, 998, 997))
    message = str(failed.value)
    assert message.startswith(
        f"could not kill the processes {JOB_USER} left running: PermissionError: [Errno 1] "
    )
    assert len(message) < 300 and "\n" not in message
    answers.append(subprocess.CompletedProcess([], 3, "said on stdout\n", ""))
    with pytest.raises(RuntimeError, match=r"left running: said on stdout$"):
        jobuser._kill_every_process_of(JobUser(JOB_USER, 998, 997))
    answers.append(subprocess.CompletedProcess([], 3, "", ""))
    with pytest.raises(RuntimeError, match=r"left running: exit 3$"):
        jobuser._kill_every_process_of(JobUser(JOB_USER, 998, 997))
    with pytest.raises(ValueError, match=r"^refusing to kill every process of root$"):
        jobuser._kill_every_process_of(JobUser("root", 0, 0))
    assert len(ran) == 4


# --- the job's credentials ----------------------------------------------------------------------------------


def test_credentials_reach_the_job_through_a_refreshable_credential_process(aws: Any, tmp_path: Path) -> None:
    sts = boto3.client("sts", region_name="us-east-1")
    launch, _ = _target()
    logged: list[tuple[Any, ...]] = []
    credentials = JobCredentials(
        sts,
        role_arn=ROLE,
        policy=job_session_policy(
            role_arn=ROLE, bucket="b-data", job_id=JOB, region="us-east-1", log_group="/l", log_stream=None
        ),
        session_name=f"{JOB}-i-0123",
        region="us-east-1",
        directory=tmp_path / "credentials",
        launch=launch,
        log=lambda *a, **k: logged.append(a),
    )
    env = credentials.start()
    try:
        assert env["AWS_CONFIG_FILE"] == str(tmp_path / "credentials" / "config")
        assert env["AWS_EC2_METADATA_DISABLED"] == "true" and env["AWS_SHARED_CREDENTIALS_FILE"] == os.devnull
        assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"} & set(env)
        written = json.loads(credentials.credentials_file.read_text())
        assert written["Version"] == 1 and written["Expiration"].endswith("Z")
        assert credentials.credentials_file.stat().st_mode & 0o777 == 0o640
        assert "credential_process = " in credentials.config_file.read_text()
        # A real SDK in a clean environment finds them through the profile alone.
        probe = "import boto3; c = boto3.Session().get_credentials(); print(c.method, c.access_key, c.token)"
        clean = {"PATH": os.environ["PATH"], **env}
        shown = subprocess.run(
            [sys.executable, "-c", probe], env=clean, capture_output=True, text=True, timeout=60, check=True
        ).stdout.split()
        assert shown == ["custom-process", written["AccessKeyId"], written["SessionToken"]]
        # The agent's refresh replaces them in place; the SDK's next refresh reads the new ones.
        credentials.refresh()
        assert json.loads(credentials.credentials_file.read_text())["AccessKeyId"] != written["AccessKeyId"]
        assert not list((tmp_path / "credentials").glob(".tmp-*"))
    finally:
        credentials.stop()


def test_the_credentials_are_refreshed_before_the_one_hour_chained_session_ends() -> None:
    assert jobuser.SESSION_SECONDS == 3600
    # Refreshed with more time left than botocore's own advisory refresh window (15 minutes).
    assert jobuser.REFRESH_BEFORE.total_seconds() > 15 * 60


class _Sts:
    """STS as the agent calls it: each AssumeRole recorded, fresh keys each time, `expiration` as given."""

    def __init__(self, expiration: Any) -> None:
        self.expiration = expiration
        self.calls: list[dict[str, Any]] = []

    def assume_role(self, **request: Any) -> dict[str, Any]:
        self.calls.append(request)
        n = len(self.calls)
        return {
            "Credentials": {
                "AccessKeyId": f"ASIA{n:016d}",
                "SecretAccessKey": f"secret-{n}",
                "SessionToken": f"token-{n}",
                "Expiration": self.expiration,
            }
        }


def _credentials(
    sts: Any,
    directory: Path,
    *,
    session_name: str = "job",
    log: Any = None,
    policy: dict[str, Any] | None = None,
) -> JobCredentials:
    launch, _ = _target()
    return JobCredentials(
        sts,
        role_arn=ROLE,
        policy=policy or {"Version": "2012-10-17", "Statement": []},
        session_name=session_name,
        region="eu-west-1",
        directory=directory,
        launch=launch,
        log=log or (lambda *a, **k: None),
    )


LATER = datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


def test_the_role_session_is_asked_for_this_jobs_policy_packed_under_a_name_sts_accepts(
    tmp_path: Path,
) -> None:
    """AssumeRole gets the job role, an hour, the session policy packed and a session name STS accepts."""
    policy = job_session_policy(
        role_arn=ROLE,
        bucket="b-data",
        job_id=JOB,
        region="eu-west-1",
        log_group="/l",
        log_stream=f"{JOB}/i/job",
    )
    sts = _Sts(LATER)
    credentials = _credentials(
        sts, tmp_path / "credentials", session_name=f"{JOB} i-0123/run:" + "x" * 80, policy=policy
    )
    credentials.start()
    credentials.close()
    (call,) = sts.calls
    assert call["RoleArn"] == ROLE and call["DurationSeconds"] == jobuser.SESSION_SECONDS
    assert json.loads(call["Policy"]) == policy and not re.search(r"\s", call["Policy"])
    name = call["RoleSessionName"]
    assert re.fullmatch(r"[\w+=,.@-]{2,64}", name) and len(name) == 64
    assert name.startswith(f"{JOB}-i-0123-run-xxx")


def test_the_credentials_file_is_what_a_credential_process_prints_expiring_in_utc_whatever_the_zone(
    tmp_path: Path,
) -> None:
    """The file is the credential_process document, its expiry in UTC whatever the zone or STS's form."""
    tokyo = timezone(timedelta(hours=9))
    zone = os.environ.get("TZ")
    os.environ["TZ"] = "Asia/Tokyo"
    time.tzset()
    try:
        for expiration in (LATER.astimezone(tokyo), "2030-01-02T03:04:05Z", "2030-01-02T12:04:05+09:00"):
            sts = _Sts(expiration)
            credentials = _credentials(sts, tmp_path / "credentials")
            assert credentials.expiration is None
            credentials.start()
            credentials.stop()
            assert json.loads(credentials.credentials_file.read_text()) == {
                "Version": 1,
                "AccessKeyId": f"ASIA{1:016d}",
                "SecretAccessKey": "secret-1",
                "SessionToken": "token-1",
                "Expiration": "2030-01-02T03:04:05Z",
            }, expiration
            assert credentials.expiration == LATER
    finally:
        if zone is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = zone
        time.tzset()


def test_starting_makes_a_folder_the_job_reads_but_never_writes_and_a_profile_naming_cat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Starting makes a folder the job reads, never writes, a profile naming cat and a daemon refresher."""
    for found, cat in (
        (lambda name: f"/opt/tools/{name}", "/opt/tools/cat"),
        (lambda name: None, "/bin/cat"),
    ):
        monkeypatch.setattr(jobuser.shutil, "which", found)
        directory = tmp_path / "run" / cat.replace("/", "-") / "credentials"
        for _ in range(2):  # a folder that does not exist yet, then one that does
            before = set(threading.enumerate())
            credentials = _credentials(_Sts(LATER), directory)
            env = credentials.start()
            try:
                assert directory.stat().st_mode & 0o777 == 0o755
                assert credentials.config_file.stat().st_mode & 0o777 == 0o644
                assert credentials.credentials_file.stat().st_mode & 0o777 == 0o640
                assert credentials.config_file.read_text() == (
                    "[default]\nregion = eu-west-1\n"
                    f"credential_process = {cat} {credentials.credentials_file}\n"
                )
                assert env["AWS_REGION"] == env["AWS_DEFAULT_REGION"] == "eu-west-1"
                (refresher,) = set(threading.enumerate()) - before
                assert refresher.daemon and refresher.name == "job-credentials"
            finally:
                credentials.stop()


def test_a_refresh_after_the_stop_writes_nothing(tmp_path: Path) -> None:
    """STS answering after the job ended: its folder may be the next job's, so nothing is written."""
    sts = _Sts(LATER)
    credentials = _credentials(sts, tmp_path / "credentials")
    credentials.start()
    credentials.stop()
    written = credentials.credentials_file.read_text()
    sts.expiration = LATER + timedelta(hours=1)
    credentials.refresh()
    assert len(sts.calls) == 2
    assert credentials.credentials_file.read_text() == written and credentials.expiration == LATER


def test_closing_ends_the_refreshes_and_removes_the_credentials_started_or_not(tmp_path: Path) -> None:
    """Closing ends the refreshes and removes the job's credentials from the instance, started or not."""
    sts = _Sts(datetime.now(timezone.utc))  # inside the refresh window: the thread would refresh at once
    credentials = _credentials(sts, tmp_path / "started")
    before = set(threading.enumerate())
    credentials.start()
    (refresher,) = set(threading.enumerate()) - before
    credentials.close()
    assert not refresher.is_alive()
    assert not (tmp_path / "started").exists()
    calls = len(sts.calls)
    time.sleep(0.1)
    assert len(sts.calls) == calls
    never = _credentials(sts, tmp_path / "never")
    (tmp_path / "never").mkdir()
    never.close()
    assert not (tmp_path / "never").exists()


def test_a_failed_refresh_is_logged_naming_the_error_and_retried(tmp_path: Path) -> None:
    """A refresh STS refuses is one log line naming the error, and the next try renews the file."""

    class Refusing(_Sts):
        def assume_role(self, **request: Any) -> dict[str, Any]:
            if len(self.calls) == 1:
                self.calls.append(request)
                raise RuntimeError("Throttling: Rate exceeded")
            return super().assume_role(**request)

    logged: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    sts = Refusing(datetime.now(timezone.utc))  # inside the refresh window: refreshed after 1 s
    launch, _ = _target()
    credentials = JobCredentials(
        sts,
        role_arn=ROLE,
        policy={"Version": "2012-10-17", "Statement": []},
        session_name="job",
        region="eu-west-1",
        directory=tmp_path / "credentials",
        launch=launch,
        log=lambda *args, **fields: logged.append((args, fields)),
        retry_seconds=0.05,
    )
    credentials.start()
    renewed = f"ASIA{3:016d}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if json.loads(credentials.credentials_file.read_text())["AccessKeyId"] == renewed:
                break
            time.sleep(0.02)
    finally:
        credentials.stop()
    assert json.loads(credentials.credentials_file.read_text())["AccessKeyId"] == renewed
    assert logged[0] == (
        ("job", "could not refresh the job's credentials; retrying"),
        {"error": "Throttling: Rate exceeded"},
    )


def test_closing_waits_for_a_refresh_in_flight_but_not_forever(tmp_path: Path) -> None:
    """Closing waits for a refresh in flight (which then writes nothing), but no longer than its timeout."""
    answer = threading.Event()

    class Slow(_Sts):
        def assume_role(self, **request: Any) -> dict[str, Any]:
            if self.calls:
                self.calls.append(request)
                answer.wait(30)
                raise RuntimeError("connection reset")
            return super().assume_role(**request)

    for wait in (0.3, None):
        answer.clear()
        sts = Slow(datetime.now(timezone.utc))  # refreshed again after 1 s
        directory = tmp_path / f"credentials-{wait}"
        credentials = _credentials(sts, directory)
        before = set(threading.enumerate())
        credentials.start()
        (refresher,) = set(threading.enumerate()) - before
        deadline = time.monotonic() + 30
        while len(sts.calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        if wait is None:
            threading.Timer(0.3, answer.set).start()
            credentials.close()
            assert not refresher.is_alive(), "closed while a refresh was still in flight"
        else:
            started = time.monotonic()
            credentials.close(timeout=wait)
            assert time.monotonic() - started < 10
            assert refresher.is_alive()
            answer.set()
            refresher.join(30)
        assert not directory.exists()


@pytest.mark.parametrize("isolated", [True, False])
def test_the_files_are_root_s_and_readable_by_the_jobs_group_only(tmp_path: Path, isolated: bool) -> None:
    """The files are the agent's and readable by the job's group, never another group."""
    launch = _target()[0] if isolated else AS_AGENT
    credentials = JobCredentials(
        _Sts(LATER),
        role_arn=ROLE,
        policy={"Version": "2012-10-17", "Statement": []},
        session_name="job",
        region="eu-west-1",
        directory=tmp_path / "credentials",
        launch=launch,
        log=lambda *a, **k: None,
    )
    credentials.start()
    credentials.stop()
    group = launch.user.gid if launch.user is not None else os.getgid()
    for path in (credentials.credentials_file, credentials.config_file):
        assert (path.stat().st_uid, path.stat().st_gid) == (os.getuid(), group), path


def test_a_write_that_fails_leaves_the_last_credentials_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed write leaves the last credentials and no temporary file; the temporary is made beside them."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-temporary-folder"))
    credentials = JobCredentials(
        _Sts(LATER),
        role_arn=ROLE,
        policy={"Version": "2012-10-17", "Statement": []},
        session_name="job",
        region="eu-west-1",
        directory=tmp_path / "credentials",
        launch=JobLaunch(user=JobUser(JOB_USER, 998, 997)),
        log=lambda *a, **k: None,
    )
    chown = os.chown
    monkeypatch.setattr(jobuser.os, "chown", lambda *args: None)  # root's gift, without being root
    credentials.start()
    credentials.stop()
    written = credentials.credentials_file.read_text()

    def refused(*args: Any) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(jobuser.os, "chown", refused)
    with pytest.raises(PermissionError):
        credentials._write(credentials.credentials_file, "{}", 0o640)
    monkeypatch.setattr(jobuser.os, "chown", chown)
    assert credentials.credentials_file.read_text() == written
    assert sorted(p.name for p in (tmp_path / "credentials").iterdir()) == ["config", "credentials.json"]


# --- the sandbox script -------------------------------------------------------------------------------------


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!{shutil.which('bash') or '/bin/bash'}\n{body}\n")
    path.chmod(0o755)


def test_the_sandbox_creates_the_user_once_and_rejects_its_imds_traffic(tmp_path: Path) -> None:
    bash = shutil.which("bash") or "/bin/bash"
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # A machine without the user and without the rules: the first run adds both, the second nothing.
    _fake(bin_dir, "id", f'[ -e "{tmp_path}/user" ]')
    _fake(bin_dir, "useradd", f'echo "useradd $*" >>"{calls}"; touch "{tmp_path}/user"')
    for tool in ("iptables", "ip6tables"):
        _fake(
            bin_dir,
            tool,
            f'echo "{tool} $*" >>"{calls}"\nrule="{tmp_path}/{tool}-rule"\n'
            'case " $* " in *" -C "*) [ -e "$rule" ];; *) touch "$rule";; esac',
        )
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    script = str(REPO / "bootstrap/instance/job-sandbox.sh")
    for _ in range(2):
        subprocess.run([bash, script], env=env, check=True, capture_output=True, timeout=60)
    made = calls.read_text().splitlines()
    assert [c for c in made if c.startswith("useradd")] == [
        "useradd --system --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin "
        "trainstack-job"
    ]
    inserted = [c for c in made if " -I " in c]
    expected = ["iptables -w -I OUTPUT -m owner --uid-owner trainstack-job -d 169.254.169.254 -j REJECT"]
    if Path("/proc/net/if_inet6").exists():
        expected.append(
            "ip6tables -w -I OUTPUT -m owner --uid-owner trainstack-job -d fd00:ec2::254 -j REJECT"
        )
    assert inserted == expected


def test_the_sandbox_fails_closed_without_a_firewall(tmp_path: Path) -> None:
    bash = shutil.which("bash") or "/bin/bash"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "id", "exit 0")
    for name in ("printf", "cat"):
        target = Path("/usr/bin") / name
        if target.exists():
            (bin_dir / name).symlink_to(target)
    result = subprocess.run(
        [bash, str(REPO / "bootstrap/instance/job-sandbox.sh")],
        env={"PATH": str(bin_dir)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "neither iptables nor nft" in result.stdout


def test_the_refresh_outlives_a_failing_sts_and_a_log_that_raises(tmp_path: Path) -> None:
    """STS refusing a refresh (throttled, a network fault) while the agent's log cannot be written: the
    refresh thread keeps trying and the job's credentials file is renewed on the next success."""
    answers: list[Any] = [RuntimeError("Throttling: Rate exceeded"), RuntimeError("connection reset")]

    class FlakySts:
        def __init__(self) -> None:
            self.calls = 0

        def assume_role(self, **_: Any) -> dict[str, Any]:
            self.calls += 1
            if self.calls > 1 and answers:
                raise answers.pop(0)
            return {
                "Credentials": {
                    "AccessKeyId": f"ASIA{self.calls:016d}",
                    "SecretAccessKey": "s",
                    "SessionToken": "t",
                    # Already inside the refresh window: the thread refreshes at once (after 1 s).
                    "Expiration": datetime.now(timezone.utc) + jobuser.REFRESH_BEFORE,
                }
            }

    def broken_log(*_: Any, **__: Any) -> None:
        raise OSError(28, "No space left on device")

    launch, _ = _target()
    sts = FlakySts()
    credentials = JobCredentials(
        sts,
        role_arn=ROLE,
        policy={"Version": "2012-10-17", "Statement": []},
        session_name="job",
        region="us-east-1",
        directory=tmp_path / "credentials",
        launch=launch,
        log=broken_log,
        retry_seconds=0.05,
    )
    credentials.start()
    try:
        deadline = time.monotonic() + 30
        while sts.calls < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sts.calls >= 4, "the refresh thread stopped after a failed refresh"
        assert json.loads(credentials.credentials_file.read_text())["AccessKeyId"] != f"ASIA{1:016d}"
    finally:
        credentials.stop()


@pytest.mark.parametrize(
    ("dataset", "readable", "refused"),
    [
        ("", "data/train/0.png", "datasets/faces/0.png"),
        ("faces", "datasets/faces/0.png", "datasets/other/0.png"),
    ],
)
def test_a_job_reads_its_own_dataset_and_no_other(dataset: str, readable: str, refused: str) -> None:
    """What AWS grants is the intersection of the job role's policy and the session policy: a job reads the
    dataset it was submitted with (the default `data/` or a named `datasets/<name>/`) and nothing else."""
    from infra.iam.machine_roles import job_role_policy
    from tests.iam.evaluate import Caller, Request, decide
    from trainstack_job.datasets import DatasetPlace

    bucket = "arn:aws:s3:::b-data"
    role = job_role_policy(
        bucket_arn=bucket, key_arn="arn:aws:kms:us-east-1:123456789012:key/k", region="us-east-1",
        log_group_arn="arn:aws:logs:us-east-1:123456789012:log-group:/l",
    )  # fmt: skip
    session = job_session_policy(
        role_arn=ROLE,
        bucket="b-data",
        job_id=JOB,
        region="us-east-1",
        log_group="/l",
        log_stream=None,
        data_prefix=DatasetPlace.of(dataset).prefix,
    )

    def allowed(key: str) -> bool:
        request = Request("s3:GetObject", f"{bucket}/{key}")
        return all(
            decide(request, Caller("job", ROLE, "123456789012", [document]), None, key_policy=False).allowed
            for document in (role, session)
        )

    assert allowed(readable)
    assert not allowed(refused)
    assert not allowed("state/ledger.json")

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
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
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
from tests.tools import require_tool

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
        probe = "import boto3; c = boto3.Session().get_credentials(); print(c.method, c.access_key)"
        clean = {"PATH": os.environ["PATH"], **env}
        shown = subprocess.run(
            [sys.executable, "-c", probe], env=clean, capture_output=True, text=True, timeout=60, check=True
        ).stdout.split()
        assert shown == ["custom-process", written["AccessKeyId"]]
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

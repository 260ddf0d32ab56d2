"""`trainstack doctor`: what would make a first `pulumi up` fail, checked from the stack config alone."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
    PartialCredentialsError,
    ProfileNotFound,
    SSOTokenLoadError,
    TokenRetrievalError,
    UnauthorizedSSOTokenError,
)
from rich.markup import escape

from trainstack.aws import Clients, error_code, explain
from trainstack.output import console, print_json
from trainstack.session import AWS_CLI_INSTALL, PLUGIN_INSTALL
from trainstack.stack import PULUMI_INSTALL, Stack, StackConfig

# EC2 vCPU quotas per instance family, from Service Quotas (service code "ec2"). Spot and on-demand
# are separate pools; new accounts often start with 0 in the GPU ones.
SPOT_QUOTAS = {
    "g": ("L-3819A6DF", "All G and VT Spot Instance Requests"),
    "p": ("L-7212CCBC", "All P Spot Instance Requests"),
    "dl": ("L-85EED4F7", "All DL Spot Instance Requests"),
}
ON_DEMAND_QUOTAS = {
    "g": ("L-DB2E81BA", "Running On-Demand G and VT instances"),
    "p": ("L-417A185B", "Running On-Demand P instances"),
    "dl": ("L-6E869C2A", "Running On-Demand DL instances"),
}
_FAMILY = re.compile(r"^([a-z]+)\d")
# The group spans AZs so a spot shortage in one does not stop training (AutoScaling.2).
MIN_AZS = 2
# The floor of the Pulumi SDK in infra/requirements.txt: a CLI older than the program's SDK is unsupported.
MIN_PULUMI = (3, 150)
_VERSION = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")
# The same advice as the README's setup step.
CREDENTIALS_FIX = (
    "run `aws configure sso` (then `aws sso login`), or export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
)
REGION_FIX = "pulumi config set aws:region us-east-1"


@dataclass(frozen=True)
class Check:
    """One line: `fix` says what to do when it fails. A failed optional check does not fail doctor
    (a tool only some commands need); an unchecked one could not run because an earlier check failed."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    optional: bool = False
    checked: bool = True

    @property
    def failed(self) -> bool:
        return not self.ok and not self.optional


def not_checked(name: str, needs: str) -> Check:
    return Check(name, False, f"not checked: needs {needs}", checked=False)


def diagnose(error: Exception) -> tuple[str, str]:
    """A failed AWS call as (what is wrong, how to fix it), for the `detail` and `fix` of a check."""
    if isinstance(error, NoCredentialsError | PartialCredentialsError):
        return "no AWS credentials found", CREDENTIALS_FIX
    if isinstance(error, SSOTokenLoadError | UnauthorizedSSOTokenError | TokenRetrievalError):
        return f"AWS SSO session expired or missing ({error})", "run `aws sso login` and retry"
    if isinstance(error, ProfileNotFound):
        return str(error), "fix AWS_PROFILE, or create the profile with `aws configure sso --profile NAME`"
    if isinstance(error, NoRegionError):
        return "no AWS region", f"{REGION_FIX}, or pass --region"
    if isinstance(error, EndpointConnectionError):
        return f"cannot reach AWS ({error})", "check your network, proxy and the region name"
    if isinstance(error, ClientError):
        code = error_code(error)
        message = error.response.get("Error", {}).get("Message", "") or code
        if code in ("AccessDenied", "AccessDeniedException", "UnauthorizedOperation"):
            return (
                f"{error.operation_name} was refused ({message})",
                "grant your identity that action (see `aws sts get-caller-identity`) or use a profile "
                "that has it",
            )
        if code in ("ExpiredToken", "ExpiredTokenException", "RequestExpired"):
            return f"AWS credentials expired ({code})", "refresh them (`aws sso login` or new keys) and retry"
        if code in (
            "InvalidClientTokenId",
            "SignatureDoesNotMatch",
            "AuthFailure",
            "UnrecognizedClientException",
        ):
            return f"AWS rejected the credentials ({code})", f"check `aws configure list`; {CREDENTIALS_FIX}"
    return str(explain(error)), ""


def parse_version(text: str) -> tuple[int, ...] | None:
    """`v3.150.0` → (3, 150, 0); `aws-cli/2.15.30 Python/3.11` → (2, 15, 30)."""
    match = _VERSION.search(text)
    return tuple(int(part) for part in match.groups() if part is not None) if match else None


def tool_output(argv: list[str]) -> str | None:
    """What `argv` prints (stdout, else stderr), or None when it is missing, fails or hangs."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    return (result.stdout or result.stderr).strip()


def quota_family(instance_type: str) -> str | None:
    """`g6.xlarge` → `g`, `vt1.3xlarge` → `g` (one quota covers G and VT), `p5.48xlarge` → `p`."""
    match = _FAMILY.match(instance_type)
    if match is None:
        return None
    family = match.group(1)
    if family == "vt":
        return "g"
    return family if family in SPOT_QUOTAS else None


def on_demand_count(config: StackConfig) -> int:
    """How many of the group's instances the Auto Scaling group may launch on-demand."""
    base = min(config.on_demand_base_capacity, config.instance_count)
    above = config.instance_count - base
    return base + math.ceil(above * config.on_demand_percentage_above_base / 100)


class Doctor:
    """Runs the checks in order; a check that cannot call AWS fails with the reason instead of stopping."""

    def __init__(self, clients: Clients, config: StackConfig) -> None:
        self.clients = clients
        self.config = config
        # --region overrides the stack's aws:region, for the checks as for the calls.
        self.region = clients.region or config.region
        self.vcpus: dict[str, int] = {}

    def run(self) -> list[Check]:
        """Every check; one that needs AWS is listed as not checked while credentials or region fail."""
        checks = [self.check_pulumi(), *self.check_session_tools()]
        credentials = self._guard("credentials", self.check_credentials)
        region = self._guard("region", self.check_region) if credentials[0].ok else self._region_set()
        checks += credentials + region
        aws_checks: list[tuple[str, Callable[[], list[Check]]]] = [
            ("instance types", self.check_instance_types),
            ("spot vCPU quota", self.check_quotas),
            ("availability zones", self.check_offerings),
            ("AMI", self.check_ami),
        ]
        missing = ""
        if not credentials[0].ok:
            missing = "AWS credentials"
        elif region[0].failed:
            missing = "a valid aws:region"
        for name, check in aws_checks:
            checks += [not_checked(name, missing)] if missing else self._guard(name, check)
        return checks

    def _guard(self, name: str, check: Callable[[], list[Check]]) -> list[Check]:
        try:
            return check()
        except (BotoCoreError, ClientError) as error:
            detail, fix = diagnose(error)
            return [Check(name, False, detail, fix)]

    def check_pulumi(self) -> Check:
        name = "Pulumi CLI"
        minimum = ".".join(map(str, MIN_PULUMI))
        fix = f"install the Pulumi CLI {minimum} or a later 3.x: {PULUMI_INSTALL}"
        if shutil.which("pulumi") is None:
            return Check(name, False, "pulumi is not on PATH", fix)
        output = tool_output(["pulumi", "version"])
        version = parse_version(output or "")
        if version is None:
            return Check(name, False, f"`pulumi version` did not report a version ({output!r})", fix)
        shown = ".".join(map(str, version))
        if version[:2] < MIN_PULUMI or version[0] > MIN_PULUMI[0]:
            return Check(name, False, f"pulumi {shown}: this project needs {minimum} or a later 3.x", fix)
        return Check(name, True, f"pulumi {shown}")

    def check_session_tools(self) -> list[Check]:
        """The AWS CLI v2 and its Session Manager plugin: only `trainstack shell` / `forward` need them."""
        needed_by = "needed by `trainstack shell` and `forward` only"
        aws = "AWS CLI v2"
        aws_fix = f"install the AWS CLI v2: {AWS_CLI_INSTALL}"
        if shutil.which("aws") is None:
            aws_check = Check(aws, False, f"aws is not on PATH ({needed_by})", aws_fix, optional=True)
        else:
            output = tool_output(["aws", "--version"]) or ""
            version = parse_version(output)
            shown = ".".join(map(str, version)) if version else "unknown version"
            good = version is not None and version[0] >= 2
            aws_check = Check(
                aws,
                good,
                f"aws-cli {shown}" + ("" if good else f" ({needed_by})"),
                "" if good else aws_fix,
                optional=True,
            )
        plugin = "session-manager-plugin"
        if shutil.which(plugin) is None:
            plugin_check = Check(
                plugin, False, f"not on PATH ({needed_by})", f"install it: {PLUGIN_INSTALL}", optional=True
            )
        else:
            shown = tool_output([plugin, "--version"]) or "installed"
            plugin_check = Check(plugin, True, shown, optional=True)
        return [aws_check, plugin_check]

    def _region_set(self) -> list[Check]:
        """Without credentials only the config itself can be checked: is aws:region set at all."""
        if not self.region:
            return [Check("region", False, f"aws:region is not set in {self.config.source}", REGION_FIX)]
        return [Check("region", True, f"{self.region} (not verified: needs AWS credentials)")]

    def check_credentials(self) -> list[Check]:
        identity = self.clients.sts().get_caller_identity()
        return [Check("credentials", True, f"{identity['Arn']} (account {identity['Account']})")]

    def check_region(self) -> list[Check]:
        region = self.region
        if not region:
            return self._region_set()
        regions = self.clients.ec2().describe_regions(AllRegions=True)["Regions"]
        status = {r["RegionName"]: r.get("OptInStatus", "opt-in-not-required") for r in regions}
        if region not in status:
            return [
                Check(
                    "region",
                    False,
                    f"'{region}' is not an AWS region",
                    REGION_FIX,
                )
            ]
        if status[region] == "not-opted-in":
            return [
                Check(
                    "region",
                    False,
                    f"{region} is not enabled in this account",
                    f"aws account enable-region --region-name {region}, or choose another aws:region",
                )
            ]
        return [Check("region", True, region)]

    def check_instance_types(self) -> list[Check]:
        wanted = list(self.config.instance_types)
        found: dict[str, Any] = {}
        paginator = self.clients.ec2().get_paginator("describe_instance_types")
        for page in paginator.paginate(Filters=[{"Name": "instance-type", "Values": wanted}]):
            found.update({entry["InstanceType"]: entry for entry in page["InstanceTypes"]})
        checks = []
        for name in wanted:
            info = found.get(name)
            if info is None:
                checks.append(
                    Check(
                        f"type {name}",
                        False,
                        f"{name} does not exist in {self.region}",
                        f"fix trainstack:instanceTypes in {self.config.source} (e.g. g6.xlarge, g5.xlarge)",
                    )
                )
                continue
            self.vcpus[name] = int(info["VCpuInfo"]["DefaultVCpus"])
            gpus = [g for g in info.get("GpuInfo", {}).get("Gpus", []) if g.get("Manufacturer") == "NVIDIA"]
            if not gpus:
                checks.append(
                    Check(
                        f"type {name}",
                        False,
                        f"{name} has no NVIDIA GPU",
                        "use NVIDIA GPU types in trainstack:instanceTypes (g4dn, g5, g6, g6e, p4d, p5...)",
                    )
                )
                continue
            gpu = gpus[0]
            memory = gpu.get("MemoryInfo", {}).get("SizeInMiB", 0) / 1024
            model = f"{gpu.get('Count', 1)} × NVIDIA {gpu.get('Name', '?')} {memory:.0f} GiB"
            checks.append(
                Check(
                    f"type {name}",
                    True,
                    f"{self.vcpus[name]} vCPUs, {model}",
                )
            )
        return checks

    def check_quotas(self) -> list[Check]:
        checks = self._quota_checks(SPOT_QUOTAS, "spot", self.config.instance_count)
        on_demand = on_demand_count(self.config)
        if on_demand:
            checks += self._quota_checks(ON_DEMAND_QUOTAS, "on-demand", on_demand)
        return checks

    def _quota_checks(self, quotas: dict[str, tuple[str, str]], kind: str, count: int) -> list[Check]:
        per_family: dict[str, int] = {}
        checks = []
        for name in self.config.instance_types:
            family = quota_family(name)
            if family is None:
                checks.append(
                    Check(
                        f"{kind} quota {name}",
                        False,
                        f"no known {kind} vCPU quota for {name}'s family",
                        "use G, VT, P or DL NVIDIA GPU types in trainstack:instanceTypes",
                    )
                )
            elif name in self.vcpus:
                # The group may land all N instances on its largest type: size the quota for that.
                per_family[family] = max(per_family.get(family, 0), self.vcpus[name] * count)
        for family, needed in sorted(per_family.items()):
            code, title = quotas[family]
            limit = self._quota_value(code)
            detail = f"{title} ({code}): {limit:g} vCPUs, the group needs {needed}"
            fix = (
                f"request an increase: aws service-quotas request-service-quota-increase --service-code ec2 "
                f"--quota-code {code} --desired-value {needed} --region {self.region}"
            )
            checks.append(Check(f"{kind} quota", limit >= needed, detail, "" if limit >= needed else fix))
        return checks

    def _quota_value(self, code: str) -> float:
        quotas = self.clients.service_quotas()
        try:
            return float(quotas.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"])
        except ClientError as error:
            # An account that never touched a quota has no applied value: the default applies.
            if error_code(error) != "NoSuchResourceException":
                raise
        return float(
            quotas.get_aws_default_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"]
        )

    def check_offerings(self) -> list[Check]:
        zones: dict[str, set[str]] = {name: set() for name in self.config.instance_types}
        paginator = self.clients.ec2().get_paginator("describe_instance_type_offerings")
        pages = paginator.paginate(
            LocationType="availability-zone",
            Filters=[{"Name": "instance-type", "Values": list(self.config.instance_types)}],
        )
        for page in pages:
            for offering in page["InstanceTypeOfferings"]:
                zones.setdefault(offering["InstanceType"], set()).add(offering["Location"])
        checks = []
        for name in self.config.instance_types:
            offered = sorted(zones[name])
            if offered:
                checks.append(Check(f"offered {name}", True, f"in {len(offered)} AZs: {', '.join(offered)}"))
            else:
                checks.append(
                    Check(
                        f"offered {name}",
                        False,
                        f"{name} is not offered in any AZ of {self.region}",
                        "remove it from trainstack:instanceTypes or choose another aws:region",
                    )
                )
        usable = sorted(set().union(*zones.values()))
        enough = len(usable) >= MIN_AZS
        checks.append(
            Check(
                "availability zones",
                enough,
                f"{len(usable)} AZs offer at least one chosen type (need ≥{MIN_AZS})",
                "" if enough else "add instance types offered in other AZs, or choose another aws:region",
            )
        )
        return checks

    def check_ami(self) -> list[Check]:
        if self.config.ami_id:
            images = self.clients.ec2().describe_images(ImageIds=[self.config.ami_id])["Images"]
            if not images:
                return [
                    Check(
                        "AMI",
                        False,
                        f"trainstack:amiId {self.config.ami_id} not found in {self.region}",
                        "AMIs are regional: copy it here or set trainstack:amiId to this region's image",
                    )
                ]
            return [Check("AMI", True, f"{self.config.ami_id} ({images[0].get('Name', 'unnamed')})")]
        parameter = self.config.ami_parameter
        try:
            value = self.clients.ssm().get_parameter(Name=parameter)["Parameter"]["Value"]
        except ClientError as error:
            if error_code(error) != "ParameterNotFound":
                raise
            return [
                Check(
                    "AMI",
                    False,
                    f"SSM parameter {parameter} not found in {self.region}",
                    "set trainstack:amiParameter to an existing DLAMI parameter (list them: aws ssm "
                    "get-parameters-by-path --path /aws/service/deeplearning/ami/x86_64 --recursive) "
                    "or pin trainstack:amiId",
                )
            ]
        return [Check("AMI", True, f"{parameter} → {value}")]


def run(clients: Clients, stack: Stack, *, as_json: bool) -> int:
    config = stack.config
    checks = Doctor(clients, config).run()
    ok = not any(c.failed for c in checks)
    if as_json:
        print_json(
            {
                "stack": config.stack,
                "region": clients.region or config.region,
                "ok": ok,
                "checks": [asdict(c) for c in checks],
            }
        )
    else:
        out = console()
        for c in checks:
            out.print(f"{_mark(c)} {escape(c.name)}: {escape(c.detail)}{_fix(c)}")
        out.print(f"[bold]{summary(checks)}[/]")
    return 0 if ok else 1


def _mark(check: Check) -> str:
    if check.ok:
        return "[green]✔[/]"
    if not check.checked:
        return "[dim]-[/]"
    return "[yellow]![/]" if check.optional else "[red]✘[/]"


def _fix(check: Check) -> str:
    return f"  [yellow]→ {escape(check.fix)}[/]" if check.fix else ""


def summary(checks: list[Check]) -> str:
    """`all checks passed` or how many failed; missing optional tools and checks not run counted apart."""
    failed = sum(c.failed and c.checked for c in checks)
    parts = [f"{failed} check(s) failed" if failed else "all checks passed"]
    unchecked = sum(not c.checked for c in checks)
    if unchecked:
        parts.append(f"{unchecked} not checked")
    optional = sum(c.optional and not c.ok for c in checks)
    if optional:
        parts.append(f"{optional} optional tool(s) missing")
    return ", ".join(parts)

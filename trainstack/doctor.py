"""`trainstack doctor`: what would make a first `pulumi up` fail, checked from the stack config alone."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from rich.markup import escape

from trainstack.aws import Clients, error_code, explain
from trainstack.output import console, print_json
from trainstack.stack import Stack, StackConfig

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


@dataclass(frozen=True)
class Check:
    """One pass/fail line; `fix` says what to do when it fails."""

    name: str
    ok: bool
    detail: str
    fix: str = ""


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
        identity = self._guard("credentials", self.check_credentials)
        if not identity[0].ok:
            # Without credentials every other call fails the same way: one line says it all.
            return identity
        checks = identity + self._guard("region", self.check_region)
        if not checks[-1].ok:
            return checks
        checks += self._guard("instance types", self.check_instance_types)
        checks += self._guard("spot vCPU quota", self.check_quotas)
        checks += self._guard("availability zones", self.check_offerings)
        checks += self._guard("AMI", self.check_ami)
        return checks

    def _guard(self, name: str, check: Callable[[], list[Check]]) -> list[Check]:
        try:
            return check()
        except (BotoCoreError, ClientError) as error:
            return [Check(name, False, str(explain(error)))]

    def check_credentials(self) -> list[Check]:
        identity = self.clients.sts().get_caller_identity()
        return [Check("credentials", True, f"{identity['Arn']} (account {identity['Account']})")]

    def check_region(self) -> list[Check]:
        region = self.region
        if not region:
            return [
                Check(
                    "region",
                    False,
                    f"aws:region is not set in {self.config.source}",
                    "pulumi config set aws:region us-east-1",
                )
            ]
        regions = self.clients.ec2().describe_regions(AllRegions=True)["Regions"]
        status = {r["RegionName"]: r.get("OptInStatus", "opt-in-not-required") for r in regions}
        if region not in status:
            return [
                Check(
                    "region",
                    False,
                    f"'{region}' is not an AWS region",
                    "pulumi config set aws:region us-east-1",
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
    ok = all(c.ok for c in checks)
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
            mark = "[green]✔[/]" if c.ok else "[red]✘[/]"
            fix = f"  [yellow]→ {escape(c.fix)}[/]" if c.fix else ""
            out.print(f"{mark} {escape(c.name)}: {escape(c.detail)}{fix}")
        summary = "all checks passed" if ok else f"{sum(not c.ok for c in checks)} check(s) failed"
        out.print(f"[bold]{summary}[/]")
    return 0 if ok else 1

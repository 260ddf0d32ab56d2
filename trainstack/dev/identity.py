"""Whether an instance with the dev tag is this stack's dev box, before anything connects to it.

The `trainstack:dev` tag is anyone's to set: whoever may run and tag instances could start one with the tag,
and a proxy that picked the newest tagged instance would empty known_hosts for it, so `accept-new` would take
that instance's host key (and Jupyter's forward would open its server). So the tag only nominates; what a
principal cannot forge with RunInstances decides, each against the stack's outputs:

- the launch template: EC2 itself tags an instance launched from a template with `aws:ec2launchtemplate:id`
  and `:version` (nobody can set an `aws:` tag), and the version must be one `pulumi up` made (no newer than
  the stack's);
- what RunInstances may override while naming the template: the image and user data must be that template
  version's, the instance profile the stack's dev box profile (attaching it needs iam:PassRole on the dev
  role), the subnet one of the stack's dev subnets, so the VPC the stack's.

An earlier version of the template is accepted: every `pulumi up` that changes the dev bundle makes a new
one, and a box launched before it is still the stack's box.
"""

from __future__ import annotations

import base64
import binascii
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import ClientError

from trainstack.aws import Clients, error_code
from trainstack.dev.instances import DevInstance, find_dev_instances
from trainstack.errors import CliError
from trainstack.stack import StackOutputs
from trainstack_job.contract import StackOutput

# What the box is checked against: Pulumi's state, which no EC2 principal can change. A stack deployed before
# these outputs lacks them until its next `pulumi up`: then the profile and newest version are read from the
# stack's template (its default version is always the one `pulumi up` made: update_default_version).
DEV_TEMPLATE_VERSION = StackOutput.DEV_TEMPLATE_VERSION.value
DEV_INSTANCE_PROFILE_ARN = StackOutput.DEV_INSTANCE_PROFILE_ARN.value
# A template image of this form names an SSM parameter, resolved at each launch: nothing to compare then.
_RESOLVED_AT_LAUNCH = "resolve:ssm:"

Warn = Callable[[str], None]


def _warn(line: str) -> None:
    # stderr: for `dev proxy` stdout is the SSH stream; ssh shows the ProxyCommand's stderr to the user.
    sys.stderr.write(f"trainstack: warning: {line}\n")


@dataclass(frozen=True)
class TemplateVersion:
    """What one version of the dev template gives an instance that overrides nothing."""

    number: int
    image_id: str | None
    user_data: bytes
    profile: str | None  # the profile's ARN, or its name where the template names it so


def _template_version(described: dict[str, Any]) -> TemplateVersion:
    data = described.get("LaunchTemplateData") or {}
    profile = data.get("IamInstanceProfile") or {}
    return TemplateVersion(
        number=int(described["VersionNumber"]),
        image_id=data.get("ImageId"),
        user_data=_decoded(data.get("UserData")),
        profile=profile.get("Arn") or profile.get("Name"),
    )


def _decoded(user_data: str | None) -> bytes:
    """User data as EC2 hands it to the instance: the template and DescribeInstanceAttribute both give it
    base64-encoded."""
    if not user_data:
        return b""
    try:
        return base64.b64decode(user_data, validate=True)
    except (binascii.Error, ValueError):
        return user_data.encode()


def _profile_name(arn: str) -> str:
    # arn:aws:iam::123456789012:instance-profile/<path/>name
    return arn.rsplit("/", 1)[-1]


@dataclass
class StackDevBox:
    """What the stack says its dev box is: read once per command, then each candidate is held to it."""

    template_id: str
    newest_version: int
    profile: str | None
    subnet_ids: tuple[str, ...]
    vpc_ids: frozenset[str]
    _versions: dict[int, TemplateVersion | None] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def read(cls, ec2: Any, outputs: StackOutputs) -> StackDevBox:
        template_id = outputs.text(StackOutput.DEV_TEMPLATE_ID)
        value = outputs.require(StackOutput.DEV_SUBNET_IDS)
        subnet_ids = tuple(str(s) for s in value) if isinstance(value, list) else (str(value),)
        # The subnets are the stack's outputs; the VPC they are in cannot change under them.
        subnets = ec2.describe_subnets(SubnetIds=list(subnet_ids))["Subnets"]
        vpc_ids = frozenset(str(s["VpcId"]) for s in subnets)
        stated = outputs.values.get(DEV_TEMPLATE_VERSION)
        wanted = "$Default" if stated in (None, "") else str(stated)
        if not wanted.isdigit() and wanted != "$Default":
            raise CliError(
                f"stack output '{DEV_TEMPLATE_VERSION}' is {stated!r}, not a template version number: run "
                "`pulumi up`"
            )
        newest = _describe_version(ec2, template_id, wanted)
        if newest is None:
            raise CliError(
                f"the stack's dev box template {template_id} has no version {wanted}: run `pulumi up` to "
                "restore it"
            )
        profile = outputs.values.get(DEV_INSTANCE_PROFILE_ARN) or newest.profile
        box = cls(template_id, newest.number, str(profile) if profile else None, subnet_ids, vpc_ids)
        box._versions[newest.number] = newest
        return box

    def version(self, ec2: Any, number: int) -> TemplateVersion | None:
        if number not in self._versions:
            self._versions[number] = _describe_version(ec2, self.template_id, str(number))
        return self._versions[number]

    def differences(self, ec2: Any, instance: DevInstance) -> list[str]:
        """What about `instance` is not the stack's dev box; empty when it is."""
        found = self._template_differences(ec2, instance)
        if not self._profile_matches(instance.profile_arn):
            found.append(
                f"its instance profile {instance.profile_arn or '(none)'} is not the stack's dev box profile "
                f"{self.profile or '(none)'}"
            )
        if instance.vpc_id not in self.vpc_ids:
            found.append(
                f"its VPC {instance.vpc_id or '(none)'} is not the stack's {', '.join(sorted(self.vpc_ids))}"
            )
        elif instance.subnet_id not in self.subnet_ids:
            found.append(
                f"its subnet {instance.subnet_id} is not one of the stack's dev subnets "
                f"({', '.join(self.subnet_ids)})"
            )
        return found

    def _template_differences(self, ec2: Any, instance: DevInstance) -> list[str]:
        if instance.template_id != self.template_id:
            where = (
                f"from launch template {instance.template_id}"
                if instance.template_id
                else "from no launch template"
            )
            return [f"it was launched {where}, not the stack's dev box template {self.template_id}"]
        try:
            number = int(instance.template_version or "")
        except ValueError:
            return [f"EC2 names no version of template {self.template_id} for it"]
        if number > self.newest_version:
            # `pulumi up` always makes its version the default (update_default_version): a newer one was
            # added to the template by someone else.
            return [
                f"it was launched from version {number} of template {self.template_id}, which `pulumi up` "
                f"did not make (the stack's is {self.newest_version})"
            ]
        version = self.version(ec2, number)
        if version is None:
            return [
                f"version {number} of template {self.template_id} it was launched from no longer exists, so "
                "its image and user data cannot be checked"
            ]
        found = []
        image = version.image_id
        if image and not image.startswith(_RESOLVED_AT_LAUNCH) and instance.image_id != image:
            found.append(f"its image {instance.image_id} is not its template version's {image}")
        if _user_data(ec2, instance.instance_id) != version.user_data:
            found.append(f"its user data is not version {number} of the template's (overridden at launch)")
        return found

    def _profile_matches(self, arn: str | None) -> bool:
        if self.profile is None or arn is None:
            return self.profile == arn
        if self.profile.startswith("arn:"):
            return arn == self.profile
        return _profile_name(arn) == self.profile


def _describe_version(ec2: Any, template_id: str, version: str) -> TemplateVersion | None:
    try:
        answer = ec2.describe_launch_template_versions(LaunchTemplateId=template_id, Versions=[version])
    except ClientError as error:
        code = error_code(error)
        if code == "InvalidLaunchTemplateId.VersionNotFound":
            return None
        if code in ("InvalidLaunchTemplateId.NotFound", "InvalidLaunchTemplateId.Malformed"):
            raise CliError(
                f"the stack's dev box template {template_id} does not exist ({code}): run `pulumi up`, or "
                "check --outputs names this stack's outputs"
            ) from None
        raise
    versions = answer.get("LaunchTemplateVersions") or []
    return _template_version(dict(versions[0])) if versions else None


def _user_data(ec2: Any, instance_id: str) -> bytes:
    answer = ec2.describe_instance_attribute(InstanceId=instance_id, Attribute="userData")
    return _decoded((answer.get("UserData") or {}).get("Value"))


def refusal(instance: DevInstance, differences: list[str]) -> str:
    """The one line that refuses `instance`: what differs and the fix."""
    return (
        f"{instance.instance_id} has the dev box tag but is not this stack's dev box: "
        f"{'; '.join(differences)}; not connecting to it: terminate it "
        f"(`aws ec2 terminate-instances --instance-ids {instance.instance_id}`) and `trainstack dev up`, or "
        "run `pulumi up` if the stack's outputs are out of date"
    )


def require_trusted_dev_box(clients: Clients, outputs: StackOutputs, warn: Warn = _warn) -> DevInstance:
    """The stack's dev box among the instances with its tag, or the one line that refuses them.

    Each other tagged instance is named on stderr (it is someone's instance posing as the box, or a box the
    stack no longer describes); with several real boxes the newest launched is used, and said so.
    """
    candidates = find_dev_instances(clients, outputs)
    if not candidates:
        raise CliError("no dev box is up: `trainstack dev up`")
    ec2 = clients.ec2()
    stack_box = StackDevBox.read(ec2, outputs)
    trusted: list[DevInstance] = []
    refused: list[str] = []
    for instance in candidates:  # newest first
        differences = stack_box.differences(ec2, instance)
        if differences:
            refused.append(refusal(instance, differences))
        else:
            trusted.append(instance)
    if not trusted:
        for line in refused[1:]:
            warn(line)
        raise CliError(refused[0])
    for line in refused:
        warn(f"ignored: {line}")
    chosen = trusted[0]
    if len(trusted) > 1:
        others = " ".join(i.instance_id for i in trusted[1:])
        plural = "s" if len(trusted) > 2 else ""
        warn(
            f"{len(trusted)} dev boxes of this stack are up: using {chosen.instance_id}, the newest "
            f"launched; `aws ec2 terminate-instances --instance-ids {others}` ends the other{plural}"
        )
    return chosen

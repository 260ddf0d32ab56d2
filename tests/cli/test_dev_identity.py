"""The dev box is the stack's by its template, profile and network, not by its `trainstack:dev` tag (34).

Against moto: the stack's dev template names the stack's dev profile, user data and image; impostors carry the
dev tag but come from another template (or none), with another profile, in another VPC, with the user data or
image overridden, or from a template version `pulumi up` did not make. Each is launched after the real box, so
a proxy that trusted the tag would pick it, empty known_hosts and let `accept-new` take its host key.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest

from demo.stack import STAND_IN_AMI
from tests.cli.conftest import REGION, STACK, Deployed, Result
from trainstack.aws import Clients, new_session
from trainstack.dev.connect import SshFiles, host_alias
from trainstack.dev.identity import DEV_INSTANCE_PROFILE_ARN, DEV_TEMPLATE_VERSION
from trainstack.dev.instances import DEV_TAG

ALIAS = host_alias(STACK)
DEV_NAME = "trainstack-test-dev"
USER_DATA = base64.b64encode(b"#cloud-config\n# the stack's dev box boot (bundle sha256 pinned)\n").decode()
EARLIER_BOX = "i-0earlierbox"


@dataclass
class DevBoxStack:
    deployed: Deployed
    home: Path
    argv_file: Path
    pushed: list[dict[str, Any]]
    template_id: str
    profile_arn: str
    security_group: str
    subnet_ids: list[str]
    outputs: dict[str, Any]

    def ec2(self) -> Any:
        return boto3.client("ec2", region_name=REGION)

    def write_outputs(self, **extra: Any) -> None:
        self.deployed.outputs_file.write_text(json.dumps({**self.outputs, **extra}), encoding="utf-8")

    def run(self, *argv: str, clients: Clients | None = None) -> Result:
        session = new_session()
        session.events.register(
            "provide-client-params.ec2-instance-connect.SendSSHPublicKey",
            lambda params, **_: self.pushed.append(dict(params)),
        )
        return self.deployed.run(*argv, clients=clients or Clients(None, session=session))

    def proxy(self) -> Result:
        return self.run("dev", "proxy", ALIAS, "22")

    @property
    def files(self) -> SshFiles:
        return SshFiles.for_stack(STACK, self.home)

    def session_target(self) -> str | None:
        if not self.argv_file.exists():
            return None
        argv = self.argv_file.read_text().splitlines()
        return argv[argv.index("--target") + 1]

    def launch(
        self,
        *,
        template: str | None = "stack",
        version: str = "$Default",
        profile: str | None = "stack",
        subnet: str | None = None,
        **overrides: Any,
    ) -> str:
        """An instance with the dev tag, launched as `trainstack dev up` does unless told otherwise. EC2
        gives it the template's instance profile; moto does not, so the profile is named here."""
        request: dict[str, Any] = {
            "MinCount": 1,
            "MaxCount": 1,
            "InstanceType": "g6.xlarge",
            "TagSpecifications": [
                {"ResourceType": "instance", "Tags": [{"Key": DEV_TAG, "Value": DEV_NAME}]}
            ],
            "NetworkInterfaces": [
                {"DeviceIndex": 0, "SubnetId": subnet or self.subnet_ids[0], "Groups": [self.security_group]}
            ],
        }
        if template is not None:
            template_id = self.template_id if template == "stack" else template
            request["LaunchTemplate"] = {"LaunchTemplateId": template_id, "Version": version}
        else:
            request["ImageId"] = STAND_IN_AMI
        if profile is not None:
            request["IamInstanceProfile"] = {"Arn": self.profile_arn if profile == "stack" else profile}
        return str(self.ec2().run_instances(**request, **overrides)["Instances"][0]["InstanceId"])


def _template_data(profile_arn: str | None, security_group: str) -> dict[str, Any]:
    """The dev template's baseline as infra/devbox.py declares it (image, profile, interface, user data)."""
    data: dict[str, Any] = {
        "ImageId": STAND_IN_AMI,
        "InstanceType": "g6.xlarge",
        "InstanceInitiatedShutdownBehavior": "terminate",
        "UserData": USER_DATA,
        "NetworkInterfaces": [{"DeviceIndex": 0, "Groups": [security_group], "DeleteOnTermination": True}],
        "TagSpecifications": [{"ResourceType": "instance", "Tags": [{"Key": DEV_TAG, "Value": DEV_NAME}]}],
    }
    if profile_arn:
        data["IamInstanceProfile"] = {"Arn": profile_arn}
    return data


@pytest.fixture()
def stack(deployed: Deployed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> DevBoxStack:
    """The deployed stack with its dev template and profile, a home folder with the SSH entry written, and
    `exec` running a fake `aws` that records the session's argv."""
    ec2 = deployed.ec2()
    subnets = ec2.describe_subnets()["Subnets"][:2]
    group = ec2.create_security_group(
        GroupName="trainstack-test-instances", Description="no inbound", VpcId=subnets[0]["VpcId"]
    )["GroupId"]
    profile_arn = boto3.client("iam", region_name=REGION).create_instance_profile(
        InstanceProfileName=DEV_NAME
    )["InstanceProfile"]["Arn"]
    template_id = ec2.create_launch_template(
        LaunchTemplateName=DEV_NAME, LaunchTemplateData=_template_data(profile_arn, group)
    )["LaunchTemplate"]["LaunchTemplateId"]
    subnet_ids = [str(s["SubnetId"]) for s in subnets]
    outputs = {
        **deployed.outputs,
        "dev_template_id": template_id,
        "dev_box_name": DEV_NAME,
        "dev_subnet_ids": subnet_ids,
    }
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    bin_dir, argv_file = tmp_path / "bin", tmp_path / "aws-argv"
    bin_dir.mkdir()
    (bin_dir / "aws").write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > {argv_file}\n')
    (bin_dir / "session-manager-plugin").write_text("#!/bin/sh\nexit 0\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def exec_fake(file: str, argv: Sequence[str]) -> None:
        # The session replaces the CLI's process on a user's machine; here it runs and returns.
        subprocess.run([str(shutil.which(file)), *argv[1:]], check=True, timeout=30)

    monkeypatch.setattr(os, "execvp", exec_fake)
    made = DevBoxStack(deployed, home, argv_file, [], template_id, profile_arn, group, subnet_ids, outputs)
    made.write_outputs()
    assert made.run("dev", "ssh-config", "--write").code == 0
    # A box of last week's: its host key is in known_hosts until the proxy trusts a new instance.
    made.files.known_hosts.write_text(f"{ALIAS} ssh-ed25519 AAAAearlier\n")
    made.files.last_instance.write_text(f"{EARLIER_BOX}\n")
    return made


def _newer() -> None:
    # moto's launch times have whole seconds: an impostor launched within the same second would tie.
    time.sleep(1.05)


def _other_vpc_subnet(ec2: Any) -> str:
    vpc = ec2.create_vpc(CidrBlock="10.77.0.0/16")["Vpc"]["VpcId"]
    return str(ec2.create_subnet(VpcId=vpc, CidrBlock="10.77.1.0/24")["Subnet"]["SubnetId"])


Impostor = Callable[[DevBoxStack], tuple[str, str]]


def _no_template(stack: DevBoxStack) -> tuple[str, str]:
    return stack.launch(template=None), "it was launched from no launch template"


def _another_template(stack: DevBoxStack) -> tuple[str, str]:
    other = stack.ec2().create_launch_template(
        LaunchTemplateName="look-alike", LaunchTemplateData=_template_data(stack.profile_arn, "sg-0")
    )["LaunchTemplate"]["LaunchTemplateId"]
    return (
        stack.launch(template=other),
        f"it was launched from launch template {other}, not the stack's dev box template {stack.template_id}",
    )


def _another_profile(stack: DevBoxStack) -> tuple[str, str]:
    other = boto3.client("iam", region_name=REGION).create_instance_profile(InstanceProfileName="intruder")[
        "InstanceProfile"
    ]["Arn"]
    return (
        stack.launch(profile=other),
        f"its instance profile {other} is not the stack's dev box profile {stack.profile_arn}",
    )


def _no_profile(stack: DevBoxStack) -> tuple[str, str]:
    return stack.launch(profile=None), "its instance profile (none) is not the stack's dev box profile"


def _another_vpc(stack: DevBoxStack) -> tuple[str, str]:
    ec2 = stack.ec2()
    subnet = _other_vpc_subnet(ec2)
    group = ec2.create_security_group(
        GroupName="elsewhere",
        Description="x",
        VpcId=ec2.describe_subnets(SubnetIds=[subnet])["Subnets"][0]["VpcId"],
    )["GroupId"]
    instance = stack.ec2().run_instances(
        LaunchTemplate={"LaunchTemplateId": stack.template_id, "Version": "$Default"},
        MinCount=1,
        MaxCount=1,
        IamInstanceProfile={"Arn": stack.profile_arn},
        NetworkInterfaces=[{"DeviceIndex": 0, "SubnetId": subnet, "Groups": [group]}],
    )["Instances"][0]["InstanceId"]
    return str(instance), "its VPC vpc-"


def _another_subnet(stack: DevBoxStack) -> tuple[str, str]:
    # The stack's VPC, but not a subnet `dev up` launches in.
    vpc = stack.ec2().describe_subnets(SubnetIds=stack.subnet_ids)["Subnets"][0]["VpcId"]
    subnets = stack.ec2().describe_subnets(Filters=[{"Name": "vpc-id", "Values": [vpc]}])["Subnets"]
    subnet = next(str(s["SubnetId"]) for s in subnets if s["SubnetId"] not in stack.subnet_ids)
    return stack.launch(subnet=subnet), f"its subnet {subnet} is not one of the stack's dev subnets"


def _user_data_overridden(stack: DevBoxStack) -> tuple[str, str]:
    return (
        stack.launch(UserData="#!/bin/sh\necho attacker-key >> /etc/ssh/ssh_host_ed25519_key.pub\n"),
        "its user data is not version 1 of the template's (overridden at launch)",
    )


def _image_overridden(stack: DevBoxStack) -> tuple[str, str]:
    return (
        stack.launch(ImageId="ami-0a11ce0000000b0b"),
        f"its image ami-0a11ce0000000b0b is not its template version's {STAND_IN_AMI}",
    )


def _version_not_from_pulumi(stack: DevBoxStack) -> tuple[str, str]:
    # Someone added a version to the stack's template (and left the default as `pulumi up` set it).
    stack.ec2().create_launch_template_version(
        LaunchTemplateId=stack.template_id,
        LaunchTemplateData=_template_data(stack.profile_arn, stack.security_group),
    )
    return (
        stack.launch(version="2"),
        f"it was launched from version 2 of template {stack.template_id}, which `pulumi up` did not make "
        "(the stack's is 1)",
    )


IMPOSTORS: dict[str, Impostor] = {
    "no template": _no_template,
    "another template": _another_template,
    "another profile": _another_profile,
    "no profile": _no_profile,
    "another VPC": _another_vpc,
    "another subnet": _another_subnet,
    "user data overridden": _user_data_overridden,
    "image overridden": _image_overridden,
    "a version pulumi did not make": _version_not_from_pulumi,
}


def test_impostors_launched_after_the_box_are_ignored_and_the_box_connects(stack: DevBoxStack) -> None:
    box = stack.launch()
    _newer()
    impostors = {name: make(stack) for name, make in IMPOSTORS.items()}

    result = stack.proxy()

    assert result.code == 0, result.err
    assert result.out == ""  # stdout is the SSH stream
    assert stack.session_target() == box, (impostors, result.err)
    assert [p["InstanceId"] for p in stack.pushed] == [box]
    # The real box is a new instance: its first key will be accepted; no impostor's ever is.
    assert stack.files.known_hosts.read_text() == ""
    assert stack.files.last_instance.read_text().strip() == box
    warnings = result.err.splitlines()
    assert len(warnings) == len(impostors)
    for name, (instance_id, difference) in impostors.items():
        [line] = [w for w in warnings if f"ignored: {instance_id} " in w]
        assert difference in line, name
        assert f"`aws ec2 terminate-instances --instance-ids {instance_id}`" in line, name
        assert box not in line, name


@pytest.mark.parametrize("impostor", IMPOSTORS, ids=list(IMPOSTORS))
def test_an_impostor_alone_is_refused_in_one_line_and_known_hosts_is_kept(
    stack: DevBoxStack, impostor: str
) -> None:
    instance_id, difference = IMPOSTORS[impostor](stack)

    result = stack.proxy()

    assert result.code == 1
    [line] = result.err.splitlines()
    assert line.startswith(f"trainstack: error: {instance_id} has the dev box tag but is not this stack's")
    assert difference in line
    assert line.endswith(
        f"terminate it (`aws ec2 terminate-instances --instance-ids {instance_id}`) and `trainstack dev up`, "
        "or run `pulumi up` if the stack's outputs are out of date"
    )
    assert stack.pushed == [] and stack.session_target() is None
    assert stack.files.known_hosts.read_text() == f"{ALIAS} ssh-ed25519 AAAAearlier\n"
    assert stack.files.last_instance.read_text().strip() == EARLIER_BOX


def test_the_real_box_connects_and_keeps_its_pinned_key(stack: DevBoxStack) -> None:
    box = stack.launch()

    first = stack.proxy()
    assert first.code == 0 and first.err == "", first.err
    assert stack.session_target() == box and stack.files.known_hosts.read_text() == ""

    stack.files.known_hosts.write_text(f"{ALIAS} ssh-ed25519 AAAAbox\n")
    again = stack.proxy()
    assert again.code == 0 and again.err == "", again.err
    assert stack.files.known_hosts.read_text() == f"{ALIAS} ssh-ed25519 AAAAbox\n"


def test_several_real_boxes_the_newest_is_used_and_named(stack: DevBoxStack) -> None:
    older = stack.launch()
    _newer()
    newer = stack.launch()

    result = stack.proxy()

    assert result.code == 0, result.err
    assert stack.session_target() == newer
    assert result.err.splitlines() == [
        f"trainstack: warning: 2 dev boxes of this stack are up: using {newer}, the newest launched; "
        f"`aws ec2 terminate-instances --instance-ids {older}` ends the other"
    ]
    assert stack.proxy().err == result.err  # the same choice every time


def test_a_box_from_an_earlier_template_version_is_still_the_stacks(stack: DevBoxStack) -> None:
    box = stack.launch()
    # `pulumi up` changed the dev bundle: a new default version, with its own user data.
    ec2 = stack.ec2()
    newer = _template_data(stack.profile_arn, stack.security_group)
    newer["UserData"] = base64.b64encode(b"#cloud-config\n# the next bundle\n").decode()
    ec2.create_launch_template_version(LaunchTemplateId=stack.template_id, LaunchTemplateData=newer)
    ec2.modify_launch_template(LaunchTemplateId=stack.template_id, DefaultVersion="2")

    result = stack.proxy()

    assert result.code == 0 and result.err == "", result.err
    assert stack.session_target() == box, result.err


def test_the_profile_and_version_outputs_when_the_stack_exports_them(stack: DevBoxStack) -> None:
    box = stack.launch()
    # Someone made a version 2 and the template's default: the stack's outputs still say 1.
    ec2 = stack.ec2()
    ec2.create_launch_template_version(
        LaunchTemplateId=stack.template_id,
        LaunchTemplateData=_template_data(stack.profile_arn, stack.security_group),
    )
    ec2.modify_launch_template(LaunchTemplateId=stack.template_id, DefaultVersion="2")
    stack.write_outputs(**{DEV_TEMPLATE_VERSION: 1, DEV_INSTANCE_PROFILE_ARN: stack.profile_arn})
    _newer()
    impostor = stack.launch(version="2")

    result = stack.proxy()

    assert result.code == 0, result.err
    assert stack.session_target() == box, result.err
    [line] = result.err.splitlines()
    assert f"ignored: {impostor} " in line and "which `pulumi up` did not make (the stack's is 1)" in line

    # The output names the profile: a template that names another one does not change it.
    other = "arn:aws:iam::123456789012:instance-profile/renamed"
    stack.write_outputs(**{DEV_TEMPLATE_VERSION: 1, DEV_INSTANCE_PROFILE_ARN: other})
    refused = stack.proxy()
    assert refused.code == 1
    assert (
        f"its instance profile {stack.profile_arn} is not the stack's dev box profile {other}" in refused.err
    )


class RecordingSsm:
    """Run Command that records what would be sent to the box (nothing may be, to an impostor)."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send_command(self, **params: Any) -> dict[str, Any]:
        self.sent.append(params)
        return {"Command": {"CommandId": "c-1"}}

    def get_command_invocation(self, **_: Any) -> dict[str, Any]:
        return {"Status": "Failed", "StandardOutputContent": "", "StandardErrorContent": "not the box"}


@pytest.mark.parametrize("command", ["jupyter", "tensorboard"])
def test_jupyter_and_tensorboard_refuse_an_impostor_too(stack: DevBoxStack, command: str) -> None:
    instance_id, difference = _another_profile(stack)
    ssm = RecordingSsm()

    result = stack.run("dev", command, clients=Clients(None, session=new_session(), overrides={"ssm": ssm}))

    assert result.code == 1 and difference in result.err and instance_id in result.err
    assert len(result.err.splitlines()) == 1
    assert ssm.sent == [] and stack.session_target() is None


def test_a_box_dev_up_launched_connects(stack: DevBoxStack) -> None:
    # A template naming no profile (moto gives an instance none from its template): `dev up`'s own request
    # (template, zone's subnet, tags) is what passes the check.
    ec2 = stack.ec2()
    ec2.delete_launch_template(LaunchTemplateId=stack.template_id)
    stack.template_id = ec2.create_launch_template(
        LaunchTemplateName=DEV_NAME, LaunchTemplateData=_template_data(None, stack.security_group)
    )["LaunchTemplate"]["LaunchTemplateId"]
    stack.outputs["dev_template_id"] = stack.template_id
    stack.write_outputs()
    up = stack.run("dev", "up", "--no-wait", "--json")
    assert up.code == 0, up.err
    box = json.loads(up.out)["instance_id"]

    result = stack.proxy()

    assert result.code == 0 and result.err == "", result.err
    assert stack.session_target() == box, result.err

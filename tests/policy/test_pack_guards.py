"""Issue 34, item 6: the pack guards every control of the job's containment, on the real program.

Each case takes the program as it renders under Pulumi mocks (tests/policy/test_program_passes_pack.py),
applies exactly one weakening of one control, and expects one line from the pack that names the resource and
the fix: the job role's Deny of the agent's control objects and the reach of its Allows, its trust, the
VPC-endpoint Deny on the bucket, the secret path's depth, what an instance's role (the agents', the dev box's)
may never do, the job sandbox in user data, and three older misses (bucket teardown, audit-trail deletion,
IMDS disabled with tokens optional). The job's session policy lives only in the agent
(bootstrap/jobuser.py): the pack never sees it, so its shape is guarded here, on the function's own output.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
from collections.abc import Callable
from fnmatch import fnmatchcase
from typing import Any

import pytest
import yaml
from pulumi_policy.proxy import UNKNOWN_STRING_VALUE

from bootstrap.agent_config import Prefixes
from bootstrap.cloud_init import JOB_SANDBOX_PATH
from bootstrap.jobuser import job_session_policy
from infra.iam.common import submitted_objects
from infra.iam.machine_roles import job_role_policy
from infra.iam.resource_policies import create_only_statements
from policypack.containment import CODE_WRITES, CONTROL_OBJECTS, ENVIRONMENT_CODE, SUBMITTED_OBJECTS
from policypack.user_data import SANDBOX_PATH
from tests.infra.program import shared_run
from tests.policy.harness import Resource, Violation, check
from tests.policy.test_program_passes_pack import _as_engine_sees_it, _explain

ACCOUNT = "123456789012"
JOB_ROLE_ARN = f"arn:aws:iam::{ACCOUNT}:role/trainstack-dev-job"
INSTANCE_ROLE_ARN = f"arn:aws:iam::{ACCOUNT}:role/trainstack-dev-instance"
DEV_ROLE_ARN = f"arn:aws:iam::{ACCOUNT}:role/trainstack-dev-dev"
EVERY_STACKS_PARAMETERS = f"arn:aws:ssm:us-east-1:{ACCOUNT}:parameter/trainstack/*"
BUCKET = "trainstack-dev-0123456789"
SANDBOX = "/usr/local/sbin/trainstack-job-sandbox"
AGENT_UNIT = "/etc/systemd/system/trainstack-agent.service"

JOB_ROLE = "job-role-contained"
ENDPOINT = "s3-instance-roles-through-endpoint"
LAUNCH = "instance-roles-launch-nothing"
SANDBOX_POLICY = "job-sandbox-in-user-data"
DATA = "iam-data-access-on-named-resources"
TEARDOWN = "iam-no-teardown-of-data-or-audit-trail"
IMDS = "imdsv2-required"
CREATE_ONLY = "s3-submissions-create-only"


@functools.cache
def _rendered(dev_box: bool) -> tuple[Resource, ...]:
    return tuple(_as_engine_sees_it(shared_run({"trainstack:devBox": True} if dev_box else None).resources))


def stack(dev_box: bool = False) -> list[Resource]:
    """A fresh copy of the compliant program's resources (the dev box's too with `dev_box`)."""
    return copy.deepcopy(list(_rendered(dev_box)))


def named(resources: list[Resource], name: str) -> Resource:
    return next(resource for resource in resources if resource.name == name)


# -- editing the rendered documents ----------------------------------------------------------------------


def _edit_document(resource: Resource, prop: str, edit: Callable[[dict[str, Any]], None]) -> None:
    document = json.loads(resource.props[prop])
    edit(document)
    resource.props[prop] = json.dumps(document)


def _statement(document: dict[str, Any], sid: str) -> dict[str, Any]:
    return next(s for s in document["Statement"] if s.get("Sid") == sid)


def _drop(name: str, sid: str, prop: str = "policy") -> Callable[[list[Resource]], None]:
    def mutate(resources: list[Resource]) -> None:
        def edit(document: dict[str, Any]) -> None:
            document["Statement"] = [s for s in document["Statement"] if s.get("Sid") != sid]

        _edit_document(named(resources, name), prop, edit)

    return mutate


def _change(
    name: str, sid: str, change: Callable[[dict[str, Any]], None], prop: str = "policy"
) -> Callable[[list[Resource]], None]:
    def mutate(resources: list[Resource]) -> None:
        _edit_document(named(resources, name), prop, lambda document: change(_statement(document, sid)))

    return mutate


def _add(name: str, *statements: dict[str, Any]) -> Callable[[list[Resource]], None]:
    def mutate(resources: list[Resource]) -> None:
        _edit_document(named(resources, name), "policy", lambda d: d["Statement"].extend(statements))

    return mutate


def _drop_resource(pattern: str) -> Callable[[dict[str, Any]], None]:
    def change(statement: dict[str, Any]) -> None:
        statement["Resource"] = [r for r in statement["Resource"] if not r.endswith(pattern)]

    return change


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(statement: dict[str, Any]) -> None:
        statement[key] = value

    return change


def _bucket_arn(resources: list[Resource]) -> str:
    return str(named(resources, "storage-bucket").props["arn"])


def _with_bucket(
    build: Callable[[str], Callable[[list[Resource]], None]],
) -> Callable[[list[Resource]], None]:
    """A mutation that needs the rendered bucket's ARN."""

    def mutate(resources: list[Resource]) -> None:
        build(_bucket_arn(resources))(resources)

    return mutate


def _allow(action: str | list[str], resource: str | list[str]) -> dict[str, Any]:
    return {"Effect": "Allow", "Action": action, "Resource": resource}


def _principal_arns(drop_name: str) -> Callable[[dict[str, Any]], None]:
    def change(statement: dict[str, Any]) -> None:
        arns = statement["Condition"]["ArnEquals"]["aws:PrincipalArn"]
        statement["Condition"]["ArnEquals"]["aws:PrincipalArn"] = [
            a for a in arns if not a.endswith(drop_name)
        ]

    return change


# -- editing the rendered user data ----------------------------------------------------------------------


def _edit_user_data(edit: Callable[[dict[str, Any]], None]) -> Callable[[list[Resource]], None]:
    def mutate(resources: list[Resource]) -> None:
        template = named(resources, "fleet-launch-template")
        text = base64.b64decode(template.props["userData"]).decode()
        document = yaml.safe_load(text)
        edit(document)
        rendered = "#cloud-config\n" + yaml.safe_dump(document, sort_keys=False, width=120)
        template.props["userData"] = base64.b64encode(rendered.encode()).decode()

    return mutate


def _written(document: dict[str, Any], path: str) -> dict[str, Any]:
    return next(entry for entry in document["write_files"] if entry["path"] == path)


def _sandbox_content(content: Callable[[str], str]) -> Callable[[list[Resource]], None]:
    def edit(document: dict[str, Any]) -> None:
        entry = _written(document, SANDBOX)
        entry["content"] = content(entry["content"])

    return _edit_user_data(edit)


def _sandbox_removed(document: dict[str, Any]) -> None:
    document["write_files"] = [e for e in document["write_files"] if e["path"] != SANDBOX]
    document["runcmd"] = [c for c in document["runcmd"] if c != [SANDBOX]]


def _agent_unit(change: Callable[[str], str]) -> Callable[[list[Resource]], None]:
    def edit(document: dict[str, Any]) -> None:
        entry = _written(document, AGENT_UNIT)
        entry["content"] = change(entry["content"])

    return _edit_user_data(edit)


def _without_exec_start_pre(unit: str) -> str:
    return "".join(line for line in unit.splitlines(keepends=True) if not line.startswith("ExecStartPre="))


def _metadata(**options: str) -> Callable[[list[Resource]], None]:
    def mutate(resources: list[Resource]) -> None:
        template = named(resources, "fleet-launch-template")
        template.props["metadataOptions"] = {**template.props["metadataOptions"], **options}

    return mutate


# -- the weakenings ------------------------------------------------------------------------------------

Case = tuple[str, bool, Callable[[list[Resource]], None], str, str, str]

_NEVER_STATE = "NeverTheAgentsState"
_TRUST = "TheStacksInstancesTakeTheJobRole"
_VPCE = "DenyInstanceRoleOutsideTheVpcEndpoint"
_SUBMISSIONS = "SubmissionsAreCreatedNeverOverwritten"
_CODE = "EnvironmentCodeOnlyFromTheOperator"


def _null_if_none_match(value: str | None) -> Callable[[dict[str, Any]], None]:
    """The create-only Deny's Null condition set to `value`, or dropped (None)."""

    def change(statement: dict[str, Any]) -> None:
        if value is None:
            del statement["Condition"]["Null"]
        else:
            statement["Condition"]["Null"] = {"s3:if-none-match": value}

    return change


CASES: list[Case] = [
    # 1-2. The job role's Deny of the agent's control objects: removed, narrowed, made conditional.
    ("job-deny-removed", False, _drop("identity-job-policy", _NEVER_STATE), JOB_ROLE, "identity-job-role",
     "add an unconditional Deny"),
    ("job-deny-without-the-checkpoint-pointer", False,
     _change("identity-job-policy", _NEVER_STATE, _drop_resource("/checkpoints/latest.json")), JOB_ROLE,
     "identity-job-role", "jobs/*/checkpoints/latest.json"),
    ("job-deny-without-the-job-record", False,
     _change("identity-job-policy", _NEVER_STATE, _drop_resource("/job.json")), JOB_ROLE,
     "identity-job-role", "jobs/*/job.json"),
    ("job-deny-without-the-jobs-state", False,
     _change("identity-job-policy", _NEVER_STATE, _drop_resource("jobs/*/state/*")), JOB_ROLE,
     "identity-job-role", "jobs/*/state/*"),
    ("job-deny-without-the-stacks-state", False,
     _change("identity-job-policy", _NEVER_STATE, lambda s: s.update(Resource=s["Resource"][1:])), JOB_ROLE,
     "identity-job-role", "state/*"),
    ("job-deny-of-put-only", False,
     _change("identity-job-policy", _NEVER_STATE, _set("Action", "s3:PutObject")), JOB_ROLE,
     "identity-job-role", "s3:DeleteObject"),
    ("job-deny-made-conditional", False,
     _change("identity-job-policy", _NEVER_STATE,
             _set("Condition", {"StringEquals": {"aws:RequestedRegion": "eu-west-1"}})),
     JOB_ROLE, "identity-job-role", "without a Condition"),
    ("job-deny-on-another-bucket", False,
     _change("identity-job-policy", _NEVER_STATE,
             lambda s: s.update(Resource=[r.replace(BUCKET, "elsewhere") for r in s["Resource"]])),
     JOB_ROLE, "identity-job-role", "add an unconditional Deny"),
    ("job-allow-widened-to-the-whole-bucket", False,
     _with_bucket(lambda b: _change("identity-job-policy", "ReadWriteJobs", _set("Resource", f"{b}/*"))),
     JOB_ROLE, "identity-job-policy", "the whole bucket"),
    ("job-allow-reads-the-whole-bucket", False,
     _with_bucket(lambda b: _change("identity-job-policy", "ReadData", _set("Resource", f"{b}/*"))),
     JOB_ROLE, "identity-job-policy", "the whole bucket"),
    ("job-allow-writes-the-queue", False,
     _with_bucket(lambda b: _add("identity-job-policy", _allow("s3:PutObject", f"{b}/queue/*"))),
     JOB_ROLE, "identity-job-policy", "only under jobs/"),
    # 3. Its trust: only the job instances' role, by name.
    ("job-trust-condition-dropped", False,
     _change("identity-job-role", _TRUST, lambda s: s.pop("Condition"), prop="assumeRolePolicy"),
     JOB_ROLE, "identity-job-role", "aws:PrincipalArn"),
    ("job-trust-condition-on-every-role", False,
     _change("identity-job-role", _TRUST,
             _set("Condition", {"ArnLike": {"aws:PrincipalArn": f"arn:aws:iam::{ACCOUNT}:role/*"}}),
             prop="assumeRolePolicy"),
     JOB_ROLE, "identity-job-role", "aws:PrincipalArn"),
    ("job-trust-names-the-dev-role", True,
     _change("identity-job-role", _TRUST,
             _set("Condition", {"ArnEquals": {"aws:PrincipalArn": [INSTANCE_ROLE_ARN, DEV_ROLE_ARN]}}),
             prop="assumeRolePolicy"),
     JOB_ROLE, "identity-job-role", "trainstack-dev-dev"),
    ("job-trust-for-the-ec2-service", False,
     _change("identity-job-role", _TRUST,
             lambda s: s.update(Principal={"Service": "ec2.amazonaws.com"}, Condition={}),
             prop="assumeRolePolicy"),
     JOB_ROLE, "identity-job-role", "aws:PrincipalArn"),
    # 5. The bucket refuses the instances' roles outside the stack's S3 endpoint.
    ("endpoint-deny-removed", False, _drop("storage-policy", _VPCE), ENDPOINT, "storage-policy",
     "aws:SourceVpce"),
    ("endpoint-deny-without-the-job-role", False,
     _change("storage-policy", _VPCE, _principal_arns("identity-job-role")), ENDPOINT, "storage-policy",
     "trainstack-dev-job"),
    ("endpoint-deny-without-the-dev-role", True,
     _change("storage-policy", _VPCE, _principal_arns("devbox-role")), ENDPOINT, "storage-policy",
     "trainstack-dev-dev"),
    ("endpoint-deny-names-another-endpoint", False,
     _change("storage-policy", _VPCE,
             lambda s: s["Condition"].update(StringNotEquals={"aws:SourceVpce": "vpce-0attacker"})),
     ENDPOINT, "storage-policy", "aws:SourceVpce"),
    ("endpoint-deny-of-reads-only", False, _change("storage-policy", _VPCE, _set("Action", "s3:GetObject")),
     ENDPOINT, "storage-policy", "s3:*"),
    # 5b. A submitter is not root: records, queue entries and job code created only (If-None-Match), the
    # environment's code written by the operator alone.
    ("create-only-deny-removed", False, _drop("storage-policy", _SUBMISSIONS), CREATE_ONLY, "storage-policy",
     f'"Sid": "{_SUBMISSIONS}"'),
    ("create-only-without-the-queue", False,
     _change("storage-policy", _SUBMISSIONS, _drop_resource("/queue/*")), CREATE_ONLY, "storage-policy",
     "trainstack-dev-job overwrite queue/*"),
    ("create-only-without-the-job-record", False,
     _change("storage-policy", _SUBMISSIONS, _drop_resource("/jobs/*/job.json")), CREATE_ONLY,
     "storage-policy", "trainstack-dev-job overwrite jobs/*/job.json"),
    ("create-only-without-the-job-code", False,
     _change("storage-policy", _SUBMISSIONS, _drop_resource("/job-code/*")), CREATE_ONLY, "storage-policy",
     "trainstack-dev-job overwrite job-code/*"),
    ("create-only-without-the-instance-role", False,
     _change("storage-policy", _SUBMISSIONS, _principal_arns("identity-instance-role")), CREATE_ONLY,
     "storage-policy", "trainstack-dev-instance overwrite job-code/*, jobs/*/job.json, queue/*"),
    ("create-only-without-the-job-role", False,
     _change("storage-policy", _SUBMISSIONS, _principal_arns("identity-job-role")), CREATE_ONLY,
     "storage-policy", "trainstack-dev-job overwrite job-code/*, jobs/*/job.json, queue/*"),
    ("create-only-without-the-dev-role", True,
     _change("storage-policy", _SUBMISSIONS, _principal_arns("devbox-role")), CREATE_ONLY, "storage-policy",
     "trainstack-dev-dev overwrite job-code/*, jobs/*/job.json, queue/*"),
    ("create-only-null-flipped-to-false", False,
     _change("storage-policy", _SUBMISSIONS, _null_if_none_match("false")), CREATE_ONLY, "storage-policy",
     "trainstack-dev-instance, trainstack-dev-job overwrite job-code/*, jobs/*/job.json, queue/*"),
    ("create-only-null-dropped", True,
     _change("storage-policy", _SUBMISSIONS, _null_if_none_match(None)), CREATE_ONLY, "storage-policy",
     "every s3:PutObject on job-code/*, jobs/*/job.json, queue/*, creates too"),
    ("create-only-on-another-bucket", False,
     _change("storage-policy", _SUBMISSIONS,
             lambda s: s.update(Resource=[r.replace(BUCKET, "elsewhere") for r in s["Resource"]])),
     CREATE_ONLY, "storage-policy", "overwrite job-code/*, jobs/*/job.json, queue/*"),
    ("environment-code-deny-removed", False, _drop("storage-policy", _CODE), CREATE_ONLY, "storage-policy",
     f'"Sid": "{_CODE}"'),
    ("environment-code-deny-of-put-only", False,
     _change("storage-policy", _CODE, _set("Action", "s3:PutObject")), CREATE_ONLY, "storage-policy",
     "trainstack-dev-job s3:DeleteObject, s3:DeleteObjectVersion on"),
    ("environment-code-deny-narrowed-to-one-object", False,
     _with_bucket(lambda b: _change("storage-policy", _CODE, _set("Resource", f"{b}/code/agent.tar.gz"))),
     CREATE_ONLY, "storage-policy", f"s3:DeleteObjectVersion on arn:aws:s3:::{BUCKET}/code/*"),
    ("environment-code-deny-without-the-dev-role", True,
     _change("storage-policy", _CODE, _principal_arns("devbox-role")), CREATE_ONLY, "storage-policy",
     "does not deny trainstack-dev-dev s3:PutObject, s3:DeleteObject, s3:DeleteObjectVersion"),
    ("environment-code-deny-made-conditional", False,
     _change("storage-policy", _CODE,
             lambda s: s["Condition"].update(StringEquals={"aws:RequestedRegion": "eu-west-1"})),
     CREATE_ONLY, "storage-policy", f'"Sid": "{_CODE}"'),
    # 6. Secrets on the stack's own path, never the root every stack shares.
    ("parameters-of-every-stack", False,
     _change("identity-instance-policy", "ReadOwnSecretParameters",
             _set("Resource", EVERY_STACKS_PARAMETERS)),
     DATA, "identity-instance-policy", "parameter/trainstack/<stack>/*"),
    ("secrets-of-every-stack", False,
     _change("identity-instance-policy", "ReadOwnSecrets",
             _set("Resource", f"arn:aws:secretsmanager:us-east-1:{ACCOUNT}:secret:trainstack/*")),
     DATA, "identity-instance-policy", "secret:trainstack/<stack>/*"),
    ("decrypt-parameters-of-every-stack", False,
     _change("identity-instance-policy", "DecryptOwnParametersThroughSsm",
             lambda s: s["Condition"]["StringLike"].update(
                 {"kms:EncryptionContext:PARAMETER_ARN": EVERY_STACKS_PARAMETERS})),
     DATA, "identity-instance-policy", "parameter/trainstack/<stack>/*"),
    # 7. The dev role (and the agents' role): no EC2, IAM or STS action, never another instance or role.
    ("dev-role-runs-instances-as-the-instance-role", True,
     _add("devbox-policy", _allow("ec2:RunInstances", "*"), _allow("iam:PassRole", INSTANCE_ROLE_ARN)),
     LAUNCH, "devbox-policy", "ec2:RunInstances"),
    ("dev-role-tags-instances", True,
     _add("devbox-policy", _allow("ec2:CreateTags", f"arn:aws:ec2:us-east-1:{ACCOUNT}:instance/*")),
     LAUNCH, "devbox-policy", "ec2:CreateTags"),
    ("dev-role-describes-instances", True, _add("devbox-policy", _allow("ec2:DescribeInstances", "*")),
     LAUNCH, "devbox-policy", "ec2:DescribeInstances"),
    ("dev-role-takes-the-job-role", True, _add("devbox-policy", _allow("sts:AssumeRole", JOB_ROLE_ARN)),
     LAUNCH, "devbox-policy", "sts:AssumeRole"),
    ("dev-role-sends-commands", True,
     _add("devbox-policy", _allow("ssm:SendCommand", f"arn:aws:ec2:us-east-1:{ACCOUNT}:instance/*")),
     LAUNCH, "devbox-policy", "ssm:SendCommand"),
    ("instance-role-runs-instances-as-itself", False,
     _add("identity-instance-policy", _allow("ec2:RunInstances", "*"),
          _allow("iam:PassRole", INSTANCE_ROLE_ARN)),
     LAUNCH, "identity-instance-policy", "iam:PassRole"),
    ("instance-role-takes-the-dev-role", True,
     _add("identity-instance-policy", _allow("sts:AssumeRole", DEV_ROLE_ARN)),
     LAUNCH, "identity-instance-policy", "trainstack-dev-dev"),
    # 8. The job sandbox in user data: the job's user and its IMDS firewall before every start of the agent.
    ("sandbox-replaced-by-exit-0", False, _sandbox_content(lambda _: "#!/bin/sh\nexit 0\n"), SANDBOX_POLICY,
     "fleet-launch-template", "bootstrap/instance/job-sandbox.sh"),
    ("sandbox-exits-before-its-rules", False,
     _sandbox_content(lambda text: text.replace("set -euo pipefail\n", "set -euo pipefail\nexit 0\n", 1)),
     SANDBOX_POLICY, "fleet-launch-template", "exits"),
    ("sandbox-removed", False, _edit_user_data(_sandbox_removed), SANDBOX_POLICY, "fleet-launch-template",
     SANDBOX),
    ("sandbox-not-run-before-the-agent", False, _agent_unit(_without_exec_start_pre), SANDBOX_POLICY,
     "fleet-launch-template", f"ExecStartPre={SANDBOX}"),
    ("sandbox-failure-ignored", False,
     _agent_unit(lambda unit: unit.replace(f"ExecStartPre={SANDBOX}", f"ExecStartPre=-{SANDBOX}")),
     SANDBOX_POLICY, "fleet-launch-template", f"ExecStartPre={SANDBOX}"),
    # 9. Older misses: the stack's own bucket, its audit trail, IMDS off with IMDSv1 on.
    ("delete-own-bucket", False,
     _with_bucket(lambda b: _add("identity-instance-policy", _allow("s3:DeleteBucket", b))),
     TEARDOWN, "identity-instance-policy", "s3:DeleteBucket"),
    ("put-own-bucket-policy", False,
     _with_bucket(lambda b: _add("identity-job-policy", _allow("s3:PutBucketPolicy", b))),
     TEARDOWN, "identity-job-policy", "s3:PutBucketPolicy"),
    ("delete-log-groups-and-flow-logs", False,
     _add("capacity-policy", _allow(["logs:DeleteLogGroup", "ec2:DeleteFlowLogs"], "*")),
     TEARDOWN, "capacity-policy", "logs:DeleteLogGroup, ec2:DeleteFlowLogs"),
    ("imds-disabled-with-tokens-optional", False, _metadata(httpEndpoint="disabled", httpTokens="optional"),
     IMDS, "fleet-launch-template", 'httpTokens = "required"'),
]  # fmt: skip


def _found(violations: list[Violation], policy: str, resource: str, fix: str) -> bool:
    return any(
        v.policy == policy and f"'{resource}'" in v.message and fix in v.message and "\n" not in v.message
        for v in violations
    )


@pytest.mark.parametrize("dev_box", [False, True], ids=["stack", "with-dev-box"])
def test_the_compliant_program_passes(dev_box: bool) -> None:
    violations = check(stack(dev_box))
    assert violations == [], _explain(violations)


@pytest.mark.parametrize(
    ("dev_box", "mutation", "policy", "resource", "fix"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_each_weakening_is_one_line_naming_the_resource_and_the_fix(
    dev_box: bool, mutation: Callable[[list[Resource]], None], policy: str, resource: str, fix: str
) -> None:
    resources = stack(dev_box)
    mutation(resources)
    violations = check(resources)
    assert _found(violations, policy, resource, fix), _explain(violations)


@pytest.mark.parametrize(("name", "prop"), [("storage-policy", "policy"), ("storage-bucket", "arn")])
def test_the_submissions_rule_waits_for_up_while_the_bucket_or_its_policy_is_unknown(
    name: str, prop: str
) -> None:
    """At a first preview the bucket's ARN and the policy built from it are unknown: the rule says nothing
    then (it runs again on `up`, with every value known), even with both statements gone."""
    resources = stack(dev_box=True)
    _drop("storage-policy", _SUBMISSIONS)(resources)
    _drop("storage-policy", _CODE)(resources)
    assert any(v.policy == CREATE_ONLY for v in check(resources))
    named(resources, name).props[prop] = UNKNOWN_STRING_VALUE
    assert [v for v in check(resources) if v.policy == CREATE_ONLY] == []


def test_there_are_at_least_twenty_weakenings_each_of_its_own() -> None:
    assert len(CASES) >= 20
    assert len({case[0] for case in CASES}) == len(CASES)


def test_the_packs_layout_is_the_programs() -> None:
    """The pack runs without the project on its path, so it writes trainstack's keys and paths itself: they
    must be the ones the program denies and renders."""
    bucket = f"arn:aws:s3:::{BUCKET}"
    document = job_role_policy(
        bucket_arn=bucket,
        key_arn="arn:aws:kms:us-east-1:123456789012:key/k",
        region="us-east-1",
        log_group_arn=f"arn:aws:logs:us-east-1:{ACCOUNT}:log-group:/trainstack/dev",
    )
    denied = {r for s in document["Statement"] if s["Effect"] == "Deny" for r in _as_list(s["Resource"])}
    assert {f"{bucket}/{shown}" for shown, _ in CONTROL_OBJECTS} <= denied
    for shown, probe in CONTROL_OBJECTS:
        assert fnmatchcase(probe, shown), (probe, shown)
    assert SANDBOX_PATH == JOB_SANDBOX_PATH == SANDBOX
    create_only, code = create_only_statements(bucket_arn=bucket, role_arns=[JOB_ROLE_ARN])
    assert [shown for shown, _ in SUBMITTED_OBJECTS] == submitted_objects()
    assert [f"{bucket}/{shown}" for shown, _ in SUBMITTED_OBJECTS] == create_only["Resource"]
    assert ENVIRONMENT_CODE[0] == f"{Prefixes().code}*"
    assert code["Resource"] == f"{bucket}/{ENVIRONMENT_CODE[0]}" and code["Action"] == list(CODE_WRITES)
    for shown, probe in (*SUBMITTED_OBJECTS, ENVIRONMENT_CODE):
        assert fnmatchcase(probe, shown), (probe, shown)


# -- the session policy: only in the agent, so guarded here ----------------------------------------------

JOB = "default-f2e58283"
_WRITES = ("s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload")


def _session(**overrides: Any) -> dict[str, Any]:
    arguments: dict[str, Any] = {
        "role_arn": JOB_ROLE_ARN,
        "bucket": BUCKET,
        "job_id": JOB,
        "region": "us-east-1",
        "log_group": "/trainstack/dev",
        "log_stream": f"{JOB}/i-0123/job",
    }
    return job_session_policy(**{**arguments, **overrides})


def _as_list(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def _decides(document: dict[str, Any], effect: str, action: str, resource: str) -> bool:
    """Whether a statement of `effect` covers `action` on `resource` (no Condition on a Deny counts)."""
    for statement in document["Statement"]:
        if statement["Effect"] != effect:
            continue
        if effect == "Deny" and statement.get("Condition"):
            continue
        actions = _as_list(statement.get("Action"))
        if not any(fnmatchcase(action, pattern) for pattern in actions):
            continue
        if any(fnmatchcase(resource, pattern) for pattern in _as_list(statement.get("Resource"))):
            return True
    return False


def session_policy_problems(document: dict[str, Any], *, bucket: str, job: str) -> list[str]:
    """What a session policy lets one job do beyond its own prefix, dataset and log stream (empty: none)."""
    arn = f"arn:aws:s3:::{bucket}"
    problems: list[str] = []
    for key in (
        f"jobs/{job}/state/ledger.json",
        f"jobs/{job}/job.json",
        f"jobs/{job}/checkpoints/latest.json",
    ):
        for action in _WRITES:
            if not _decides(document, "Deny", action, f"{arn}/{key}"):
                problems.append(f"no unconditional Deny of {action} on {key}")
    for key in ("jobs/another-job/checkpoints/step-1.pt", "queue/x.json", "state/current-job.json", "code/x"):
        for action in ("s3:GetObject", *_WRITES):
            if _decides(document, "Allow", action, f"{arn}/{key}"):
                problems.append(f"allows {action} on {key}")
    if not _decides(document, "Allow", "s3:PutObject", f"{arn}/jobs/{job}/checkpoints/step-1.pt"):
        problems.append("the job cannot write its own checkpoints")
    for statement in (s for s in document["Statement"] if s["Effect"] == "Allow"):
        actions = _as_list(statement.get("Action"))
        services = {action.split(":")[0] for action in actions}
        via = statement.get("Condition", {}).get("StringEquals", {}).get("kms:ViaService")
        if "kms" in services and _as_list(via) != ["s3.us-east-1.amazonaws.com"]:
            problems.append("uses KMS other than through S3")
        streams = _as_list(statement.get("Resource"))
        if "logs" in services and any(
            "*" in r or not r.endswith(f":log-stream:{job}/i-0123/job") for r in streams
        ):
            problems.append("writes log streams other than its own")
        if services - {"s3", "kms", "logs"}:
            problems.append(f"allows {actions} beyond S3, KMS through S3 and its log stream")
    return problems


def test_the_agents_session_policy_has_the_shape_that_contains_one_job() -> None:
    assert session_policy_problems(_session(), bucket=BUCKET, job=JOB) == []


def _session_without(sid: str) -> dict[str, Any]:
    document = _session()
    document["Statement"] = [s for s in document["Statement"] if s.get("Sid") != sid]
    return document


def _session_with(sid: str, **fields: Any) -> dict[str, Any]:
    document = _session()
    next(s for s in document["Statement"] if s.get("Sid") == sid).update(fields)
    return document


SESSION_WEAKENINGS: list[tuple[str, dict[str, Any], str]] = [
    ("state-deny-removed", _session_without("NeverOwnState"), f"on jobs/{JOB}/state/ledger.json"),
    ("pointer-deny-removed", _session_without("NeverTheCheckpointPointer"),
     f"on jobs/{JOB}/checkpoints/latest.json"),
    ("own-job-widened-to-every-job",
     _session_with("ReadWriteOwnJob", Resource=f"arn:aws:s3:::{BUCKET}/jobs/*"),
     "on jobs/another-job/checkpoints/step-1.pt"),
    ("data-widened-to-the-bucket", _session_with("ReadData", Resource=f"arn:aws:s3:::{BUCKET}/*"),
     "allows s3:GetObject on queue/x.json"),
    ("kms-without-via-service", _session_with("StackKeyThroughS3", Condition={}), "uses KMS other than"),
    ("every-log-stream",
     _session_with("OwnLogStream", Resource=f"arn:aws:logs:us-east-1:{ACCOUNT}:log-group:/trainstack/dev:*"),
     "log streams other than its own"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("document", "problem"), [w[1:] for w in SESSION_WEAKENINGS], ids=[w[0] for w in SESSION_WEAKENINGS]
)
def test_a_weakened_session_policy_is_told_apart(document: dict[str, Any], problem: str) -> None:
    problems = session_policy_problems(document, bucket=BUCKET, job=JOB)
    assert any(problem in line for line in problems), problems

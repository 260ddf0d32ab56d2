"""The job's containment (SECURITY.md T7, T9, T11, T15): the job role, its trust, what an instance's role may
never do, the bucket refusing the instances' roles outside the stack's S3 endpoint, and the bucket letting the
stack's roles only create submissions, never overwrite one nor write the environment's code.

Which role is which is read off the resources (roles.py). The object keys are trainstack's layout: the pack
runs without the project on its path, so they are written here; tests/policy/test_pack_guards.py checks they
are the ones the program denies.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Any

from pulumi_policy import PolicyResource, ReportViolation

from . import resource_types as t
from .documents import Statement, UnreadableDocumentError, statements
from .patterns import OBJECT_ARN, has_wildcard, literal_prefix, matches_shape
from .properties import get, is_unknown
from .roles import (
    PRINCIPAL_ARN_OPERATORS,
    Role,
    Roles,
    covers_role,
    is_account_root,
    names_role,
    principal_arn_conditions,
    role_arn_hint,
    stack_roles,
)
from .stack import configurers, describe, of_type

# The agent's control objects (infra/iam/machine_roles.py job_role_policy): the stack's state, every job's
# state (ledger, cost, crash counter, lease), every job's record, and every job's checkpoint pointer (it
# carries the lease's fencing token). As written in a fix, and as a key the Deny must cover.
CONTROL_OBJECTS = (
    ("state/*", "state/current-job.json"),
    ("jobs/*/state/*", "jobs/any-job/state/ledger.json"),
    ("jobs/*/job.json", "jobs/any-job/job.json"),
    ("jobs/*/checkpoints/latest.json", "jobs/any-job/checkpoints/latest.json"),
)
JOB_DENIED_WRITES = ("s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload")
OBJECT_WRITES = ("s3:PutObject", "s3:DeleteObject", "s3:DeleteObjectVersion", "s3:AbortMultipartUpload")
OBJECT_ACTIONS = ("s3:GetObject", "s3:GetObjectVersion", *OBJECT_WRITES)
# A job writes only under its own jobs/<job-id>/ (the agent's session policy narrows jobs/ to it).
JOB_WRITABLE_PREFIX = "jobs/"
_S3_ARN = re.compile(r"^arn:(?P<partition>[^:*?]+):s3:::(?P<bucket>[^/*?]+)(?:/(?P<key>.*))?$")

# What no role an instance runs as may do: launch, start, change or tag instances (a tag is what the dev box's
# proxy once trusted), rewrite what launches, hand a role to an instance, or run commands on other instances.
INSTANCE_FORBIDDEN = (
    "ec2:RunInstances",
    "ec2:StartInstances",
    "ec2:StopInstances",
    "ec2:TerminateInstances",
    "ec2:ModifyInstanceAttribute",
    "ec2:CreateLaunchTemplate",
    "ec2:CreateLaunchTemplateVersion",
    "ec2:ModifyLaunchTemplate",
    "ec2:AssociateIamInstanceProfile",
    "ec2:ReplaceIamInstanceProfileAssociation",
    "ec2:CreateTags",
    "ec2:DeleteTags",
    "iam:PassRole",
    "ssm:SendCommand",
    "ssm:StartSession",
    "ec2-instance-connect:SendSSHPublicKey",
)
# A dev box's role (an instance role no group launches): no action of these services at all (SECURITY.md).
_DEV_FORBIDDEN_SERVICES = ("ec2", "iam", "sts")
_DESCRIBE = re.compile(r"^ec2:(describe|get)", re.IGNORECASE)


def _glob(pattern: str) -> str:
    """An IAM pattern (`*`, `?`) as an fnmatch one: IAM gives `[` no meaning."""
    return pattern.strip().replace("[", "[[]")


def _covers_resource(statement: Statement, arn: str) -> bool:
    if statement.not_resources:
        return not any(fnmatchcase(arn, _glob(pattern)) for pattern in statement.not_resources)
    return any(fnmatchcase(arn, _glob(pattern)) for pattern in statement.resources)


def _denied(statements: Iterable[Statement], action: str, arn: str) -> bool:
    """Whether an unconditional Deny covers `action` on `arn`."""
    return any(
        s.denies() and not s.conditions and s.covers_action(action) and _covers_resource(s, arn)
        for s in statements
    )


def _buckets_reached(role: Role, actions: Sequence[str]) -> dict[str, str]:
    """bucket name -> its ARN, for each bucket named in an Allow of `actions` the role gets."""
    found: dict[str, str] = {}
    for _, _, statement in role.allows():
        if not any(statement.covers_action(action) for action in actions):
            continue
        for resource in statement.resources:
            match = _S3_ARN.match(resource.strip())
            if match:
                found.setdefault(match["bucket"], f"arn:{match['partition']}:s3:::{match['bucket']}")
    return found


def _key_literal(resource: str) -> str | None:
    """What an object-ARN pattern pins of the key ('' for the whole bucket); None when it names no object."""
    resource = resource.strip()
    match = _S3_ARN.match(resource)
    if match:
        return None if match["key"] is None else literal_prefix(match["key"])
    return "" if has_wildcard(resource) and matches_shape(resource, OBJECT_ARN) else None


# -- the job role ----------------------------------------------------------------------------------------


def job_role_contained(
    resources: Sequence[PolicyResource], config: Mapping[str, Any], report: ReportViolation
) -> None:
    """T9: the role the job instances hand a job is taken by them alone, writes only under jobs/, reads no
    whole bucket, and is denied, unconditionally, every write of the agent's control objects."""
    roles = stack_roles(resources)
    for role in roles.job:
        _judge_trust(role, roles, report)
        _judge_allows(role, report)
        _judge_deny(role, report)


def _judge_trust(role: Role, roles: Roles, report: ReportViolation) -> None:
    takers = roles.takers
    names = ", ".join(taker.label for taker in takers)
    fix = (
        f'trust only the job instances\' role: Principal {{"AWS": "arn:aws:iam::<account>:root"}} with '
        "Condition "
        f'{{"ArnEquals": {{"aws:PrincipalArn": "{role_arn_hint(takers[0]) if takers else "<its ARN>"}"}}}}'
    )
    for index, statement in enumerate(role.trust or []):
        if not statement.allows() or not (
            statement.covers_action("sts:AssumeRole") or statement.covers_action("sts:TagSession")
        ):
            continue
        principals = statement.typed_principals
        if principals and all(
            kind == "AWS" and any(names_role(v, t) for t in takers) for kind, v in principals
        ):
            continue
        conditions = principal_arn_conditions(statement)
        narrowing = [
            values for values in conditions if all(any(names_role(v, t) for t in takers) for v in values)
        ]
        if principals and all(kind == "AWS" and is_account_root(v) for kind, v in principals) and narrowing:
            continue
        if not principals or statement.not_principals:
            who = (
                "everyone it does not list (NotPrincipal)"
                if statement.not_principals
                else "no named principal"
            )
        else:
            who = ", ".join(value for _, value in principals)
        if conditions:
            widest = ", ".join(v for values in conditions for v in values)
            what = f"lets aws:PrincipalArn {widest} ({who}) take the job role, not only {names}"
        else:
            what = f"lets {who} take the job role without an aws:PrincipalArn condition naming {names}"
        report(
            f"{describe(role.resource)}: assumeRolePolicy Statement[{index}] {what}: {fix}", role.resource.urn
        )


def _judge_allows(role: Role, report: ReportViolation) -> None:
    for document, index, statement in role.allows():
        covered = [action for action in OBJECT_ACTIONS if statement.covers_action(action)]
        if not covered:
            continue
        writes = [action for action in covered if action in OBJECT_WRITES]
        targets = list(statement.resources) or (["*"] if statement.not_resources else [])
        for resource in targets:
            literal = _key_literal(resource)
            where = f"{describe(document.carrier)}: {document.where} Statement[{index}]"
            if literal == "":
                report(
                    f"{where} gives the job role {role.label} {', '.join(covered)} on {resource.strip()}, "
                    "the whole "
                    "bucket: name the job's prefixes only (jobs/*, data/*, datasets/*)",
                    document.carrier.urn,
                )
            elif literal is not None and writes and not literal.startswith(JOB_WRITABLE_PREFIX):
                report(
                    f"{where} gives the job role {role.label} {', '.join(writes)} on {resource.strip()}: a "
                    "job "
                    f"writes only under {JOB_WRITABLE_PREFIX} (its own jobs/<job-id>/, narrowed by the "
                    "agent's "
                    "session policy); remove it",
                    document.carrier.urn,
                )


def _judge_deny(role: Role, report: ReportViolation) -> None:
    statements = role.all_statements()
    if statements is None:
        return  # known on `up`
    for bucket_arn in _buckets_reached(role, OBJECT_ACTIONS).values():
        missing_keys: list[str] = []
        missing_actions: list[str] = []
        for shown, probe in CONTROL_OBJECTS:
            for action in JOB_DENIED_WRITES:
                if not _denied(statements, action, f"{bucket_arn}/{probe}"):
                    missing_keys += [] if shown in missing_keys else [shown]
                    missing_actions += [] if action in missing_actions else [action]
        if missing_keys:
            keys = ", ".join(f"{bucket_arn}/{key}" for key in missing_keys)
            report(
                f"{describe(role.resource)}: the job role {role.label} is not denied "
                f"{', '.join(missing_actions)} "
                f"on {keys} (the agent's state, the job's record, the checkpoint pointer that carries the "
                f"lease's fencing token): add an unconditional Deny, without a Condition, of "
                f"{', '.join(JOB_DENIED_WRITES)} on them",
                role.resource.urn,
            )


# -- what an instance's role may never do ----------------------------------------------------------------


def instance_roles_launch_nothing(
    resources: Sequence[PolicyResource], config: Mapping[str, Any], report: ReportViolation
) -> None:
    """T7 and the dev box's row of SECURITY.md's trust table: a role instances run as never launches, starts,
    changes or tags instances, rewrites launch templates, passes a role or runs commands on other instances;
    the job instances' role takes no role but the job role; the dev box's role has no EC2, IAM or STS
    action."""
    roles = stack_roles(resources)
    for role in roles.instance:
        # The dev box's role when it is one for sure; else (the job instances', or not known at preview)
        # judged as the job instances' role.
        launches_jobs = role not in roles.unlaunched
        for document, index, statement in role.allows():
            found = [action for action in INSTANCE_FORBIDDEN if statement.covers_action(action)]
            found += _role_taking(statement, roles, launches_jobs)
            for action in statement.actions:
                service = action.split(":", 1)[0].lower()
                extra = (not launches_jobs and service in _DEV_FORBIDDEN_SERVICES) or (
                    launches_jobs and service == "ec2" and not _DESCRIBE.match(action)
                )
                if extra and not any(action.strip().lower() == f.lower() for f in found):
                    found.append(action.strip())
            if found:
                kind = (
                    "the job instances' role"
                    if launches_jobs
                    else "an instance's role that no group launches"
                )
                report(
                    f"{describe(document.carrier)}: {document.where} Statement[{index}] gives {role.label} "
                    f"({kind}) "
                    f"{', '.join(found)}: remove it; a role instances run as never launches, changes, tags "
                    "or "
                    "reaches other instances, passes a role or takes one other than the job role (the dev "
                    "box "
                    "stops its own bill with `shutdown`)",
                    document.carrier.urn,
                )


def _role_taking(statement: Statement, roles: Roles, launches_jobs: bool) -> list[str]:
    if not statement.covers_action("sts:AssumeRole"):
        return []
    if not launches_jobs:
        return ["sts:AssumeRole"]
    if statement.not_resources:
        return ["sts:AssumeRole with NotResource"]
    return [
        f"sts:AssumeRole on {resource.strip()}"
        for resource in statement.resources
        if not is_unknown(resource) and not any(names_role(resource, job) for job in roles.job)
    ]


# -- the bucket refuses the instances' roles outside the stack's S3 endpoint ------------------------------

_ENDPOINT_KEYS = ("aws:sourcevpce", "aws:sourcevpc")
_NEGATIVE = ("stringnotequals", "stringnotequalsifexists")
_CONFINED_ACTIONS = ("s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:ListBucket")
_BUCKET_ACTIONS = (*OBJECT_ACTIONS, "s3:ListBucket")


def instance_roles_through_endpoint(
    resources: Sequence[PolicyResource], config: Mapping[str, Any], report: ReportViolation
) -> None:
    """T11: with an S3 endpoint in the stack, every bucket a role of its instances (or the job role) reaches
    denies that role everything unless the request comes through one of the stack's endpoints (or VPCs):
    stolen instance or job credentials are useless elsewhere."""
    endpoints = [
        e
        for e in of_type(resources, [t.VPC_ENDPOINT])
        if isinstance(get(e.props, "serviceName"), str) and str(get(e.props, "serviceName")).endswith(".s3")
    ]
    if not endpoints:
        return
    endpoint_ids = {v for e in endpoints if isinstance(v := get(e.props, "id"), str) and not is_unknown(v)}
    vpc_ids = {v for e in endpoints if isinstance(v := get(e.props, "vpcId"), str) and not is_unknown(v)}
    roles = stack_roles(resources)
    confined = [*roles.instance, *(role for role in roles.job if role not in roles.instance)]
    for bucket in of_type(resources, t.BUCKETS):
        name, arn = _bucket_name(bucket)
        if name is None:
            continue
        reaching = [
            role
            for role in confined
            if any(_names_bucket(b, name) for b in _buckets_reached(role, _BUCKET_ACTIONS))
        ]
        if not reaching:
            continue
        found = configurers(resources, bucket, [t.BUCKET_POLICY], "bucket")
        if found.maybe:
            continue
        documents = [get(bucket.props, "policy"), *(get(p.props, "policy") for p in found.found)]
        parsed = [_parse(document) for document in documents]
        if any(statements is None for statements in parsed):
            continue  # known on `up`
        statements = [s for group in parsed for s in group or []]
        loose = [
            role
            for role in reaching
            if not any(_confines(s, role, arn, endpoint_ids, vpc_ids) for s in statements)
        ]
        if loose:
            target = found.found[0] if found.found else bucket
            endpoint = sorted(endpoint_ids)[0] if endpoint_ids else "<the S3 endpoint's id>"
            arns = ", ".join(f'"{role_arn_hint(role)}"' for role in loose)
            report(
                f"{describe(target)}: the bucket {name} does not refuse {', '.join(r.label for r in loose)} "
                "outside "
                f'the stack\'s S3 endpoint: add a Deny of "s3:*" on {arn} and {arn}/* for Principal "*" with '
                f'Condition {{"ArnEquals": {{"aws:PrincipalArn": [{arns}]}}, "StringNotEquals": '
                f'{{"aws:SourceVpce": "{endpoint}"}}}}',
                target.urn,
            )


def _parse(document: Any) -> list[Statement] | None:
    try:
        return statements(document)
    except UnreadableDocumentError:
        return []  # s3-tls-only says so


def _bucket_name(bucket: PolicyResource) -> tuple[str | None, str]:
    arn = get(bucket.props, "arn")
    if isinstance(arn, str) and not is_unknown(arn) and (match := _S3_ARN.match(arn)):
        return match["bucket"], arn
    name = get(bucket.props, "bucket")
    if isinstance(name, str) and name and not is_unknown(name):
        return name, f"arn:aws:s3:::{name}"
    return None, ""


def _names_bucket(pattern: str, name: str) -> bool:
    return fnmatchcase(name, _glob(pattern))


def _confines(
    statement: Statement, role: Role, bucket_arn: str, endpoint_ids: set[str], vpc_ids: set[str]
) -> bool:
    """A Deny for everyone (or naming `role`) of every S3 action on the bucket and its objects, unless the
    request comes through one of the stack's endpoints or VPCs, and on no other condition."""
    if not statement.denies() or not any(
        kind in ("*", "AWS") and v == "*" for kind, v in statement.typed_principals
    ):
        return False
    if not all(statement.covers_action(action) for action in _CONFINED_ACTIONS):
        return False
    if not (_covers_resource(statement, bucket_arn) and _covers_resource(statement, f"{bucket_arn}/any/key")):
        return False
    through_endpoint = False
    for operator, block in statement.conditions.items():
        for key, values in block.items():
            key = key.lower()
            if key in _ENDPOINT_KEYS and operator.lower() in _NEGATIVE:
                known = endpoint_ids if key == "aws:sourcevpce" else vpc_ids
                through_endpoint = bool(values) and (not known or set(values) <= known)
                if not through_endpoint:
                    return False
            elif key != "aws:principalarn" or (
                operator.lower().removesuffix("ifexists") not in PRINCIPAL_ARN_OPERATORS
            ):
                return False
    if not through_endpoint:
        return False
    principals = principal_arn_conditions(statement)
    return all(any(covers_role(value, role) for value in values) for values in principals)


# -- a submitter is not root: submissions created only, the environment's code from the operator only ------

# What a submission writes (infra/iam/common.py submitted_objects): a job's code, its record, its queue entry.
# As written in a fix, and as a key the create-only Deny must cover.
SUBMITTED_OBJECTS = (
    ("job-code/*", "job-code/any-job.tar.gz"),
    ("jobs/*/job.json", "jobs/any-job/job.json"),
    ("queue/*", "queue/any-entry.json"),
)
# The environment's code (Prefixes.code), which the agent runs as root.
ENVIRONMENT_CODE = ("code/*", "code/any/agent.tar.gz")
CODE_WRITES = ("s3:PutObject", "s3:DeleteObject", "s3:DeleteObjectVersion")
_CREATE_ONLY = {"null": {"s3:if-none-match": ("true",)}}
_CREATE_ONLY_SID = "SubmissionsAreCreatedNeverOverwritten"
_CODE_SID = "EnvironmentCodeOnlyFromTheOperator"


def submissions_create_only(
    resources: Sequence[PolicyResource], config: Mapping[str, Any], report: ReportViolation
) -> None:
    """T15: a bucket the stack's roles (its instances', the dev box's, the job's) write submissions in denies
    each of them s3:PutObject of a job's code, record or queue entry without If-None-Match (created, never
    overwritten), and every write or delete of the environment's code/, which the agent runs as root."""
    roles = stack_roles(resources)
    writers = [*roles.instance, *(role for role in roles.job if role not in roles.instance)]
    if not writers:
        return
    for bucket in of_type(resources, t.BUCKETS):
        name, arn = _bucket_name(bucket)
        if name is None or not _submits_into(writers, arn):
            continue
        found = configurers(resources, bucket, [t.BUCKET_POLICY], "bucket")
        if found.maybe:
            continue
        parsed = [
            _parse(d) for d in [get(bucket.props, "policy"), *(get(p.props, "policy") for p in found.found)]
        ]
        if any(group is None for group in parsed):
            continue  # known on `up`
        denies = [s for group in parsed for s in group or [] if s.denies()]
        target = found.found[0] if found.found else bucket
        _judge_create_only(target, name, arn, writers, denies, report)
        _judge_environment_code(target, name, arn, writers, denies, report)


def _submits_into(writers: Sequence[Role], bucket_arn: str) -> bool:
    """Whether one of the roles is allowed s3:PutObject on a submission's key (or the code) in the bucket."""
    probes = [probe for _, probe in (*SUBMITTED_OBJECTS, ENVIRONMENT_CODE)]
    return any(
        statement.covers_action("s3:PutObject")
        and any(_covers_resource(statement, f"{bucket_arn}/{probe}") for probe in probes)
        for role in writers
        for _, _, statement in role.allows()
    )


def _denial_conditions(statement: Statement, role: Role) -> dict[str, dict[str, tuple[str, ...]]] | None:
    """The conditions of a Deny that reaches `role` (Principal "*" or the role, every aws:PrincipalArn
    condition naming it), lower-cased, less those aws:PrincipalArn ones; None when it does not reach it."""
    principals = statement.typed_principals
    if not any(
        (kind in ("*", "AWS") and value.strip() == "*") or (kind == "AWS" and covers_role(value, role))
        for kind, value in principals
    ):
        return None
    if not all(any(covers_role(v, role) for v in values) for values in principal_arn_conditions(statement)):
        return None
    rest: dict[str, dict[str, tuple[str, ...]]] = {}
    for operator, block in statement.conditions.items():
        positive = operator.lower().removesuffix("ifexists") in PRINCIPAL_ARN_OPERATORS
        for key, values in block.items():
            if positive and key.lower() == "aws:principalarn":
                continue
            rest.setdefault(operator.lower(), {})[key.lower()] = tuple(v.strip().lower() for v in values)
    return rest


def _phrase(gaps: Mapping[str, Sequence[str]], verb: str) -> str:
    """Roles with the same gaps together: 'r1, r2 <verb> a, b; r3 <verb> c'."""
    grouped: dict[tuple[str, ...], list[str]] = {}
    for role, missing in gaps.items():
        grouped.setdefault(tuple(missing), []).append(role)
    return "; ".join(f"{', '.join(roles)} {verb}{', '.join(missing)}" for missing, roles in grouped.items())


def _role_arn(role: Role) -> str:
    arn = get(role.resource.props, "arn")
    if isinstance(arn, str) and not is_unknown(arn) and re.match(r"^arn:[^:]+:iam::\d{12}:role/", arn):
        return arn
    return role_arn_hint(role)


def _deny_statement(sid: str, actions: Sequence[str], resources: Sequence[str], condition: Any) -> str:
    return json.dumps(
        {
            "Sid": sid,
            "Effect": "Deny",
            "Principal": "*",
            "Action": actions[0] if len(actions) == 1 else list(actions),
            "Resource": resources[0] if len(resources) == 1 else list(resources),
            "Condition": condition,
        }
    )


def _roles_condition(writers: Sequence[Role]) -> dict[str, Any]:
    return {"ArnEquals": {"aws:PrincipalArn": [_role_arn(role) for role in writers]}}


def _judge_create_only(
    target: PolicyResource,
    name: str,
    arn: str,
    writers: Sequence[Role],
    denies: Sequence[Statement],
    report: ReportViolation,
) -> None:
    overwrite: dict[str, list[str]] = {}
    blocked: dict[str, list[str]] = {}
    for role in writers:
        for shown, probe in SUBMITTED_OBJECTS:
            key = f"{arn}/{probe}"
            reaching = [
                conditions
                for s in denies
                if s.covers_action("s3:PutObject")
                and _covers_resource(s, key)
                and (conditions := _denial_conditions(s, role)) is not None
            ]
            if _CREATE_ONLY in reaching:
                continue
            (blocked if {} in reaching else overwrite).setdefault(role.label, []).append(shown)
    if not overwrite and not blocked:
        return
    fix = _deny_statement(
        _CREATE_ONLY_SID,
        ["s3:PutObject"],
        [f"{arn}/{shown}" for shown, _ in SUBMITTED_OBJECTS],
        {**_roles_condition(writers), "Null": {"s3:if-none-match": "true"}},
    )
    problems = []
    if overwrite:
        problems.append(
            f"lets {_phrase(overwrite, 'overwrite ')} (a job's code, record, queue entry: no Deny of "
            's3:PutObject without If-None-Match, {"Null": {"s3:if-none-match": "true"}}), and the agent '
            "runs what a record names as root"
        )
    if blocked:
        problems.append(
            f"refuses {_phrase(blocked, 'every s3:PutObject on ')}, creates too (a Deny without the "
            '{"Null": {"s3:if-none-match": "true"}} condition): submissions fail'
        )
    report(
        f"{describe(target)}: the bucket {name} {'; it '.join(problems)}: make the bucket policy carry this "
        f"statement: {fix}",
        target.urn,
    )


def _judge_environment_code(
    target: PolicyResource,
    name: str,
    arn: str,
    writers: Sequence[Role],
    denies: Sequence[Statement],
    report: ReportViolation,
) -> None:
    shown, probe = ENVIRONMENT_CODE
    key = f"{arn}/{probe}"
    missing: dict[str, list[str]] = {}
    for role in writers:
        for action in CODE_WRITES:
            if not any(
                s.covers_action(action) and _covers_resource(s, key) and _denial_conditions(s, role) == {}
                for s in denies
            ):
                missing.setdefault(role.label, []).append(action)
    if not missing:
        return
    fix = _deny_statement(_CODE_SID, CODE_WRITES, [f"{arn}/{shown}"], _roles_condition(writers))
    report(
        f"{describe(target)}: the bucket {name} does not deny {_phrase(missing, '')} on {arn}/{shown}, the "
        "environment's code that the agent runs as root (only `pulumi up`, the operator's own credentials, "
        f"writes it): make the bucket policy carry this statement: {fix}",
        target.urn,
    )

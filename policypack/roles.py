"""Who is who among a stack's roles, read off the resources: the roles its instances run as, the role its job
instances hand a job, and every identity policy statement each role gets.

- **Instance roles**: the roles of the stack's instance profiles (what its instances, the dev box's too, run
  as).
- **Job instances' roles**: the roles of the instance profiles of the launch templates the stack's Auto
  Scaling groups launch (the agents' role; a dev box's template is launched by no group).
- **Job roles**: roles that are no instance role and that a job instances' role takes for its job: the role's
  trust names one (as principal, or in an `aws:PrincipalArn` condition), or one's policy allows
  `sts:AssumeRole` on the role by name.

Values known only after `up` match nothing here: the rules built on this pass at preview and run again on
`up`, with every ID known.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from pulumi_policy import PolicyResource

from . import managed
from . import resource_types as t
from .compute import template_references
from .documents import Statement, UnreadableDocumentError, statements
from .patterns import has_wildcard
from .properties import Unknown, get, is_unknown, items
from .stack import of_type

INSTANCE_PROFILE = "aws:iam/instanceProfile:InstanceProfile"
ROLE_POLICY = "aws:iam/rolePolicy:RolePolicy"
ROLE_POLICY_ATTACHMENT = "aws:iam/rolePolicyAttachment:RolePolicyAttachment"
_ROLE_ARN = re.compile(r"^arn:[^:]*:iam::[^:]*:role/(?P<path>.*)$", re.IGNORECASE)
_ACCOUNT_ROOT = re.compile(r"^(arn:[^:]+:iam::\d{12}:root|\d{12})$")
PRINCIPAL_ARN_OPERATORS = ("arnequals", "arnlike", "stringequals", "stringlike")


@dataclass
class Document:
    """One identity policy document a role gets: where it is written, and its statements (None: unknown)."""

    carrier: PolicyResource
    where: str
    statements: list[Statement] | None


@dataclass
class Role:
    resource: PolicyResource
    name: str | None
    trust: list[Statement] | None
    documents: list[Document] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.name or self.resource.name

    def allows(self) -> Iterator[tuple[Document, int, Statement]]:
        """Every Allow statement of every known document the role gets."""
        for document in self.documents:
            for index, statement in enumerate(document.statements or []):
                if statement.allows():
                    yield document, index, statement

    def all_statements(self) -> list[Statement] | None:
        """Every statement of the role's policies; None when one is unknown (at preview)."""
        found: list[Statement] = []
        for document in self.documents:
            if document.statements is None:
                return None
            found.extend(document.statements)
        return found


def _known(value: Any) -> str | None:
    return value if isinstance(value, str) and value and not is_unknown(value) else None


def _identities(resource: PolicyResource) -> set[str]:
    return {v for key in ("id", "arn", "name") if (v := _known(get(resource.props, key))) is not None}


def _points_at(holder: PolicyResource, prop: str, value: Any, target: PolicyResource) -> bool:
    if any(dependency.urn == target.urn for dependency in holder.property_dependencies.get(prop, [])):
        return True
    known = _known(value)
    return known is not None and known in _identities(target)


def _parse(document: Any) -> list[Statement] | None:
    try:
        return statements(document)
    except UnreadableDocumentError:
        return []  # iam-no-wildcard-actions says so; nothing here to judge


def names_role(value: str, role: Role) -> bool:
    """Whether an ARN names `role` exactly (no wildcard): its `arn`, or `arn:<partition>:iam::<account>:role/
    [<path>/]<name>`."""
    value = value.strip()
    if has_wildcard(value):
        return False
    if value in _identities(role.resource) - {role.name}:
        return True
    match = _ROLE_ARN.match(value)
    return bool(match and role.name and match["path"].rsplit("/", 1)[-1] == role.name)


def covers_role(pattern: str, role: Role) -> bool:
    """Whether an ARN pattern (`*`, `?`) matches `role`'s ARN."""
    pattern = pattern.strip()
    if names_role(pattern, role) or any(fnmatchcase(i, pattern) for i in _identities(role.resource)):
        return True
    match = _ROLE_ARN.match(pattern)
    return bool(match and role.name and fnmatchcase(role.name, match["path"].rsplit("/", 1)[-1]))


@dataclass
class Roles:
    """The stack's roles, sorted into the kinds the containment rules judge."""

    all: list[Role]
    instance: list[Role]
    job_instances: list[Role]
    job: list[Role]
    # Instance roles seen only on launch templates that no group launches (the dev box's): judged by the dev
    # box's row. An instance role whose template cannot be told (a reference unknown at preview) is not one.
    unlaunched: list[Role] = field(default_factory=list)
    # Who may take the job role: the job instances' role, or every instance role not surely the dev box's
    # where the templates cannot be told apart.
    takers: list[Role] = field(default_factory=list)


def _documents_of(resources: Sequence[PolicyResource], role: PolicyResource) -> list[Document]:
    found: list[Document] = []
    inline = items(role.props, "inlinePolicies")
    for index, policy in enumerate([] if isinstance(inline, Unknown) else inline):
        found.append(Document(role, f"inlinePolicies[{index}].policy", _parse(get(policy, "policy"))))
    for carrier in of_type(resources, [ROLE_POLICY]):
        if _points_at(carrier, "role", get(carrier.props, "role"), role):
            found.append(Document(carrier, "policy", _parse(get(carrier.props, "policy"))))
    arns: list[tuple[PolicyResource, str, Any]] = []
    managed_arns = items(role.props, "managedPolicyArns")
    for index, arn in enumerate([] if isinstance(managed_arns, Unknown) else managed_arns):
        arns.append((role, f"managedPolicyArns[{index}]", arn))
    for attachment in of_type(resources, [ROLE_POLICY_ATTACHMENT]):
        if _points_at(attachment, "role", get(attachment.props, "role"), role):
            arns.append((attachment, "policyArn", get(attachment.props, "policyArn")))
    policies = of_type(resources, [t.IAM_POLICY])
    for carrier, where, arn in arns:
        declared = [p for p in policies if _points_at(carrier, where.split("[")[0], arn, p)]
        for policy in declared:
            found.append(Document(carrier, f"{where} ({policy.name})", _parse(get(policy.props, "policy"))))
        known = _known(arn)
        document = managed.document(known) if known else None
        if document is not None:
            found.append(Document(carrier, where, _parse(document)))
    return found


def _profiles_of(resources: Sequence[PolicyResource], launcher: PolicyResource) -> list[PolicyResource]:
    profiles = of_type(resources, [INSTANCE_PROFILE])
    spec = get(launcher.props, "iamInstanceProfile")
    if isinstance(spec, str):
        values = [spec]
    else:
        values = [get(spec, "arn"), get(spec, "name")] if spec is not None and not is_unknown(spec) else []
    return [
        p
        for p in profiles
        if any(_points_at(launcher, "iamInstanceProfile", v, p) for v in values)
        or any(d.urn == p.urn for d in launcher.property_dependencies.get("iamInstanceProfile", []))
    ]


def _roles_of(profiles: Iterable[PolicyResource], roles: Sequence[Role]) -> list[Role]:
    found: list[Role] = []
    for profile in profiles:
        for role in roles:
            if _points_at(profile, "role", get(profile.props, "role"), role.resource) and role not in found:
                found.append(role)
    return found


def _templates_launched(resources: Sequence[PolicyResource]) -> list[PolicyResource]:
    templates = of_type(resources, [t.LAUNCH_TEMPLATE])
    launched: list[PolicyResource] = []
    for group in of_type(resources, [t.AUTOSCALING_GROUP]):
        references = {value for _, value in template_references(group.props)}
        dependencies = {
            d.urn
            for prop in ("launchTemplate", "mixedInstancesPolicy")
            for d in group.property_dependencies.get(prop, [])
        }
        for template in templates:
            if (
                references & _identities(template) or template.urn in dependencies
            ) and template not in launched:
                launched.append(template)
    return launched


def _trust_names(role: Role, others: Sequence[Role]) -> bool:
    """Whether `role`'s trust lets one of `others` take it (as principal, or in aws:PrincipalArn)."""
    for statement in role.trust or []:
        if not statement.allows():
            continue
        if any(
            kind == "AWS" and any(names_role(v, o) for o in others) for kind, v in statement.typed_principals
        ):
            return True
        for values in principal_arn_conditions(statement):
            if any(covers_role(value, other) for value in values for other in others):
                return True
    return False


def principal_arn_conditions(statement: Statement) -> list[tuple[str, ...]]:
    """The values of each positive aws:PrincipalArn condition of a statement (ArnEquals, ArnLike, ...)."""
    found: list[tuple[str, ...]] = []
    for operator, block in statement.conditions.items():
        if operator.lower().removesuffix("ifexists") not in PRINCIPAL_ARN_OPERATORS:
            continue
        for key, values in block.items():
            if key.lower() == "aws:principalarn":
                found.append(values)
    return found


def is_account_root(principal: str) -> bool:
    return bool(_ACCOUNT_ROOT.match(principal.strip()))


def stack_roles(resources: Sequence[PolicyResource]) -> Roles:
    everyone = [
        Role(
            resource=role,
            name=_known(get(role.props, "name")),
            trust=_parse(get(role.props, "assumeRolePolicy")),
            documents=_documents_of(resources, role),
        )
        for role in of_type(resources, [t.IAM_ROLE])
    ]
    instance = _roles_of(of_type(resources, [INSTANCE_PROFILE]), everyone)
    job_instances = _roles_of(
        (p for template in _templates_launched(resources) for p in _profiles_of(resources, template)),
        everyone,
    )
    launched = _templates_launched(resources)
    idle_templates = [t_ for t_ in of_type(resources, [t.LAUNCH_TEMPLATE]) if t_ not in launched]
    unlaunched = [
        role
        for role in _roles_of(
            (p for template in idle_templates for p in _profiles_of(resources, template)), everyone
        )
        if role not in job_instances
    ]
    # Who takes the job role: the job instances' role, or, where the templates cannot be told apart (a
    # reference unknown at preview), any instance role that is not surely the dev box's.
    takers = job_instances or [role for role in instance if role not in unlaunched]
    assumed = {
        resource
        for role in takers
        for _, _, statement in role.allows()
        if statement.covers_action("sts:AssumeRole")
        for resource in statement.resources
    }
    job = [
        role
        for role in everyone
        if role not in instance
        and (_trust_names(role, takers) or any(names_role(arn, role) for arn in assumed))
    ]
    return Roles(
        all=everyone,
        instance=instance,
        job_instances=job_instances,
        job=job,
        unlaunched=unlaunched,
        takers=takers,
    )


def role_arn_hint(role: Role) -> str:
    """How a fix names the role: `arn:aws:iam::<account>:role/<name>`."""
    return f"arn:aws:iam::<account>:role/{role.label}"

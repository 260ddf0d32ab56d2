"""Resource and trust policies: nothing is granted to everyone, nor to an account other than the stack's.

A grant is public when its principal is `*` (`"Principal": "*"`, `{"AWS": "*"}`, an ARN with a wildcard
account, NotPrincipal) and no condition ties it to this account, organization, VPC endpoint or source; it is
cross-account when it names another account's principal. "The stack's account" is the account of the
resources the stack declares (the account in their ARNs: outputs AWS fills in, which a document cannot
fake) plus the policy's `trustedAccountIds`; while no ARN is known (a first preview) only public grants are
judged, and the policy runs again after `pulumi up` with every ARN known.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from pulumi_policy import PolicyResource, ReportViolation

from . import resource_types as t
from .documents import Statement, UnreadableDocumentError, statements
from .properties import get, is_set, is_unknown
from .stack import describe, of_type

_ARN_ACCOUNT = re.compile(r"^arn:[^:]+:[^:]+:[^:]*:(?P<account>[^:]*):")
_ACCOUNT = re.compile(r"^\d{12}$")
# Condition keys that tie a grant to known callers or sources, under operators that require a match.
_RESTRICTING_KEYS = frozenset(
    {
        "aws:sourceaccount",
        "aws:sourceowner",
        "aws:sourcearn",
        "aws:sourceorgid",
        "aws:sourceorgpaths",
        "aws:principalaccount",
        "aws:principalarn",
        "aws:principalorgid",
        "aws:principalorgpaths",
        "aws:sourcevpce",
        "aws:sourcevpc",
        "aws:userid",
        "kms:calleraccount",
    }
)
_ACCOUNT_KEYS = frozenset(
    {"aws:sourceaccount", "aws:sourceowner", "aws:principalaccount", "kms:calleraccount"}
)
_MATCHING_OPERATORS = frozenset(
    {"stringequals", "stringequalsignorecase", "stringlike", "arnequals", "arnlike"}
)

Finding = Callable[[Any], Iterator[str]]


def own_accounts(resources: Sequence[PolicyResource], config: Mapping[str, Any]) -> set[str]:
    """The stack's account(s): those in the ARNs of its resources, plus the configured trusted accounts."""
    accounts = {str(account) for account in config.get("trustedAccountIds", [])}
    for resource in resources:
        arn = get(resource.props, "arn")
        if isinstance(arn, str) and not is_unknown(arn):
            match = _ARN_ACCOUNT.match(arn.strip())
            if match and _ACCOUNT.match(match.group("account")):
                accounts.add(match.group("account"))
    return accounts


def account_of(principal: str) -> str | None:
    """The account a principal names: `123456789012`, `arn:aws:iam::123456789012:root|role/...`."""
    principal = principal.strip()
    if _ACCOUNT.match(principal):
        return principal
    match = _ARN_ACCOUNT.match(principal)
    return match.group("account") if match else None


def _restricted(statement: Statement, own: set[str]) -> bool:
    """Does a condition tie this statement to named callers or sources (this stack's account, if known)?"""
    for operator, block in statement.conditions.items():
        if operator.lower() not in _MATCHING_OPERATORS:
            continue  # ...IfExists, Not..., ForAllValues: pass when the key is missing or differs
        for key, values in block.items():
            key = key.lower()
            if key not in _RESTRICTING_KEYS or not values:
                continue
            if any(value.strip() in ("", "*") for value in values):
                continue
            known = [value for value in values if not is_unknown(value)]
            accounts = [value if key in _ACCOUNT_KEYS else account_of(value) for value in known]
            named = [account for account in accounts if account and "*" not in account and "?" not in account]
            if key in _ACCOUNT_KEYS and len(named) != len(values):
                continue
            if own and any(account not in own for account in named):
                continue
            return True
    return False


def document_grants(
    document: Any, own: set[str], *, trust: bool = False, report_unreadable: bool = True
) -> Iterator[str]:
    """One line per Allow statement that grants everyone, or another account, something."""
    try:
        parsed = statements(document)
    except UnreadableDocumentError as error:
        if report_unreadable:
            yield f"{error}: fix the JSON"
        return
    for index, statement in enumerate(parsed or []):
        if not statement.allows():
            continue
        where = f"Statement[{index}]"
        if statement.not_principals:
            yield (
                f"{where} allows NotPrincipal, i.e. everyone it does not list: name the principals in "
                "Principal instead"
            )
            continue
        for kind, principal in statement.typed_principals:
            if is_unknown(principal):
                continue
            yield from _principal_findings(where, kind, principal.strip(), statement, own, trust)


def _principal_findings(
    where: str, kind: str, principal: str, statement: Statement, own: set[str], trust: bool
) -> Iterator[str]:
    public_fix = (
        "name this account's principals, or add a condition on aws:SourceAccount, aws:SourceArn, "
        "aws:PrincipalAccount, aws:PrincipalOrgID or aws:SourceVpce"
    )
    if kind in ("*", "AWS"):
        account = account_of(principal)
        if principal == "*" or (account is not None and ("*" in account or "?" in account)):
            if not _restricted(statement, own):
                yield (
                    f"{where} allows Principal {_shown(kind, principal)} (anyone) without a restricting "
                    f"condition: {public_fix}"
                )
            return
        if account and own and account not in own:
            yield (
                f"{where} grants account {account}, not this stack's account ({', '.join(sorted(own))}): "
                "grant this account's principals only (or list the account in the policy's trustedAccountIds)"
            )
    elif kind == "Federated" and trust:
        account = account_of(principal)
        if account is None and not statement.conditions:
            yield (
                f"{where} lets any identity of {principal} assume the role: add a condition on its audience "
                "or subject"
            )
        elif account and own and account not in own:
            yield f"{where} trusts an identity provider of account {account}, not this stack's account"


def _shown(kind: str, principal: str) -> str:
    return '"*"' if kind == "*" else f'{{"{kind}": "{principal}"}}'


def _document_rule(
    carriers: Mapping[str, str], *, trust: bool = False, report_unreadable: bool = True
) -> Callable[[Sequence[PolicyResource], Mapping[str, Any], ReportViolation], None]:
    """A stack check of the documents at `carriers` (type token -> property holding the document)."""

    def check(
        resources: Sequence[PolicyResource], config: Mapping[str, Any], report: ReportViolation
    ) -> None:
        own = own_accounts(resources, config)
        for resource in of_type(resources, list(carriers)):
            prop = carriers[resource.resource_type]
            document = get(resource.props, prop)
            for finding in document_grants(document, own, trust=trust, report_unreadable=report_unreadable):
                report(f"{describe(resource)}: {prop} {finding}", resource.urn)

    return check


# An unreadable bucket policy is s3-tls-only's finding already.
bucket_policy_not_public = _document_rule(
    {t.BUCKET_POLICY: "policy", **{token: "policy" for token in t.BUCKETS}}, report_unreadable=False
)
key_policy_not_public = _document_rule({t.KMS_KEY: "policy", t.KMS_KEY_POLICY: "policy"})
trust_policy_not_public = _document_rule({t.IAM_ROLE: "assumeRolePolicy"}, trust=True)
topic_policy_not_public = _document_rule({t.SNS_TOPIC: "policy", t.SNS_TOPIC_POLICY: "policy"})


def lambda_permission_not_public(
    resources: Sequence[PolicyResource], config: Mapping[str, Any], report: ReportViolation
) -> None:
    """Lambda.1 / CKV_AWS_301 / CKV_AWS_364: nobody outside the account invokes a function, and a service
    invokes it only for this account's source (SourceArn or SourceAccount: no confused deputy)."""
    own = own_accounts(resources, config)
    for permission in of_type(resources, [t.LAMBDA_PERMISSION]):
        principal = get(permission.props, "principal")
        if not isinstance(principal, str) or is_unknown(principal):
            continue
        principal = principal.strip()
        sourced = any(
            is_set(get(permission.props, key)) for key in ("sourceArn", "sourceAccount", "principalOrgId")
        )
        account = account_of(principal)
        if "*" in principal or "?" in principal:
            if not sourced:
                report(
                    f"{describe(permission)}: principal {principal} lets anyone invoke the function: name "
                    "this account's principal or a service with source_arn",
                    permission.urn,
                )
        elif account is not None:
            if own and account not in own:
                report(
                    f"{describe(permission)}: principal {principal} is another account than the stack's "
                    f"({', '.join(sorted(own))}): grant this account's principals only",
                    permission.urn,
                )
        elif not is_set(get(permission.props, "sourceArn")) and not is_set(
            get(permission.props, "sourceAccount")
        ):
            report(
                f"{describe(permission)}: {principal} may invoke the function for any account's resources: "
                "set source_arn (or source_account) to this stack's source",
                permission.urn,
            )


def snapshots_not_public(
    resources: Sequence[PolicyResource], config: Mapping[str, Any], report: ReportViolation
) -> None:
    """EC2.1: no EBS snapshot (nor AMI, whose snapshots come with it) is restorable by everyone or by
    another account."""
    own = own_accounts(resources, config)
    for permission in of_type(resources, [t.SNAPSHOT_CREATE_VOLUME_PERMISSION, t.AMI_LAUNCH_PERMISSION]):
        what = "snapshot" if permission.resource_type == t.SNAPSHOT_CREATE_VOLUME_PERMISSION else "image"
        group = get(permission.props, "group")
        account = get(permission.props, "accountId")
        if (isinstance(group, str) and group.lower() == "all") or (
            isinstance(account, str) and account.lower() == "all"
        ):
            report(
                f"{describe(permission)}: makes the {what} public (anyone can copy its volumes): remove it",
                permission.urn,
            )
        elif isinstance(account, str) and not is_unknown(account) and own and account not in own:
            report(
                f"{describe(permission)}: shares the {what} with account {account}, not this stack's "
                f"({', '.join(sorted(own))}): remove it (or list the account in trustedAccountIds)",
                permission.urn,
            )

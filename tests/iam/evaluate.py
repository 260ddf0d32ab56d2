"""IAM policy evaluation as AWS does it for one request in one account, for the documents trainstack writes.

Why our own: no maintained Python library evaluates a request against policies locally (parliament,
policyuniverse, policy_sentry and cloudsplaining lint, expand or generate documents; AWS's simulator is an
API call). This covers what the program's documents use, and refuses what it does not model:

- Effect Allow/Deny, Action/NotAction, Resource/NotResource, Principal in resource policies;
- action wildcards (case-insensitive), ARN wildcards (`*`, `?`; segment by segment up to the account,
  then across the resource part, which is how `bucket/*` covers `bucket/a/b`);
- the condition operators String*, Arn*, Bool and Null, with `...IfExists`; a key the request does not
  carry makes a positive operator false and a negated one true, as in IAM;
- a condition key the request model does not know (MODELLED_KEYS, or the request's own keys) raises
  UnmodelledConditionError instead of guessing, so a new condition in a policy is never waved through.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

Document = Mapping[str, Any]

# Global keys every request carries here (see requests.py): transport is TLS (botocore uses https on AWS),
# and the principal's own ARN and account.
MODELLED_KEYS = frozenset({"aws:securetransport", "aws:principalarn", "aws:principalaccount"})


class UnmodelledConditionError(Exception):
    """A statement that applies to the request has a condition this evaluator cannot decide."""


@dataclass(frozen=True)
class Request:
    """One authorization AWS makes: this action on this resource, with these condition keys.

    `context` holds the keys the request carries (lower-case names; absent keys are simply not there);
    `known` names keys the model understands even when this request does not carry them (s3:prefix on a
    listing without one is absent, not unknown).
    """

    action: str
    resource: str
    context: Mapping[str, Sequence[str]] = field(default_factory=dict)
    known: frozenset[str] = frozenset()
    why: str = ""  # which call or rule asked for it, for the failure message
    # What a refusal means to the caller when it is not the call's own AccessDenied (a missing object read
    # without s3:ListBucket is AccessDenied where the code expects NoSuchKey), and how to fix it.
    refusal: str = ""


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else [value]


@cache
def _glob(pattern: str, ignore_case: bool) -> re.Pattern[str]:
    body = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.compile(f"^{body}$", re.DOTALL | (re.IGNORECASE if ignore_case else 0))


def glob_match(pattern: str, value: str, *, ignore_case: bool = False) -> bool:
    return _glob(pattern, ignore_case).match(value) is not None


def action_matches(pattern: str, action: str) -> bool:
    return pattern == "*" or glob_match(pattern, action, ignore_case=True)


def arn_matches(pattern: str, arn: str) -> bool:
    """IAM's resource match: `*` alone is everything; otherwise partition, service, region and account
    match segment by segment and the resource part as one glob."""
    if pattern == "*":
        return True
    p_parts, a_parts = pattern.split(":", 5), arn.split(":", 5)
    if len(p_parts) != 6 or len(a_parts) != 6:
        return glob_match(pattern, arn)
    return all(glob_match(p, a) for p, a in zip(p_parts, a_parts, strict=True))


# --- conditions -----------------------------------------------------------------------------------------


def _string_op(base: str, expected: str, actual: str) -> bool:
    if base in ("StringEquals", "ArnEquals"):
        return expected == actual
    if base == "StringEqualsIgnoreCase":
        return expected.lower() == actual.lower()
    if base in ("StringLike", "ArnLike"):
        return (arn_matches if base == "ArnLike" else glob_match)(expected, actual)
    if base == "Bool":
        return expected.lower() == actual.lower()
    raise UnmodelledConditionError(f"operator {base}")


_NEGATED = {
    "StringNotEquals": "StringEquals",
    "StringNotLike": "StringLike",
    "StringNotEqualsIgnoreCase": "StringEqualsIgnoreCase",
    "ArnNotEquals": "ArnEquals",
    "ArnNotLike": "ArnLike",
}
_POSITIVE = {"StringEquals", "StringLike", "StringEqualsIgnoreCase", "ArnEquals", "ArnLike", "Bool"}


def _condition_holds(operator: str, key: str, expected: Any, request: Request) -> bool:
    if operator.startswith(("ForAnyValue:", "ForAllValues:")):
        raise UnmodelledConditionError(f"set operator {operator} on {key}")
    name = key.lower()
    if name not in MODELLED_KEYS and name not in request.known and name not in request.context:
        raise UnmodelledConditionError(f"condition key {key}")
    actual = request.context.get(name)
    if operator == "Null":
        # "Null": "true" holds when the key is absent, "false" when it is present.
        return all(str(e).lower() == ("true" if actual is None else "false") for e in _as_list(expected))
    if_exists = operator.endswith("IfExists")
    base = operator.removesuffix("IfExists")
    if actual is None:
        # IAM: a missing key makes a positive operator false and a negated one true; IfExists makes both true.
        if base in _NEGATED:
            return True
        if base in _POSITIVE:
            return if_exists
        raise UnmodelledConditionError(f"operator {operator}")
    values = [str(e) for e in _as_list(expected)]
    if base in _NEGATED:
        # Negated operators: true when no value of the request matches any listed value.
        return not any(_string_op(_NEGATED[base], e, a) for e in values for a in actual)
    # Positive operators: true when a value of the request matches any listed value (values are ORed).
    return any(_string_op(base, e, a) for e in values for a in actual)


def conditions_hold(conditions: Mapping[str, Mapping[str, Any]], request: Request) -> bool:
    """All operators, all keys within an operator (AND); the values of one key are ORed."""
    return all(
        _condition_holds(operator, key, expected, request)
        for operator, keys in conditions.items()
        for key, expected in keys.items()
    )


# --- statements and decisions ---------------------------------------------------------------------------


def _principal_matches(principal: Any, principal_arn: str, account: str) -> bool:
    """A resource policy's Principal: "*", or an AWS principal naming this role or its account's root."""
    if principal == "*":
        return True
    if not isinstance(principal, Mapping):
        return False
    for named in _as_list(principal.get("AWS", [])):
        if named in ("*", principal_arn, account, f"arn:aws:iam::{account}:root"):
            return True
    return False  # Service and Federated principals are never the callers checked here


def statement_applies(statement: Mapping[str, Any], request: Request) -> bool:
    if "Action" in statement:
        if not any(action_matches(p, request.action) for p in _as_list(statement["Action"])):
            return False
    elif any(action_matches(p, request.action) for p in _as_list(statement.get("NotAction", []))):
        return False
    if "Resource" in statement:
        if not any(arn_matches(p, request.resource) for p in _as_list(statement["Resource"])):
            return False
    elif any(arn_matches(p, request.resource) for p in _as_list(statement.get("NotResource", []))):
        return False
    return conditions_hold(statement.get("Condition", {}), request)


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str


@dataclass(frozen=True)
class Caller:
    """Who asks: the role's ARN and account; `identity` None means its identity policies are not the
    program's to declare (the CLI's user): they are taken to allow, and only explicit denies decide."""

    name: str
    arn: str
    account: str
    identity: Sequence[Document] | None


def _statements(documents: Iterable[Document]) -> Iterable[Mapping[str, Any]]:
    for document in documents:
        yield from _as_list(document.get("Statement", []))


def decide(
    request: Request, caller: Caller, resource_policy: Document | None, *, key_policy: bool
) -> Decision:
    """AWS's order within one account: an explicit Deny anywhere wins; then an Allow is needed.

    For a KMS key the key policy must allow, either the caller directly or the account (root), in which
    case the caller's IAM policy must allow as well. For other resources an Allow in the caller's IAM policy
    or in the resource's policy (naming the caller) suffices.
    """
    identity = list(caller.identity) if caller.identity is not None else []
    resource = (
        [
            s
            for s in _statements([resource_policy])
            if _principal_matches(s.get("Principal"), caller.arn, caller.account)
        ]
        if resource_policy
        else []
    )
    for statement in [*_statements(identity), *resource]:
        if statement.get("Effect") == "Deny" and statement_applies(statement, request):
            return Decision(False, f"explicitly denied by {statement.get('Sid', 'a Deny statement')}")
    identity_allows = caller.identity is None or any(
        s.get("Effect") == "Allow" and statement_applies(s, request) for s in _statements(identity)
    )
    resource_allows = [s for s in resource if s.get("Effect") == "Allow" and statement_applies(s, request)]
    if key_policy:
        if not resource_allows:
            return Decision(False, "the key policy allows neither the caller nor its account")
        direct = any(
            caller.arn in _as_list(s.get("Principal", {}).get("AWS", []))
            for s in resource_allows
            if isinstance(s.get("Principal"), Mapping)
        )
        if direct or identity_allows:
            return Decision(True, "allowed by the key policy and the caller's policy")
        return Decision(False, "the key policy leaves it to IAM, and the caller's policy does not allow it")
    if identity_allows or resource_allows:
        return Decision(True, "allowed")
    return Decision(False, "no statement allows it (implicit deny)")

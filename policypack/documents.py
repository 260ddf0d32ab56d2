"""Policy documents (IAM, bucket, key policies) read as statements, whatever shape they were written in."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from pulumi_policy.proxy import UnknownValueError

from .properties import get, is_unknown


@dataclass(frozen=True)
class Statement:
    """One statement, with the single-or-list fields normalised to tuples."""

    effect: str
    actions: tuple[str, ...]
    not_actions: tuple[str, ...]
    resources: tuple[str, ...]
    principals: tuple[str, ...]
    conditions: Mapping[str, Mapping[str, tuple[str, ...]]]
    # NotResource: an Allow with it grants every resource it does not list.
    not_resources: tuple[str, ...] = ()
    # The principals with their kind: ("*", "*") for `"Principal": "*"`, ("AWS", arn), ("Service", name)...
    typed_principals: tuple[tuple[str, str], ...] = ()
    # NotPrincipal: an Allow with it grants everyone it does not list.
    not_principals: tuple[str, ...] = ()

    def allows(self) -> bool:
        return self.effect.lower() == "allow"

    def denies(self) -> bool:
        return self.effect.lower() == "deny"

    def covers_action(self, action: str) -> bool:
        """True if this statement's Action (or NotAction) applies to `action`, e.g. "kms:Decrypt"."""
        if self.not_actions:
            return not any(_action_matches(pattern, action) for pattern in self.not_actions)
        return any(_action_matches(pattern, action) for pattern in self.actions)


class UnreadableDocumentError(ValueError):
    """The document is not JSON policy grammar; the message says what was wrong."""


def statements(document: Any) -> list[Statement] | None:
    """The statements of a policy document given as JSON text or an object; None when unknown at preview."""
    if document is None:
        return []
    if is_unknown(document):
        return None
    if isinstance(document, str):
        try:
            parsed = json.loads(document)
        except json.JSONDecodeError as error:
            raise UnreadableDocumentError(f"the policy document is not valid JSON ({error.msg})") from error
        document = parsed
    if not isinstance(document, Mapping):
        raise UnreadableDocumentError("the policy document is not a JSON object")
    raw = get(document, "Statement")
    if is_unknown(raw):
        return None
    if raw is None:
        return []
    raw_list = [raw] if isinstance(raw, Mapping) else [get(raw, i) for i in range(len(raw))]
    if any(is_unknown(item) for item in raw_list):
        return None
    try:
        return [_statement(item) for item in raw_list]
    except (UnknownValueError, _UnknownFieldError):
        return None  # a document given as an object, with a value only `up` will know


class _UnknownFieldError(Exception):
    """A statement's field (`"Resource": bucket.arn` in a document given as an object) only `up` will know:
    `get` turns the engine's marker into UNKNOWN, which is no string or list to read."""


def _field(raw: Mapping[str, Any], key: str) -> Any:
    value = get(raw, key)
    if is_unknown(value):
        raise _UnknownFieldError(key)
    return value


def _statement(raw: Mapping[str, Any]) -> Statement:
    conditions: dict[str, dict[str, tuple[str, ...]]] = {}
    for operator, block in dict(_field(raw, "Condition") or {}).items():
        if isinstance(block, Mapping):
            conditions[operator] = {key: _strings(value) for key, value in block.items()}
    return Statement(
        effect=str(_field(raw, "Effect") or ""),
        actions=_strings(_field(raw, "Action")),
        not_actions=_strings(_field(raw, "NotAction")),
        resources=_strings(_field(raw, "Resource")),
        principals=_principals(_field(raw, "Principal")),
        conditions=conditions,
        not_resources=_strings(_field(raw, "NotResource")),
        typed_principals=_typed_principals(_field(raw, "Principal")),
        not_principals=_principals(_field(raw, "NotPrincipal")),
    )


def _typed_principals(raw: Any) -> tuple[tuple[str, str], ...]:
    if raw is None:
        return ()
    if isinstance(raw, Mapping):
        return tuple((str(kind), value) for kind, values in raw.items() for value in _strings(values))
    return tuple(("*" if value.strip() == "*" else "AWS", value) for value in _strings(raw))


def _principals(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, Mapping):
        return tuple(value for values in raw.values() for value in _strings(values))
    return _strings(raw)


def _strings(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str | bool | int):
        return (str(raw).lower() if isinstance(raw, bool) else str(raw),)
    return tuple(str(item).lower() if isinstance(item, bool) else str(item) for item in raw)


def _action_matches(pattern: str, action: str) -> bool:
    # IAM action names are case-insensitive and support * and ? wildcards.
    return fnmatchcase(action.lower(), pattern.lower())


def is_wildcard_action(action: str, allowed_patterns: Collection[str] = ()) -> bool:
    """Any `*` or `?` in an action (`*`, `s3:*`, `s3:?*`, `s3:*Object*`), unless explicitly allowed (IAM.21).

    A pattern grants whatever AWS adds under it later; only the exact patterns in `allowed_patterns`
    (compared case-insensitively, as IAM compares actions) pass.
    """
    action = action.strip()
    if "*" not in action and "?" not in action:
        return False
    return action.lower() not in {pattern.strip().lower() for pattern in allowed_patterns}

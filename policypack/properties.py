"""Reading resource properties that may still be unknown at preview, without ever raising."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Final

from pulumi_policy.proxy import (
    UNKNOWN_ARCHIVE_VALUE,
    UNKNOWN_ARRAY_VALUE,
    UNKNOWN_ASSET_VALUE,
    UNKNOWN_BOOLEAN_VALUE,
    UNKNOWN_NUMBER_VALUE,
    UNKNOWN_OBJECT_VALUE,
    UNKNOWN_STRING_VALUE,
    UnknownValueError,
)

_ENGINE_UNKNOWNS = frozenset(
    (
        UNKNOWN_ARCHIVE_VALUE,
        UNKNOWN_ARRAY_VALUE,
        UNKNOWN_ASSET_VALUE,
        UNKNOWN_BOOLEAN_VALUE,
        UNKNOWN_NUMBER_VALUE,
        UNKNOWN_OBJECT_VALUE,
        UNKNOWN_STRING_VALUE,
    )
)
# Property paths found unknown while one resource policy runs (None: nobody is recording).
_unknown_paths: ContextVar[list[str] | None] = ContextVar("unknown_paths", default=None)


class Unknown:
    """A value the engine will only know after `pulumi up` (an output of another resource)."""

    _instance: Unknown | None = None

    def __new__(cls) -> Unknown:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Final = Unknown()


def is_unknown(value: Any) -> bool:
    """True for our sentinel and for Pulumi's raw unknown markers (both mean "known only after up")."""
    return value is UNKNOWN or (isinstance(value, str) and value in _ENGINE_UNKNOWNS)


@contextmanager
def recording_unknowns() -> Iterator[list[str]]:
    """Collects the property paths that `get` finds unknown inside the block."""
    paths: list[str] = []
    token = _unknown_paths.set(paths)
    try:
        yield paths
    finally:
        _unknown_paths.reset(token)


def _record_unknown(path: Sequence[str | int]) -> Unknown:
    paths = _unknown_paths.get()
    if paths is not None:
        paths.append(".".join(str(step) for step in path))
    return UNKNOWN


def get(props: Any, *path: str | int) -> Any:
    """The value at `path`, None where a step is missing, UNKNOWN where a step is not known yet.

    pulumi-policy wraps props in proxies that raise on unknown values; every rule reads through here
    so that an unknown value becomes UNKNOWN, which each rule treats as a pass (no false failure at
    preview; the same rule runs again on `pulumi up` with the value known). The path is recorded for
    `recording_unknowns`, so the policy can say at preview what it could not check.
    """
    current: Any = props
    for depth, step in enumerate(path):
        if current is None or is_unknown(current):
            return None if current is None else UNKNOWN
        try:
            if isinstance(step, str) and isinstance(current, Mapping):
                current = current.get(step)
            elif isinstance(step, int) and _is_list(current):
                current = current[step] if -len(current) <= step < len(current) else None
            else:
                return None
        except UnknownValueError as error:
            # The proxy knows the full path from the resource's root; ours may start at a nested object.
            return _record_unknown(error.props or path[: depth + 1])
        if is_unknown(current):
            return _record_unknown(path[: depth + 1])
    return current


def items(props: Any, *path: str | int) -> list[Any] | Unknown:
    """The list at `path` (a missing list is empty, a single object is a list of one), or UNKNOWN.

    Elements that are unknown come back as UNKNOWN, so a rule can skip them.
    """
    value = get(props, *path)
    if value is None:
        return []
    if value is UNKNOWN:
        return UNKNOWN
    if isinstance(value, Mapping):
        return [value]
    if not _is_list(value):
        return [value]
    return [get(value, index) for index in range(len(value))]


def count(props: Any, *path: str | int) -> int | Unknown:
    """How many elements the list at `path` has (0 if missing), without reading them: a list of
    subnet IDs unknown at preview still has a known length."""
    value = get(props, *path)
    if value is None:
        return 0
    if isinstance(value, Unknown):
        return value
    return len(value) if _is_list(value) else 1


def as_bool(value: Any) -> bool | None:
    """A boolean from a bool or the strings pulumi-aws uses ("true" on launch templates); None if unset."""
    if value is None or is_unknown(value):
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        return value.strip().lower() == "true"
    return bool(value)


def as_int(value: Any) -> int | None:
    """An integer from a number or numeric string; None if unset, unknown or not a number."""
    if value is None or is_unknown(value) or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def is_set(value: Any) -> bool:
    """True when a property holds something (an unknown value counts: it will hold something)."""
    if is_unknown(value):
        return True
    if value is None:
        return False
    if isinstance(value, str | Mapping) or _is_list(value):
        return len(value) > 0
    return True


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)

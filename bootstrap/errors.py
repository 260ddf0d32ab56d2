"""Exceptions said in one calm line, for the agent's events and notifications."""

from __future__ import annotations


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


def error_code(exc: BaseException) -> str:
    """AWS's error code (AccessDenied, ValidationError…) or the exception's kind: one calm word."""
    response = getattr(exc, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    return str(code or type(exc).__name__)

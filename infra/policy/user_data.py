"""Finding credentials in EC2 user data, which any process on the instance can read back from IMDS."""

from __future__ import annotations

import base64
import binascii
import gzip
import re

# The credential shapes checkov's CKV_AWS_46 and detect-secrets look for, plus private keys and tokens.
_SECRET_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("an AWS access key ID", re.compile(r"\b(?:AKIA|ASIA|ABIA|ACCA|A3T[A-Z0-9])[A-Z0-9]{16}\b")),
    (
        "an AWS secret access key",
        re.compile(r"(?i)aws_?secret_?access_?key[\"']?\s*[:=]\s*[\"']?[A-Za-z0-9/+=]{40}(?![A-Za-z0-9/+=])"),
    ),
    ("a private key", re.compile(r"-----BEGIN (?:[A-Z]+ )?PRIVATE KEY-----")),
    ("a GitHub token", re.compile(r"\bgh[pousr]_[A-Za-z0-9]{36,}\b")),
    ("a Slack token", re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}\b")),
    ("credentials in a URL", re.compile(r"\b[a-z][a-z0-9+.-]*://[^/\s:@]+:[^/\s:@$<{]{3,}@")),
    ("a password", re.compile(r"(?i)\b(?:password|passwd)[\"']?\s*[:=]\s*[\"']?[^\s\"'$<{]{8,}")),
)


def decode(user_data: str, *, base64_encoded: bool) -> str:
    """The user data as text: base64 and gzip (both allowed by EC2 and cloud-init) undone."""
    raw: bytes = user_data.encode()
    if base64_encoded:
        try:
            raw = base64.b64decode("".join(user_data.split()), validate=True)
        except (binascii.Error, ValueError):
            raw = user_data.encode()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError):
            return raw.decode(errors="replace")
    return raw.decode(errors="replace")


def find_secrets(text: str) -> list[str]:
    """What kinds of secret the text holds, in the order checked (empty when none)."""
    return [kind for kind, pattern in _SECRET_PATTERNS if pattern.search(text)]

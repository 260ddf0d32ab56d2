"""What looks like a credential: the one definition of the shapes of secret values and of the names that say
a value is one. Standard library only, importing nothing but trainstack_job.secret_refs: the job file's
`env:` check (trainstack_job/jobfile.py), the built-in trainer config's check at preview and `trainstack run`
(infra/submission.py) and the policy pack's user-data scan (policypack/user_data.py, which runs in its own
virtualenv) all read the same patterns, so a shape added here is refused everywhere at once.
"""

from __future__ import annotations

import re
from typing import Any

from trainstack_job.secret_refs import SET_COMMAND

# The credential shapes checkov's CKV_AWS_46 and detect-secrets look for, plus private keys and tokens; in
# this order the policy pack names what it finds. Where the agent's and the pack's copies had drifted apart,
# the wider pattern won: every AWS key prefix, every PEM/PGP private key header, a password of 6 characters.
CREDENTIAL_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("an AWS access key ID", re.compile(r"\b(?:AKIA|ASIA|ABIA|ACCA|A3T[A-Z0-9])[A-Z0-9]{16}\b")),
    (
        "an AWS secret access key",
        re.compile(r"(?i)aws_?secret_?access_?key[\"']?\s*[:=]\s*[\"']?[A-Za-z0-9/+=]{40}(?![A-Za-z0-9/+=])"),
    ),
    ("a private key", re.compile(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----")),
    ("a GitHub token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,})")),
    ("a Slack token", re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}\b")),
    # A password of three characters or more; one that starts like a reference ($VAR, <placeholder>) is none.
    ("credentials in a URL", re.compile(r"\b[a-z][a-z0-9+.-]*://[^/\s:@]+:[^/\s:@$<{][^/\s@]{2,}@")),
    ("a password", re.compile(r"(?i)\b(?:password|passwd)[\"']?\s*[:=]\s*[\"']?[^\s\"'$<{]{6,}")),
    ("a Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{30,}\b")),
    ("a .netrc password", re.compile(r"(?is)\b(?:machine\s+\S+|default)\s.*?\bpassword\s+(?![$<{(])\S+")),
)
# Name segments (split at '_', any case) that mark a credential: HF_TOKEN, DB_PASSWORD, CLIENT_SECRET.
CREDENTIAL_WORDS = frozenset(
    {"TOKEN", "SECRET", "SECRETS", "PASSWORD", "PASSWD", "PASSPHRASE", "APIKEY", "CREDENTIAL", "CREDENTIALS"}
)
# Names whose 40-hex value is a commit or a digest, not a W&B key.
_HASH_WORDS = frozenset({"SHA", "SHA1", "COMMIT", "REV", "REVISION", "HASH", "DIGEST", "REF"})
_HEX40 = re.compile(r"(?<![0-9A-Fa-f])[0-9a-f]{40}(?![0-9A-Fa-f])")
_BASE64_40 = re.compile(r"(?<![A-Za-z0-9/+=])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])")


def credential_kinds(text: str) -> list[str]:
    """Every kind of credential `text` holds, in CREDENTIAL_PATTERNS' order (empty when none)."""
    return [kind for kind, pattern in CREDENTIAL_PATTERNS if pattern.search(text)]


def secret_name(name: str) -> bool:
    """Whether a job's environment variable's name says it holds a credential (any `*_KEY` included: a job's
    env names its own settings, unlike user data, whose `bundle_key` the policy pack must let pass)."""
    upper = name.upper()
    parts = upper.split("_")
    return (
        bool(CREDENTIAL_WORDS.intersection(parts))
        or parts[-1] == "KEY"
        or "PASSWORD" in upper
        or upper == "AWS_ACCESS_KEY_ID"
    )


def secret_value_kind(value: str, name: str = "") -> str | None:
    """What kind of credential `value` looks like (e.g. "a Hugging Face token"), or None. Beyond the shapes
    above, a value alone: 40 hex digits (a W&B key, unless its name says commit or digest) and 40 mixed-case
    base64 characters (an AWS secret access key without its name)."""
    kinds = credential_kinds(value)
    if kinds:
        return kinds[0]
    hashes = bool(_HASH_WORDS.intersection(name.upper().split("_")))
    if not hashes and _HEX40.search(value):
        return "a W&B API key (40 hex digits)"
    for token in _BASE64_40.findall(value):
        if (
            any(c.isupper() for c in token)
            and any(c.islower() for c in token)
            and any(c.isdigit() for c in token)
        ):
            return "an AWS secret access key (40 base64 characters)"
    return None


def _plain(value: Any) -> bool:
    """Values no credential is: empty, a number, a boolean."""
    if isinstance(value, bool | int | float):
        return True
    text = str(value).strip()
    if text.lower() in ("", "true", "false", "yes", "no", "on", "off", "null", "none"):
        return True
    try:
        float(text)
    except ValueError:
        return False
    return True


def env_secret_problem(where: str, name: str, value: Any) -> str | None:
    """The one line refusing a secret-looking env entry (never repeating its value), or None."""
    kind = secret_value_kind(str(value), name) if isinstance(value, str) else None
    if kind is None and (not secret_name(name) or _plain(value)):
        return None
    what = f"its value looks like {kind}" if kind else "its name says it holds a credential"
    return (
        f"{where}.{name}: {what}, and env is written in plain text into user data, Pulumi state and the "
        f"preview diff; store it with `{SET_COMMAND} NAME` and reference it under secrets: {{{name}: NAME}} "
        "(docs/job-contract.md, Secrets)"
    )


def find_secret_values(tree: Any, where: str) -> list[str]:
    """Each string of a parsed config that looks like a credential, by its dotted key (never its value)."""
    found: list[str] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, child in node.items():
                walk(child, f"{path}.{key}" if path else str(key))
        elif isinstance(node, list):
            for index, child in enumerate(node):
                walk(child, f"{path}[{index}]")
        elif isinstance(node, str):
            kind = secret_value_kind(node, path.rsplit(".", 1)[-1])
            if kind:
                found.append(
                    f"{where}: {path}: looks like {kind}; keep credentials out of the config (it is written "
                    f"into user data) and name them under secrets: (`{SET_COMMAND} NAME`)"
                )

    walk(tree, "")
    return found

"""A job's secrets by reference: what `secrets:` names and where each one lives (docs/job-contract.md).
Standard library only: the job file's schema (trainstack_job/jobfile.py), the agent that resolves them
(bootstrap/secrets.py), the CLI that stores them (trainstack/secrets.py) and the instance role's grant
(infra/iam/machine_roles.py) all read these names from here.

Reference syntax (`secrets: {ENV_NAME: REF}` in job.yaml, or at the top of the built-in trainer's config):

- `hf-token` or `ssm:hf-token`: the SSM SecureString parameter `/trainstack/<stack>/hf-token` (the default,
  what `trainstack secrets set hf-token` writes);
- `secretsmanager:wandb`: the Secrets Manager secret `trainstack/<stack>/wandb`.

A reference is a name under the stack's own path, never a full path or ARN: the instance role may read that
path only (infra/iam/machine_roles.py), so a job file cannot even name another stack's or the account's
other secrets, and one job file serves every stack (each stack holds its own token).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The stack's own path: /trainstack/<stack>/ in SSM, trainstack/<stack>/ in Secrets Manager.
SECRETS_ROOT = "trainstack"
SSM = "ssm"
SECRETS_MANAGER = "secretsmanager"
STORES = (SSM, SECRETS_MANAGER)
# What stores a secret: the CLI command a missing one's error names.
SET_COMMAND = "trainstack secrets set"
# An environment variable's name, as a job file's `env:` and `secrets:` keys must spell it.
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SEGMENT = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
_NAME = re.compile(rf"^{_SEGMENT}(?:/{_SEGMENT})*$")
_MAX_NAME = 128


@dataclass(frozen=True)
class SecretRef:
    """One reference: a store (`ssm` or `secretsmanager`) and a name under the stack's path."""

    store: str
    name: str

    def location(self, stack: str) -> str:
        """The SSM parameter name or the Secrets Manager secret id this reference reads for `stack`."""
        return parameter_name(stack, self.name) if self.store == SSM else secret_id(stack, self.name)

    def described(self, stack: str) -> str:
        kind = "SSM parameter" if self.store == SSM else "Secrets Manager secret"
        return f"{kind} {self.location(stack)}"

    def __str__(self) -> str:
        return self.name if self.store == SSM else f"{self.store}:{self.name}"


def parameter_path(stack: str) -> str:
    """The SSM path every secret of `stack` lives under, with its trailing slash."""
    return f"/{SECRETS_ROOT}/{stack}/"


def parameter_name(stack: str, name: str) -> str:
    return f"{parameter_path(stack)}{name}"


def secret_id(stack: str, name: str) -> str:
    """A Secrets Manager secret's name, no leading slash (ARN: `secret:trainstack/<stack>/<name>-XXXXXX`)."""
    return f"{SECRETS_ROOT}/{stack}/{name}"


def name_problem(name: str) -> str | None:
    """What is wrong with a secret's name under the stack's path, or None."""
    if name.startswith(("/", "arn:")):
        return "name it under the stack's path /trainstack/<stack>/ (e.g. hf-token), not as a path or ARN"
    if len(name) > _MAX_NAME or not _NAME.match(name):
        return "letters, digits, '_', '.', '-' and '/' between segments, at most 128 (e.g. hf-token)"
    return None


def parse_ref(text: str) -> SecretRef:
    """`hf-token`, `ssm:hf-token` or `secretsmanager:wandb`; ValueError says what is wrong and the fix."""
    store, sep, name = text.partition(":")
    if not sep or store.startswith(("/", "arn")):
        store, name = SSM, text
    elif store not in STORES:
        raise ValueError(f"unknown store {store!r}: write NAME or ssm:NAME (SSM) or secretsmanager:NAME")
    problem = name_problem(name)
    if problem:
        raise ValueError(f"{text!r}: {problem}")
    return SecretRef(store, name)


def parse_secrets(raw: Any, where: str) -> tuple[dict[str, SecretRef], list[str]]:
    """A `secrets:` mapping of ENV_NAME: reference, validated; problems one line each, naming the key."""
    if raw is None:
        return {}, []
    if not isinstance(raw, dict):
        return {}, [f"{where}: a mapping of ENV_NAME: secret name, e.g. {{HF_TOKEN: hf-token}}"]
    refs: dict[str, SecretRef] = {}
    problems: list[str] = []
    for key, value in raw.items():
        if not isinstance(key, str) or not ENV_NAME.match(key):
            problems.append(f"{where}.{key}: not a valid environment variable name")
        elif key.startswith("TRAINSTACK_"):
            problems.append(f"{where}.{key}: TRAINSTACK_* are set by the agent; choose another name")
        elif not isinstance(value, str) or not value:
            problems.append(
                f"{where}.{key}: the secret's name under /trainstack/<stack>/ (e.g. hf-token, "
                "secretsmanager:wandb), never its value"
            )
        else:
            try:
                refs[key] = parse_ref(value)
            except ValueError as exc:
                problems.append(f"{where}.{key}: {exc}")
    return refs, problems


def refs_to_mapping(refs: Mapping[str, SecretRef]) -> dict[str, str]:
    return {key: str(ref) for key, ref in refs.items()}

"""A job's secrets by reference: what `secrets:` names, how the agent resolves it into the job's environment,
and what in a job's plain `env` looks like a secret that belongs there instead (docs/job-contract.md).

Reference syntax (`secrets: {ENV_NAME: REF}` in job.yaml, or at the top of the built-in trainer's config):

- `hf-token` or `ssm:hf-token`: the SSM SecureString parameter `/trainstack/<stack>/hf-token` (the default,
  what `trainstack secrets set hf-token` writes);
- `secretsmanager:wandb`: the Secrets Manager secret `trainstack/<stack>/wandb`.

A reference is a name under the stack's own path, never a full path or ARN: the instance role may read that
path only (infra/policies.py), so a job file cannot even name another stack's or the account's other secrets,
and one job file serves every stack (each stack holds its own token).

Values live in the agent's memory only: they go into the job process's environment and nowhere else — never
the agent config, user data, state, the event log or a file. Lines of the job's output that repeat a value are
masked before they are shipped (Redactor).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# The stack's own path: /trainstack/<stack>/ in SSM, trainstack/<stack>/ in Secrets Manager.
SECRETS_ROOT = "trainstack"
SSM = "ssm"
SECRETS_MANAGER = "secretsmanager"
STORES = (SSM, SECRETS_MANAGER)
# What stores a secret: the CLI command a missing one's error names.
SET_COMMAND = "trainstack secrets set"
_SEGMENT = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
_NAME = re.compile(rf"^{_SEGMENT}(?:/{_SEGMENT})*$")
_MAX_NAME = 128
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A value shorter than this is never masked in the job's output: it would mask ordinary words.
_MIN_REDACTED = 6
MASK = "***"


class SecretUnavailableError(ValueError):
    """A secret the job names cannot be read: one line naming the parameter or secret and the fix. Permanent:
    another life would read the same store with the same role."""


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
        if not isinstance(key, str) or not _ENV_NAME.match(key):
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


# --- resolution on the instance ------------------------------------------------------------------------

ClientFactory = Callable[[str], Any]


def resolve(refs: Mapping[str, SecretRef], *, stack: str, clients: ClientFactory) -> dict[str, str]:
    """Each reference's value, read with the instance role (SSM decrypts with the stack's key). A missing,
    denied or unusable secret raises SecretUnavailableError (permanent); throttling or an unreachable endpoint
    after botocore's retries raise botocore's own error (the life fails and the next one tries again)."""
    values: dict[str, str] = {}
    for env_name in sorted(refs):
        ref = refs[env_name]
        value = (
            _read_parameter(env_name, ref, stack, clients(SSM))
            if ref.store == SSM
            else _read_secret(env_name, ref, stack, clients(SECRETS_MANAGER))
        )
        if "\0" in value:
            raise SecretUnavailableError(
                f"secrets.{env_name}: {ref.described(stack)} holds a NUL byte, which no environment variable "
                f"can; store the value again with `{SET_COMMAND} {ref.name} --overwrite`"
            )
        values[env_name] = value
    return values


def _code(error: Exception) -> str:
    response = getattr(error, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


# Error codes that another try cannot fix: the secret is missing, denied, or its key unusable.
_PERMANENT = re.compile(r"NotFound|AccessDenied|Unauthorized|KMS|Decryption|InvalidKeyId|Validation|Invalid")


def _fix(env_name: str, ref: SecretRef, stack: str) -> str:
    if ref.store == SSM:
        return f"store it with `{SET_COMMAND} {ref.name} --stack {stack}`, then `trainstack resume`"
    return (
        f"create it with `aws secretsmanager create-secret --name {secret_id(stack, ref.name)} --kms-key-id "
        f"<the stack's kms_key_arn>`, or keep it in SSM (`{SET_COMMAND} {ref.name}`, then "
        f"`{env_name}: {ref.name}`), then `trainstack resume`"
    )


def _unavailable(env_name: str, ref: SecretRef, stack: str, error: Exception) -> Exception:
    code = _code(error)
    if not code or not _PERMANENT.search(code):
        return error
    where = ref.described(stack)
    if "NotFound" in code:
        return SecretUnavailableError(
            f"secrets.{env_name}: {where} does not exist; {_fix(env_name, ref, stack)}"
        )
    return SecretUnavailableError(
        f"secrets.{env_name}: reading {where} was refused ({code}); the instance role reads "
        f"{parameter_path(stack)}* and secret {secret_id(stack, '*')} only, decrypting with the stack's key "
        f"through the service: {_fix(env_name, ref, stack)}"
    )


def _read_parameter(env_name: str, ref: SecretRef, stack: str, ssm: Any) -> str:
    try:
        parameter = ssm.get_parameter(Name=ref.location(stack), WithDecryption=True)["Parameter"]
    except Exception as exc:
        raise _unavailable(env_name, ref, stack, exc) from None
    if parameter.get("Type") != "SecureString":
        raise SecretUnavailableError(
            f"secrets.{env_name}: {ref.described(stack)} is a {parameter.get('Type')} parameter, stored "
            f"unencrypted; store it as a SecureString with `{SET_COMMAND} {ref.name} --overwrite`"
        )
    return str(parameter["Value"])


def _read_secret(env_name: str, ref: SecretRef, stack: str, secretsmanager: Any) -> str:
    try:
        secret = secretsmanager.get_secret_value(SecretId=ref.location(stack))
    except Exception as exc:
        raise _unavailable(env_name, ref, stack, exc) from None
    if "SecretString" not in secret:
        raise SecretUnavailableError(
            f"secrets.{env_name}: {ref.described(stack)} holds SecretBinary; an environment variable takes "
            "text: store it as SecretString"
        )
    return str(secret["SecretString"])


class Redactor:
    """Masks the job's secret values in lines the agent ships (the job's output, a failure's last lines)."""

    def __init__(self, values: Iterable[str] = ()) -> None:
        # The job's output is shipped line by line: a multi-line value (a PEM key) is masked line by line.
        pieces = {piece.strip("\r") for v in values for piece in (v, *v.splitlines())}
        # Longest first, so a value containing another is masked whole.
        self._values = sorted({v for v in pieces if len(v) >= _MIN_REDACTED}, key=len, reverse=True)

    def __bool__(self) -> bool:
        return bool(self._values)

    def __call__(self, line: str) -> str:
        for value in self._values:
            if value in line:
                line = line.replace(value, MASK)
        return line


# --- what looks like a secret in a job's plain env ---------------------------------------------------------

# Name segments (split at '_') that mark a credential: HF_TOKEN, WANDB_API_KEY, DB_PASSWORD, CLIENT_SECRET.
_SECRET_WORDS = frozenset(
    {"TOKEN", "SECRET", "SECRETS", "PASSWORD", "PASSWD", "PASSPHRASE", "APIKEY", "CREDENTIAL", "CREDENTIALS"}
)
# Names whose 40-hex value is a commit or a digest, not a W&B key.
_HASH_WORDS = frozenset({"SHA", "SHA1", "COMMIT", "REV", "REVISION", "HASH", "DIGEST", "REF"})
_VALUE_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("an AWS access key ID", re.compile(r"\b(?:AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}\b")),
    ("a private key", re.compile(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----")),
    ("a GitHub token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,})")),
    ("a Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{30,}\b")),
    ("a Slack token", re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}\b")),
    ("a .netrc password", re.compile(r"(?is)\b(?:machine\s+\S+|default)\s.*?\bpassword\s+(?![$<{])\S+")),
    ("credentials in a URL", re.compile(r"\b[a-z][a-z0-9+.-]*://[^/\s:@]+:[^/\s@$<{][^/\s@]*@")),
    ("a password", re.compile(r"(?i)\b(?:password|passwd)[\"']?\s*[:=]\s*[\"']?[^\s\"'$<{]{6,}")),
)
_HEX40 = re.compile(r"(?<![0-9A-Fa-f])[0-9a-f]{40}(?![0-9A-Fa-f])")
_BASE64_40 = re.compile(r"(?<![A-Za-z0-9/+=])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])")


def secret_name(name: str) -> bool:
    """Whether an environment variable's name says it holds a credential."""
    upper = name.upper()
    parts = upper.split("_")
    return (
        bool(_SECRET_WORDS.intersection(parts))
        or parts[-1] == "KEY"
        or "PASSWORD" in upper
        or upper == "AWS_ACCESS_KEY_ID"
    )


def secret_value_kind(value: str, name: str = "") -> str | None:
    """What kind of credential `value` looks like (e.g. "a Hugging Face token"), or None."""
    for kind, pattern in _VALUE_PATTERNS:
        if pattern.search(value):
            return kind
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

"""A job's secrets on the instance: the agent resolves the references a job names (their syntax and where each
lives: trainstack_job/secret_refs.py) into the job's environment, and masks their values in what it ships.

Values live in the agent's memory only: they go into the job process's environment and nowhere else — never
the agent config, user data, state, the event log or a file. Lines of the job's output that repeat a value are
masked before they are shipped (Redactor).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from trainstack_job.secret_refs import SECRETS_MANAGER, SET_COMMAND, SSM, SecretRef, parameter_path, secret_id

# A value shorter than this is never masked in the job's output: it would mask ordinary words.
_MIN_REDACTED = 6
MASK = "***"


class SecretUnavailableError(ValueError):
    """A secret the job names cannot be read: one line naming the parameter or secret and the fix. Permanent:
    another life would read the same store with the same role."""


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

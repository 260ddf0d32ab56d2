"""`trainstack secrets set|list|delete`: a job's secrets, SSM SecureString parameters under the stack's path.

Values are read from stdin (a pipe, or a hidden prompt on a terminal), never from the command line (shell
history, `ps`), and never printed: `list` shows names and dates only. Each is encrypted with the stack's own
KMS key, the one the instance role may decrypt through SSM (infra/iam/machine_roles.py
secret_read_statements).

Why SSM Parameter Store and not Secrets Manager by default: a standard parameter costs nothing to keep (its
SecureString calls cost the KMS requests only), while a secret costs 0.40 USD a month plus 0.05 USD per
10,000 calls; Secrets Manager's gain is managed rotation (a Lambda per secret type, for AWS databases and the
like), which a Hugging Face or W&B token cannot use: they are rotated by hand on their own sites, which `set
--overwrite` covers. A secret already in Secrets Manager under `trainstack/<stack>/` is still read by
reference (`secretsmanager:NAME`, bootstrap/secrets.py).
"""

from __future__ import annotations

import getpass
import sys
from datetime import datetime
from typing import Any, TextIO

from botocore.exceptions import ClientError

from trainstack.aws import Clients, error_code
from trainstack.errors import CliError
from trainstack.output import console, print_json
from trainstack.stack import Stack
from trainstack_job.contract import StackOutput
from trainstack_job.secret_refs import (
    SECRETS_MANAGER,
    SSM,
    name_problem,
    parameter_name,
    parameter_path,
    secret_id,
)

# A standard-tier parameter holds 4 KB; an advanced one costs 0.05 USD a month.
MAX_VALUE_BYTES = 4096
_DENIED = ("AccessDenied", "AccessDeniedException", "UnauthorizedOperation")


def _check_name(name: str) -> None:
    if ":" in name:
        raise CliError(
            f"{name!r}: trainstack stores secrets in SSM only; give the plain name (e.g. hf-token), or "
            "manage a Secrets Manager secret with `aws secretsmanager` under trainstack/<stack>/"
        )
    problem = name_problem(name)
    if problem:
        raise CliError(f"secret name {name!r}: {problem}")


def read_value(name: str, stdin: TextIO | None = None) -> str:
    """The value from stdin: a hidden prompt on a terminal, else all that is piped in less a final newline."""
    stream = stdin or sys.stdin
    if stream.isatty():
        value = getpass.getpass(f"value of {name} (input hidden): ", stream=sys.stderr)
    else:
        value = stream.read()
        value = value[:-2] if value.endswith("\r\n") else value[:-1] if value.endswith("\n") else value
    if not value:
        raise CliError(
            f'no value for {name} on stdin: pipe it in, e.g. `printf %s "$TOKEN" | trainstack secrets set '
            f"{name}`, or run it in a terminal to be prompted (never pass a value as an argument)"
        )
    if "\0" in value:
        raise CliError(f"the value of {name} holds a NUL byte, which no environment variable can carry")
    if len(value.encode()) > MAX_VALUE_BYTES:
        raise CliError(
            f"the value of {name} is over {MAX_VALUE_BYTES} bytes (an SSM standard parameter's limit): store "
            f"it in Secrets Manager as {secret_id('<stack>', name)} and reference it as secretsmanager:{name}"
        )
    return value


def set_secret(
    clients: Clients, stack: Stack, name: str, *, overwrite: bool, stdin: TextIO | None = None
) -> dict[str, Any]:
    """Store NAME's value (from stdin) as a SecureString with the stack's KMS key."""
    _check_name(name)
    key = stack.outputs.text(StackOutput.KMS_KEY_ARN)
    value = read_value(name, stdin)
    parameter = parameter_name(stack.name, name)
    try:
        answer = clients.ssm().put_parameter(
            Name=parameter,
            Value=value,
            Type="SecureString",
            KeyId=key,
            Overwrite=overwrite,
            Tier="Standard",
            Description=f"trainstack secret of stack {stack.name} (`trainstack secrets set`)",
        )
    except ClientError as error:
        code = error_code(error)
        if code == "ParameterAlreadyExists":
            raise CliError(
                f"{parameter} already exists: pass --overwrite to replace its value "
                f"(`trainstack secrets set {name} --overwrite`)"
            ) from None
        if code in _DENIED:
            raise CliError(
                f"storing {parameter} was refused ({code}): your identity needs ssm:PutParameter on it and "
                f"kms:Encrypt on the stack's key {key}"
            ) from None
        raise
    return {"name": name, "parameter": parameter, "version": answer.get("Version"), "kms_key": key}


def _date(value: Any) -> str:
    return value.isoformat(timespec="seconds") if isinstance(value, datetime) else str(value or "")


def list_secrets(clients: Clients, stack: Stack) -> dict[str, Any]:
    """Names, stores and last-modified dates under the stack's path: never a value."""
    path = parameter_path(stack.name)
    found: list[dict[str, Any]] = []
    pages = (
        clients.ssm()
        .get_paginator("describe_parameters")
        .paginate(ParameterFilters=[{"Key": "Path", "Option": "Recursive", "Values": [path.rstrip("/")]}])
    )
    for page in pages:
        for parameter in page.get("Parameters", []):
            found.append(
                {
                    "name": str(parameter["Name"]).removeprefix(path),
                    "store": SSM,
                    "location": parameter["Name"],
                    "type": parameter.get("Type"),
                    "last_modified": _date(parameter.get("LastModifiedDate")),
                    "version": parameter.get("Version"),
                }
            )
    notes: list[str] = []
    prefix = secret_id(stack.name, "")
    try:
        secrets = (
            clients.client("secretsmanager")
            .get_paginator("list_secrets")
            .paginate(Filters=[{"Key": "name", "Values": [prefix]}])
        )
        for page in secrets:
            for secret in page.get("SecretList", []):
                if not str(secret["Name"]).startswith(prefix):
                    continue  # the name filter matches prefixes of words too
                found.append(
                    {
                        "name": f"{SECRETS_MANAGER}:{str(secret['Name']).removeprefix(prefix)}",
                        "store": SECRETS_MANAGER,
                        "location": secret["Name"],
                        "type": "secret",
                        "last_modified": _date(secret.get("LastChangedDate") or secret.get("CreatedDate")),
                        "version": None,
                    }
                )
    except ClientError as error:
        if error_code(error) not in _DENIED:
            raise
        notes.append(f"Secrets Manager not listed ({error_code(error)}): only SSM parameters are shown")
    return {
        "stack": stack.name,
        "path": path,
        "secrets": sorted(found, key=lambda s: s["name"]),
        "notes": notes,
    }


def delete_secret(clients: Clients, stack: Stack, name: str) -> dict[str, Any]:
    _check_name(name)
    parameter = parameter_name(stack.name, name)
    try:
        clients.ssm().delete_parameter(Name=parameter)
    except ClientError as error:
        if error_code(error) == "ParameterNotFound":
            raise CliError(
                f"no secret {name}: {parameter} does not exist; `trainstack secrets list` shows the stack's"
            ) from None
        raise
    return {"name": name, "parameter": parameter, "deleted": True}


def run(
    clients: Clients,
    stack: Stack,
    action: str,
    *,
    name: str | None = None,
    overwrite: bool = False,
    as_json: bool = False,
    stdin: TextIO | None = None,
) -> int:
    out = console()
    if action == "set":
        assert name is not None
        result = set_secret(clients, stack, name, overwrite=overwrite, stdin=stdin)
        if as_json:
            print_json(result)
        else:
            out.print(
                f"{name}: stored as SecureString {result['parameter']} (version {result['version']}), "
                f"encrypted with the stack's key. Use it in job.yaml: secrets: {{ENV_NAME: {name}}}"
            )
        return 0
    if action == "list":
        listing = list_secrets(clients, stack)
        if as_json:
            print_json(listing)
            return 0
        for note in listing["notes"]:
            print(f"note: {note}", file=sys.stderr)
        if not listing["secrets"]:
            out.print(f"no secrets under {listing['path']}: `trainstack secrets set NAME` stores one")
            return 0
        from rich.table import Table

        table = Table("name", "store", "type", "last modified")
        for secret in listing["secrets"]:
            plain = secret["store"] == SECRETS_MANAGER or secret["type"] == "SecureString"
            kind = (
                secret["type"] if plain else f"{secret['type']} (unencrypted: set it again with --overwrite)"
            )
            table.add_row(secret["name"], secret["store"], kind, secret["last_modified"])
        out.print(table)
        return 0
    if action == "delete":
        assert name is not None
        result = delete_secret(clients, stack, name)
        if as_json:
            print_json(result)
        else:
            out.print(f"{name}: deleted {result['parameter']}")
        return 0
    raise CliError(f"unknown secrets action {action!r}: set, list or delete")

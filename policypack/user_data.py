"""Finding credentials in EC2 user data, which any process on the instance can read back from IMDS.

Scanned twice: the text as written and decoded (patterns that hold whatever the format), and, when it is YAML
(a `#cloud-config`, and the YAML files it writes, such as an agent config), its PARSED values: YAML folds a
long line and quotes or escapes a value as it likes, so a raw-text pattern misses `aws_secret_access_key`
folded onto the next line, while the parsed value is whole. A mapping key that names a credential (HF_TOKEN,
WANDB_API_KEY, DB_PASSWORD) with a literal value is a secret whatever the value looks like; so is a shell or
dotenv assignment to such a name in a script, and a `.netrc` line with a password.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import re
from collections.abc import Iterator
from typing import Any

import yaml  # PyYAML: a dependency of the pulumi SDK the pack already requires

# The one definition of the credential shapes, shared with the job file's and the trainer config's checks
# (standard library only; __main__.py puts the checkout's root on the path when Pulumi runs the pack).
from trainstack_job.credentials import CREDENTIAL_PATTERNS, CREDENTIAL_WORDS

# A mapping key or variable that ends so names a credential (the words are CREDENTIAL_WORDS). Not any
# `*_KEY`, as a job's env check counts it: user data holds settings such as the agent config's `bundle_key`.
_CREDENTIAL_ENDINGS = ("API_KEY", "ACCESS_KEY", "SECRET_KEY", "PRIVATE_KEY", "ACCESS_KEY_ID", "AUTH_KEY")
# `NAME=value` in a script or dotenv file (`export`, systemd's Environment=, `env NAME=...` alike).
_ASSIGNMENT = re.compile(r"(?:^|[\s;'\"=])([A-Za-z_][A-Za-z0-9_]*)=([\"']?)([^\s\"';]+)", re.MULTILINE)
# Values that are no credential: a reference to one ($VAR, $(command), ${VAR}, <placeholder>), or a keyword.
_REFERENCE = re.compile(r"^(?:[$<{(%]|ssm:|secretsmanager:|arn:)")
_MIN_LITERAL = 8
_BY_NAME = "a credential in "
# Parsed documents nest: a cloud-config writes a YAML file (an agent config) that holds a job's env.
_MAX_DEPTH = 4


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
    return [kind for kind, pattern in CREDENTIAL_PATTERNS if pattern.search(text)]


# A download fed straight to an interpreter: `curl ... | sudo bash`, `wget -qO- ... | sh -s --`,
# `bash <(curl ...)`, `sh -c "$(wget -O- ...)"`, `eval "$(curl ...)"`, `python3 <(curl ...)`.
_FETCH = r"(?:curl|wget|fetch)\b"
_INTERPRETER = (
    r"(?:sudo\s+(?:-\S+\s+)*)?(?:/usr)?(?:/bin/)?(?:env\s+)?(?:ba|da|k|z)?sh\b|python[0-9.]*\b|perl\b|ruby\b"
)
_PIPED_DOWNLOADS = (
    re.compile(rf"{_FETCH}[^\n;&]*\|\s*(?:{_INTERPRETER})", re.IGNORECASE),
    re.compile(rf"(?:{_INTERPRETER}|source|\.)\s*<\(\s*{_FETCH}", re.IGNORECASE),
    re.compile(rf"(?:(?:{_INTERPRETER})\s+-c|eval)\s+\\?[\"']?\$\(\s*{_FETCH}", re.IGNORECASE),
)


def find_piped_downloads(text: str) -> list[str]:
    """Each command that runs downloaded code without keeping or checking it (as written, one line each)."""
    found: list[str] = []
    for pattern in _PIPED_DOWNLOADS:
        for match in pattern.finditer(text):
            command = " ".join(match.group(0).split())
            if command not in found:
                found.append(command)
    return found


def credential_name(name: str) -> bool:
    """Whether a variable or key named so holds a credential (HF_TOKEN, wandb_api_key, DB_PASSWORD)."""
    upper = name.upper()
    return bool(CREDENTIAL_WORDS.intersection(upper.split("_"))) or upper.endswith(_CREDENTIAL_ENDINGS)


def _literal(value: Any) -> bool:
    """A value that is a credential itself, not a reference to one, a number or a boolean."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        return False
    text = str(value).strip().strip("\"'")
    return len(text) >= _MIN_LITERAL and not _REFERENCE.match(text) and not text.isdigit()


def _parse(text: str) -> Any:
    if ":" not in text or "\n" not in text.strip():
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return None


def _written_content(entry: dict[str, Any]) -> str | None:
    """A cloud-config write_files entry's content, its b64/gzip encoding undone."""
    content = entry.get("content")
    if not isinstance(content, str):
        return None
    encoding = str(entry.get("encoding", "")).lower()
    if encoding in ("b64", "base64", "gz+b64", "gzip+base64", "gz+base64", "gzip+b64"):
        return decode(content, base64_encoded=True)
    return content


def _walk(node: Any, depth: int, under_references: bool = False) -> Iterator[str]:
    if depth > _MAX_DEPTH:
        return
    if isinstance(node, dict):
        if "content" in node and "encoding" in node:
            content = _written_content(node)
            if content is not None:
                yield from _scan_string(content, depth)
        for key, value in node.items():
            # A `secrets:` mapping names secrets by reference (trainstack_job/secret_refs.py): names expected.
            references = under_references or str(key) == "secrets"
            if isinstance(value, dict | list):
                yield from _walk(value, depth, references)
                continue
            if not references and credential_name(str(key)) and _literal(value):
                yield f"{_BY_NAME}{key}"
            if isinstance(value, str):
                yield from _scan_string(value, depth)
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item, depth, under_references)
    elif isinstance(node, str):
        yield from _scan_string(node, depth)


def _scan_string(text: str, depth: int) -> Iterator[str]:
    yield from find_secrets(text)
    for name, _, value in _ASSIGNMENT.findall(text):
        if credential_name(name) and _literal(value):
            yield f"{_BY_NAME}{name}"
    nested = _parse(text)
    if isinstance(nested, dict | list):
        yield from _walk(nested, depth + 1)


def scan_user_data(written: str, decoded: str) -> list[str]:
    """What kinds of secret user data holds, as written and decoded, its YAML read as parsed values."""
    kinds = find_secrets(f"{written}\n{decoded}")
    for text in dict.fromkeys((decoded, written)):
        # A script's assignments, or a YAML document's values (and the files and scripts they hold).
        kinds += list(_scan_string(text, 0))
    found = list(dict.fromkeys(kinds))
    # One line per finding: a value whose shape is known is named by its shape, not again by its key.
    shaped = [kind for kind in found if not kind.startswith(_BY_NAME)]
    return shaped or found


# The job's sandbox (bootstrap/cloud_init.py, bootstrap/instance/job-sandbox.sh): trainstack's agent unit runs
# it before every start (ExecStartPre, no `-`: a failure is a failed start), and it creates the job's user and
# rejects that user's packets to IMDS (v4 and v6), owner-matched (iptables --uid-owner, nft skuid).
SANDBOX_NAME = "trainstack-job-sandbox"
SANDBOX_PATH = f"/usr/local/sbin/{SANDBOX_NAME}"
AGENT_UNIT_NAME = "trainstack-agent.service"
SANDBOX_SOURCE = "bootstrap/instance/job-sandbox.sh"
_EXEC_START_PRE = re.compile(
    rf"^ExecStartPre=(?P<flags>[-@+!:]*)(?P<path>\S*/{SANDBOX_NAME})\s*$", re.MULTILINE
)
_IMDS_ADDRESSES = ("169.254.169.254", "fd00:ec2::254")
_OWNER_MATCH = re.compile(r"--uid-owner|\bskuid\b")
_REFUSAL = re.compile(r"\b(?:REJECT|DROP|reject|drop)\b")
_EARLY_EXIT = re.compile(r"^(?:exit(?:\s+0)?|true\s*;\s*exit(?:\s+0)?)\s*(?:#.*)?$")


def _written_files(document: Any) -> dict[str, str]:
    """path -> content of a cloud-config's write_files (contents decoded)."""
    found: dict[str, str] = {}
    entries = document.get("write_files") if isinstance(document, dict) else None
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("path"), str):
            content = _written_content(entry)
            found[entry["path"]] = content if content is not None else ""
    return found


def _early_exit(script: str) -> str | None:
    """An unindented `exit`/`exit 0` with commands after it: what skips the rest of the script."""
    lines = script.splitlines()
    for number, line in enumerate(lines, start=1):
        if _EARLY_EXIT.match(line) and any(
            rest.strip() and not rest.strip().startswith("#") for rest in lines[number:]
        ):
            return f"`{line.strip()}` on line {number}"
    return None


def _sandbox_shortfalls(script: str) -> list[str]:
    shortfalls = []
    if not re.search(r"\b(?:useradd|adduser)\b", script):
        shortfalls.append("creates no job user")
    if not (
        all(address in script for address in _IMDS_ADDRESSES)
        and _OWNER_MATCH.search(script)
        and _REFUSAL.search(script)
    ):
        shortfalls.append(
            f"leaves IMDS open to the job's user (no owner-matched reject of {' and '.join(_IMDS_ADDRESSES)})"
        )
    early = _early_exit(script)
    if early:
        shortfalls.append(f"exits early ({early})")
    return shortfalls


def sandbox_problems(decoded: str) -> list[str]:
    """What undoes the job's sandbox in trainstack's user data (a cloud-config that writes the agent's unit or
    the sandbox): the unit not running it before every start, the script missing, or emptied."""
    if AGENT_UNIT_NAME not in decoded and SANDBOX_NAME not in decoded:
        return []
    try:
        document = yaml.load(decoded, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError:
        return []
    files = _written_files(document)
    unit = next((content for path, content in files.items() if path.endswith(f"/{AGENT_UNIT_NAME}")), None)
    sandbox = next(
        ((path, content) for path, content in files.items() if path.endswith(f"/{SANDBOX_NAME}")), None
    )
    path = sandbox[0] if sandbox else SANDBOX_PATH
    problems: list[str] = []
    if unit is not None:
        run = _EXEC_START_PRE.search(unit)
        if run is None or "-" in run["flags"]:
            problems.append(
                f"its {AGENT_UNIT_NAME} does not run the job sandbox before every start of the agent, "
                "failing the "
                f"start when it fails: add ExecStartPre={path} to its [Service]"
            )
    if sandbox is None:
        if unit is not None or SANDBOX_NAME in decoded:
            problems.append(
                f"it writes no {path} (the job's user and its IMDS firewall) while the agent starts jobs: "
                "write "
                f"{SANDBOX_SOURCE} there, as render_user_data does"
            )
    else:
        shortfalls = _sandbox_shortfalls(sandbox[1])
        if shortfalls:
            problems.append(
                f"its {path} {', '.join(shortfalls)}: ship {SANDBOX_SOURCE} as it is (render_user_data "
                "writes it)"
            )
    return problems

"""boto3 clients for the agent: the stack's region, standard retry mode, endpoints from the environment."""

from __future__ import annotations

import itertools
import json
import os
import threading
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

# Every AWS call of the agent is bounded: standard mode retries throttling and 5xx (S3 SlowDown included)
# with backoff, 4 attempts of at most 5 s to connect and 20 s per read ride out a short brown-out, and a
# blackholed endpoint costs at most about 100 s per call — never on the stop path, which makes no calls.
RETRY_CONFIG = Config(retries={"mode": "standard", "max_attempts": 4}, connect_timeout=5, read_timeout=20)

# One session for every client of the process: a new session parses botocore's endpoint and service
# models again, about 70 ms of CPU per client (a life makes eight). Sessions are not thread-safe, so clients
# are made under a lock; the clients themselves are safe to share between threads.
_session: boto3.session.Session | None = None
_session_lock = threading.Lock()


def client(service: str, region: str, config: Config = RETRY_CONFIG, principal: str | None = None) -> Any:
    """A client honouring AWS_ENDPOINT_URL (boto3 does natively): the agent runs against moto unchanged.
    `principal`: whose role makes the calls, for the IAM check (default the instance role; the dev box's
    watcher is `dev-role`)."""
    global _session
    with _session_lock:
        if _session is None:
            _session = boto3.session.Session()
        made = _session.client(service, region_name=region, config=config)  # type: ignore[call-overload]
    folder = os.environ.get(IAM_RECORD_ENV)
    if folder:
        record_calls(made, principal or INSTANCE_PRINCIPAL, folder)
    return made


# Opt-in record of every AWS call, for the IAM check of the tests and the demo (tests/iam): moto never
# evaluates IAM, so each call is written down and later checked against the policy the program declares for
# its principal. An environment variable, not a sitecustomize or a patch of botocore: it reaches the agents
# that tests and the demo start as subprocesses (they inherit it), costs one lookup per client when unset,
# and is never set on an instance (user data and the agent's config do not know it).
IAM_RECORD_ENV = "TRAINSTACK_IAM_RECORD"
INSTANCE_PRINCIPAL = "instance-role"
_record_lock = threading.Lock()
_clients_recorded = itertools.count(1)
_calls_recorded = itertools.count(1)
# Where the call's id travels from the request to its answer: botocore hands both events the same context.
_CALL_ID = "trainstack_iam_call"


def record_calls(made: Any, principal: str, folder: str) -> None:
    """Append one JSON line per API call of `made` to FOLDER/<principal>-<pid>.jsonl: the operation and its
    parameters as the caller passed them (bodies left out), before botocore sends anything; and, for a call
    answered with an error, one line `answer_to` its id with the error's code and HTTP status."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    path = Path(folder) / f"{principal}-{os.getpid()}.jsonl"
    service = made.meta.service_model.service_name
    region = made.meta.region_name
    # Which client made the call: the check binds each client to the first stack it names (tests/iam).
    client_id = next(_clients_recorded)

    def write(line: dict[str, Any]) -> None:
        with _record_lock, path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")

    def record(params: dict[str, Any], model: Any, context: dict[str, Any], **_: Any) -> None:
        call_id = context[_CALL_ID] = next(_calls_recorded)
        write(
            {
                "principal": principal,
                "service": service,
                "operation": model.name,
                "region": region,
                "client": client_id,
                "call": call_id,
                "params": _plain(params),
            }
        )

    def answered(http_response: Any, parsed: Any, context: dict[str, Any], **_: Any) -> None:
        # The answer matters where AWS's would differ from moto's: a read of a missing object is NoSuchKey
        # only for a caller that may list the key, AccessDenied for any other (tests/iam/requests.py).
        if _CALL_ID not in context or http_response.status_code < 300:
            return
        error = parsed.get("Error", {}) if isinstance(parsed, dict) else {}
        code = context.get("error_code_override") or error.get("Code")
        write(
            {
                "principal": principal,
                "answer_to": context[_CALL_ID],
                "status": http_response.status_code,
                "error": code,
            }
        )

    # provide-client-params: once per API call (not per retry), with the parameters as the caller named them;
    # after-call: once per call answered (after the retries), with the same context.
    made.meta.events.register("provide-client-params", record)
    made.meta.events.register("after-call", answered)


def _plain(value: Any) -> Any:
    """Parameters as JSON: payloads (bytes, files, streams) are left out; they never decide an IAM check."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if k != "Body"}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value) if hasattr(value, "isoformat") else f"<{type(value).__name__}>"

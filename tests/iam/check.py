"""Read a recording (one JSON-lines file per process and principal) and check every call it holds."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.iam.evaluate import Request, UnmodelledConditionError, decide
from tests.iam.principals import CLI, caller, resource_policy
from tests.iam.requests import Stack, UnmappedCallError, requests_for, stack_named_by

# Services whose resources carry a policy the program declares (the bucket's, the key's): the only ones
# where a CLI call, made with the user's own credentials, can be refused by the program.
RESOURCE_POLICY_SERVICES = frozenset({"s3", "kms"})


@dataclass(frozen=True)
class Finding:
    """A call AWS would refuse (or that the model cannot judge), as the failure names it."""

    principal: str
    action: str
    resource: str
    call: str
    reason: str

    def line(self) -> str:
        return f"{self.principal}: {self.action} on {self.resource} ({self.call}): {self.reason}"


def calls_in(folder: Path) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """Each recording file's calls in the order its process made them, each with its `answer` (the error's
    code and status) when it was answered with an error."""
    for path in sorted(folder.glob("*.jsonl")):
        lines = path.read_text(encoding="utf-8").splitlines()
        yield path.name, with_answers(json.loads(line) for line in lines if line.strip())


def with_answers(lines: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls of one recording, an `answer_to` line folded into the latest call of that id before it."""
    calls: list[dict[str, Any]] = []
    by_id: dict[Any, dict[str, Any]] = {}
    for line in lines:
        if "answer_to" in line:
            call = by_id.get(line["answer_to"])
            if call is not None:
                call["answer"] = {"status": line.get("status"), "error": line.get("error")}
            continue
        calls.append(line)
        if "call" in line:
            by_id[line["call"]] = line
    return calls


def check_calls(calls: Iterable[Mapping[str, Any]]) -> tuple[list[Finding], int]:
    """Findings for one process's calls, and how many authorizations were checked.

    Each client (each principal's, without a client id) is bound to the first stack it names: a later call
    that names another stack's resource is judged by the first stack's policy, as the role of that stack's
    instance would be. A call that names no stack (an instance id) works for the stack its process named
    last (requests.py)."""
    findings: list[Finding] = []
    checked = 0
    bound: dict[tuple[str, Any], Stack] = {}
    last: Stack | None = None
    for call in calls:
        principal = call["principal"]
        named = stack_named_by(call)
        key = (principal, call.get("client"))
        if named is not None:
            bound.setdefault(key, Stack(named, call["region"]))
            last = Stack(named, call["region"])
        current = bound.get(key, last)
        where = f"{call['service']}.{call['operation']}"
        try:
            requests = requests_for(call, current)
        except UnmappedCallError as error:
            if principal == CLI and call["service"] not in RESOURCE_POLICY_SERVICES:
                continue  # the user's own policy decides, and no policy of the program's applies to it
            reason = f"not modelled in tests/iam/requests.py: {error}"
            findings.append(Finding(principal, where, "?", where, reason))
            continue
        for request in requests:
            checked += 1
            finding = _judge(principal, request, current or Stack("unknown-stack", call["region"]))
            if finding is not None:
                findings.append(finding)
    return findings, checked


def _judge(principal: str, request: Request, stack: Stack) -> Finding | None:
    try:
        who = caller(principal, stack)
    except KeyError as error:
        return Finding(principal, request.action, request.resource, request.why, str(error))
    context = {
        **request.context,
        "aws:securetransport": ["true"],
        "aws:principalarn": [who.arn],
        "aws:principalaccount": [who.account],
    }
    full = Request(request.action, request.resource, context, request.known, request.why)
    policy, is_key = resource_policy(request.resource, stack)
    try:
        decision = decide(full, who, policy, key_policy=is_key)
    except UnmodelledConditionError as error:
        return Finding(principal, request.action, request.resource, request.why, f"cannot evaluate {error}")
    if decision.allowed:
        return None
    reason = f"{request.refusal} ({decision.reason})" if request.refusal else decision.reason
    return Finding(principal, request.action, request.resource, request.why, reason)


def check_folder(folder: Path) -> tuple[list[Finding], int, Counter[str]]:
    """Every finding of a recording folder, the number of authorizations checked, calls per principal."""
    findings: list[Finding] = []
    checked = 0
    principals: Counter[str] = Counter()
    for _, calls in calls_in(folder):
        principals.update(call["principal"] for call in calls)
        found, count = check_calls(calls)
        findings += found
        checked += count
    return findings, checked, principals


def report(findings: list[Finding], *, limit: int = 30) -> list[str]:
    """One line per principal, action, operation and reason (most frequent first), naming its first resource
    and call."""
    groups: dict[tuple[str, str, str, str], list[Finding]] = {}
    for finding in findings:
        operation = finding.call.split(" ", 1)[0]
        groups.setdefault((finding.principal, finding.action, operation, finding.reason), []).append(finding)
    ordered = sorted(groups.values(), key=len, reverse=True)
    lines = []
    for group in ordered[:limit]:
        # A missing key's listing is one resource (the bucket) for many keys: the calls name the keys.
        others = len({(f.resource, f.call) for f in group}) - 1
        more = f" and {others} more resource(s) or key(s)" if others else ""
        lines.append(f"{group[0].line()}{more}{f'  [x{len(group)}]' if len(group) > 1 else ''}")
    if len(ordered) > limit:
        lines.append(f"... and {len(ordered) - limit} more")
    return lines

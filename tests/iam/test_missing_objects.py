"""A read of a missing object: AWS answers NoSuchKey (or HEAD's 404) only to a caller that may also
s3:ListBucket the key, AccessDenied to any other. moto always says NoSuchKey, so the recorder keeps the
answer and the check asks for that listing; here it catches a policy without it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from botocore.stub import Stubber

from bootstrap import aws
from tests.iam import principals
from tests.iam.check import check_calls, check_folder, report
from tests.iam.principals import CAPACITY_FALLBACK, DEV, INSTANCE
from tests.iam.requests import Stack, requests_for

REGION = "us-east-1"
STACK = Stack("trainstack-test", REGION)
BUCKET_ARN = f"arn:aws:s3:::{STACK.bucket}"
LEDGER = "jobs/charlm-1a2b3c4d/state/ledger.json"
NO_SUCH_KEY = {"status": 404, "error": "NoSuchKey"}


def _read(
    principal: str, key: str, answer: dict[str, Any] | None = NO_SUCH_KEY, op: str = "GetObject"
) -> dict[str, Any]:
    call = {
        "principal": principal,
        "service": "s3",
        "operation": op,
        "region": REGION,
        "client": 1,
        "params": {"Bucket": STACK.bucket, "Key": key},
    }
    return {**call, "answer": answer} if answer else call


def test_a_missing_object_is_also_a_listing_of_its_key_and_decrypts_nothing() -> None:
    requests = requests_for(_read(INSTANCE, LEDGER), STACK)
    assert [(r.action, r.resource) for r in requests] == [
        ("s3:GetObject", f"{BUCKET_ARN}/{LEDGER}"),
        ("s3:ListBucket", BUCKET_ARN),
    ]
    assert requests[1].context == {"s3:prefix": [LEDGER]}
    head = requests_for(_read(INSTANCE, LEDGER, {"status": 404, "error": "404"}, "HeadObject"), STACK)
    assert [r.action for r in head] == ["s3:GetObject", "s3:ListBucket"]
    # A read that found its object, or failed for another reason, asks for no listing.
    found = requests_for(_read(INSTANCE, LEDGER, None), STACK)
    assert [r.action for r in found] == ["s3:GetObject", "kms:Decrypt"]
    no_bucket = requests_for(_read(INSTANCE, LEDGER, {"status": 404, "error": "NoSuchBucket"}), STACK)
    assert "s3:ListBucket" not in [r.action for r in no_bucket]


@pytest.mark.parametrize(
    ("principal", "key"),
    [
        (CAPACITY_FALLBACK, "state/current-job.json"),
        (CAPACITY_FALLBACK, LEDGER),
        (CAPACITY_FALLBACK, "state/ledger.json"),
        (INSTANCE, "jobs/charlm-1a2b3c4d/checkpoints/latest.json"),
        (INSTANCE, "checkpoints/latest.json"),
        (INSTANCE, "queue/0001-charlm-1a2b3c4d.json"),
        (INSTANCE, "state/current-job.json"),
        (DEV, LEDGER),
        (DEV, "state/data-manifest.json"),
    ],
)
def test_the_declared_policies_let_each_principal_learn_its_reads_are_missing(
    principal: str, key: str
) -> None:
    findings, checked = check_calls([_read(principal, key)])
    assert checked == 2 and findings == []


def test_the_cost_cap_may_list_exactly_its_keys_and_nothing_else() -> None:
    findings, _ = check_calls([_read(CAPACITY_FALLBACK, "jobs/charlm-1a2b3c4d/checkpoints/latest.json")])
    assert {f.action for f in findings} == {"s3:GetObject", "s3:ListBucket"}


@pytest.fixture()
def planted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The function's role as declared, less the listing of its keys: what the check must catch."""
    declared = principals.capacity_fallback_policy

    def without_listing(stack: Stack, **kwargs: Any) -> dict[str, Any]:
        document = declared(stack, **kwargs)
        kept = [s for s in document["Statement"] if s.get("Sid") != "KnowAMissingLedgerIsMissing"]
        assert len(kept) == len(document["Statement"]) - 1
        return {**document, "Statement": kept}

    monkeypatch.setattr(principals, "capacity_fallback_policy", without_listing)


@pytest.mark.usefixtures("planted")
def test_the_check_catches_a_planted_policy_without_the_listing() -> None:
    findings, _ = check_calls([_read(CAPACITY_FALLBACK, LEDGER)])
    (finding,) = findings
    assert (finding.principal, finding.action, finding.resource) == (
        CAPACITY_FALLBACK,
        "s3:ListBucket",
        BUCKET_ARN,
    )
    line = finding.line()
    assert line.startswith(f"{CAPACITY_FALLBACK}: s3:ListBucket on {BUCKET_ARN} (s3.GetObject of {LEDGER},")
    assert "AWS would answer AccessDenied here, not NoSuchKey" in line
    assert "grant s3:ListBucket on the bucket with an s3:prefix condition matching the key" in line
    # The object's own read is still allowed: only what AWS would answer when it is missing changes.
    assert check_calls([_read(CAPACITY_FALLBACK, LEDGER, None)])[0] == []


def test_the_recorder_keeps_a_missing_objects_answer_and_the_check_judges_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    monkeypatch.setenv(aws.IAM_RECORD_ENV, str(tmp_path))
    s3 = aws.client("s3", REGION, principal=CAPACITY_FALLBACK)
    with Stubber(s3) as stub:
        stub.add_client_error("get_object", "NoSuchKey", http_status_code=404)
        stub.add_response("get_object", {}, {"Bucket": STACK.bucket, "Key": "state/current-job.json"})
        stub.add_client_error("get_object", "AccessDenied", http_status_code=403)
        with pytest.raises(s3.exceptions.NoSuchKey):
            s3.get_object(Bucket=STACK.bucket, Key=LEDGER)
        s3.get_object(Bucket=STACK.bucket, Key="state/current-job.json")
        with pytest.raises(s3.exceptions.ClientError):
            s3.get_object(Bucket=STACK.bucket, Key="state/ledger.json")
    (recording,) = tmp_path.glob(f"{CAPACITY_FALLBACK}-*.jsonl")
    lines = [json.loads(line) for line in recording.read_text().splitlines()]
    calls = [line for line in lines if "answer_to" not in line]
    answers = {line["answer_to"]: (line["status"], line["error"]) for line in lines if "answer_to" in line}
    assert answers == {calls[0]["call"]: (404, "NoSuchKey"), calls[2]["call"]: (403, "AccessDenied")}
    findings, checked, _ = check_folder(tmp_path)
    # The missing ledger: its read and the listing; each read that reached an object: it and its Decrypt.
    assert findings == [] and checked == 6
    request.getfixturevalue("planted")
    findings, _, _ = check_folder(tmp_path)
    (line,) = report(findings)
    assert LEDGER in line and "not NoSuchKey" in line

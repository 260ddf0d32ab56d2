"""The embedded AWS endpoint (demo/moto_server.py): moto still routes with its service list cached, answers
a ranged GET from the range alone, as S3 does, and makes a KMS key's pair only when the key first signs."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import EndpointConnectionError

from demo.moto_server import cache_moto_service_list, moto_server


def test_the_cached_service_list_is_the_one_moto_computes() -> None:
    from moto import backends

    cache_moto_service_list()
    cached = list(backends.list_of_moto_modules())
    original = backends.list_of_moto_modules.__wrapped__
    computed = list(original())  # moto's own function, asked now
    assert cached == computed
    assert {"s3", "ec2", "autoscaling", "sns", "kms"} <= set(cached)
    # Asked again and again (twice per request), the answer is the same whole list, not a spent iterator.
    assert list(backends.list_of_moto_modules()) == cached


def test_a_server_with_the_cached_list_routes_each_service_and_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    with moto_server() as endpoint:
        assert endpoint.startswith("http://127.0.0.1:")
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="routed")
        assert [b["Name"] for b in s3.list_buckets()["Buckets"]] == ["routed"]
        topic = boto3.client("sns", region_name="us-east-1").create_topic(Name="routed")["TopicArn"]
        assert topic.endswith(":routed")
        groups = boto3.client("autoscaling", region_name="us-east-1").describe_auto_scaling_groups()
        assert groups["AutoScalingGroups"] == []
    once = Config(retries={"total_max_attempts": 1})
    with pytest.raises(EndpointConnectionError):  # stopped: nothing listens there any more
        boto3.client("s3", region_name="us-east-1", config=once).list_buckets()


def test_a_ranged_get_reads_only_its_range_and_answers_as_s3_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import demo.moto_server

    body = os.urandom(6 * 2**20 + 7)  # over moto's 5 MB: kept in a temporary file, as a shard is
    reads: list[int] = []
    original = demo.moto_server._RangeOfValue.__getitem__

    def counted(self: Any, part: slice) -> bytes:
        data = original(self, part)
        reads.append(len(data))
        return data

    monkeypatch.setattr(demo.moto_server._RangeOfValue, "__getitem__", counted)
    with moto_server() as endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="ranges")
        s3.put_object(Bucket="ranges", Key="shard.tar", Body=body)

        def get(asked: str) -> tuple[bytes, str | None]:
            answer = s3.get_object(Bucket="ranges", Key="shard.tar", Range=asked)
            return answer["Body"].read(), answer.get("ContentRange")

        last = len(body) - 1
        assert get("bytes=0-9") == (body[:10], f"bytes 0-9/{len(body)}")
        assert get("bytes=5000000-5000999") == (
            body[5_000_000:5_001_000],
            f"bytes 5000000-5000999/{len(body)}",
        )
        assert get(f"bytes={last - 2}-{last + 1000}") == (body[-3:], f"bytes {last - 2}-{last}/{len(body)}")
        assert reads == [10, 1000, 3]  # each answer read its own bytes, never the whole object
        # Left to moto, as before: a suffix, an open end, a range moto ignores; and a whole GET.
        assert get("bytes=-4")[0] == body[-4:]
        assert get("bytes=6291450-")[0] == body[6_291_450:]
        assert get("bytes=9-2")[0] == body
        assert s3.get_object(Bucket="ranges", Key="shard.tar")["Body"].read() == body
        # The transfer manager's parallel ranges put the object back together byte for byte.
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=2**20, multipart_chunksize=2**20, max_concurrency=8)
        s3.download_file("ranges", "shard.tar", str(tmp_path / "copy"), Config=config)
        assert (tmp_path / "copy").read_bytes() == body
        with pytest.raises(s3.exceptions.ClientError) as past:
            get(f"bytes={len(body)}-{len(body) + 5}")
        assert past.value.response["Error"]["Code"] == "InvalidRange"
    # The download's ranges of 1 MiB read theirs alone too (its last, open-ended, is moto's as before).
    assert reads[:3] == [10, 1000, 3] and reads[3:] == [2**20] * 6


def test_a_range_moto_answers_whole_after_all_is_the_objects_bytes() -> None:
    import io
    import threading

    from demo.moto_server import _RangeOfValue

    key = SimpleNamespace(size=6, lock=threading.Lock(), _value_buffer=io.BytesIO(b"abcdef"))
    value = _RangeOfValue(key)
    assert len(value) == 6 and value[2:4] == b"cd" and value[4:99] == b"ef" and value[5:2] == b""
    assert b"".join(value) == b"abcdef"  # the web server iterates a body that is not bytes


def rsa_keys_made(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of each RSA private key generated from now on in this test, by moto or anyone in this
    process."""
    from cryptography.hazmat.primitives.asymmetric import rsa

    made: list[int] = []
    generate = rsa.generate_private_key

    def counted(public_exponent: int, key_size: int, backend: Any = None) -> rsa.RSAPrivateKey:
        made.append(key_size)
        return generate(public_exponent, key_size)

    monkeypatch.setattr(rsa, "generate_private_key", counted)
    return made


def test_a_symmetric_key_makes_no_key_pair_and_an_asymmetric_one_signs_with_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding, rsa

    made = rsa_keys_made(monkeypatch)
    with moto_server() as endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        kms = boto3.client("kms", region_name="us-east-1")
        symmetric = kms.create_key(Description="a stack's key")["KeyMetadata"]
        assert symmetric["KeySpec"] == "SYMMETRIC_DEFAULT"
        sealed = kms.encrypt(KeyId=symmetric["KeyId"], Plaintext=b"secret")["CiphertextBlob"]
        assert kms.decrypt(CiphertextBlob=sealed)["Plaintext"] == b"secret"
        assert len(kms.generate_data_key(KeyId=symmetric["KeyId"], KeySpec="AES_256")["Plaintext"]) == 32
        assert made == [], "a symmetric key has no key pair"

        signing = kms.create_key(KeySpec="RSA_2048", KeyUsage="SIGN_VERIFY", MultiRegion=True)["KeyMetadata"]
        assert signing["SigningAlgorithms"] and made == []  # made when first used, not at CreateKey
        key_id = signing["KeyId"]
        signature = kms.sign(KeyId=key_id, Message=b"manifest", SigningAlgorithm="RSASSA_PSS_SHA_256")[
            "Signature"
        ]
        assert made == [2048]
        verified = kms.verify(
            KeyId=key_id, Message=b"manifest", Signature=signature, SigningAlgorithm="RSASSA_PSS_SHA_256"
        )
        assert verified["SignatureValid"] is True
        answer = kms.get_public_key(KeyId=key_id)
        assert answer["CustomerMasterKeySpec"] == "RSA_2048" and answer["KeyUsage"] == "SIGN_VERIFY"
        public = serialization.load_der_public_key(answer["PublicKey"])
        assert isinstance(public, rsa.RSAPublicKey) and public.key_size == 2048
        # The public key returned is the signing pair's: the signature checks out with it, outside moto.
        pss = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)
        public.verify(signature, b"manifest", pss, hashes.SHA256())
        # A replica signs with its primary's pair, as moto's replicas did before: still one pair made.
        kms.replicate_key(KeyId=key_id, ReplicaRegion="us-west-2")
        replica = boto3.client("kms", region_name="us-west-2").get_public_key(KeyId=key_id)
        assert replica["PublicKey"] == answer["PublicKey"]
        assert made == [2048]


def test_sns_signs_every_delivery_with_one_key_as_its_region_does(monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    made = rsa_keys_made(monkeypatch)
    with moto_server() as endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        sns = boto3.client("sns", region_name="us-east-1")
        sqs = boto3.client("sqs", region_name="us-east-1")
        delivered = []
        for n in range(3):  # three stacks: a topic each, its alerts queue subscribed
            topic = sns.create_topic(Name=f"alerts-{n}")["TopicArn"]
            queue = sqs.create_queue(QueueName=f"alerts-{n}")["QueueUrl"]
            attributes = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"]
            arn = attributes["QueueArn"]
            sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=arn)
            sns.publish(TopicArn=topic, Message=f"job {n} completed", Subject="trainstack")
            body = json.loads(sqs.receive_message(QueueUrl=queue, WaitTimeSeconds=1)["Messages"][0]["Body"])
            delivered.append(body)
    assert [b["Message"] for b in delivered] == [f"job {n} completed" for n in range(3)]
    assert all(b["Signature"] and b["SigningCertURL"].startswith("https://sns.us-east-1.") for b in delivered)
    assert len(made) <= 1, f"one signing key for the region, not one per subscription: {made}"


def test_a_services_regions_are_listed_once_and_are_botocores() -> None:
    from botocore.session import Session
    from moto.core.base_backend import AccountSpecificBackend

    from demo.moto_server import regions_once_per_service

    regions_once_per_service()
    backend = AccountSpecificBackend.__new__(AccountSpecificBackend)
    listed = backend._generate_regions("sqs")
    expected = [
        region
        for partition in Session().get_available_partitions()
        for region in Session().get_available_regions("sqs", partition_name=partition)
    ]
    assert listed == expected and "us-east-1" in listed
    other = AccountSpecificBackend.__new__(AccountSpecificBackend)
    listed.append("changed by its caller")
    assert other._generate_regions("sqs") == expected, "each backend gets the list, not a shared one"

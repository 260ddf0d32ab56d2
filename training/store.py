"""S3 for a trainer run by hand: results to output.uri (checkpoints go through bootstrap/persist.py)."""

from __future__ import annotations

from pathlib import Path

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config as BotoConfig

# 64 MiB parts: a 200 MB checkpoint goes up as a few parallel parts, each with its own checksum.
_TRANSFER = TransferConfig(multipart_threshold=64 * 2**20, multipart_chunksize=64 * 2**20, max_concurrency=8)


def split_uri(uri: str) -> tuple[str, str]:
    """s3://bucket/some/prefix -> ("bucket", "some/prefix")."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, prefix.strip("/")


class S3Prefix:
    """Files under one s3://bucket/prefix; every AWS call honours AWS_ENDPOINT_URL through boto3."""

    def __init__(self, uri: str) -> None:
        self.uri = uri.rstrip("/")
        self.bucket, self.prefix = split_uri(uri)
        self.client = boto3.client(
            "s3", config=BotoConfig(retries={"mode": "standard", "max_attempts": 10}, connect_timeout=10)
        )

    def key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def upload_file(self, local: Path, relative: str) -> None:
        # SHA256 checksums make S3 reject a part corrupted in transit instead of storing it.
        self.client.upload_file(
            str(local),
            self.bucket,
            self.key(relative),
            ExtraArgs={"ChecksumAlgorithm": "SHA256"},
            Config=_TRANSFER,
        )

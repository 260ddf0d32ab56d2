"""The S3 side of the checkpoint store: boto3 transfers with checksums and standard retries."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config as BotoConfig
from botocore.exceptions import ClientError

STEP_DIR = re.compile(r"^step-(\d+)$")

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

    def upload_bytes(self, data: bytes, relative: str) -> None:
        self.client.put_object(
            Bucket=self.bucket, Key=self.key(relative), Body=data, ChecksumAlgorithm="SHA256"
        )

    def download_file(self, relative: str, local: Path) -> None:
        self.client.download_file(self.bucket, self.key(relative), str(local), Config=_TRANSFER)

    def read_bytes(self, relative: str) -> bytes | None:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self.key(relative))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in {"NoSuchKey", "404"}:
                return None
            raise
        body: bytes = response["Body"].read()
        return body

    def step_dirs(self) -> list[int]:
        """Steps that have at least one object under step-<N>/, newest first."""
        paginator = self.client.get_paginator("list_objects_v2")
        base = self.key("")
        steps: set[int] = set()
        for page in paginator.paginate(Bucket=self.bucket, Prefix=base, Delimiter="/"):
            for common in page.get("CommonPrefixes", []):
                match = STEP_DIR.match(common["Prefix"][len(base) :].rstrip("/"))
                if match:
                    steps.add(int(match.group(1)))
        return sorted(steps, reverse=True)

    def delete_dir(self, relative: str) -> None:
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.key(relative.rstrip("/") + "/")):
            objects: list[Any] = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if objects:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True})

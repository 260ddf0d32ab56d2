"""A completed job's output directory, uploaded to the stack's results prefix by the agent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from boto3.s3.transfer import TransferConfig

_TRANSFER = TransferConfig(multipart_threshold=64 * 2**20, multipart_chunksize=64 * 2**20, max_concurrency=8)


def upload_results(s3: Any, bucket: str, prefix: str, output_dir: Path) -> list[str]:
    """Upload every file under `output_dir` to `s3://bucket/<prefix><relative path>`; returns the keys.

    Hidden files (editor and tool droppings) stay behind; a failure raises, naming the file.
    """
    keys = []
    for path in sorted(p for p in output_dir.rglob("*") if p.is_file()):
        relative = path.relative_to(output_dir)
        if any(part.startswith(".") for part in relative.parts):
            continue
        key = prefix + relative.as_posix()
        s3.upload_file(str(path), bucket, key, ExtraArgs={"ChecksumAlgorithm": "SHA256"}, Config=_TRANSFER)
        keys.append(key)
    return keys

"""A completed job's output directory, uploaded to the stack's results prefix by the agent."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig

from bootstrap.safefiles import fd_path, regular_files

_TRANSFER = TransferConfig(multipart_threshold=64 * 2**20, multipart_chunksize=64 * 2**20, max_concurrency=8)


def _to_agent_log(line: str) -> None:
    # The agent's stderr goes to its journal: the agent's log, never the job's output.
    print(f"trainstack agent: {line}", file=sys.stderr, flush=True)


def upload_results(
    s3: Any, bucket: str, prefix: str, output_dir: Path, say: Callable[[str], None] = _to_agent_log
) -> list[str]:
    """Upload every file under `output_dir` to `s3://bucket/<prefix><relative path>`; returns the keys.

    Hidden files (editor and tool droppings) stay behind; a failure raises, naming the file.

    The job owns `output_dir` and the agent uploads as root to a prefix the job can read back: a link there
    (to /etc/shadow, to a folder of root's) would publish what it points to. So no link is followed: each is
    left out with one line to `say`, a linked folder is not walked, and each file is uploaded from the
    descriptor opened on it, so a link swapped in after the walk saw a file is never read through either.
    """
    keys = []
    for relative, handle in regular_files(output_dir, say, skip=lambda name: name.startswith(".")):
        key = prefix + relative.as_posix()
        source = fd_path(handle, output_dir / relative)
        try:
            s3.upload_file(
                str(source), bucket, key, ExtraArgs={"ChecksumAlgorithm": "SHA256"}, Config=_TRANSFER
            )
        except S3UploadFailedError as exc:
            # boto3 names the file it was given, /proc/self/fd/N: the failure names it as the job wrote it.
            raise S3UploadFailedError(str(exc).replace(str(source), str(output_dir / relative))) from exc
        keys.append(key)
    return keys

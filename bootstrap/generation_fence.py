"""Who may commit a multi-node job's checkpoints: the nodes of its newest generation (docs/multi-node.md,
"Checkpoints fenced by generation").

Why: a node that was frozen or cut off (a network partition that heals; SIGSTOP then SIGCONT on one
machine) comes back with a step saved locally in a generation the others already declared lost: they
restored the newest confirmed checkpoint and train on in a newer generation. Its upload would move
`latest.json` to a step of a lineage nobody trains any more. The generation record (`rendezvous.json`,
bootstrap/rendezvous.py) only ever names higher generations, so it is the fencing token: the persister
(bootstrap/persist.py, `Fence`) checks it before a step's first file, its manifest and `latest.json`, and
`latest.json` carries the writer's generation.

The rule (also in the persister's docstring):
- the token is the generation this node trains in; it rises as the node joins later generations within one
  life (`enter`), and before its first join the node takes the generation the record names (its persister
  may upload a step an earlier agent on this instance left; nothing newer exists to lose it to);
- `check()` raises `GenerationSupersededError` (a `LeaseLostError`, so the persister stops writing for good)
  when the record names a newer generation hosted by another node. One hosted by this node is its own
  proposal, written an instant before `enter` (or an earlier agent's here, which no node joins): no node
  trains from an older step in it. An absent or damaged record names no newer generation: the check passes,
  and `latest.json`'s own generation still keeps an older writer out;
- `latest.json` carries the generation under `"generation"`, never `"token"`: the single-node lease's tokens
  count acquisitions, not generations, and must never be compared with them. A `latest.json` without a
  `"generation"` (written by the lease's holder, an unfenced writer or an older agent) is an earlier
  writer's and is replaced, as the lease's rule replaces a lower token;
- a read that fails (S3 unreachable, throttled) is not "superseded": it propagates, and the persister
  retries rather than write unchecked, exactly as with the lease.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from botocore.exceptions import ClientError

from bootstrap.lease import LeaseLostError
from bootstrap.rendezvous import RECORD, Generation

# The key `latest.json` carries this fence's token under (the lease's is "token").
LATEST_KEY = "generation"


class GenerationSupersededError(LeaseLostError):
    """A newer generation owns the job: this node's steps since the confirmed one are not the job's."""

    def __init__(self, generation: int, newer: int, uri: str = "") -> None:
        super().__init__(f"generation {newer}", newer, uri)
        self.generation = generation
        self.newer = newer
        where = f"{uri}: " if uri else ""
        self.args = (
            f"{where}generation {newer} owns the job (this node trained in generation {generation}): "
            "this node no longer writes the job's checkpoints",
        )

    @property
    def lost_line(self) -> str:
        """What the persister says once, when it stops writing."""
        return (
            f"generation {self.newer} owns the job (this node trained in generation {self.generation}): "
            "this node no longer writes the job's checkpoints"
        )

    @property
    def not_confirmed_line(self) -> str:
        """What the persister says at the end: why its newest step is not confirmed."""
        return (
            "this node's newest checkpoint was NOT confirmed: a newer generation owns the job and trains "
            "on from the confirmed checkpoint; steps saved here since belong to a generation the job "
            "declared lost"
        )


class GenerationFence:
    """The persister's `Fence` on a node of a multi-node job: `token` is the generation this node trains in.

    Thread-safe: the persister checks from its upload thread while `Generations.train` enters generations.
    """

    latest_key = LATEST_KEY

    def __init__(self, s3: Any, bucket: str, state_prefix: str, *, instance_id: str) -> None:
        self._s3 = s3
        self.bucket = bucket
        self.key = f"{state_prefix}{RECORD}"
        self.instance_id = instance_id
        self._lock = threading.Lock()
        self._generation: int | None = None

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    @property
    def token(self) -> int:
        """The generation this node trains in (0 until it is known)."""
        with self._lock:
            return self._generation or 0

    def enter(self, generation: int) -> None:
        """This node launches in `generation` (joined or hosted): its commits carry it from now on. A node's
        generations only go up; a lower number (a stale caller) changes nothing."""
        with self._lock:
            if self._generation is None or generation > self._generation:
                self._generation = generation

    def current(self) -> Generation | None:
        """The generation the record names now (None: absent or not a record). S3 errors propagate."""
        try:
            response = self._s3.get_object(Bucket=self.bucket, Key=self.key)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in {"NoSuchKey", "404", "NotFound"}:
                return None
            raise
        try:
            return Generation.from_record(json.loads(response["Body"].read()))
        except ValueError:
            return None

    def check(self) -> Generation | None:
        """One GET of the record; `GenerationSupersededError` when it names a newer generation hosted by
        another node. A read that fails raises what S3 raised: unknown, never "superseded"."""
        record = self.current()
        with self._lock:
            if self._generation is None:
                # Before this node's first join: whatever trains now is what it will join.
                self._generation = record.number if record is not None else None
                return record
            mine = self._generation
        if record is None or record.number <= mine or record.host_id == self.instance_id:
            return record
        raise GenerationSupersededError(mine, record.number, self.uri)

    def superseded(self, token: int, uri: str) -> LeaseLostError:
        """The loss to report when `latest.json` already carries a newer generation than this node's."""
        return GenerationSupersededError(self.token, token, uri)

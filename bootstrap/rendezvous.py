"""Generations of a multi-node job: which c10d store this node's trainer joins, decided through S3.

Why S3, and why generations (docs/multi-node.md):
- S3 is the only shared, durable thing the stack already has. A coordinator instance would be paid for
  around the clock and, on spot, lost like any node; etcd or a managed service would be one more thing for
  users to run. Every node here can be interrupted, the one hosting the rendezvous included.
- A generation is one elastic run of the trainer. Its c10d store lives in that generation's host agent (the
  host's launcher serves it) and dies with it; nobody needs it afterwards.
- The store's port is never free between being published and being served: the host binds port 0 on its
  address and listens before it proposes the generation, publishes the port it got, and keeps the socket
  for as long as it hosts that generation; its launcher serves the store on that very socket (inherited,
  training/launch.py LISTEN_FD_ENV). A port probed free and closed could be taken by any process in
  between, and a peer dialling the endpoint early waits in the listen backlog instead of being refused.
- Any membership change by interruption ends the generation: the interrupted node's notice stops every rank
  of every node at one step through the trainer's coordinated stop. The survivors then call `join` with the
  generation they ran in; they all want generation + 1 and the first writer hosts it (an S3 conditional
  write lets exactly one proposal in, the others re-read and join the winner).
- A node that arrives while a generation trains joins it as a client (newer than anything it ran, host
  alive); torch's own elastic restart absorbs it into a new round of that generation.
- Liveness is a heartbeat in each node's own file. Clock skew between instances only shifts heartbeat ages:
  EC2 instances keep NTP time (Amazon Time Sync), and `stale_seconds` is tens of seconds. The survivors'
  watch for a node that vanished mid-generation (bootstrap/generations.py) compares no clocks at all: it
  reads every other node's file (`other_nodes`) and times how long its heartbeat stays unchanged.

Keys under the job's state prefix:
- `nodes/<instance_id>.json`: {"instance_id", "address", "heartbeat_at" (epoch s), "generation" (the one
  this node last launched in, or null)}. Only its own node writes it (plain puts); `leave` deletes it.
- `rendezvous.json`: the current generation, {"generation", "host_id", "endpoint" ("address:port": the
  port of a socket the host was already listening on when it wrote the record),
  "run_id" ("<stack>-g<generation>"), "created_at", "min_nodes", "max_nodes"}. Only ever written with
  If-None-Match: * (the first) or If-Match: <the ETag read> (every later one).

Errors: S3 unreachable raises botocore's errors (the caller bounds and retries joins; heartbeats are retried
by the next poll). A node file that is not a node file (not JSON, keys missing) counts as absent: that node
is not alive. A record that is not a record counts as "no live generation": the next `join` replaces it with
a conditional write against its ETag and says so in `Membership.repaired`, for the caller to log.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from botocore.exceptions import ClientError

from trainstack_job.records import is_conflict, write_condition

RECORD = "rendezvous.json"
NODES = "nodes/"
# Proposals lost in a row before `join` gives up for now: each loss means another node's proposal got in,
# which the next read joins, so more than a couple in a row means something keeps rewriting the record.
JOIN_ATTEMPTS = 8


def _number(value: Any) -> bool:
    # JSON has one number type; bool is an int in Python but never a valid count or time here.
    return isinstance(value, int | float) and not isinstance(value, bool)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Generation:
    """One elastic run: its number, the node hosting its c10d store, and the store's endpoint."""

    number: int
    host_id: str
    endpoint: str
    run_id: str
    created_at: float
    min_nodes: int
    max_nodes: int

    def to_record(self) -> dict[str, Any]:
        record = asdict(self)
        record["generation"] = record.pop("number")
        return record

    @classmethod
    def from_record(cls, raw: Any) -> Generation | None:
        """None for anything that is not a complete record (hand-edited, truncated, another format)."""
        if not isinstance(raw, dict):
            return None
        texts = ("host_id", "endpoint", "run_id")
        if not (
            _count(raw.get("generation"))
            and raw["generation"] >= 1
            and all(isinstance(raw.get(key), str) and raw[key] for key in texts)
            and _number(raw.get("created_at"))
            and _count(raw.get("min_nodes"))
            and _count(raw.get("max_nodes"))
        ):
            return None
        return cls(
            number=raw["generation"],
            host_id=raw["host_id"],
            endpoint=raw["endpoint"],
            run_id=raw["run_id"],
            created_at=float(raw["created_at"]),
            min_nodes=raw["min_nodes"],
            max_nodes=raw["max_nodes"],
        )


@dataclass(frozen=True)
class Membership:
    """The generation this node launches in next, and whether its launcher serves the c10d store.

    `repaired` names what this join overwrote that was not a valid record (None normally): worth a log line.
    """

    generation: Generation
    is_host: bool
    repaired: str | None = None


def _node_file(raw: Any, instance_id: str | None = None) -> dict[str, Any] | None:
    """The node file as written by `heartbeat`, or None when it is not one (or names another node)."""
    if not isinstance(raw, dict):
        return None
    generation = raw.get("generation")
    if not (
        isinstance(raw.get("instance_id"), str)
        and isinstance(raw.get("address"), str)
        and _number(raw.get("heartbeat_at"))
        and (generation is None or _count(generation))
    ):
        return None
    if instance_id is not None and raw["instance_id"] != instance_id:
        return None
    return raw


def listen(address: str) -> socket.socket:
    """A TCP socket on `address`, bound to a port the OS picked and listening: the c10d store's socket for a
    generation this node proposes. Python makes it non-inheritable (PEP 446), so only the trainer it is
    passed to (subprocess's pass_fds) gets a copy, never another child of the agent."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((address, 0))
        # Every node's launcher dials the store once per rendezvous round; SOMAXCONN lets a whole group
        # that read the record before the store serves wait in the backlog rather than be refused.
        listener.listen(socket.SOMAXCONN)
    except BaseException:
        listener.close()
        raise
    return listener


@dataclass(frozen=True)
class _Hosting:
    """The listening socket behind an endpoint this node published (or is about to)."""

    endpoint: str
    listener: socket.socket


class Rendezvous:
    """This node's view of the job's generations and of the other nodes, all kept in S3."""

    def __init__(
        self,
        s3: Any,
        bucket: str,
        state_prefix: str,
        *,
        instance_id: str,
        address: str,
        stack: str,
        min_nodes: int,
        max_nodes: int,
        stale_seconds: float,
        now: Callable[[], float] = time.time,
        attempts: int = JOIN_ATTEMPTS,
    ) -> None:
        self._s3 = s3
        self.bucket = bucket
        self.prefix = state_prefix
        self.instance_id = instance_id
        self.address = address
        self.stack = stack
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.stale_seconds = stale_seconds
        self._now = now
        self._attempts = attempts
        # The generations this object proposed. A record naming this instance as host but not proposed here
        # was written by an earlier agent on this instance (systemd restarted it): that agent's launcher,
        # and the c10d store in it, died with it, so the record is dead even though this node is alive.
        # One proposed here is live even if its write looked lost (a retried put answered 412).
        self._proposed: set[tuple[int, str]] = set()
        # The socket of the generation this node hosts (or of the proposal of the join under way). A store
        # can only be served on it, so a generation of this node's is alive exactly while it is held.
        self._hosting: _Hosting | None = None

    @property
    def record_key(self) -> str:
        return f"{self.prefix}{RECORD}"

    def node_key(self, instance_id: str) -> str:
        return f"{self.prefix}{NODES}{instance_id}.json"

    def _uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    # -- this node's file ---------------------------------------------------------------------------

    def heartbeat(self, generation: int | None) -> None:
        """Say this node is alive, at which address, and the generation it last launched in."""
        body = {
            "instance_id": self.instance_id,
            "address": self.address,
            "heartbeat_at": self._now(),
            "generation": generation,
        }
        self._s3.put_object(
            Bucket=self.bucket,
            Key=self.node_key(self.instance_id),
            Body=json.dumps(body).encode(),
            ContentType="application/json",
        )

    def leave(self) -> None:
        """Remove this node's file: no one joins a generation it hosts from now on (S3 deletes are
        idempotent, so leaving twice is fine). The store's socket goes first: closing it is local and must
        happen even when S3 cannot be reached."""
        self.close_listener()
        self._s3.delete_object(Bucket=self.bucket, Key=self.node_key(self.instance_id))

    # -- the store's socket -------------------------------------------------------------------------

    def listener(self, generation: Generation) -> socket.socket | None:
        """The listening socket of `generation` if this node hosts it and still holds it, else None."""
        hosting = self._hosting
        if hosting is None or hosting.endpoint != generation.endpoint or hosting.listener.fileno() < 0:
            return None
        return hosting.listener

    def close_listener(self) -> None:
        """Close the socket of the generation this node hosted: the generation is over here (its trainer
        exited, or this node leaves). The launcher's own copy, if it still runs, keeps the store up."""
        hosting, self._hosting = self._hosting, None
        if hosting is not None:
            hosting.listener.close()

    def _endpoint(self) -> str:
        """The endpoint of this join's proposals: one socket for all of them (a proposal whose answer was
        lost may have been written, and a later read of it must find its socket still here)."""
        if self._hosting is None:
            listener = listen(self.address)
            self._hosting = _Hosting(f"{self.address}:{listener.getsockname()[1]}", listener)
        return self._hosting.endpoint

    # -- the other nodes ----------------------------------------------------------------------------

    def _get(self, key: str) -> tuple[Any, str | None]:
        """The object's parsed JSON (None if absent or not JSON) and its ETag (None if absent)."""
        try:
            response = self._s3.get_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in {"NoSuchKey", "404"}:
                return None, None
            raise
        etag = str(response["ETag"])
        try:
            return json.loads(response["Body"].read()), etag
        except ValueError:  # not JSON (or not UTF-8): the caller treats it as malformed
            return None, etag

    def _fresh(self, node: dict[str, Any]) -> bool:
        return self._now() - float(node["heartbeat_at"]) < self.stale_seconds

    def node(self, instance_id: str) -> dict[str, Any] | None:
        """That node's file if its heartbeat is fresh, else None (gone, stale or malformed)."""
        raw, _ = self._get(self.node_key(instance_id))
        node = _node_file(raw, instance_id)
        return node if node is not None and self._fresh(node) else None

    def _node_keys(self) -> Iterator[str]:
        pages = self._s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=f"{self.prefix}{NODES}"
        )
        for page in pages:
            for item in page.get("Contents", []):
                if item["Key"].endswith(".json"):
                    yield item["Key"]

    def other_nodes(self) -> dict[str, dict[str, Any]]:
        """Every other node's file as it is, fresh or not, by instance id: what the peer watch compares from
        one poll to the next (bootstrap/generations.py). Malformed files are left out."""
        prefix = f"{self.prefix}{NODES}"
        found: dict[str, dict[str, Any]] = {}
        for key in self._node_keys():
            instance_id = key[len(prefix) : -len(".json")]
            if instance_id == self.instance_id:
                continue
            raw, _ = self._get(key)
            node = _node_file(raw, instance_id)
            if node is not None:
                found[instance_id] = node
        return found

    def live_nodes(self) -> dict[str, dict[str, Any]]:
        """Every node whose heartbeat is fresh, by instance id (one list and one get per node file: the
        job has tens of nodes at most, and this is asked for status, not on every poll)."""
        prefix = f"{self.prefix}{NODES}"
        live: dict[str, dict[str, Any]] = {}
        for key in self._node_keys():
            instance_id = key[len(prefix) : -len(".json")]
            node = self.node(instance_id)
            if node is not None:
                live[instance_id] = node
        return live

    # -- generations --------------------------------------------------------------------------------

    def current(self) -> Generation | None:
        """The generation the record names now (None when there is no valid record)."""
        raw, _ = self._get(self.record_key)
        return Generation.from_record(raw)

    def _host_alive(self, generation: Generation) -> bool:
        if generation.host_id == self.instance_id:
            proposed = (generation.number, generation.endpoint) in self._proposed
            return proposed and self.listener(generation) is not None
        return self.node(generation.host_id) is not None

    def _floor(self) -> int:
        """The highest generation any live node launched in. Without a valid record this keeps generation
        numbers going up (the ledger counts one crash per generation, and a node joins only a generation
        newer than its last), whatever happened to the record."""
        launched = [node["generation"] or 0 for node in self.live_nodes().values()]
        return max(launched, default=0)

    def join(self, last_generation: int | None) -> Membership:
        """The generation to launch in next, for a node ready to (re)launch its trainer.

        The record's generation if it is newer than `last_generation` (the one this node last launched in)
        and its host is alive; otherwise a new generation hosted here, written conditionally. A lost race
        re-reads and decides again, so of several nodes proposing at once one hosts and the others join it.
        A generation hosted here comes with its store's socket, bound and listening before the record
        names its port, held until the next join, `close_listener` or `leave` (see `listener`).
        """
        # Asked between generations only (this node's trainer has exited): a store it hosted is over.
        self.close_listener()
        try:
            # Alive before any record can name this node: another node may read the record the moment it
            # is written, and would take this node for dead if its file were missing or old.
            self.heartbeat(last_generation)
            membership = self._decide(last_generation)
            if not membership.is_host:
                self.close_listener()  # every proposal of this join lost: its port goes back
            self.heartbeat(membership.generation.number)
        except BaseException:
            self.close_listener()
            raise
        return membership

    def _decide(self, last_generation: int | None) -> Membership:
        for _ in range(self._attempts):
            raw, etag = self._get(self.record_key)
            record = Generation.from_record(raw)
            if record is not None and record.number > (last_generation or 0) and self._host_alive(record):
                return Membership(record, record.host_id == self.instance_id)
            # An object there that is not a record: replaced by this proposal if it wins, and reported.
            repaired = None
            if record is None and etag is not None:
                repaired = f"{self._uri(self.record_key)} was not a generation record; replaced"
            number = max(record.number if record is not None else self._floor(), last_generation or 0) + 1
            # Bound and listening before the record names it: the published port is already this node's.
            proposal = Generation(
                number=number,
                host_id=self.instance_id,
                endpoint=self._endpoint(),
                run_id=f"{self.stack}-g{number}",
                created_at=self._now(),
                min_nodes=self.min_nodes,
                max_nodes=self.max_nodes,
            )
            if self._propose(proposal, etag):
                return Membership(proposal, True, repaired)
        lost = f"{self._attempts} generation proposals lost in a row"
        raise RuntimeError(f"{self._uri(self.record_key)}: {lost}; will retry")

    def _propose(self, proposal: Generation, etag: str | None) -> bool:
        """Write the proposal unless the record changed since it was read (False: another write got in)."""
        self._proposed.add((proposal.number, proposal.endpoint))
        try:
            self._s3.put_object(
                Bucket=self.bucket,
                Key=self.record_key,
                Body=json.dumps(proposal.to_record(), indent=2).encode(),
                ContentType="application/json",
                **write_condition(etag),
            )
        except ClientError as exc:
            if is_conflict(exc):
                return False
            raise
        return True

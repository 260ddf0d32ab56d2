"""Generations through S3 (bootstrap/rendezvous.py) against the moto server: who hosts, who joins, who
takes over when a host is gone, and that of two nodes proposing at once exactly one hosts; the host
publishes the port of a socket it already listens on and holds it exactly as long as the generation."""

from __future__ import annotations

import ast
import json
import os
import re
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from bootstrap import rendezvous as rendezvous_module
from bootstrap.rendezvous import RECORD, Membership, Rendezvous
from tests.conftest import MotoServer
from trainstack_job.records import is_conflict

BUCKET = "trainstack-rdzv"
PREFIX = "state/"
STALE = 60.0
ADDRESS = "127.0.0.1"


class Clock:
    """Epoch seconds the test moves by hand: staleness without sleeping."""

    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


class SharedS3:
    """The S3 client every node of a test shares, with two test hooks on the generation record.

    moto checks If-Match / If-None-Match and then stores the object in two steps, without a lock, on one of
    its request threads; S3 does both atomically. The lock around puts of the record gives moto S3's
    atomicity: which write gets in, and the 412 the other gets, are still moto's conditional-write answers.
    `race` makes each of that many threads read the record once before any of them writes it.
    """

    def __init__(self, client: Any, race: int = 0) -> None:
        self._client = client
        self._put_lock = threading.Lock()
        self._race = threading.Barrier(race, timeout=30) if race else None
        self._raced = threading.local()
        self.conflicts = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def get_object(self, **kwargs: Any) -> Any:
        response = self._client.get_object(**kwargs)
        if self._race is not None and kwargs["Key"].endswith(RECORD) and not getattr(self._raced, "v", 0):
            self._raced.v = 1
            self._race.wait(timeout=10)
        return response

    def put_object(self, **kwargs: Any) -> Any:
        if not kwargs["Key"].endswith(RECORD):
            return self._client.put_object(**kwargs)
        with self._put_lock:
            try:
                return self._client.put_object(**kwargs)
            except ClientError as exc:
                if is_conflict(exc):
                    self.conflicts += 1
                raise


@pytest.fixture()
def s3(aws: MotoServer) -> Any:
    client = boto3.client("s3", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    return client


@pytest.fixture()
def clock() -> Clock:
    return Clock()


NodeFactory = Callable[..., Rendezvous]


@pytest.fixture()
def node(s3: Any, clock: Clock) -> NodeFactory:
    def build(instance_id: str, client: Any = None, **kwargs: Any) -> Rendezvous:
        return Rendezvous(
            client or s3,
            BUCKET,
            PREFIX,
            instance_id=instance_id,
            address=ADDRESS,
            stack="demo",
            min_nodes=1,
            max_nodes=3,
            stale_seconds=STALE,
            now=clock,
            **kwargs,
        )

    return build


def record(s3: Any) -> dict[str, Any]:
    return dict(json.loads(s3.get_object(Bucket=BUCKET, Key=PREFIX + RECORD)["Body"].read()))


def refused(code: str, status: int) -> ClientError:
    """A conditional put's refusal, as botocore raises it."""
    response: Any = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(response, "PutObject")


def join_together(nodes: list[Rendezvous], last: int | None) -> list[Membership]:
    """Every node joins at once (a barrier lines them up), as the survivors of one generation do."""
    start = threading.Barrier(len(nodes), timeout=30)

    def join(rendezvous: Rendezvous) -> Membership:
        start.wait(timeout=10)
        return rendezvous.join(last)

    with ThreadPoolExecutor(len(nodes)) as pool:
        return list(pool.map(join, nodes))


def test_the_first_node_creates_generation_1_and_hosts_it_the_second_joins_it(
    s3: Any, node: NodeFactory, clock: Clock
) -> None:
    a, b = node("i-a"), node("i-b")
    first = a.join(None)
    assert first.is_host and first.generation.number == 1 and first.repaired is None
    host, port = first.generation.endpoint.rsplit(":", 1)
    assert host == ADDRESS and int(port) > 0
    assert record(s3) == {
        "generation": 1,
        "host_id": "i-a",
        "endpoint": first.generation.endpoint,
        "run_id": "demo-g1",
        "created_at": clock.t,
        "min_nodes": 1,
        "max_nodes": 3,
    }
    second = b.join(None)
    assert not second.is_host
    assert second.generation == first.generation, "same generation: same endpoint and run id"
    # Each node's file says which generation it launched in.
    assert {k: v["generation"] for k, v in a.live_nodes().items()} == {"i-a": 1, "i-b": 1}


def test_survivors_proposing_at_once_get_exactly_one_host_each_generation(s3: Any, node: NodeFactory) -> None:
    shared = SharedS3(s3)
    nodes = [node("i-a", shared), node("i-b", shared)]
    last: int | None = None
    for generation in range(1, 6):
        members = join_together(nodes, last)
        assert sorted(m.is_host for m in members) == [False, True], f"generation {generation}"
        assert {m.generation for m in members} == {members[0].generation}
        assert members[0].generation.number == generation
        assert members[0].generation.run_id == f"demo-g{generation}"
        last = generation


def test_two_proposals_against_one_etag_are_decided_by_the_s3_conditional_write(
    s3: Any, node: NodeFactory
) -> None:
    node("i-a").join(None)
    node("i-b").join(None)
    # Both survivors of generation 1 read it before either writes: both propose generation 2 If-Match the
    # same ETag; S3 lets one in and answers the other 412, which re-reads and joins the winner.
    shared = SharedS3(s3, race=2)
    members = join_together([node("i-a", shared), node("i-b", shared)], 1)
    assert shared.conflicts == 1
    assert sorted(m.is_host for m in members) == [False, True]
    assert {m.generation.number for m in members} == {2}
    winner = next(m for m in members if m.is_host)
    assert record(s3)["host_id"] == winner.generation.host_id


def test_a_new_node_joins_a_running_generation_whose_host_is_alive(node: NodeFactory, clock: Clock) -> None:
    a, b = node("i-a"), node("i-b")
    a.join(None)
    b.join(None)
    running = join_together([a, b], 1)[0].generation
    clock.t += STALE - 1  # within staleness of the joins' heartbeats
    b.heartbeat(2)
    newcomer = node("i-c").join(None)
    assert not newcomer.is_host and newcomer.generation == running
    assert running.number == 2


def test_a_host_whose_heartbeat_is_stale_is_replaced_by_the_next_joiner(
    s3: Any, node: NodeFactory, clock: Clock
) -> None:
    node("i-a").join(None)
    clock.t += STALE + 1  # i-a vanished without a word: its file stays, its heartbeat ages
    taken = node("i-b").join(None)
    assert taken.is_host and taken.generation.number == 2
    assert record(s3)["host_id"] == "i-b"


def test_the_host_interrupted_the_survivors_regroup_under_a_new_host(node: NodeFactory) -> None:
    a, b, c = node("i-a"), node("i-b"), node("i-c")
    assert a.join(None).is_host
    b.join(None)
    c.join(None)
    a.leave()  # its life ended with the spot notice
    members = join_together([b, c], 1)
    assert {m.generation.number for m in members} == {2}
    assert sorted(m.is_host for m in members) == [False, True]
    assert members[0].generation.host_id in {"i-b", "i-c"}
    # A replacement arriving afterwards joins the survivors' generation.
    late = node("i-d").join(None)
    assert not late.is_host and late.generation == members[0].generation


def test_a_restarted_agent_does_not_rejoin_the_generation_its_dead_predecessor_hosted(
    node: NodeFactory,
) -> None:
    node("i-a").join(None)
    # systemd restarted i-a's agent: the launcher and its c10d store died with the old one, though the
    # instance (and its heartbeat) lives on. The new agent must not host a store that is gone.
    again = node("i-a").join(None)
    assert again.is_host and again.generation.number == 2


def test_a_winning_proposal_whose_answer_was_lost_still_hosts(s3: Any, node: NodeFactory) -> None:
    class LostAnswer(SharedS3):
        """The write lands, then a retry of it is refused 412: what a lost response looks like."""

        def put_object(self, **kwargs: Any) -> Any:
            response = super().put_object(**kwargs)
            if kwargs["Key"].endswith(RECORD):
                raise refused("PreconditionFailed", 412)
            return response

    membership = node("i-a", LostAnswer(s3)).join(None)
    assert membership.is_host and membership.generation.number == 1


def test_proposals_lost_without_end_give_up_naming_the_record(s3: Any, node: NodeFactory) -> None:
    class Refused(SharedS3):
        def put_object(self, **kwargs: Any) -> Any:
            if kwargs["Key"].endswith(RECORD):
                raise refused("ConditionalRequestConflict", 409)
            return super().put_object(**kwargs)

    with pytest.raises(RuntimeError, match=f"s3://{BUCKET}/{PREFIX}{RECORD}: 3 generation proposals lost"):
        node("i-a", Refused(s3), attempts=3).join(None)


@pytest.mark.parametrize("body", [b"{not json", b'{"generation": 4}', b"[1, 2]", b"\xff\xfe"])
def test_a_malformed_record_is_replaced_above_every_live_nodes_generation(
    s3: Any, node: NodeFactory, body: bytes
) -> None:
    node("i-b").heartbeat(4)  # a live node launched in generation 4 before the record was mangled
    s3.put_object(Bucket=BUCKET, Key=PREFIX + RECORD, Body=body)
    membership = node("i-a").join(None)
    assert membership.is_host and membership.generation.number == 5
    assert membership.repaired is not None and f"s3://{BUCKET}/{PREFIX}{RECORD}" in membership.repaired
    assert record(s3)["generation"] == 5
    assert node("i-b").join(4) == Membership(membership.generation, False)


def test_a_malformed_node_file_counts_as_a_dead_node(s3: Any, node: NodeFactory) -> None:
    a = node("i-a")
    a.join(None)
    for body in (b"garbage", json.dumps({"instance_id": "i-a", "address": ADDRESS}).encode()):
        s3.put_object(Bucket=BUCKET, Key=a.node_key("i-a"), Body=body)
        assert a.live_nodes() == {}
    taken = node("i-b").join(None)
    assert taken.is_host and taken.generation.number == 2


def test_leave_removes_the_node_file(s3: Any, node: NodeFactory) -> None:
    a = node("i-a")
    a.heartbeat(None)
    assert set(a.live_nodes()) == {"i-a"}
    a.leave()
    assert s3.list_objects_v2(Bucket=BUCKET, Prefix=PREFIX + "nodes/")["KeyCount"] == 0
    a.leave()  # twice is fine: a life may end through more than one path


def test_live_nodes_lists_only_fresh_heartbeats(node: NodeFactory, clock: Clock) -> None:
    a, b = node("i-a"), node("i-b")
    a.heartbeat(None)
    clock.t += STALE / 2
    b.heartbeat(3)
    assert set(a.live_nodes()) == {"i-a", "i-b"}
    clock.t += STALE / 2  # i-a's heartbeat is now exactly STALE old: stale
    live = a.live_nodes()
    assert set(live) == {"i-b"}
    assert live["i-b"] == {
        "instance_id": "i-b",
        "address": ADDRESS,
        "heartbeat_at": clock.t - STALE / 2,
        "generation": 3,
    }


def test_other_nodes_gives_every_other_valid_node_file_fresh_or_not(
    s3: Any, node: NodeFactory, clock: Clock
) -> None:
    """What the survivors' watch compares from poll to poll (bootstrap/generations.py): stale files too (a
    silent node is what it looks for), never this node's own, never a file that is not a node file."""
    a, b, c = node("i-a"), node("i-b"), node("i-c")
    for rendezvous in (a, b, c):
        rendezvous.heartbeat(1)
    clock.t += 10 * STALE
    c.heartbeat(2)
    s3.put_object(Bucket=BUCKET, Key=a.node_key("i-bad"), Body=b"garbage")
    others = a.other_nodes()
    assert set(others) == {"i-b", "i-c"}
    assert others["i-b"]["heartbeat_at"] == clock.t - 10 * STALE and others["i-c"]["generation"] == 2


# -- the store's socket: bound and listening before the record names its port, held for the generation ------


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def accepts(endpoint: str) -> bool:
    """Whether something listens there: a connect to a listening socket completes in its backlog even
    when nobody accepts; to a closed one it is refused at once (loopback: no waiting on a timeout)."""
    try:
        with socket.create_connection(("127.0.0.1", port_of(endpoint)), timeout=5):
            return True
    except ConnectionRefusedError:
        return False


@pytest.fixture()
def sockets(monkeypatch: pytest.MonkeyPatch) -> list[socket.socket]:
    """Every listening socket the rendezvous opens, to check each is closed when its generation is over."""
    made: list[socket.socket] = []
    listen = rendezvous_module.listen

    def recording(address: str) -> socket.socket:
        made.append(listen(address))
        return made[-1]

    monkeypatch.setattr(rendezvous_module, "listen", recording)
    return made


def test_the_host_publishes_the_port_of_a_socket_it_already_listens_on(s3: Any, node: NodeFactory) -> None:
    """No port race: the port in the record is this node's from before the record exists (a port probed
    free and closed could be taken in between), so a peer that reads the record can dial it at once."""
    at_publication: list[bool] = []

    class Dialling(SharedS3):
        def put_object(self, **kwargs: Any) -> Any:
            if kwargs["Key"].endswith(RECORD):  # dial the endpoint before the record exists
                at_publication.append(accepts(json.loads(kwargs["Body"])["endpoint"]))
            return super().put_object(**kwargs)

    a = node("i-a", Dialling(s3))
    hosted = a.join(None)
    assert at_publication == [True], "the endpoint was not listening when its record was written"
    listener = a.listener(hosted.generation)
    assert listener is not None and listener.getsockname() == (ADDRESS, port_of(hosted.generation.endpoint))
    assert listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
    assert port_of(record(s3)["endpoint"]) == listener.getsockname()[1]
    # Held: nobody else can take the published port while the generation lasts.
    with socket.socket() as other, pytest.raises(OSError):
        other.bind((ADDRESS, port_of(hosted.generation.endpoint)))
    # A node that joins it holds no socket of its own.
    b = node("i-b")
    joined = b.join(None)
    assert joined.generation == hosted.generation and b.listener(joined.generation) is None


def test_the_store_socket_lives_exactly_as_long_as_the_generation_hosted_here(
    node: NodeFactory, sockets: list[socket.socket]
) -> None:
    a, b = node("i-a"), node("i-b")
    first = a.join(None)
    b.join(None)
    assert len(sockets) == 1 and a.listener(first.generation) is sockets[0]
    # The next join means the generation is over here: its socket is closed, the next one's opened.
    second = join_together([a, b], 1)
    hosting = next(n for n, m in zip([a, b], second, strict=True) if m.is_host)
    assert sockets[0].fileno() == -1 and a.listener(first.generation) is None
    held = hosting.listener(second[0].generation)
    assert held is not None and held.getsockname()[1] == port_of(second[0].generation.endpoint)
    # The loser of generation 2's race (if it proposed at all) let its socket go.
    assert [s for s in sockets if s.fileno() != -1] == [held]
    hosting.close_listener()  # the generation ended here (bootstrap/generations.py)
    assert held.fileno() == -1
    hosting.close_listener()  # twice is fine
    third = hosting.join(2)
    assert third.is_host and hosting.listener(third.generation) is sockets[-1]
    hosting.leave()  # the node leaves: its socket goes with its file
    assert sockets[-1].fileno() == -1 and hosting.listener(third.generation) is None


def test_a_lost_proposal_closes_its_socket(s3: Any, node: NodeFactory, sockets: list[socket.socket]) -> None:
    first = node("i-a")
    first.join(None)
    node("i-b").join(None)
    first.close_listener()  # generation 1 is over
    shared = SharedS3(s3, race=2)  # both read generation 1 before either writes: one proposal loses
    members = join_together([node("i-a", shared), node("i-b", shared)], 1)
    assert shared.conflicts == 1 and len(sockets) == 3, "generation 1's socket, then one per proposal"
    winner = next(m for m in members if m.is_host)
    open_now = [s for s in sockets if s.fileno() != -1]
    assert len(open_now) == 1 and open_now[0].getsockname()[1] == port_of(winner.generation.endpoint)


def test_a_generation_of_this_node_whose_socket_is_gone_is_dead(s3: Any, node: NodeFactory) -> None:
    """The store can only be served on the socket that was published: once it is closed (the generation
    ended here, or the join that proposed it failed), the record is replaced, not joined."""
    a = node("i-a")
    first = a.join(None)
    a.close_listener()
    assert a.join(None).generation.number == first.generation.number + 1


def test_the_join_that_fails_closes_its_socket(
    s3: Any, node: NodeFactory, sockets: list[socket.socket]
) -> None:
    class Refused(SharedS3):
        def put_object(self, **kwargs: Any) -> Any:
            if kwargs["Key"].endswith(RECORD):
                raise refused("ConditionalRequestConflict", 409)
            return super().put_object(**kwargs)

    with pytest.raises(RuntimeError):
        node("i-a", Refused(s3), attempts=2).join(None)
    assert len(sockets) == 1 and sockets[0].fileno() == -1, "one socket for the join's proposals, closed"


_PORT_PICKER = re.compile(r"(free|unused|available|spare)_port", re.IGNORECASE)


def _calls(node: ast.AST, owner: str, method: str) -> list[ast.Call]:
    """The calls `owner.method(...)` under `node`."""
    return [
        call
        for call in ast.walk(node)
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == method
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id == owner
    ]


def _binds_port_zero(call: ast.Call) -> bool:
    address = call.args[0] if call.args else None
    return (
        isinstance(address, ast.Tuple)
        and len(address.elts) >= 2
        and isinstance(address.elts[1], ast.Constant)
        and address.elts[1].value == 0
    )


def bind_close_reuse(source: str) -> list[str]:
    """The functions in `source` that pick a port by binding port 0, closing the socket and handing the
    number on (another process can take the port in between; issue 27). Caught: a function named like
    `free_port`/`unused_port`/`available_port`; one whose socket X is bound to port 0 (`X.bind((host, 0))`),
    closed in the function (the target of a `with`, or `X.close()`), and whose return value is
    `X.getsockname()` or a name assigned from it. Not caught (and not a race): a socket returned or kept
    open while its port is used, as `listen()` above and the tests' reservations do."""
    found = []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if _PORT_PICKER.search(function.name):
            found.append(function.name)
            continue
        closed = {
            item.optional_vars.id
            for with_ in ast.walk(function)
            if isinstance(with_, ast.With)
            for item in with_.items
            if isinstance(item.optional_vars, ast.Name)
        }
        bound = {
            call.func.value.id
            for call in ast.walk(function)
            if isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "bind"
            and isinstance(call.func.value, ast.Name)
            and _binds_port_zero(call)
        }
        for name in bound:
            if name not in closed and not _calls(function, name, "close"):
                continue
            numbers = {name + ".getsockname"}
            for assign in ast.walk(function):
                if isinstance(assign, ast.Assign) and _calls(assign.value, name, "getsockname"):
                    numbers |= {target.id for target in assign.targets if isinstance(target, ast.Name)}
            for returned in ast.walk(function):
                if not isinstance(returned, ast.Return) or returned.value is None:
                    continue
                names = {n.id for n in ast.walk(returned.value) if isinstance(n, ast.Name)}
                if _calls(returned.value, name, "getsockname") or names & numbers:
                    found.append(function.name)
                    break
    return found


def test_the_guard_catches_a_port_picked_by_binding_closing_and_binding_again() -> None:
    """The guard below is only as good as its detector: each way of handing on a closed socket's port is
    caught, and keeping the socket (returning it, using the port inside its `with`) is not."""
    racy = {
        "named": "def free_port():\n    return 1\n",
        "returned_from_with": (
            "def pick():\n    with socket.socket() as s:\n        s.bind(('127.0.0.1', 0))\n"
            "        return int(s.getsockname()[1])\n"
        ),
        "assigned_in_with": (
            "def pick():\n    with socket.socket() as s:\n        s.bind(('', 0))\n"
            "        port = s.getsockname()[1]\n    return port\n"
        ),
        "closed_by_hand": (
            "def pick():\n    s = socket.socket()\n    s.bind((HOST, 0))\n    port = s.getsockname()[1]\n"
            "    s.close()\n    return port\n"
        ),
    }
    for case, source in racy.items():
        assert bind_close_reuse(source), case
    held = {
        "socket_returned": (
            "def reserve():\n    s = socket.socket()\n    s.bind(('127.0.0.1', 0))\n    return s\n"
        ),
        "used_inside_with": (
            "def test():\n    with socket.socket() as s:\n        s.bind(('127.0.0.1', 0))\n"
            "        run(s.getsockname()[1])\n"
        ),
        "closed_only_on_error": (
            "def listen():\n    s = socket.socket()\n    try:\n        s.bind(('127.0.0.1', 0))\n"
            "    except BaseException:\n        s.close()\n        raise\n    return s\n"
        ),
    }
    for case, source in held.items():
        assert bind_close_reuse(source) == [], case


def test_no_code_picks_a_port_by_binding_closing_and_binding_again() -> None:
    """Guard over the product and the tests: no port is picked by binding port 0, closing the socket and
    handing the number on (`bind_close_reuse` says what is caught); listeners bind port 0 and keep the
    socket, tests hold a reserved port's socket for as long as they use the number."""
    root = Path(__file__).resolve().parents[2]
    folders = [
        *("bootstrap", "training", "trainstack_job", "trainstack", "demo", "infra", "bench", "examples"),
        "tests",
    ]
    found = []
    for folder in folders:
        for where, dirs, files in os.walk(root / folder):
            dirs[:] = [d for d in dirs if d not in {"out", "__pycache__"}]  # bench/out: copies of old runs
            for file in (Path(where, f) for f in files if f.endswith(".py")):
                text = file.read_text()
                if ".bind(" in text or "_port" in text:  # (parsing only these keeps the guard fast)
                    found += [f"{file.relative_to(root)}: {name}" for name in bind_close_reuse(text)]
    assert found == []
    assert not hasattr(rendezvous_module, "free_port")

"""Multi-node checkpoint commits fenced by generation (bootstrap/generation_fence.py, bootstrap/persist.py)
against the moto server: a node whose generation the others declared lost (frozen, cut off, then healed)
never moves `latest.json` to its step, leaves no step of its own confirmed, says why once, and ends its life;
the new generation's commits go on below that step; the token follows the node into later generations; a
`latest.json` of a lease, of an unfenced writer or of an older agent never blocks a generation, nor the other
way round; and a record S3 cannot hand over is "unknown", never "superseded". In-process persisters only;
at the end, the fence alone against a record held in memory."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import boto3
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from bootstrap.agent_config import AgentConfig
from bootstrap.eventlog import EventLog
from bootstrap.generation_fence import LATEST_KEY as LATEST_FIELD
from bootstrap.generation_fence import GenerationFence, GenerationSupersededError
from bootstrap.generations import Generations
from bootstrap.lease import JobLease, LeaseLostError
from bootstrap.multinode import NodeGroup
from bootstrap.outcomes import LifeEnd, LifeFacts, Outcomes
from bootstrap.persist import CheckpointPersister, PersistResult
from bootstrap.rendezvous import RECORD, Generation, Membership, Rendezvous
from bootstrap.stops import STOP_OUTCOMES, StopRequests
from bootstrap.supervisor import Supervisor
from bootstrap.trainer import TrainerPaths, TrainerProcess
from tests.bootstrap.test_fencing import Events
from tests.checkpoints import commit_step
from tests.conftest import MotoServer
from trainstack_job.contract import NodeExit

BUCKET = "trainstack-genfence"
JOB = "jobs/multi-1a2b3c4d/"
PREFIX = f"{JOB}checkpoints"
STATE = f"{JOB}state/"
LATEST_KEY = f"{PREFIX}/latest.json"
RECORD_KEY = f"{STATE}{RECORD}"
T0 = 1_800_000_000.0
GONE = "no longer writes the job's checkpoints"


@pytest.fixture()
def s3(aws: MotoServer) -> Any:
    client = boto3.client("s3", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    return client


def record(s3: Any, number: int, host: str) -> None:
    """The generation record as a join leaves it (bootstrap/rendezvous.py writes it conditionally)."""
    generation = Generation(number, host, "10.0.0.1:29400", f"demo-g{number}", T0, 1, 3)
    s3.put_object(Bucket=BUCKET, Key=RECORD_KEY, Body=json.dumps(generation.to_record()).encode())


def fence(s3: Any, instance_id: str, generation: int | None = None) -> GenerationFence:
    made = GenerationFence(s3, BUCKET, STATE, instance_id=instance_id)
    if generation is not None:
        made.enter(generation)
    return made


def node(
    s3: Any,
    root: Path,
    gate: GenerationFence | None,
    events: Events | None = None,
    on_lost: Callable[[LeaseLostError], None] | None = None,
) -> CheckpointPersister:
    root.mkdir(parents=True, exist_ok=True)
    return CheckpointPersister(
        s3, BUCKET, PREFIX, root, events or Events(), poll_seconds=0.05, fence=gate, on_lease_lost=on_lost
    )


def keys(s3: Any, under: str = PREFIX) -> set[str]:
    return {item["Key"] for item in s3.list_objects_v2(Bucket=BUCKET, Prefix=under).get("Contents", [])}


def latest(s3: Any) -> dict[str, Any]:
    return dict(json.loads(s3.get_object(Bucket=BUCKET, Key=LATEST_KEY)["Body"].read()))


def soon() -> float:
    return time.monotonic() + 20


def zombie_with_step_30(
    s3: Any, tmp_path: Path, events: Events, lost: list[LeaseLostError]
) -> CheckpointPersister:
    """Node i-a hosted generation 1 and confirmed step 20; it saved step 30 and froze before uploading it."""
    record(s3, 1, "i-a")
    zombie = node(s3, tmp_path / "a", fence(s3, "i-a", 1), events, lost.append)
    commit_step(tmp_path / "a", 20)
    assert zombie.persist_newest(soon()) == 20
    assert (latest(s3)["step"], latest(s3)["generation"]) == (20, 1)
    commit_step(tmp_path / "a", 30)
    return zombie


def survivors_go_on(s3: Any, root: Path, steps: list[int]) -> CheckpointPersister:
    """The survivors declared generation 1 lost: i-b hosts generation 2, restores step 20 and trains on."""
    record(s3, 2, "i-b")
    survivor = node(s3, root, fence(s3, "i-b", 2))
    assert survivor.restore() == 20
    for step in steps:
        commit_step(root, step)
        assert survivor.persist_newest(soon()) == step
    return survivor


# -- (a) the zombie of generation 1 --------------------------------------------------------------------


def test_a_healed_node_of_a_lost_generation_uploads_nothing_and_ends_saying_why(
    s3: Any, tmp_path: Path
) -> None:
    events, lost = Events(), list[LeaseLostError]()
    zombie = zombie_with_step_30(s3, tmp_path, events, lost)
    survivors_go_on(s3, tmp_path / "b", [23])
    before = keys(s3)
    # It thaws: its uploads resume where they stopped.
    with pytest.raises(GenerationSupersededError):
        zombie.persist_newest(soon())
    assert keys(s3) == before, "the lost generation's step reached S3"
    assert (latest(s3)["step"], latest(s3)["generation"]) == (23, 2)
    assert [(e.generation, e.newer) for e in lost if isinstance(e, GenerationSupersededError)] == [(1, 2)]
    assert len(lost) == 1
    said = "generation 2 owns the job (this node trained in generation 1): this node " + GONE
    assert events.messages(GONE) == [said]
    # For good: no later call writes or checks again, and the end is reported as not confirmed, truthfully.
    with pytest.raises(GenerationSupersededError):
        zombie.persist_newest(soon())
    result = zombie.finish(soon())
    assert result.lease_lost and not result.confirmed
    assert (result.newest_local_step, result.confirmed_step) == (30, 20)
    assert events.messages("NOT confirmed: a newer generation owns the job") != []
    assert keys(s3) == before and len(lost) == 1
    # A node arriving now restores generation 2's lineage, never step 30.
    assert node(s3, tmp_path / "c", None).restore() == 23


def test_a_node_that_froze_mid_upload_leaves_no_step_of_its_own_confirmed(s3: Any, tmp_path: Path) -> None:
    events, lost = Events(), list[LeaseLostError]()
    record(s3, 1, "i-a")
    commit_step(tmp_path / "a", 20)
    node(s3, tmp_path / "a", fence(s3, "i-a", 1)).persist_newest(soon())
    commit_step(tmp_path / "a", 30)
    checks = 0

    class FrozenAfterItsFiles(GenerationFence):
        def check(self) -> Generation | None:
            nonlocal checks
            checks += 1
            if checks == 2:  # its files are up; it froze before the manifest, and the others went on
                survivors_go_on(s3, tmp_path / "b", [23])
            return super().check()

    gate = FrozenAfterItsFiles(s3, BUCKET, STATE, instance_id="i-a")
    gate.enter(1)
    zombie = node(s3, tmp_path / "a", gate, events, lost.append)
    with pytest.raises(GenerationSupersededError):
        zombie.persist_newest(soon())
    assert f"{PREFIX}/step-30/state.bin" in keys(s3), "the story needs the zombie's files in S3"
    assert f"{PREFIX}/step-30/manifest.json" not in keys(s3), "an unconfirmed step got its commit marker"
    assert (latest(s3)["step"], latest(s3)["generation"]) == (23, 2)
    assert node(s3, tmp_path / "c", None).restore() == 23
    assert len(lost) == 1


def test_latest_json_keeps_out_a_node_whose_last_check_passed_just_before_the_others_went_on(
    s3: Any, tmp_path: Path
) -> None:
    events, lost = Events(), list[LeaseLostError]()
    zombie_with_step_30(s3, tmp_path, events, lost)
    checks = 0

    class FrozenAfterItsLastCheck(GenerationFence):
        def check(self) -> Generation | None:
            nonlocal checks
            checks += 1
            seen = super().check()
            if checks == 3:  # the check before latest.json passed; then it froze, and the others went on
                survivors_go_on(s3, tmp_path / "b", [23])
            return seen

    gate = FrozenAfterItsLastCheck(s3, BUCKET, STATE, instance_id="i-a")
    gate.enter(1)
    zombie = node(s3, tmp_path / "a", gate, events, lost.append)
    with pytest.raises(GenerationSupersededError) as raised:
        zombie.persist_newest(soon())
    assert (raised.value.generation, raised.value.newer) == (1, 2)
    assert (latest(s3)["step"], latest(s3)["generation"]) == (23, 2)
    assert zombie.confirmed_step is None
    assert events.messages(GONE) == [
        f"generation 2 owns the job (this node trained in generation 1): this node {GONE}"
    ]


# -- (b) the new generation commits below the zombie's step --------------------------------------------


def test_the_new_generation_commits_below_a_step_the_lost_one_slipped_into_latest(
    s3: Any, tmp_path: Path
) -> None:
    events, lost = Events(), list[LeaseLostError]()
    zombie = zombie_with_step_30(s3, tmp_path, events, lost)
    record(s3, 2, "i-b")
    survivor = node(s3, tmp_path / "b", fence(s3, "i-b", 2))
    assert survivor.restore() == 20

    # The worst race: the zombie's last check came just before the others went on (the gap between a
    # check and a write that no fence closes), and its put of latest.json landed before generation 2's
    # first commit.
    class PassedJustBefore(GenerationFence):
        def check(self) -> Generation | None:
            return None  # what it read an instant before the others went on

    gate = PassedJustBefore(s3, BUCKET, STATE, instance_id="i-a")
    gate.enter(1)
    stale = node(s3, tmp_path / "a", gate)
    assert stale.persist_newest(soon()) == 30
    assert (latest(s3)["step"], latest(s3)["generation"]) == (30, 1)
    for step in (23, 26):
        commit_step(tmp_path / "b", step)
        assert survivor.persist_newest(soon()) == step
        assert (latest(s3)["step"], latest(s3)["generation"]) == (step, 2)
    assert survivor.lease_lost is None
    # The zombie's next step is refused, and generation 2's lineage is what a new node restores.
    commit_step(tmp_path / "a", 33)
    with pytest.raises(GenerationSupersededError):
        zombie.persist_newest(soon())
    assert f"{PREFIX}/step-33/manifest.json" not in keys(s3)
    assert (latest(s3)["step"], latest(s3)["generation"]) == (26, 2)
    assert node(s3, tmp_path / "c", None).restore() == 26


def test_generation_2_commits_every_step_below_the_refused_one(s3: Any, tmp_path: Path) -> None:
    events, lost = Events(), list[LeaseLostError]()
    zombie = zombie_with_step_30(s3, tmp_path, events, lost)
    survivor = survivors_go_on(s3, tmp_path / "b", [23])
    with pytest.raises(GenerationSupersededError):
        zombie.persist_newest(soon())
    for step in (26, 29):
        commit_step(tmp_path / "b", step)
        assert survivor.persist_newest(soon()) == step
    assert (latest(s3)["step"], latest(s3)["generation"]) == (29, 2)
    assert survivor.finish(soon()).confirmed


# -- (c) the token follows the node into later generations ---------------------------------------------


def test_a_node_joining_generation_3_in_the_same_life_commits_with_the_new_token(
    s3: Any, tmp_path: Path
) -> None:
    record(s3, 2, "i-b")
    gate = fence(s3, "i-c", 2)
    member = node(s3, tmp_path / "c", gate)
    commit_step(tmp_path / "c", 23)
    assert member.persist_newest(soon()) == 23
    assert (latest(s3)["step"], latest(s3)["generation"]) == (23, 2)
    # Generation 2 ends; i-b proposes 3 and this node joins it: Generations.train enters it before launching.
    record(s3, 3, "i-b")
    gate.enter(3)
    gate.enter(2)  # a stale caller never lowers it
    assert gate.token == 3
    commit_step(tmp_path / "c", 26)
    assert member.persist_newest(soon()) == 26
    assert (latest(s3)["step"], latest(s3)["generation"]) == (26, 3)
    assert json.loads((tmp_path / "c" / "latest.json").read_text())["generation"] == 3
    # A generation-2 writer that never joined 3 is now refused.
    stale = node(s3, tmp_path / "d", fence(s3, "i-d", 2))
    commit_step(tmp_path / "d", 40)
    with pytest.raises(GenerationSupersededError):
        stale.persist_newest(soon())
    assert latest(s3)["step"] == 26


def test_a_node_is_not_fenced_by_its_own_proposal_before_it_enters_it(s3: Any, tmp_path: Path) -> None:
    """The instant between a node's proposal of the next generation and `enter`: its upload goes on."""
    rendezvous = Rendezvous(
        s3,
        BUCKET,
        STATE,
        instance_id="i-a",
        address="127.0.0.1",
        stack="demo",
        min_nodes=1,
        max_nodes=2,
        stale_seconds=60.0,
    )
    first = rendezvous.join(None)
    gate = fence(s3, "i-a", first.generation.number)
    second = rendezvous.join(first.generation.number)  # this node hosts the next one
    rendezvous.close_listener()
    assert (second.is_host, second.generation.number) == (True, first.generation.number + 1)
    assert gate.token == first.generation.number
    member = node(s3, tmp_path / "a", gate)
    commit_step(tmp_path / "a", 5)
    assert member.persist_newest(soon()) == 5
    assert latest(s3)["generation"] == first.generation.number


def test_before_its_first_join_a_node_takes_the_generation_the_record_names(s3: Any, tmp_path: Path) -> None:
    gate = fence(s3, "i-a")
    assert gate.token == 0
    record(s3, 4, "i-b")
    assert gate.check() is not None and gate.token == 4
    record(s3, 5, "i-b")
    with pytest.raises(GenerationSupersededError, match=r"generation 5 owns the job \(this node trained in "):
        gate.check()


# -- (d) the other writers: unfenced, older agents, the single-node lease -------------------------------


@pytest.mark.parametrize(
    "before",
    [
        {"step": 40, "dir": "step-40"},  # an older agent's, or an unfenced writer's: no token at all
        {"step": 40, "dir": "step-40", "token": 7},  # the single-node lease's token 7 counts acquisitions
    ],
    ids=["without-token", "lease-token"],
)
def test_a_latest_json_without_a_generation_is_an_earlier_writers_and_replaced(
    s3: Any, tmp_path: Path, before: dict[str, Any]
) -> None:
    s3.put_object(Bucket=BUCKET, Key=LATEST_KEY, Body=json.dumps(before).encode())
    record(s3, 1, "i-a")
    member = node(s3, tmp_path / "a", fence(s3, "i-a", 1))
    commit_step(tmp_path / "a", 3, epoch=2)
    assert member.persist_newest(soon()) == 3
    # Everything the job's own readers take from it (step, epoch, folder), and the generation beside them.
    assert {k: latest(s3)[k] for k in ("step", "epoch", "dir", "generation")} == {
        "step": 3,
        "epoch": 2,
        "dir": "step-3",
        "generation": 1,
    }
    assert "token" not in latest(s3)


def test_a_newer_generation_found_in_latest_json_alone_is_a_loss_named_at_latest_json(
    s3: Any, tmp_path: Path
) -> None:
    """The record names nothing newer (absent here; damaged or deleted by hand in life), but `latest.json`
    carries a newer generation: that alone keeps this node out, and the loss names the object that showed
    it."""
    newer = {"step": 10, "dir": "step-10", "generation": 5}
    s3.put_object(Bucket=BUCKET, Key=LATEST_KEY, Body=json.dumps(newer).encode())
    events, lost = Events(), list[LeaseLostError]()
    member = node(s3, tmp_path / "a", fence(s3, "i-a", 1), events, lost.append)
    commit_step(tmp_path / "a", 3)
    with pytest.raises(GenerationSupersededError) as raised:
        member.persist_newest(soon())
    assert (raised.value.generation, raised.value.newer) == (1, 5)
    assert raised.value.uri == f"s3://{BUCKET}/{LATEST_KEY}"
    assert (latest(s3)["step"], latest(s3)["generation"]) == (10, 5)
    assert member.confirmed_step is None and lost == [raised.value]


def test_generation_numbers_never_reach_the_lease_and_its_tokens_never_reach_a_generation(
    s3: Any, tmp_path: Path
) -> None:
    # The job trained on several nodes up to generation 9; then it runs on one, under the lease.
    record(s3, 9, "i-a")
    multi = node(s3, tmp_path / "a", fence(s3, "i-a", 9))
    commit_step(tmp_path / "a", 50)
    multi.persist_newest(soon())
    unfenced = node(s3, tmp_path / "probe", None)
    assert unfenced.latest_token() is None, "a generation number must not raise the lease's floor"
    lease = JobLease(s3, BUCKET, f"{STATE}lease.json", holder="i-s", life_id="i-s@life")
    assert lease.try_acquire(T0, floor=unfenced.latest_token() or 0) == 1
    (tmp_path / "s").mkdir()
    single = CheckpointPersister(s3, BUCKET, PREFIX, tmp_path / "s", Events(), fence=lease)
    assert single.restore() == 50
    commit_step(tmp_path / "s", 51)
    assert single.persist_newest(soon()) == 51
    assert (latest(s3)["step"], latest(s3)["token"]) == (51, 1)
    # …and back to several nodes: generation 10's commits replace the lease's latest.json.
    record(s3, 10, "i-a")
    again = node(s3, tmp_path / "a", fence(s3, "i-a", 10))
    commit_step(tmp_path / "a", 52)
    assert again.persist_newest(soon()) == 52
    assert (latest(s3)["step"], latest(s3)["generation"]) == (52, 10)


def test_an_absent_or_damaged_record_names_no_newer_generation(s3: Any, tmp_path: Path) -> None:
    gate = fence(s3, "i-a", 3)
    assert gate.check() is None
    s3.put_object(Bucket=BUCKET, Key=RECORD_KEY, Body=b"{not json")
    assert gate.check() is None
    member = node(s3, tmp_path / "a", gate)
    commit_step(tmp_path / "a", 7)
    assert member.persist_newest(soon()) == 7
    # latest.json's own generation still keeps an older writer out when the record cannot say.
    older = node(s3, tmp_path / "b", fence(s3, "i-b", 2))
    commit_step(tmp_path / "b", 9)
    with pytest.raises(GenerationSupersededError, match="generation 3 owns the job"):
        older.persist_newest(soon())
    assert latest(s3)["step"] == 7


# -- (e) S3 errors are "unknown", never "superseded" ----------------------------------------------------


class FlakyRecord:
    """The S3 client, with reads of the generation record failing while `failure` is set."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.failure: Exception | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def get_object(self, **kwargs: Any) -> Any:
        if self.failure is not None and kwargs["Key"] == RECORD_KEY:
            raise self.failure
        return self._client.get_object(**kwargs)


def client_error(code: str, status: int) -> ClientError:
    response: dict[str, Any] = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(response, "GetObject")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "failure",
    [
        EndpointConnectionError(endpoint_url="https://s3.amazonaws.com"),
        client_error("SlowDown", 503),
        client_error("AccessDenied", 403),
    ],
    ids=["unreachable", "throttled", "denied"],
)
def test_a_record_that_cannot_be_read_is_unknown_not_lost_and_nothing_is_written_unchecked(
    s3: Any, tmp_path: Path, failure: Exception
) -> None:
    record(s3, 1, "i-a")
    flaky = FlakyRecord(s3)
    events, lost = Events(), list[LeaseLostError]()
    member = node(flaky, tmp_path / "a", fence(flaky, "i-a", 1), events, lost.append)
    commit_step(tmp_path / "a", 3)
    flaky.failure = failure
    with pytest.raises(type(failure)):
        member.persist_newest(soon())
    assert keys(s3) == set(), "a step was written without its fence check"
    assert member.lease_lost is None and lost == [] and events.messages(GONE) == []
    # S3 back, generation unchanged: the same step goes up.
    flaky.failure = None
    assert member.persist_newest(soon()) == 3
    assert (latest(s3)["step"], latest(s3)["generation"]) == (3, 1)


def test_the_background_uploads_retry_through_an_outage_and_then_stop_at_the_newer_generation(
    s3: Any, tmp_path: Path
) -> None:
    record(s3, 1, "i-a")
    flaky = FlakyRecord(s3)
    flaky.failure = client_error("InternalError", 500)
    events, lost = Events(), list[LeaseLostError]()
    member = node(flaky, tmp_path / "a", fence(flaky, "i-a", 1), events, lost.append)
    commit_step(tmp_path / "a", 30)
    member.start()
    deadline = time.monotonic() + 10
    while not events.messages("checkpoint upload failed"):
        assert time.monotonic() < deadline, "the outage was never reported"
        time.sleep(0.02)
    assert member.lease_lost is None and keys(s3) == set()
    record(s3, 2, "i-b")  # the others went on while this node could not read
    flaky.failure = None
    deadline = time.monotonic() + 20
    while member.lease_lost is None:
        assert time.monotonic() < deadline, "the fence was never found superseded"
        time.sleep(0.02)
    result = member.finish(soon())
    member.close()
    assert result.lease_lost and keys(s3) == set() and len(lost) == 1


# -- what the node does: its life ends, and its stop line says why --------------------------------------


class Generation2Owns:
    """`Generations` with what `_superseded` and `job_checkpoint_confirmed` use (no trainer, no ledger)."""

    def __init__(self, s3: Any, tmp_path: Path, gate: GenerationFence) -> None:
        self.out = io.StringIO()
        self.log = EventLog(self.out)
        self.stops = StopRequests(self.log, 30.0)
        rendezvous = Rendezvous(
            s3,
            BUCKET,
            STATE,
            instance_id=gate.instance_id,
            address="127.0.0.1",
            stack="demo",
            min_nodes=1,
            max_nodes=2,
            stale_seconds=60.0,
        )
        nodes = NodeGroup(rendezvous, min_nodes=1, max_nodes=2, exit_file=tmp_path / "exit.json", address="x")
        self.generations = Generations(
            cast(Any, None),
            self.log,
            self.stops,
            cast(Any, None),
            cast(Any, None),
            nodes,
            poll_seconds=0.5,
            fence=gate,
        )

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.out.getvalue().splitlines()]


def test_a_node_holding_an_unconfirmed_step_of_a_replaced_generation_ends_instead_of_regrouping(
    s3: Any, tmp_path: Path
) -> None:
    events, lost = Events(), list[LeaseLostError]()
    zombie = zombie_with_step_30(s3, tmp_path, events, lost)
    gate = fence(s3, "i-a", 1)
    agent = Generation2Owns(s3, tmp_path, gate)
    # Its generation was lost but nobody replaced it yet: it regroups with its step, like any survivor.
    assert agent.generations._superseded(zombie) is False
    assert agent.stops.reason is None
    record(s3, 2, "i-b")
    assert agent.generations._superseded(zombie) is True
    assert agent.stops.reason == "generation_superseded"
    assert STOP_OUTCOMES["generation_superseded"] is LifeEnd.SUPERSEDED
    said = [line for line in agent.lines() if line["stage"] == "rendezvous"]
    assert said[-1]["message"] == (
        "generation 2 owns the job: step 30 saved here in generation 1 is NOT confirmed and is not the "
        "job's; ending this life"
    )
    stop = [line for line in agent.lines() if line["stage"] == "stop"]
    assert [(s["reason"], s["generation"], s["newer_generation"]) for s in stop] == [
        ("generation_superseded", 1, 2)
    ]
    # What the life reports at its end stays "not confirmed", whatever the node exit record says.
    # (Its ranks' record names a common step from another node's rank 0: still not this node's to claim.)
    NodeExit(75, stopped_step=30, rank0_here=False).write(tmp_path / "exit.json")
    ended = PersistResult(30, 20, lease_lost=True)
    assert agent.generations.job_checkpoint_confirmed(ended, zombie, time.monotonic() + 0.2) is ended


def test_a_survivor_with_nothing_unconfirmed_regroups_into_the_newer_generation(
    s3: Any, tmp_path: Path
) -> None:
    record(s3, 1, "i-a")
    commit_step(tmp_path / "a", 20)
    node(s3, tmp_path / "a", fence(s3, "i-a", 1)).persist_newest(soon())
    gate = fence(s3, "i-b", 1)
    survivor = node(s3, tmp_path / "b", gate)
    assert survivor.restore() == 20
    record(s3, 2, "i-c")
    agent = Generation2Owns(s3, tmp_path, gate)
    assert agent.generations._superseded(survivor) is False
    assert agent.stops.reason is None


def test_a_fence_check_that_fails_at_the_regroup_is_no_finding(s3: Any, tmp_path: Path) -> None:
    events, lost = Events(), list[LeaseLostError]()
    zombie = zombie_with_step_30(s3, tmp_path, events, lost)
    flaky = FlakyRecord(s3)
    flaky.failure = client_error("SlowDown", 503)
    agent = Generation2Owns(s3, tmp_path, fence(flaky, "i-a", 1))
    assert agent.generations._superseded(zombie) is False
    assert agent.stops.reason is None
    assert "cannot read the generation record; regrouping" in agent.out.getvalue()


class OneGeneration:
    """NodeGroup as `Generations.train` uses it: generation `number` hosted here, ending as `ended` says."""

    min_nodes, max_nodes = 1, 2

    def __init__(self, number: int, ended: NodeExit, rendezvous: Any) -> None:
        self.number, self.ended, self.rendezvous = number, ended, rendezvous
        self.joins = 0
        self.last_generation: int | None = None

    def join(self) -> Membership:
        self.joins += 1
        self.last_generation = self.number + self.joins - 1
        generation = Generation(self.last_generation, "i-a", "127.0.0.1:1", "demo", T0, 1, 2)
        return Membership(generation, True)

    def trainer_env(self, membership: Membership) -> dict[str, str]:
        return {}

    def end_generation(self) -> None:
        pass

    def node_exit(self) -> NodeExit:
        return self.ended


class FrozenThenHealed:
    """The supervisor of a generation during which this node froze and the others went on without it."""

    def __init__(self, during: Callable[[], None]) -> None:
        self.during = during

    def supervise(self, trainer: Any, persister: Any, *, watch_silent: bool) -> int:
        self.during()
        return 1  # its ranks' peers are gone: the launcher exits 1 after training


class IdleTrainer:
    def __init__(self) -> None:
        self.stop_requests = 0

    def update_env(self, env: dict[str, str]) -> None:
        pass

    def start(self) -> None:
        pass

    def request_stop(self) -> None:
        self.stop_requests += 1


def test_generations_train_enters_each_generation_and_a_replaced_node_ends_its_life_instead_of_regrouping(
    s3: Any, tmp_path: Path
) -> None:
    events, lost = Events(), list[LeaseLostError]()
    record(s3, 1, "i-a")
    commit_step(tmp_path / "earlier", 20)
    node(s3, tmp_path / "earlier", fence(s3, "i-x", 1)).persist_newest(soon())
    gate = fence(s3, "i-a")  # this node's life begins: no generation yet
    zombie = node(s3, tmp_path / "a", gate, events, lost.append)
    assert zombie.restore() == 20 and gate.token == 0

    def frozen_at_step_31() -> None:
        assert gate.token == 1, "the generation was not entered before its trainer started"
        commit_step(tmp_path / "a", 30)  # saved, not uploaded: then frozen while the others went on
        survivors_go_on(s3, tmp_path / "b", [23])

    out = io.StringIO()
    log = EventLog(out)
    stops = StopRequests(log, 30.0)
    nodes = OneGeneration(1, NodeExit(1, trained=True, ended_by="the store is gone"), None)
    generations = Generations(
        cast(Any, None),
        log,
        stops,
        cast(Any, type("Job", (), {"record": lambda self, change: True})()),
        cast(Any, FrozenThenHealed(frozen_at_step_31)),
        cast(Any, nodes),
        poll_seconds=0.5,
        fence=gate,
    )
    trainer = IdleTrainer()
    assert generations.train(cast(Any, trainer), zombie, restored=20) == 1
    assert nodes.joins == 1, "the replaced node regrouped, carrying step 30 into the next generation"
    assert stops.reason == "generation_superseded"
    assert "generation lost without a stop" not in out.getvalue()
    # Its final flush then finds the same, says it once, and writes nothing.
    result = zombie.finish(soon())
    assert result.lease_lost and not result.confirmed
    assert f"{PREFIX}/step-30/state.bin" not in keys(s3)
    assert (latest(s3)["step"], latest(s3)["generation"]) == (23, 2)
    assert len(events.messages(GONE)) == 1


@pytest.mark.parametrize("code", [1, 75, -9])
def test_the_stop_line_says_the_step_was_not_confirmed_because_a_newer_generation_owns_the_job(
    tmp_path: Path, code: int
) -> None:
    out = io.StringIO()
    log = EventLog(out)
    stops = StopRequests(log, deadline_seconds=100)
    stops.request("generation_superseded", generation=1, newer_generation=2)
    config = AgentConfig(region="us-east-1", bucket="b", group_name="g", topic_arn="arn:t", log_group="/l")
    supervisor = Supervisor(
        config, log, stops, user_job=None, job_root=tmp_path, trainer_command=None, tick_seconds=0.1
    )
    trainer = TrainerProcess(["true"], TrainerPaths(tmp_path), {}, lambda _: None)
    persisted = PersistResult(30, 20, lease_lost=True)
    assert supervisor.classify_exit(code, "generation_superseded", persisted, trainer) is LifeEnd.SUPERSEDED
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    (line,) = [entry for entry in lines if entry["stage"] == "stop" and entry["message"] != "stop requested"]
    assert line["message"] == (
        "checkpoint step 30 NOT confirmed: a newer generation owns the job and trains on from the confirmed "
        "one; the confirmed checkpoint (step 20) is kept"
    )
    assert (line["checkpoint_confirmed"], line["reason"]) == (False, "generation_superseded")


@pytest.mark.parametrize(
    ("instance_count", "said"),
    [
        (2, "superseded: a newer generation owns the job; this node stopped writing"),
        (1, "superseded: another instance holds the lease; this one stopped writing"),
    ],
)
def test_the_end_line_of_a_superseded_life_names_what_superseded_it(instance_count: int, said: str) -> None:
    out = io.StringIO()
    log = EventLog(out)
    ended: list[Any] = []

    class Job:
        def record(self, change: Callable[[Any], None]) -> bool:
            ended.append(change)
            return True

    job = Job()
    fleet = type("Fleet", (), {"leave": lambda self, instance_id, *, instance_count: False})()
    config = AgentConfig(
        region="us-east-1",
        bucket="b",
        group_name="g",
        topic_arn="arn:t",
        log_group="/l",
        instance_count=instance_count,
    )
    outcomes = Outcomes(
        config,
        log,
        cast(Any, job),
        None,
        cast(Any, fleet),
        cast(Any, None),
        cast(Any, None),
        builtin_trainer=True,
        release_wait_seconds=0.0,
    )
    identity = cast(Any, type("Identity", (), {"instance_id": "i-a"})())
    result = outcomes.one_writer_end(LifeEnd.SUPERSEDED, LifeFacts(identity, "training", None))
    assert result.outcome is LifeEnd.SUPERSEDED and result.exit_code == 0 and len(ended) == 1
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["message"] for line in lines if line["stage"] == "end"] == [said]


# -- the fence alone, in memory: a superseded node's error, S3's answers, the token before a first join ---


RECORD_URI = f"s3://{BUCKET}/{RECORD_KEY}"
ME = "i-0aaaaaaaaaaaaaaaa"
OTHER = "i-0bbbbbbbbbbbbbbbb"


class RecordStore:
    """S3's GetObject of the generation record: a record, nothing (an S3 error code), or a refusal."""

    def __init__(self) -> None:
        self.body: bytes | None = None
        self.error: dict[str, Any] | None = None
        self.reads: list[tuple[str, str]] = []

    def put(self, number: int, host: str) -> None:
        generation = Generation(number, host, "10.0.0.1:29400", f"job-g{number}", T0, 1, 3)
        self.body = json.dumps(generation.to_record()).encode()

    def get_object(self, *, Bucket: str, Key: str) -> dict[str, Any]:  # noqa: N803 (boto3's names)
        self.reads.append((Bucket, Key))
        if self.error is not None:
            raise ClientError(self.error, "GetObject")  # type: ignore[arg-type]
        if self.body is None:
            raise ClientError({"Error": {"Code": "NoSuchKey"}}, "GetObject")
        return {"Body": io.BytesIO(self.body)}


@pytest.fixture()
def store() -> RecordStore:
    return RecordStore()


def test_a_superseded_node_is_told_which_generation_owns_the_job_where_and_that_it_stopped_writing(
    store: RecordStore,
) -> None:
    mine = fence(store, ME)
    mine.enter(2)
    store.put(3, OTHER)
    with pytest.raises(GenerationSupersededError) as raised:
        mine.check()
    error = raised.value
    assert store.reads == [(BUCKET, f"{STATE}{RECORD}")]
    assert str(error) == (
        f"{RECORD_URI}: generation 3 owns the job (this node trained in generation 2): "
        "this node no longer writes the job's checkpoints"
    )
    assert (error.generation, error.newer) == (2, 3)
    # The lease's fields, which the persister's log and the stop request read for any lost fence.
    assert isinstance(error, LeaseLostError)
    assert (error.holder, error.token, error.uri) == ("generation 3", 3, RECORD_URI)
    assert error.lost_line == (
        "generation 3 owns the job (this node trained in generation 2): "
        "this node no longer writes the job's checkpoints"
    )
    assert "NOT confirmed" in error.not_confirmed_line and "declared lost" in error.not_confirmed_line


def test_an_error_made_without_a_place_names_none() -> None:
    error = GenerationSupersededError(4, 6)
    assert str(error) == (
        "generation 6 owns the job (this node trained in generation 4): "
        "this node no longer writes the job's checkpoints"
    )
    assert error.uri == ""


def test_a_newer_generation_in_latest_json_is_reported_with_this_nodes_generation_and_the_place(
    store: RecordStore,
) -> None:
    mine = fence(store, ME)
    mine.enter(5)
    latest = f"s3://{BUCKET}/jobs/multi-1a2b3c4d/checkpoints/latest.json"
    error = mine.superseded(7, latest)
    assert isinstance(error, GenerationSupersededError)
    assert (error.generation, error.newer, error.token, error.uri) == (5, 7, 7, latest)
    assert str(error).startswith(f"{latest}: generation 7 owns the job (this node trained in generation 5)")
    assert mine.latest_key == LATEST_FIELD == "generation"


@pytest.mark.parametrize("code", ["NoSuchKey", "404", "NotFound"])
def test_a_record_s3_does_not_have_names_no_generation(store: RecordStore, code: str) -> None:
    store.error = {"Error": {"Code": code}}
    assert fence(store, ME).current() is None


def test_an_answer_without_an_error_code_is_not_absent_and_is_raised() -> None:
    """(A refusal or a throttle with its code: test_generation_fence.py, against moto.) An answer without
    one (as a proxy may give) names no "not found" either: unknown, raised as S3 said."""
    store = RecordStore()
    store.error = {}
    with pytest.raises(ClientError):
        fence(store, ME).current()
    with pytest.raises(ClientError):
        fence(store, ME).check()


def test_before_its_first_join_a_node_without_a_record_has_no_generation_until_one_is_written(
    store: RecordStore,
) -> None:
    mine = fence(store, ME)
    assert mine.check() is None and mine.token == 0
    store.put(4, OTHER)
    # Still before its first join: the generation the record names now is the one it will join.
    checked = mine.check()
    assert checked is not None and checked.number == 4 and mine.token == 4
    store.put(5, OTHER)
    with pytest.raises(GenerationSupersededError):
        mine.check()


def test_a_lower_or_equal_generation_entered_changes_nothing_and_a_higher_one_raises_the_token(
    store: RecordStore,
) -> None:
    mine = fence(store, ME)
    mine.enter(3)
    mine.enter(2)
    assert mine.token == 3
    mine.enter(3)
    assert mine.token == 3
    mine.enter(4)
    assert mine.token == 4

"""bootstrap/phases/: a life's phases behind one interface, run in order until one ends the life, so a new
phase is a file and one entry in the list, never an edit of the life's class."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar, cast

import pytest

from bootstrap.datasync import DatasetVersionError, DiskSpaceError, SyncAborted
from bootstrap.eventlog import EventLog
from bootstrap.generation_fence import GenerationSupersededError
from bootstrap.imds import InstanceIdentity
from bootstrap.lease import LeaseExpiredError, LeaseLostError
from bootstrap.ledger import TERMINAL_STATUSES
from bootstrap.lifecycle import InstanceLife
from bootstrap.outcomes import Failure, LifeEnd
from bootstrap.persist import TOKEN_RECORD, CheckpointPersister, UploadAbandonedError
from bootstrap.phases import Ended, Life, life_phases, run_phases
from bootstrap.phases import data as data_phase
from bootstrap.phases import training as training_phase
from bootstrap.phases import workspace as workspace_phase
from bootstrap.phases import writer as writer_phase
from bootstrap.phases.data import Data
from bootstrap.phases.gpu import GpuCheck
from bootstrap.phases.training import FINAL_UPLOAD_SECONDS, Training, restore, train
from bootstrap.phases.workspace import Workspace
from bootstrap.phases.writer import (
    OneWriterRole,
    close_dead_holder,
    job_ended,
    lease_lost,
    leaving_before_binding,
    persister_for,
    protect_from_scale_in,
    take_role,
    wait_as_standby,
)
from bootstrap.standby import Role
from bootstrap.stops import StopRequests
from bootstrap.trainer import TrainerPaths, TrainerProcess
from demo.stack import LocalStack
from trainstack_job.contract import RESUME_COMMAND
from trainstack_job.jobfile import JobSpec, JobSpecError
from trainstack_job.jobs import JobPrefixes

MakeLife = Callable[..., InstanceLife]


class Step:
    """A phase that records its turn and ends the life or lets it go on."""

    def __init__(self, name: str, seen: list[str], end: Ended | None = None) -> None:
        self.name, self.seen, self.end = name, seen, end
        self.lives: list[Life] = []

    def run(self, life: Life) -> Ended | None:
        self.seen.append(self.name)
        self.lives.append(life)
        return self.end


def test_the_phases_run_in_order_until_one_ends_the_life() -> None:
    seen: list[str] = []
    life = cast(Life, object())
    phases = [Step("a", seen), Step("b", seen, LifeEnd.SURPLUS), Step("c", seen, LifeEnd.COMPLETED)]
    assert run_phases(life, phases) is LifeEnd.SURPLUS
    assert seen == ["a", "b"], "a phase after the end ran"
    assert [phase.lives for phase in phases] == [[life], [life], []], "a phase ran on another life"


def test_a_list_whose_last_phase_lets_the_life_go_on_is_a_bug_named_with_its_phases() -> None:
    seen: list[str] = []
    with pytest.raises(RuntimeError, match=r"no phase ended the life \(a, b\)"):
        run_phases(cast(Life, object()), [Step("a", seen), Step("b", seen)])
    assert seen == ["a", "b"]


def test_a_life_runs_the_gpu_check_scratch_one_writer_data_and_training_in_that_order() -> None:
    """The one writer is decided before the data sync: a surplus instance leaves before it syncs anything,
    a standby syncs the data while it waits."""
    assert [phase.name for phase in life_phases()] == [
        "gpu-check",
        "scratch",
        "one-writer",
        "data",
        "training",
    ]
    assert life_phases() is not life_phases()


def test_a_phase_added_to_one_lifes_list_runs_with_what_the_earlier_phases_set_up_and_its_end_is_the_lifes(
    make_life: MakeLife, stack: LocalStack
) -> None:
    seen: dict[str, Any] = {}

    class Check:
        name = "check"

        def run(self, life: Life) -> Ended | None:
            assert life.writer is not None and life.paths is not None
            seen.update(
                phase=life.phase, gpus=life.gpu_count, role=life.writer.role, scratch=life.paths.scratch
            )
            return Failure(LifeEnd.FAILED, "refused by a phase of its own", [], permanent=True)

    life = make_life(fake={"steps": 12})
    data = next(i for i, phase in enumerate(life.phases) if isinstance(phase, Data))
    life.phases.insert(data, Check())
    result = life.run()
    assert result.outcome is LifeEnd.GAVE_UP, "a permanent failure gives the job up at once"
    assert seen == {
        "phase": "gpu-check",
        "gpus": 0,
        "role": Role.HOLDER,
        "scratch": Path(str(life.config.scratch_dir)),
    }
    ledger = stack.read_json("state/ledger.json")
    assert ledger is not None and ledger["status"] == "failed"
    assert [life["outcome"] for life in ledger["lives"]] == ["failed"]
    (alert,) = stack.alerts()
    assert "training failed: refused by a phase of its own" in alert["Subject"]
    assert stack.read_json("state/progress.json") is None, "the data phase or the trainer ran after the end"


# -- each phase in-process, with a small fake life -----------------------------------------------------------

IDENTITY = InstanceIdentity("i-0123456789abcdef0", "g5.xlarge", "us-east-1a", "us-east-1", "spot")
DEFAULT_SPEC_FIX = f"fix the job's requirements file, run pulumi up, then {RESUME_COMMAND}"


class Ledger:
    """The ledger writes a phase makes, in order."""

    def __init__(self) -> None:
        self.writes: list[tuple[Any, ...]] = []

    def mark_standby(self, at: datetime) -> None:
        self.writes.append(("mark_standby", at))

    def end_standby(self, at: datetime) -> None:
        self.writes.append(("end_standby", at))

    def close_dead_holder(self, dead: str, me: str) -> None:
        self.writes.append(("close_dead_holder", dead, me))

    def spot_interruptions(self) -> int:
        return 2


class LedgerStore:
    def __init__(self) -> None:
        self.life_id = ""
        self.status = "running"

    def load(self) -> SimpleNamespace:
        return SimpleNamespace(status=self.status)


class Job:
    """The job's state as the phases use it: ledger writes applied to a recording ledger."""

    def __init__(self) -> None:
        self.ledger = Ledger()
        self.ledger_store = LedgerStore()
        self.progress_file: Path | None = None
        self.progress_uploads = 0

    def record(self, change: Callable[[Ledger], None]) -> None:
        change(self.ledger)

    def upload_progress_quietly(self) -> None:
        self.progress_uploads += 1


class Fleet:
    """The group's calls a phase makes, in order; `leaving` (or an error) is what the group answers."""

    def __init__(self, leaving: bool = False, error: Exception | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.answer, self.error = leaving, error

    def protect(self, instance_id: str, protected: bool) -> None:
        self.calls.append(("protect", instance_id, protected))
        if self.error is not None:
            raise self.error

    def leaving(self, instance_id: str) -> bool:
        self.calls.append(("leaving", instance_id))
        if self.error is not None:
            raise self.error
        return self.answer

    def instance_gone(self, instance_id: str) -> bool:
        return False


class Boot:
    """The GPU check's answer and the dataset wait's; each may see a stop come while it runs."""

    def __init__(self, life: FakeLife) -> None:
        self.life = life
        self.gpus: int | None = 4
        self.dataset_arrives = True
        self.stop_during: str | None = None
        self.waited: list[tuple[Any, ...]] = []

    def preflight(self) -> int | None:
        if self.stop_during:
            self.life.stops.request(self.stop_during)
        return self.gpus

    def wait_for_dataset(self, dataset: Any, job: Any, stops: Any, poll_seconds: float) -> bool:
        self.waited.append((dataset, job, stops, poll_seconds, self.life.phase))
        if self.stop_during:
            stops.request(self.stop_during)
        return self.dataset_arrives


class Trainer:
    argv = ("python", "train.py")

    def __init__(self) -> None:
        self.calls: list[str] = []

    def start(self) -> None:
        self.calls.append("start")

    def open_gate(self) -> None:
        self.calls.append("open_gate")

    def request_stop(self) -> None:
        self.calls.append("request_stop")


class Supervisor:
    """Makes the job's process, supervises it to an exit code and classifies the exit (all recorded)."""

    def __init__(self, life: FakeLife) -> None:
        self.life = life
        self.made: list[tuple[Any, ...]] = []
        self.trainers: list[Trainer] = []
        self.problem: JobSpecError | None = None
        self.supervised: list[tuple[Any, ...]] = []
        self.stop_during: str | None = None
        self.classified: list[tuple[Any, ...]] = []

    def job_process(
        self, paths: TrainerPaths, gpu_count: int, restored: int | None, **kwargs: Any
    ) -> Trainer:
        if self.problem is not None:
            raise self.problem
        self.made.append((paths, gpu_count, restored, kwargs))
        self.trainers.append(Trainer())
        return self.trainers[-1]

    def supervise(self, trainer: Trainer, persister: Any, *, watch_silent: bool) -> int:
        self.supervised.append((trainer, persister, watch_silent, self.life.phase))
        if self.stop_during:
            self.life.stops.request(self.stop_during)
        return 143

    def classify_exit(self, code: int, reason: str | None, persisted: bool, trainer: Trainer) -> LifeEnd:
        self.classified.append((code, reason, persisted, trainer))
        return LifeEnd.COMPLETED


class FakeLife:
    """What the phases read and write of a life (`Life`), with recording collaborators and a real stop and
    event log."""

    def __init__(self, tmp_path: Path) -> None:
        self.stream = io.StringIO()
        self.log = EventLog(self.stream)
        self.stops = StopRequests(self.log, deadline_seconds=90)
        self.config = SimpleNamespace(
            scratch_dir=str(tmp_path / "scratch"),
            job_id="job-7",
            dataset="imagenet-mini",
            lanes=1,
            group_name="trainstack-gpu",
            bucket="the-bucket",
            prefixes=SimpleNamespace(state="jobs/job-7/state/", checkpoints="jobs/job-7/checkpoints/"),
            resume_from="",
            stop_deadline_seconds=90.0,
        )
        self.stack_config = SimpleNamespace(name="the stack's config")
        self.clients = SimpleNamespace(s3=object(), cloudwatch=object())
        self.boot = Boot(self)
        self.fleet = Fleet()
        self.imds = object()
        self.job = Job()
        self.supervisor = Supervisor(self)
        self.user_job: JobSpec | None = None
        self.multi_node = False
        self.state_poll_seconds = 0.25
        self.drift_seconds = 1.5
        self.background_stop = threading.Event()
        self.gpu_count = -1  # never counted
        self.paths: TrainerPaths | None = TrainerPaths(scratch=tmp_path / "scratch")
        self.writer: Any = None
        self.persister: Any = None
        self.generation_fence: Any = None
        self.generations: Any = None
        self.identity: InstanceIdentity | None = IDENTITY
        self.stale_seconds = 120.0
        self.spawned: list[tuple[str, Callable[[], None]]] = []

    @property
    def phase(self) -> str:
        return self.stops.phase

    @phase.setter
    def phase(self, phase: str) -> None:
        self.stops.phase = phase

    @property
    def ledger(self) -> Ledger:
        return self.job.ledger

    def spawn(self, name: str, target: Callable[[], None]) -> None:
        self.spawned.append((name, target))

    def trainer_log_sink(self) -> Callable[[str], None]:
        return print

    @property
    def life(self) -> Life:
        return cast(Life, self)

    def events(self, stage: str) -> list[dict[str, Any]]:
        """The life's events of `stage`, each without its time."""
        lines = [json.loads(line) for line in self.stream.getvalue().splitlines()]
        return [{k: v for k, v in e.items() if k != "time"} for e in lines if e["stage"] == stage]

    def said(self, stage: str) -> list[str]:
        return [event["message"] for event in self.events(stage)]


@pytest.fixture()
def fake(tmp_path: Path) -> FakeLife:
    return FakeLife(tmp_path)


def user_job(**fields: Any) -> JobSpec:
    return JobSpec(name="mine", command=("python", "train.py"), **fields)


# -- the GPU check -------------------------------------------------------------------------------------------


def test_gpus_that_answer_are_counted_and_the_life_goes_on(fake: FakeLife) -> None:
    assert GpuCheck().run(fake.life) is None
    assert fake.gpu_count == 4
    assert fake.phase == "gpu-check"


def test_an_instance_without_gpus_goes_on_with_none_counted(fake: FakeLife) -> None:
    fake.boot.gpus = 0
    assert GpuCheck().run(fake.life) is None
    assert fake.gpu_count == 0


def test_no_gpu_answer_has_the_instance_replaced_and_counts_nothing(fake: FakeLife) -> None:
    fake.boot.gpus = None
    assert GpuCheck().run(fake.life) is LifeEnd.REPLACE
    assert fake.gpu_count == -1


def test_a_stop_seen_during_the_gpu_check_ends_the_life_with_its_outcome_and_counts_no_gpus(
    fake: FakeLife,
) -> None:
    fake.boot.stop_during = "spot"
    assert GpuCheck().run(fake.life) is LifeEnd.PREEMPTED
    assert fake.gpu_count == -1
    (stopped,) = fake.events("stop")[1:]
    assert stopped["message"] == "stopped before training; nothing new to persist"
    assert stopped["phase"] == "gpu-check"


def test_a_stop_wins_over_a_gpu_that_did_not_answer(fake: FakeLife) -> None:
    """An instance being stopped is not replaced for its GPU: the stop's outcome is the life's."""
    fake.boot.gpus, fake.boot.stop_during = None, "control"
    assert GpuCheck().run(fake.life) is LifeEnd.STOPPED


# -- the scratch space ---------------------------------------------------------------------------------------


def test_the_scratch_is_prepared_from_the_config_and_claimed_for_this_job_alone(
    fake: FakeLife, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[Any, ...]] = []
    scratch = tmp_path / "nvme"

    def prepare(wanted: str, log: EventLog) -> Path:
        calls.append(("prepare", wanted, log))
        return scratch

    monkeypatch.setattr(workspace_phase, "prepare_scratch", prepare)
    monkeypatch.setattr(workspace_phase, "claim_scratch", lambda *args: calls.append(("claim", *args)))
    fake.paths = None
    assert Workspace().run(fake.life) is None
    assert calls == [("prepare", fake.config.scratch_dir, fake.log), ("claim", scratch, "job-7", fake.log)]
    assert fake.paths == TrainerPaths(scratch=scratch)


# -- the one writer ------------------------------------------------------------------------------------------


class Writer:
    """OneWriter as the phases use it: its construction, `take`'s role and the dead holder it found."""

    def __init__(self, role: Role, dead: str | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.next_role, self.dead, self.args, self.kwargs = role, dead, args, kwargs
        self.role: Role | None = None
        self.floors: list[int] = []
        self.watched: list[tuple[Any, ...]] = []
        self.lease = object()

    def take(self, floor: int) -> Role:
        self.floors.append(floor)
        self.role = self.next_role
        return self.next_role

    def watch_own_clock(self, stops: Any, wait: Any) -> None:
        self.watched.append((stops, wait))

    def dead_holder(self) -> str | None:
        return self.dead


class Persister:
    """CheckpointPersister's construction as persister_for makes it, and the token floor it records."""

    floor: int | None = 7
    made: ClassVar[list[Persister]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs
        self.closed = False
        Persister.made.append(self)

    def token_floor(self) -> int | None:
        return self.floor

    def close(self) -> None:
        self.closed = True


def install_writer(
    monkeypatch: pytest.MonkeyPatch, role: Role, dead: str | None = None, floor: int | None = 7
) -> list[Writer]:
    made: list[Writer] = []

    def build(*args: Any, **kwargs: Any) -> Writer:
        made.append(Writer(role, dead, args, kwargs))
        return made[-1]

    monkeypatch.setattr(writer_phase, "OneWriter", build)
    monkeypatch.setattr(writer_phase, "CheckpointPersister", Persister)
    monkeypatch.setattr(Persister, "floor", floor)
    monkeypatch.setattr(Persister, "made", [])
    return made


def test_a_multi_node_job_takes_no_lease_its_generation_fences_its_commits(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = install_writer(monkeypatch, Role.SURPLUS)
    fake.multi_node = True
    assert OneWriterRole().run(fake.life) is None
    assert made == [] and fake.writer is None


@pytest.mark.parametrize(
    ("role", "end"), [(Role.HOLDER, None), (Role.STANDBY, None), (Role.SURPLUS, LifeEnd.SURPLUS)]
)
def test_a_single_node_job_decides_its_one_writer_and_a_surplus_instance_ends_the_life(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch, role: Role, end: LifeEnd | None
) -> None:
    made = install_writer(monkeypatch, role)
    assert OneWriterRole().run(fake.life) is end
    (writer,) = made
    assert fake.writer is writer and writer.role is role


def test_the_writer_is_this_instances_life_with_the_lifes_clocks_and_the_groups_view_of_dead_instances(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = install_writer(monkeypatch, Role.HOLDER)
    assert take_role(fake.life, TrainerPaths(scratch=Path("/s"))) is Role.HOLDER
    (writer,) = made
    assert writer.args == (fake.clients.s3, fake.config, fake.log)
    assert writer.kwargs == {
        "instance_id": IDENTITY.instance_id,
        "life_id": IDENTITY.instance_id,  # no ledger life yet: the instance names it
        "stale_seconds": 120.0,
        "instance_gone": fake.fleet.instance_gone,
        "drift_seconds": 1.5,
    }


def test_the_writer_names_the_ledgers_life_when_it_has_one(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = install_writer(monkeypatch, Role.HOLDER)
    fake.job.ledger_store.life_id = "life-3"
    take_role(fake.life, TrainerPaths(scratch=Path("/s")))
    assert made[0].kwargs["life_id"] == "life-3"


@pytest.mark.parametrize(("floor", "taken_at"), [(7, 7), (None, 0)])
def test_the_lease_is_taken_above_the_agents_own_record_of_its_tokens(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch, floor: int | None, taken_at: int
) -> None:
    """The floor is the agent's token record (none yet: 0), never latest.json's token the job could write."""
    made = install_writer(monkeypatch, Role.HOLDER, floor=floor)
    take_role(fake.life, TrainerPaths(scratch=Path("/s")))
    assert made[0].floors == [taken_at]
    (reader,) = Persister.made
    assert reader.closed, "the persister read for the floor keeps its transfer threads for the whole life"


def test_once_the_role_is_taken_the_lease_clock_watches_it_with_the_lifes_stops_until_the_life_ends(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = install_writer(monkeypatch, Role.HOLDER)
    take_role(fake.life, TrainerPaths(scratch=Path("/s")))
    ((name, target),) = fake.spawned
    assert name == "lease-clock"
    target()
    assert made[0].watched == [(fake.stops, fake.background_stop.wait)]


def test_a_holder_marks_no_standby_and_stays_protected(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_writer(monkeypatch, Role.HOLDER)
    fake.config.lanes = 2
    take_role(fake.life, TrainerPaths(scratch=Path("/s")))
    assert fake.job.ledger.writes == []
    assert fake.fleet.calls == []


def test_a_standby_is_marked_in_the_ledger_and_a_lanes_standby_comes_off_scale_in_protection(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_writer(monkeypatch, Role.STANDBY)
    fake.config.lanes = 2
    assert take_role(fake.life, TrainerPaths(scratch=Path("/s"))) is Role.STANDBY
    ((write, at),) = fake.job.ledger.writes
    assert write == "mark_standby" and isinstance(at, datetime) and at.tzinfo is not None
    assert fake.fleet.calls == [("protect", IDENTITY.instance_id, False)]
    assert fake.said("fleet") == ["scale-in protection off while it waits as a standby"]


def test_a_standby_of_a_one_lane_group_leaves_its_protection_alone(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_writer(monkeypatch, Role.STANDBY)
    take_role(fake.life, TrainerPaths(scratch=Path("/s")))
    assert fake.fleet.calls == []


def test_a_lease_taken_from_a_vanished_holder_closes_that_life_in_the_ledger(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_writer(monkeypatch, Role.HOLDER, dead="life-2")
    take_role(fake.life, TrainerPaths(scratch=Path("/s")))
    assert fake.job.ledger.writes == [("close_dead_holder", "life-2", IDENTITY.instance_id)]


def test_no_dead_holder_no_writer_or_no_identity_closes_nothing(fake: FakeLife) -> None:
    close_dead_holder(fake.life)  # no writer yet
    fake.writer = Writer(Role.HOLDER, None, (), {})
    close_dead_holder(fake.life)
    fake.writer, fake.identity = Writer(Role.HOLDER, "life-2", (), {}), None
    close_dead_holder(fake.life)
    assert fake.job.ledger.writes == []


@pytest.mark.parametrize("status", sorted(TERMINAL_STATUSES))
def test_a_job_whose_ledger_says_it_ended_has_ended(fake: FakeLife, status: str) -> None:
    fake.job.ledger_store.status = status
    assert job_ended(fake.life)


def test_a_running_job_has_not_ended(fake: FakeLife) -> None:
    assert not job_ended(fake.life)


# -- the checkpoint persister and a lost fence ---------------------------------------------------------------


def persister(fake: FakeLife, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> Persister:
    monkeypatch.setattr(writer_phase, "CheckpointPersister", Persister)

    def fence(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
        return (args, kwargs)

    monkeypatch.setattr(writer_phase, "GenerationFence", fence)
    made = persister_for(fake.life, TrainerPaths(scratch=Path("/scratch")), **kwargs)
    assert isinstance(made, Persister)
    return made


def test_the_persister_maps_the_jobs_checkpoints_to_this_instances_folder_and_records_its_tokens(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = persister(fake, monkeypatch)
    assert made.args == (
        fake.clients.s3,
        "the-bucket",
        "jobs/job-7/checkpoints/",
        Path("/scratch/checkpoints"),
        fake.log,
    )
    assert made.kwargs == {
        "keep": 3,
        "fence": None,
        "on_lease_lost": None,
        "token_record": "jobs/job-7/state/" + TOKEN_RECORD,
    }


def test_the_persister_keeps_as_many_checkpoints_as_the_users_job_says(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.user_job = user_job(checkpoint_keep=5)
    assert persister(fake, monkeypatch).kwargs["keep"] == 5


def test_a_standbys_persister_only_reads_even_when_asked_fenced_without_a_writer(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the lease's holder commits fenced; a standby, or a life that holds no lease, has no fence."""
    fake.writer = Writer(Role.STANDBY, None, (), {})
    assert persister(fake, monkeypatch).kwargs["fence"] is None
    fake.writer = None
    assert persister(fake, monkeypatch, fenced=True).kwargs["fence"] is None


def test_the_holders_commits_are_fenced_by_its_lease_and_a_lost_lease_is_a_stop_at_once(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.writer = Writer(Role.HOLDER, None, (), {})
    made = persister(fake, monkeypatch, fenced=True)
    assert made.kwargs["fence"] is fake.writer.lease
    made.kwargs["on_lease_lost"](LeaseLostError("life-9", 12))
    assert fake.stops.reason == "lease_lost"


def test_a_multi_node_nodes_commits_are_fenced_by_its_generation(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.multi_node = True
    made = persister(fake, monkeypatch)
    fence = made.kwargs["fence"]
    assert fence == (
        (fake.clients.s3, "the-bucket", "jobs/job-7/state/"),
        {"instance_id": IDENTITY.instance_id},
    )
    assert fake.generation_fence is fence
    made.kwargs["on_lease_lost"](GenerationSupersededError(3, 4))
    assert fake.stops.reason == "generation_superseded"


def test_a_multi_node_life_not_yet_identified_has_no_fence(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.multi_node, fake.identity = True, None
    made = persister(fake, monkeypatch)
    assert made.kwargs["fence"] is None and made.kwargs["on_lease_lost"] is None
    assert fake.generation_fence is None


@pytest.mark.parametrize(
    ("error", "stop"),
    [
        (
            GenerationSupersededError(3, 5),
            {"reason": "generation_superseded", "generation": 3, "newer_generation": 5},
        ),
        (
            LeaseExpiredError("life-2", 8, unproven_seconds=12.3456),
            {"reason": "lease_expiring", "unrenewed_s": 12.3},
        ),
        (LeaseLostError("life-9", 12), {"reason": "lease_lost", "holder": "life-9", "token": 12}),
    ],
)
def test_a_fence_lost_at_a_commit_is_its_own_stop_with_what_it_lost_to(
    fake: FakeLife, error: LeaseLostError, stop: dict[str, Any]
) -> None:
    fake.phase = "training"
    lease_lost(fake.life, error)
    (event,) = fake.events("stop")
    assert event == {
        "stage": "stop",
        "message": "stop requested",
        "phase": "training",
        "deadline_s": 90,
        **stop,
    }


# -- scale-in protection of a pool's instance ----------------------------------------------------------------


def test_protection_on_says_why_and_names_the_group(fake: FakeLife) -> None:
    protect_from_scale_in(fake.life)
    assert fake.fleet.calls == [("protect", IDENTITY.instance_id, True)]
    assert fake.events("fleet") == [
        {
            "stage": "fleet",
            "message": "protected from scale-in while it serves the job",
            "group": "trainstack-gpu",
        }
    ]


def test_protection_off_says_it_waits_as_a_standby(fake: FakeLife) -> None:
    protect_from_scale_in(fake.life, False, why="never said")
    assert fake.fleet.calls == [("protect", IDENTITY.instance_id, False)]
    assert fake.events("fleet") == [
        {"stage": "fleet", "message": "scale-in protection off while it waits as a standby"}
    ]


@pytest.mark.parametrize("protected", [True, False])
def test_a_protection_the_group_refuses_is_said_and_never_raised(fake: FakeLife, protected: bool) -> None:
    fake.fleet.error = RuntimeError("Throttling: rate exceeded\nsecond line")
    protect_from_scale_in(fake.life, protected)
    assert fake.events("fleet") == [
        {
            "stage": "fleet",
            "message": "could not set this instance's scale-in protection",
            "error": "Throttling: rate exceeded",
        }
    ]


def test_before_binding_the_instance_is_protected_first_then_its_group_state_read(fake: FakeLife) -> None:
    assert leaving_before_binding(fake.life, IDENTITY) is False
    assert fake.fleet.calls == [("protect", IDENTITY.instance_id, True), ("leaving", IDENTITY.instance_id)]
    assert fake.events("fleet") == [
        {
            "stage": "fleet",
            "message": "protected from scale-in while it looks for a job and serves it",
            "group": "trainstack-gpu",
        }
    ]


def test_an_instance_scale_in_chose_before_its_protection_claims_nothing_and_says_so(fake: FakeLife) -> None:
    fake.fleet.answer = True
    assert leaving_before_binding(fake.life, IDENTITY) is True
    assert fake.events("fleet")[-1] == {
        "stage": "fleet",
        "message": "scaled in before it claimed a job: it takes none",
        "group": "trainstack-gpu",
    }


def test_an_instance_whose_group_cannot_be_read_goes_on_to_claim_a_job(fake: FakeLife) -> None:
    fake.fleet.error = RuntimeError("AccessDenied")
    assert leaving_before_binding(fake.life, IDENTITY) is False
    assert fake.events("fleet")[-1] == {
        "stage": "fleet",
        "message": "could not read this instance's state in its group",
        "error": "AccessDenied",
    }


# -- the standby's wait --------------------------------------------------------------------------------------


def install_wait(monkeypatch: pytest.MonkeyPatch, ended: Ended | None) -> list[dict[str, Any]]:
    waits: list[dict[str, Any]] = []

    def wait(writer: Any, trainer: Any, stops: Any, log: Any, **kwargs: Any) -> Ended | None:
        waits.append({"writer": writer, "trainer": trainer, "stops": stops, "log": log, **kwargs})
        return ended

    monkeypatch.setattr(writer_phase, "wait_warm", wait)
    return waits


def standby(fake: FakeLife, dead: str | None = None) -> Trainer:
    fake.writer = Writer(Role.STANDBY, dead, (), {})
    return Trainer()


@pytest.mark.parametrize(("job", "gated"), [(None, True), (user_job(), False)])
def test_a_standby_gates_the_built_in_trainer_only_and_waits_with_the_lifes_stops_and_floor(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch, job: JobSpec | None, gated: bool
) -> None:
    waits = install_wait(monkeypatch, LifeEnd.HANDED_OVER)
    fake.user_job = job
    trainer = standby(fake)
    assert wait_as_standby(fake.life, cast(TrainerProcess, trainer), floor=9) is LifeEnd.HANDED_OVER
    (wait,) = waits
    job_ended_now = wait.pop("job_ended")
    assert wait == {
        "writer": fake.writer,
        "trainer": trainer,
        "stops": fake.stops,
        "log": fake.log,
        "gated": gated,
        "floor": 9,
    }
    assert fake.phase == "standby"
    assert not job_ended_now()
    fake.job.ledger_store.status = "completed"
    assert job_ended_now(), "the wait reads the job's end from its ledger"
    assert fake.job.ledger.writes == [], "a standby that never held the lease ended its standby in the ledger"


def test_a_standby_that_takes_the_lease_ends_its_standby_closes_the_dead_holder_and_trains(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_wait(monkeypatch, None)
    trainer = standby(fake, dead="life-1")
    assert wait_as_standby(fake.life, cast(TrainerProcess, trainer), floor=0) is None
    (ended, at), closed = fake.job.ledger.writes
    assert ended == "end_standby" and isinstance(at, datetime) and at.tzinfo is not None
    assert closed == ("close_dead_holder", "life-1", IDENTITY.instance_id)
    assert fake.fleet.calls == [], "a one-lane instance's protection was touched"
    assert trainer.calls == []


@pytest.mark.parametrize("lanes", [2, 3])
def test_a_lanes_standby_is_protected_from_scale_in_once_it_holds_the_lease(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch, lanes: int
) -> None:
    install_wait(monkeypatch, None)
    fake.config.lanes = lanes
    wait_as_standby(fake.life, cast(TrainerProcess, standby(fake)), floor=0)
    assert fake.fleet.calls == [("protect", IDENTITY.instance_id, True)]
    assert fake.said("fleet") == ["protected from scale-in while it serves the job"]


def test_a_standby_that_takes_the_lease_of_an_ended_job_lets_it_go(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_wait(monkeypatch, None)
    fake.job.ledger_store.status = "completed"
    trainer = standby(fake)
    assert wait_as_standby(fake.life, cast(TrainerProcess, trainer), floor=0) is LifeEnd.STANDBY_ENDED
    assert trainer.calls == ["request_stop"]
    assert fake.said("standby") == ["took the lease of a job that has ended; letting it go"]


# -- the dataset ---------------------------------------------------------------------------------------------


class Dataset:
    def __init__(self, life: FakeLife, error: Exception | None) -> None:
        self.life, self.error = life, error
        self.synced: list[tuple[Any, ...]] = []

    def sync(self, destination: Path, *, should_abort: Any, check_version: Any) -> str:
        self.synced.append((destination, should_abort, check_version, self.life.phase))
        if self.error is not None:
            raise self.error
        return "the sync's report"


class Version:
    made: ClassVar[list[Version]] = []

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.recorded: list[Any] = []
        Version.made.append(self)

    def check(self, version: str) -> None:
        pass

    def record(self, synced: Any) -> None:
        self.recorded.append(synced)


def install_data(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch, error: Exception | None = None
) -> tuple[list[tuple[Any, ...]], Dataset]:
    chosen: list[tuple[Any, ...]] = []
    dataset = Dataset(fake, error)

    def for_dataset(*args: Any) -> Dataset:
        chosen.append(args)
        return dataset

    monkeypatch.setattr(data_phase, "DataSync", SimpleNamespace(for_dataset=for_dataset))
    monkeypatch.setattr(data_phase, "JobDataset", Version)
    Version.made = []
    return chosen, dataset


def test_a_job_that_reads_its_data_itself_syncs_nothing(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    chosen, _ = install_data(fake, monkeypatch)
    fake.user_job = user_job(data_sync=False)
    assert Data().run(fake.life) is None
    assert chosen == [] and fake.boot.waited == []


@pytest.mark.parametrize("job", [None, user_job()])
def test_the_jobs_dataset_is_waited_for_then_synced_into_scratch_at_the_jobs_version(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch, job: JobSpec | None
) -> None:
    fake.user_job = job
    chosen, dataset = install_data(fake, monkeypatch)
    assert Data().run(fake.life) is None
    assert chosen == [(fake.clients.s3, fake.stack_config, "imagenet-mini", fake.log)]
    assert fake.boot.waited == [(dataset, fake.job, fake.stops, 0.25, "data-wait")]
    (version,) = Version.made
    assert version.args == (fake.clients.s3, fake.config, fake.job, fake.log)
    assert fake.paths is not None
    assert dataset.synced == [(fake.paths.scratch / "data", fake.stops.is_set, version.check, "data-sync")]
    assert version.recorded == ["the sync's report"]


@pytest.mark.parametrize(
    ("job", "streams"),
    [
        (None, True),
        (user_job(data_mode="stream"), True),
        (user_job(), False),
        (user_job(data_mode="sync"), False),
    ],
)
def test_the_built_in_trainer_and_a_job_asking_for_it_stream_a_sharded_version_the_others_sync_it(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch, job: JobSpec | None, streams: bool
) -> None:
    """The shard cache under scratch is offered to the sync (which streams a version pushed as shards, and
    syncs one pushed as files whole) for the built-in trainer and for a job.yaml with `data: {mode: stream}`;
    a job that did not ask gets every file synced, as before."""
    fake.user_job = job
    _, dataset = install_data(fake, monkeypatch)
    assert Data().run(fake.life) is None
    assert fake.paths is not None
    expected = fake.paths.scratch / data_phase.SHARD_CACHE if streams else None
    assert getattr(dataset, "stream_cache", None) == expected


def test_a_dataset_that_never_comes_ends_the_life_with_no_data(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, dataset = install_data(fake, monkeypatch)
    fake.boot.dataset_arrives = False
    assert Data().run(fake.life) is LifeEnd.NO_DATA
    assert dataset.synced == []


def test_a_stop_during_the_dataset_wait_ends_the_life_with_the_stops_outcome(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_data(fake, monkeypatch)
    fake.boot.dataset_arrives, fake.boot.stop_during = False, "cost_cap"
    assert Data().run(fake.life) is LifeEnd.COST_CAP


def test_a_dataset_version_the_checkpoints_were_not_trained_on_is_a_permanent_failure_with_its_fix(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_data(fake, monkeypatch, DatasetVersionError("dataset v2, checkpoints v1", fix="push v1 back"))
    failure = Data().run(fake.life)
    assert isinstance(failure, Failure)
    assert (failure.outcome, failure.reason, failure.fix, failure.permanent) == (
        LifeEnd.FAILED,
        "dataset v2, checkpoints v1",
        "push v1 back",
        True,
    )
    assert fake.events("failed") == [
        {
            "stage": "failed",
            "message": "dataset version differs from the job's checkpoints",
            "error": "dataset v2, checkpoints v1",
        }
    ]
    assert failure.lines == list(fake.log.tail) and failure.lines
    assert Version.made[0].recorded == []


def test_a_dataset_that_does_not_fit_is_a_permanent_failure_naming_the_bigger_disk(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_data(fake, monkeypatch, DiskSpaceError("needs 80 GB, 40 GB free"))
    failure = Data().run(fake.life)
    assert isinstance(failure, Failure)
    assert (failure.outcome, failure.reason, failure.permanent) == (
        LifeEnd.FAILED,
        "needs 80 GB, 40 GB free",
        True,
    )
    assert failure.fix == (
        "raise trainstack:rootVolumeSizeGb (or use a type with a larger instance store), "
        f"run pulumi up, then {RESUME_COMMAND}"
    )
    assert fake.events("failed") == [
        {
            "stage": "failed",
            "message": "dataset does not fit on this instance",
            "error": "needs 80 GB, 40 GB free",
        }
    ]
    assert failure.lines == list(fake.log.tail) and failure.lines


def test_a_stop_during_the_sync_ends_the_life_with_the_stops_outcome(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_data(fake, monkeypatch, SyncAborted())
    fake.stops.request("spot")
    assert Data().run(fake.life) is LifeEnd.PREEMPTED
    assert fake.events("data") == [
        {"stage": "data", "message": "dataset sync aborted by the stop", "reason": "spot"}
    ]
    assert Version.made[0].recorded == []


# -- training ------------------------------------------------------------------------------------------------


class Store:
    """A checkpoint persister as training drives it: restores, floor, start, finish within a deadline."""

    def __init__(self, life: FakeLife, fenced: bool) -> None:
        self.life, self.fenced = life, fenced
        self.restored: int | None = 40
        self.floor: int | None = 6
        self.error: BaseException | None = None
        self.calls: list[str] = []
        self.phases: list[str] = []
        self.aborts: list[Any] = []
        self.deadline: float | None = None
        self.lost_at_finish = False
        self.local_dir = Path("/scratch/checkpoints")

    def restore(self, should_abort: Any) -> int | None:
        self.calls.append("restore")
        self.phases.append(self.life.phase)
        self.aborts.append(should_abort)
        if self.error is not None:
            raise self.error
        return self.restored

    def token_floor(self) -> int | None:
        return self.floor

    def start(self) -> None:
        self.calls.append("start")

    def finish(self, deadline: float) -> bool:
        self.calls.append("finish")
        self.phases.append(self.life.phase)
        self.deadline = deadline
        if self.lost_at_finish:
            self.life.stops.request("lease_lost")
        return True

    def close(self) -> None:
        self.calls.append("close")


class Metrics:
    made: ClassVar[list[Metrics]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs
        self.calls: list[str] = []
        Metrics.made.append(self)

    def start(self) -> None:
        self.calls.append("start")

    def stop(self) -> None:
        self.calls.append("stop")


class TrainingRig:
    """What train() was given to work with, once the fakes are in."""

    def __init__(self, fake: FakeLife, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fake = fake
        self.stores: list[Store] = []
        self.store_setup: Callable[[Store], None] = lambda store: None
        self.waits: list[tuple[Any, ...]] = []
        self.wait_end: Ended | None = None
        monkeypatch.setattr(training_phase, "persister_for", self.persister_for)
        monkeypatch.setattr(training_phase, "wait_as_standby", self.wait_as_standby)
        monkeypatch.setattr(training_phase, "GpuMetricPublisher", Metrics)
        Metrics.made = []

    def persister_for(self, life: Life, paths: TrainerPaths, *, fenced: bool = False) -> Store:
        assert life is self.fake and paths is self.fake.paths
        self.stores.append(Store(self.fake, fenced))
        self.store_setup(self.stores[-1])
        return self.stores[-1]

    def wait_as_standby(self, life: Life, trainer: Trainer, floor: int) -> Ended | None:
        assert life is self.fake
        self.waits.append((trainer, floor, list(self.stores[0].calls)))
        return self.wait_end

    def train(self) -> Ended:
        assert self.fake.paths is not None
        return train(self.fake.life, self.fake.paths, 4)


@pytest.fixture()
def training(fake: FakeLife, monkeypatch: pytest.MonkeyPatch) -> TrainingRig:
    return TrainingRig(fake, monkeypatch)


def test_the_training_phase_trains_with_the_scratch_and_gpus_set_up_before_it(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[Any, ...]] = []

    def train(*args: Any) -> LifeEnd:
        seen.append(args)
        return LifeEnd.COMPLETED

    monkeypatch.setattr(training_phase, "train", train)
    fake.gpu_count = 8
    assert Training().run(fake.life) is LifeEnd.COMPLETED
    assert seen == [(fake, fake.paths, 8)]


def test_a_holder_restores_through_its_fenced_persister_starts_its_job_and_classifies_its_exit(
    fake: FakeLife, training: TrainingRig
) -> None:
    fake.writer = Writer(Role.HOLDER, None, (), {})
    fake.writer.role = Role.HOLDER
    assert training.train() is LifeEnd.COMPLETED
    (store,) = training.stores
    assert store.fenced and fake.persister is store
    assert store.calls == ["restore", "start", "finish", "close"]
    assert store.phases == ["restore", "final-upload"]
    assert store.aborts == [fake.stops.is_set]
    ((paths, gpus, restored, kwargs),) = fake.supervisor.made
    assert (paths, gpus, restored) == (fake.paths, 4, 40)
    assert kwargs == {"identity": IDENTITY, "spot_interruptions": 2, "log_sink": fake.trainer_log_sink}
    (trainer,) = fake.supervisor.trainers
    assert trainer.calls == ["start"]
    assert fake.said("train") == ["trainer starting"]
    assert fake.events("train")[0]["argv"] == ["python", "train.py"]
    assert fake.events("train")[0]["restored_step"] == 40
    assert fake.supervisor.supervised == [(trainer, store, True, "training")]
    assert fake.supervisor.classified == [(143, None, True, trainer)]
    assert fake.paths is not None and fake.job.progress_file == fake.paths.progress_file
    assert fake.job.progress_uploads == 1
    assert training.waits == []


class Progress(Job):
    """A job state that says whether the progress file was there when heartbeats began to read it."""

    def __init__(self) -> None:
        super().__init__()
        self.stale_when_read: list[bool] = []

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "progress_file" and value is not None:
            self.stale_when_read.append(Path(value).exists())
        super().__setattr__(name, value)


@pytest.mark.parametrize("user", [False, True])
def test_an_earlier_lifes_progress_report_is_deleted_before_heartbeats_read_the_file(
    fake: FakeLife, training: TrainingRig, user: bool
) -> None:
    # A life of the same job before, on this instance: its last report must not count as this life's.
    assert fake.paths is not None
    fake.paths.progress_file.parent.mkdir(parents=True, exist_ok=True)
    fake.paths.progress_file.write_text('{"step": 90, "samples_per_second": 999.0}')
    fake.job = job = Progress()
    if user:
        fake.user_job = user_job()
    training.train()
    assert job.stale_when_read == [False]


def test_a_gated_standbys_own_progress_report_is_kept_at_its_hand_over(
    fake: FakeLife, training: TrainingRig
) -> None:
    # Its trainer has run since the gate was set (its start deleted any earlier life's file): the report is
    # its own warm-up's.
    fake.writer = Writer(Role.STANDBY, None, (), {})
    fake.writer.role = Role.STANDBY
    assert fake.paths is not None
    fake.paths.progress_file.parent.mkdir(parents=True, exist_ok=True)
    fake.paths.progress_file.write_text('{"step": 40}')
    fake.job = job = Progress()
    training.train()
    assert job.stale_when_read == [True]


def test_a_life_without_a_writer_restores_through_an_unfenced_persister(
    fake: FakeLife, training: TrainingRig
) -> None:
    training.train()
    assert not training.stores[0].fenced


def test_a_users_job_is_not_watched_for_silence(fake: FakeLife, training: TrainingRig) -> None:
    fake.user_job = user_job()
    training.train()
    assert fake.supervisor.supervised[0][2] is False


@pytest.mark.parametrize(("gpus", "started"), [(4, ["start", "stop"]), (0, ["stop"])])
def test_gpu_metrics_are_published_for_this_instance_and_job_only_while_gpus_train(
    fake: FakeLife, training: TrainingRig, gpus: int, started: list[str]
) -> None:
    assert fake.paths is not None
    train(fake.life, fake.paths, gpus)
    (metrics,) = Metrics.made
    assert metrics.args == (fake.clients.cloudwatch, "trainstack-gpu", fake.log)
    assert metrics.kwargs == {"instance_id": IDENTITY.instance_id, "job_id": "job-7"}
    assert metrics.calls == started


def test_gpu_metrics_stop_even_when_supervising_raises(
    fake: FakeLife, training: TrainingRig, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> int:
        raise OSError("supervisor broke")

    monkeypatch.setattr(fake.supervisor, "supervise", broken)
    with pytest.raises(OSError, match="supervisor broke"):
        training.train()
    assert Metrics.made[0].calls == ["start", "stop"]


@pytest.mark.parametrize("error", [UploadAbandonedError("s3 gone"), InterruptedError()])
def test_a_stop_during_the_restore_ends_the_life_with_the_stops_outcome_and_starts_nothing(
    fake: FakeLife, training: TrainingRig, error: BaseException
) -> None:
    def stopped(store: Store) -> None:
        store.error = error
        fake.stops.request("spot")

    training.store_setup = stopped
    assert training.train() is LifeEnd.PREEMPTED
    assert fake.supervisor.made == [] and fake.supervisor.supervised == []


def test_a_stop_before_the_launch_means_the_trainer_never_starts(
    fake: FakeLife, training: TrainingRig
) -> None:
    training.store_setup = lambda store: fake.stops.request("control")
    assert training.train() is LifeEnd.STOPPED
    assert fake.supervisor.trainers[0].calls == []
    assert training.stores[0].calls == ["restore"], "the persister started for a trainer that never ran"
    assert Metrics.made[0].calls == []


@pytest.mark.parametrize(("fix", "expected"), [("", DEFAULT_SPEC_FIX), ("pin torch", "pin torch")])
def test_a_job_that_cannot_be_set_up_is_a_permanent_failure_with_its_first_problem_and_fix(
    fake: FakeLife, training: TrainingRig, fix: str, expected: str
) -> None:
    fake.supervisor.problem = JobSpecError(["requirements: torch==9 not found", "env: bad"], fix=fix)
    fake.log.event("install", "pip failed")
    failure = training.train()
    assert isinstance(failure, Failure)
    assert (failure.outcome, failure.reason, failure.fix, failure.permanent) == (
        LifeEnd.FAILED,
        "requirements: torch==9 not found",
        expected,
        True,
    )
    assert failure.lines == list(fake.log.tail) and failure.lines


def test_the_final_upload_has_five_minutes_when_no_stop_came(fake: FakeLife, training: TrainingRig) -> None:
    before = time.monotonic()
    training.train()
    after = time.monotonic()
    deadline = training.stores[0].deadline
    assert deadline is not None
    assert before + FINAL_UPLOAD_SECONDS <= deadline <= after + FINAL_UPLOAD_SECONDS
    assert FINAL_UPLOAD_SECONDS == 300.0


def test_after_a_stop_the_final_upload_has_the_stops_deadline_from_when_it_was_seen(
    fake: FakeLife, training: TrainingRig
) -> None:
    fake.supervisor.stop_during = "spot"
    training.train()
    _, seen_at = fake.stops.state()
    assert seen_at is not None and training.stores[0].deadline == seen_at + 90.0
    assert fake.supervisor.classified[0][1] == "spot"


def test_the_final_upload_ends_by_the_leases_kill_time_when_that_comes_first(
    fake: FakeLife, training: TrainingRig
) -> None:
    kill_at = time.monotonic() + 20
    fake.stops.kill_by(kill_at)
    training.train()
    assert training.stores[0].deadline == kill_at


def test_a_later_kill_time_leaves_the_stops_deadline(fake: FakeLife, training: TrainingRig) -> None:
    fake.supervisor.stop_during = "spot"
    fake.stops.kill_by(time.monotonic() + 3600)
    training.train()
    _, seen_at = fake.stops.state()
    assert seen_at is not None and training.stores[0].deadline == seen_at + 90.0


def test_a_lease_lost_at_the_final_upload_is_the_reason_the_exit_is_classified_with(
    fake: FakeLife, training: TrainingRig
) -> None:
    training.store_setup = lambda store: setattr(store, "lost_at_finish", True)
    training.train()
    assert fake.supervisor.classified[0][1] == "lease_lost"


def test_a_standby_reads_warm_waits_for_the_lease_then_restores_the_holders_last_step_fenced(
    fake: FakeLife, training: TrainingRig
) -> None:
    """The built-in trainer, started gated while it waited, has its start gate opened: no second process."""
    fake.writer = Writer(Role.STANDBY, None, (), {})
    fake.writer.role = Role.STANDBY
    training.store_setup = lambda store: setattr(store, "restored", 40 if not training.stores[1:] else 52)
    assert training.train() is LifeEnd.COMPLETED
    reader, holder = training.stores
    assert not reader.fenced and holder.fenced
    (trainer,) = fake.supervisor.trainers
    assert training.waits == [(trainer, 6, ["restore"])]
    assert reader.calls == ["restore", "close"]
    assert holder.calls == ["restore", "start", "finish", "close"]
    assert holder.phases[0] == "restore" and holder.aborts == [fake.stops.is_set]
    assert fake.persister is holder
    assert trainer.calls == ["open_gate"]
    assert fake.events("train") == [
        {"stage": "train", "message": "start gate opened: the standby trains", "restored_step": 52}
    ]
    assert fake.supervisor.supervised[0][:2] == (trainer, holder)


def test_a_standby_with_no_token_floor_waits_from_zero(fake: FakeLife, training: TrainingRig) -> None:
    fake.writer = Writer(Role.STANDBY, None, (), {})
    fake.writer.role = Role.STANDBY
    training.store_setup = lambda store: setattr(store, "floor", None)
    training.train()
    assert training.waits[0][1] == 0


def test_a_users_job_starts_once_its_standby_holds_the_lease_at_the_holders_last_step(
    fake: FakeLife, training: TrainingRig
) -> None:
    fake.user_job = user_job()
    fake.writer = Writer(Role.STANDBY, None, (), {})
    fake.writer.role = Role.STANDBY
    training.store_setup = lambda store: setattr(store, "restored", 40 if not training.stores[1:] else 52)
    training.train()
    assert [made[:3] for made in fake.supervisor.made] == [(fake.paths, 4, 40), (fake.paths, 4, 52)]
    first, second = fake.supervisor.trainers
    assert first.calls == [] and second.calls == ["start"]
    assert fake.events("train")[0]["restored_step"] == 52


def test_a_standbys_wait_that_ends_the_life_ends_it_without_training(
    fake: FakeLife, training: TrainingRig
) -> None:
    fake.writer = Writer(Role.STANDBY, None, (), {})
    fake.writer.role = Role.STANDBY
    training.wait_end = LifeEnd.HANDED_OVER
    assert training.train() is LifeEnd.HANDED_OVER
    assert len(training.stores) == 1 and training.stores[0].calls == ["restore", "close"]
    assert fake.supervisor.supervised == []


@pytest.mark.parametrize("error", [UploadAbandonedError("s3 gone"), InterruptedError()])
def test_a_stop_during_the_take_overs_restore_ends_the_life_with_the_stops_outcome(
    fake: FakeLife, training: TrainingRig, error: BaseException
) -> None:
    fake.writer = Writer(Role.STANDBY, None, (), {})
    fake.writer.role = Role.STANDBY

    def second_fails(store: Store) -> None:
        if training.stores[1:]:
            store.error = error
            fake.stops.request("scale-in")

    training.store_setup = second_fails
    assert training.train() is LifeEnd.PREEMPTED
    assert fake.supervisor.supervised == []


class Nodes:
    """A multi-node job's generations: each starts the trainer itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs
        self.trained: list[tuple[Any, ...]] = []
        self.confirmed: list[tuple[Any, ...]] = []

    def train(self, trainer: Trainer, persister: Store, restored: int | None) -> int:
        self.trained.append((trainer, persister, restored))
        return 0

    def job_checkpoint_confirmed(self, persisted: bool, persister: Store, deadline: float) -> bool:
        self.confirmed.append((persisted, persister, deadline))
        return False


def test_a_multi_node_job_trains_in_generations_and_its_exit_counts_the_jobs_confirmed_checkpoint(
    fake: FakeLife, training: TrainingRig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(training_phase, "Generations", SimpleNamespace(for_node=Nodes))
    fake.multi_node = True
    fake.generation_fence = object()
    training.train()
    nodes = fake.generations
    assert isinstance(nodes, Nodes)
    assert nodes.args == (
        fake.config,
        fake.log,
        fake.stops,
        fake.job,
        fake.supervisor,
        fake.clients.s3,
        fake.imds,
        IDENTITY,
        fake.paths,
    )
    assert nodes.kwargs == {"poll_seconds": 0.25, "fence": fake.generation_fence}
    (store,) = training.stores
    (trainer,) = fake.supervisor.trainers
    assert trainer.calls == [], "the agent started a trainer its generations start"
    assert fake.said("train") == []
    assert nodes.trained == [(trainer, store, 40)]
    assert fake.supervisor.supervised == []
    assert nodes.confirmed == [(True, store, store.deadline)]
    assert fake.supervisor.classified == [(0, None, False, trainer)]


def restore_from(
    fake: FakeLife,
    monkeypatch: pytest.MonkeyPatch,
    own: int | None,
    origin: int | Exception | None,
    made: list[Any] | None = None,
) -> tuple[int | None, list[Any]]:
    """restore() with this life's own newest checkpoint `own` and resume_from's `origin` (or its error)."""
    opened: list[Any] = [] if made is None else made

    class Origin:
        def __init__(self, *args: Any) -> None:
            self.args = args
            self.calls: list[Any] = []
            opened.append(self)

        def restore(self, should_abort: Any) -> int | None:
            self.calls.append(("restore", should_abort))
            if isinstance(origin, Exception):
                raise origin
            return origin

        def close(self) -> None:
            self.calls.append("close")

    monkeypatch.setattr(training_phase, "CheckpointPersister", Origin)
    store = Store(fake, fenced=True)
    store.restored = own
    return restore(fake.life, cast(CheckpointPersister, store)), opened


def test_a_job_with_its_own_checkpoint_resumes_from_it(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.config.resume_from = "job-3"
    assert restore_from(fake, monkeypatch, own=40, origin=90) == (40, [])


def test_a_new_job_without_resume_from_starts_at_step_zero(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert restore_from(fake, monkeypatch, own=None, origin=90) == (None, [])
    assert fake.events("checkpoint") == []


def test_a_new_job_starts_from_resume_froms_checkpoint_and_says_which(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.config.resume_from = "job-3"
    restored, (origin,) = restore_from(fake, monkeypatch, own=None, origin=90)
    assert restored == 90
    assert origin.args == (
        fake.clients.s3,
        "the-bucket",
        JobPrefixes.of("job-3").checkpoints,
        Path("/scratch/checkpoints"),
        fake.log,
    )
    assert origin.calls == [("restore", fake.stops.is_set), "close"]
    assert fake.events("checkpoint") == [
        {
            "stage": "checkpoint",
            "message": "new job: starting from job job-3's checkpoint",
            "resume_from": "job-3",
            "step": 90,
        }
    ]


def test_a_resume_from_job_without_a_checkpoint_starts_at_step_zero_and_says_so(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.config.resume_from = "job-3"
    assert restore_from(fake, monkeypatch, own=None, origin=None)[0] is None
    assert fake.events("checkpoint") == [
        {
            "stage": "checkpoint",
            "message": "new job: job job-3 has no checkpoint to start from; starting at step 0",
            "resume_from": "job-3",
            "step": None,
        }
    ]


def test_resume_froms_persister_is_closed_even_when_its_restore_is_stopped(
    fake: FakeLife, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.config.resume_from = "job-3"
    made: list[Any] = []
    with pytest.raises(InterruptedError):
        restore_from(fake, monkeypatch, own=None, origin=InterruptedError(), made=made)
    assert made[0].calls == [("restore", fake.stops.is_set), "close"]

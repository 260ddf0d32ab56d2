"""How a life ends: one enum from the trainer's exit to the agent's exit status; and only the lease's holder
ends a job (its results, status, e-mail and scale to zero), against moto."""

from __future__ import annotations

import dataclasses
import io
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
from botocore.exceptions import ClientError

from bootstrap.agent_config import AgentConfig, Prefixes
from bootstrap.eventlog import EventLog, iso, utc_now
from bootstrap.fleet import Fleet
from bootstrap.imds import ImdsClient, ImdsUnavailableError, InstanceIdentity
from bootstrap.jobstate import JobState
from bootstrap.notify import Notifier
from bootstrap.outcomes import FINAL_ENDS, Failure, LifeEnd, LifeFacts, LifeResult, Outcomes
from demo.stack import LocalStack, create_stack
from tests.conftest import MotoServer
from trainstack_job.contract import RESUME_COMMAND, LifeOutcome


def test_every_ledger_outcome_is_a_life_end_with_the_same_value() -> None:
    for outcome in LifeOutcome:
        assert LifeEnd(outcome.value).ledger_outcome() is outcome
    with pytest.raises(ValueError):
        LifeEnd.GAVE_UP.ledger_outcome()


@pytest.mark.parametrize(
    "end",
    [
        "completed",
        "preempted",
        "stopped",
        "cost_cap",
        "no_data",
        "replaced",
        "skipped",
        "gave_up",
        "handed_over",
        "superseded",
        "surplus",
        "standby_ended",
    ],
)
def test_a_final_end_exits_0_so_systemd_starts_no_other_life(end: str) -> None:
    assert LifeResult(LifeEnd(end)).exit_code == 0


@pytest.mark.parametrize("end", sorted(set(LifeEnd) - FINAL_ENDS))
def test_any_other_end_exits_1_so_systemd_starts_the_next_life(end: LifeEnd) -> None:
    assert LifeResult(end).exit_code == 1
    assert end in {"running", "interrupted", "failed", "stalled", "killed", "replace"}


# -- only the lease's holder ends a job (bootstrap/outcomes.py `not_the_holder`) ---------------------------


class Answers:
    """What `holds_lease` answers, one call after the other (the last answer repeats)."""

    def __init__(self, *answers: bool | None) -> None:
        self._answers = list(answers)
        self.calls = 0

    def __call__(self) -> bool | None:
        self.calls += 1
        return self._answers.pop(0) if len(self._answers) > 1 else self._answers[0]


@pytest.fixture()
def ending(life_end: Ending) -> Callable[..., Any]:
    """The outcome handlers of a life that trained and holds (or held) the job's lease, against moto: its
    ledger life begun, the trainer's results on disk; `end(outcome, *answers)` ends it."""

    def end(outcome: LifeEnd | Failure, *answers: bool | None) -> tuple[LifeResult, Answers]:
        holds = Answers(*answers)
        handlers = life_end.handlers(holds_lease=holds)
        return handlers.finish(outcome, life_end.facts("final-upload")), holds

    return end


def _results(stack: LocalStack) -> list[str]:
    listed = stack.client("s3").list_objects_v2(Bucket=stack.bucket, Prefix="results/")
    return [item["Key"] for item in listed.get("Contents", [])]


def test_a_completion_by_the_holder_uploads_writes_the_status_mails_once_and_scales_in(
    ending: Callable[..., Any], stack: LocalStack
) -> None:
    result, holds = ending(LifeEnd.COMPLETED, True)
    assert result.outcome is LifeEnd.COMPLETED and holds.calls == 2, (
        "proved before the end and before the status"
    )
    assert sorted(_results(stack)) == ["results/metrics.json", "results/model.pt"]
    ledger = stack.read_json("state/ledger.json")
    assert ledger is not None and ledger["status"] == "completed"
    assert [a["Subject"] for a in stack.alerts()] == ["trainstack [trainstack-test]: training completed"]
    assert stack.group()["DesiredCapacity"] == 0


@pytest.mark.parametrize(
    "outcome",
    [
        LifeEnd.COMPLETED,
        LifeEnd.STOPPED,
        LifeEnd.COST_CAP,
        LifeEnd.CANCELLED,
        LifeEnd.NO_DATA,
        Failure(LifeEnd.FAILED, "trainer exited 1", [], permanent=True),
    ],
    ids=["completed", "stopped", "cost_cap", "cancelled", "no_data", "failed"],
)
def test_a_life_whose_lease_another_holds_ends_superseded_and_ends_nothing_of_the_job(
    ending: Callable[..., Any], stack: LocalStack, outcome: LifeEnd | Failure
) -> None:
    desired = stack.group()["DesiredCapacity"]
    result, _ = ending(outcome, False)
    assert result.outcome is LifeEnd.SUPERSEDED and result.exit_code == 0
    assert _results(stack) == [], "a superseded life uploaded results"
    ledger = stack.read_json("state/ledger.json")
    assert ledger is not None and ledger["status"] == "running", "a superseded life changed the job's status"
    assert ledger["lives"][-1]["outcome"] == "superseded" and ledger["consecutive_failures"] == 0
    assert stack.alerts() == [], "a superseded life sent an e-mail"
    assert stack.group()["DesiredCapacity"] == desired, "a superseded life scaled the group in"


def test_a_life_that_cannot_prove_its_lease_leaves_the_end_to_the_next_life_here(
    ending: Callable[..., Any], stack: LocalStack
) -> None:
    desired = stack.group()["DesiredCapacity"]
    before = stack.read_json("state/ledger.json")
    assert before is not None
    # A crash counter and interruptions from earlier lives: an expired lease says nothing of either.
    seeded = before | {"consecutive_failures": 1, "interruptions": 2}
    stack.client("s3").put_object(
        Bucket=stack.bucket, Key="state/ledger.json", Body=json.dumps(seeded).encode()
    )
    result, _ = ending(LifeEnd.COMPLETED, None)
    assert result.outcome is LifeEnd.LEASE_EXPIRED and result.again and result.next_job == "legacy"
    assert result.exit_code == 0
    assert _results(stack) == [] and stack.alerts() == []
    ledger = stack.read_json("state/ledger.json")
    assert ledger is not None and ledger["status"] == "running"
    assert ledger["lives"][-1]["outcome"] == "lease_expired"
    assert (ledger["consecutive_failures"], ledger["interruptions"]) == (1, 2), (
        "neither a failure nor a reset"
    )
    assert stack.group()["DesiredCapacity"] == desired


def test_a_lease_lost_during_the_results_upload_writes_no_status_mails_nothing_and_scales_nothing(
    ending: Callable[..., Any], stack: LocalStack
) -> None:
    """Proved before the end, lost by the time the results were up (only when S3 was unreachable from here
    for the lease's length): the status is the job's end, and it is the new holder's to write."""
    desired = stack.group()["DesiredCapacity"]
    result, holds = ending(LifeEnd.COMPLETED, True, False)
    assert result.outcome is LifeEnd.SUPERSEDED and holds.calls == 2
    ledger = stack.read_json("state/ledger.json")
    assert ledger is not None and ledger["status"] == "running"
    assert stack.alerts() == [] and stack.group()["DesiredCapacity"] == desired


def test_a_life_that_stopped_on_its_own_clock_is_lease_expired_in_the_ledger_with_its_phase(
    life_end: Ending, stack: LocalStack
) -> None:
    result = life_end.end(LifeEnd.LEASE_EXPIRED, phase="final-upload", holds_lease=Answers(True))
    assert result == LifeResult(LifeEnd.LEASE_EXPIRED, next_job="legacy", again=True)
    life = life_end.ledger()["lives"][-1]
    assert (life["outcome"], life["phase"]) == ("lease_expired", "final-upload")
    assert stack.alerts() == []
    assert life_end.said(
        "lease expired on this instance's clock: stopped writing the job; the next life here serves it again "
        "(a standby may hold it by now)"
    )


def test_an_end_no_handler_knows_is_a_bug_said_as_such(life_end: Ending) -> None:
    with pytest.raises(AssertionError, match=re.escape("unknown outcome LifeEnd.KILLED")):
        life_end.end(LifeEnd.KILLED)


@pytest.mark.parametrize(
    "end", [LifeEnd.HANDED_OVER, LifeEnd.PREEMPTED, LifeEnd.SURPLUS, LifeEnd.STANDBY_ENDED]
)
def test_ends_that_end_nothing_of_the_job_ask_for_no_proof(ending: Callable[..., Any], end: LifeEnd) -> None:
    result, holds = ending(end, False)
    assert result.outcome is end and holds.calls == 0


# -- each end, as the job, the group, the mail and the ledger see it ----------------------------------------


class Broken:
    """A collaborator (the fleet, the IMDS) whose named methods raise `error`; the rest pass through."""

    def __init__(self, inner: Any, error: Exception, *methods: str) -> None:
        self._inner = inner
        self._error = error
        self._methods = set(methods)
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name not in self._methods:
            return getattr(self._inner, name)

        def fail(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            raise self._error

        return fail


@dataclass
class Parts:
    """What the outcome handlers of one life work with, as the agent builds them (bootstrap/lifecycle.py),
    against the stack in moto; no IMDS, no trainer."""

    config: AgentConfig
    log: EventLog
    job: JobState
    s3: Any
    fleet: Fleet
    notifier: Notifier
    imds: ImdsClient
    identity: InstanceIdentity

    @classmethod
    def of(cls, stack: LocalStack, tmp_path: Path) -> Parts:
        config = stack.agent_config(scratch_dir=str(tmp_path / "instance"))
        log = EventLog(stream=io.StringIO())
        s3 = stack.client("s3")
        identity = InstanceIdentity(
            instance_id=stack.instance_ids()[0],
            instance_type="g5.xlarge",
            az="us-east-1a",
            region=stack.region,
            lifecycle="spot",
        )
        return cls(
            config,
            log,
            JobState(s3, config, log),
            s3,
            Fleet(stack.client("autoscaling"), config.group_name),
            Notifier(stack.client("sns"), config.topic_arn, config.stack, log),
            ImdsClient(),
            identity,
        )


class Ending:
    """One life of the legacy job against moto, its ledger life begun and its results on disk; `handlers()`
    builds the outcome handlers as the agent does, with what each test changes."""

    def __init__(self, life: Parts, stack: LocalStack, output: Path) -> None:
        self.life = life
        self.stack = stack
        self.output = output
        self.identity: InstanceIdentity | None = life.identity
        self.lines: list[str] = []
        life.log.add_sink(self.lines.append)

    def handlers(
        self,
        *,
        next_job: Callable[[], str | None] | None = None,
        holds_lease: Callable[[], bool | None] | None = None,
        builtin_trainer: bool = True,
        fleet: Any = None,
        imds: Any = None,
        release_wait_seconds: float = 0,
        instance_id: Callable[[], str | None] | None = None,
        **config: Any,
    ) -> Outcomes:
        life = self.life
        return Outcomes(
            dataclasses.replace(life.config, **config),
            life.log,
            life.job,
            life.s3,
            fleet or life.fleet,
            life.notifier,
            imds or life.imds,
            builtin_trainer=builtin_trainer,
            release_wait_seconds=release_wait_seconds,
            next_job=next_job,
            holds_lease=holds_lease,
            instance_id=instance_id,
        )

    def facts(self, phase: str = "training", **changes: Any) -> LifeFacts:
        return dataclasses.replace(
            LifeFacts(identity=self.identity, phase=phase, output_dir=self.output), **changes
        )

    def end(self, outcome: LifeEnd | Failure, phase: str = "training", **options: Any) -> LifeResult:
        return self.handlers(**options).finish(outcome, self.facts(phase))

    def ledger(self) -> dict[str, Any]:
        ledger = self.stack.read_json("state/ledger.json")
        assert ledger is not None
        return ledger

    def seed(self, **fields: Any) -> None:
        """The ledger as other lives or nodes left it."""
        self.stack.client("s3").put_object(
            Bucket=self.stack.bucket,
            Key="state/ledger.json",
            Body=json.dumps(self.ledger() | fields).encode(),
        )

    def new_life(self) -> None:
        assert self.identity is not None
        self.life.job.ledger_store.begin_life(self.identity, None, utc_now(), stale_after_seconds=60)

    @property
    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.lines]

    def said(self, message: str) -> list[dict[str, Any]]:
        return [event for event in self.events if event["message"] == message]

    def desired(self) -> int:
        return int(self.stack.group()["DesiredCapacity"])


@pytest.fixture(scope="module")
def stack(moto_server: MotoServer) -> Iterator[LocalStack]:
    """One stack in moto for this module (making one is most of a test's time here); `life_end` gives each
    test an empty bucket, no mail and a group of one."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint_url)
        yield create_stack(name="trainstack-test")
        requests.post(f"{moto_server.endpoint_url}/moto-api/reset", timeout=10)


def _fresh(stack: LocalStack) -> None:
    s3 = stack.client("s3")
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=stack.bucket):
        for item in page.get("Contents", []):
            s3.delete_object(Bucket=stack.bucket, Key=item["Key"])
    stack.client("autoscaling").set_desired_capacity(AutoScalingGroupName=stack.group_name, DesiredCapacity=1)
    stack.alerts()


# The journal's stage of each line the outcome handlers write: operators filter the agent's journal by it
# (`stage == "end"` is how each life ended).
STAGES = {
    "lease expired on this instance's clock: stopped writing the job; the next life here serves it again (a "
    "standby may hold it by now)": "end",
    "completed; the node that ran rank 0 uploaded the results": "end",
    "results uploaded": "results",
    "completed": "end",
    "completed; scaled to zero": "end",
    "life failed; systemd starts the next life": "end",
    "the job had already been given up by another node": "end",
    "preempted: the group's replacement resumes from the confirmed checkpoint": "end",
    "cost cap reached": "end",
    "cost cap reached; scaled to zero": "end",
    "cancelled": "end",
    "cancelled; scaled to zero": "end",
    "yielded to a --now job: back in the queue, resumes from its confirmed checkpoint": "end",
    "instance marked unhealthy; the group replaces it": "end",
    "handed over: the standby continues from the confirmed step": "end",
    "superseded: another instance holds the lease; this one stopped writing": "end",
    "superseded: a newer generation owns the job; this node stopped writing": "end",
    "surplus: the job has its writer and its standby": "end",
    "standby ended without taking the job over": "end",
    "no job is running and the queue holds none: scaling the group to zero": "queue",
    "cannot read the job queue; scaling to zero": "queue",
    "the next queued job runs on this instance": "queue",
    "group desired capacity set to 0": "fleet",
    "scale to zero FAILED: set the group's desired capacity to 0 by hand": "fleet",
    "left the group": "fleet",
    "could not leave the group": "fleet",
    "instance not terminating; drain hook left alone": "release",
    "no job of the pool needs this instance: it leaves the group": "queue",
    "left the group, one instance fewer wanted; the pool's other jobs run on": "fleet",
    "drain hook completed; the group terminates this instance now": "release",
}


def stage_of(message: str) -> str | None:
    if message in STAGES:
        return STAGES[message]
    if message.startswith("training failed") or message.endswith(
        ": another node of this job already said so"
    ):
        return "end"
    if message.startswith("drain hook not completed"):
        return "release"
    return None


@pytest.fixture()
def life_end(stack: LocalStack, tmp_path: Path) -> Iterator[Ending]:
    _fresh(stack)
    life = Parts.of(stack, tmp_path)
    life.job.ledger_store.begin_life(life.identity, None, utc_now(), stale_after_seconds=60)
    output = tmp_path / "output"
    output.mkdir()
    (output / "model.pt").write_bytes(b"weights")
    (output / "metrics.json").write_text('{"final": {"val_acc": 0.91234, "epochs": 3}, "val_acc": 0.1}')
    stack.alerts()
    ending = Ending(life, stack, output)
    yield ending
    for event in ending.events:
        assert event["stage"] == (stage_of(event["message"]) or event["stage"]), event
        assert isinstance(event["stage"], str), event


def test_every_line_of_an_end_is_under_its_stage() -> None:
    """The check `life_end` makes of every test's lines, itself checked."""
    assert stage_of("training failed 3 times in a row; group scaled to zero") == "end"
    assert stage_of("stopped: another node of this job already said so") == "end"
    assert stage_of("drain hook not completed (…)") == "release"
    assert stage_of("SNS message sent") is None


SUBJECT = "trainstack [trainstack-test]: "


def test_a_completion_mails_its_duration_cost_metrics_and_where_the_results_are(
    life_end: Ending, stack: LocalStack
) -> None:
    life_end.seed(interruptions=2)
    result = life_end.end(LifeEnd.COMPLETED)
    assert result == LifeResult(LifeEnd.COMPLETED) and result.exit_code == 0
    [alert] = stack.alerts()
    assert alert["Subject"] == SUBJECT + "training completed"
    lines = alert["Message"].splitlines()
    assert lines[0] == "Training completed: job legacy."
    assert re.fullmatch(r"  duration: 0m0\ds over 1 instance life/lives", lines[1]), lines[1]
    assert lines[2] == "  spot interruptions survived: 2"
    assert re.fullmatch(r"  estimated cost: \$\d+\.\d{4}", lines[3])
    assert lines[4:7] == ["Final metrics:", "  val_acc: 0.9123", "  epochs: 3"], "the trainer's final section"
    assert lines[7:] == [
        f"Artifacts: s3://{stack.bucket}/results/",
        "Fetch them with: trainstack results pull --job legacy",
        f"The group {stack.group_name} has been scaled to zero; nothing bills any more.",
    ]
    assert life_end.desired() == 0
    ledger = life_end.ledger()
    assert ledger["status"] == "completed" and ledger["lives"][-1]["outcome"] == "completed"
    [done] = life_end.said("completed; scaled to zero")
    assert done["metrics"] == {"final": {"val_acc": 0.91234, "epochs": 3}, "val_acc": 0.1}
    assert done["cost_usd"] == ledger["total_cost_usd"]
    [uploaded] = life_end.said("results uploaded")
    assert (uploaded["uri"], uploaded["files"]) == (f"s3://{stack.bucket}/results/", 2)


def test_a_completion_with_a_job_queued_goes_on_to_it_and_keeps_the_group(
    life_end: Ending, stack: LocalStack
) -> None:
    desired = life_end.desired()
    result = life_end.end(LifeEnd.COMPLETED, next_job=lambda: "next-1a2b3c4d")
    assert result == LifeResult(LifeEnd.COMPLETED, next_job="next-1a2b3c4d")
    assert life_end.desired() == desired, "the next job runs on this instance"
    [alert] = stack.alerts()
    assert alert["Subject"] == SUBJECT + "training completed; next: next-1a2b3c4d"
    lines = alert["Message"].splitlines()
    assert lines[-1] == "The next queued job, next-1a2b3c4d, runs on this instance now (no reboot)."
    assert not any("scaled to zero" in line for line in lines)
    assert life_end.ledger()["status"] == "completed"
    assert life_end.said("the next queued job runs on this instance")[0]["next_job"] == "next-1a2b3c4d"
    [done] = life_end.said("completed")
    assert done["metrics"] == {"final": {"val_acc": 0.91234, "epochs": 3}, "val_acc": 0.1}
    assert done["cost_usd"] == life_end.ledger()["total_cost_usd"]


def test_a_completions_duration_counts_from_the_jobs_first_life(life_end: Ending, stack: LocalStack) -> None:
    ledger = life_end.ledger()
    first = ledger["lives"][0] | {"started_at": iso(utc_now() - timedelta(hours=2, minutes=3))}
    life_end.seed(lives=[first, *ledger["lives"][1:]])
    life_end.life.job.ledger_store.load()
    life_end.end(LifeEnd.COMPLETED)
    [alert] = stack.alerts()
    assert re.fullmatch(r"  duration: 2h03m0\ds over 1 instance life/lives", alert["Message"].splitlines()[1])


def test_a_queue_that_cannot_be_read_scales_the_group_to_zero(life_end: Ending, stack: LocalStack) -> None:
    def unreadable() -> str | None:
        raise RuntimeError("queue.json: AccessDenied")

    result = life_end.end(LifeEnd.COMPLETED, next_job=unreadable)
    assert result == LifeResult(LifeEnd.COMPLETED)
    assert life_end.desired() == 0, "an unreadable queue must never keep a GPU billing"
    [said] = life_end.said("cannot read the job queue; scaling to zero")
    assert said["stage"] == "queue" and said["error"] == "queue.json: AccessDenied"
    assert [a["Subject"] for a in stack.alerts()] == [SUBJECT + "training completed"]


def test_a_job_of_its_own_names_itself_in_every_subject(life_end: Ending, stack: LocalStack) -> None:
    life_end.end(LifeEnd.STOPPED, job_id="resnet-1a2b3c4d")
    [alert] = stack.alerts()
    assert alert["Subject"] == SUBJECT + "job resnet-1a2b3c4d: stopped on request; group scaled to zero"


def test_a_completion_whose_metrics_are_unreadable_says_so_and_still_completes(
    life_end: Ending, stack: LocalStack
) -> None:
    for body, says in [
        ("[1, 2]", "  (no metrics.json found)"),
        ("{not json", "  (no metrics.json found)"),
        ('{"note": ["a"]}', "  (metrics.json has no scalar values)"),
    ]:
        (life_end.output / "metrics.json").write_text(body)
        life_end.new_life()
        assert life_end.end(LifeEnd.COMPLETED).outcome is LifeEnd.COMPLETED
        [alert] = stack.alerts()
        assert says in alert["Message"].splitlines(), body
    (life_end.output / "metrics.json").write_text("[" * 100_000 + "]" * 100_000)
    life_end.new_life()
    assert life_end.end(LifeEnd.COMPLETED).outcome is LifeEnd.COMPLETED, "deep nesting is no metrics"
    assert "  (no metrics.json found)" in stack.alerts()[0]["Message"].splitlines()


def test_a_builtin_trainer_that_exits_0_without_its_model_failed(life_end: Ending, stack: LocalStack) -> None:
    (life_end.output / "model.pt").unlink()
    result = life_end.end(LifeEnd.COMPLETED)
    assert result.outcome is LifeEnd.FAILED and result.exit_code == 1
    ledger = life_end.ledger()
    assert ledger["status"] == "running" and ledger["lives"][-1]["outcome"] == "failed"
    assert ledger["consecutive_failures"] == 1
    assert _results(stack) == [] and stack.alerts() == []
    [failed] = life_end.said("life failed; systemd starts the next life")
    assert failed["reason"] == f"trainer exited 0 but {life_end.output / 'model.pt'} is missing"


def test_a_builtin_trainer_without_any_result_names_each_missing_file_and_may_give_up(
    life_end: Ending, stack: LocalStack
) -> None:
    (life_end.output / "model.pt").unlink()
    (life_end.output / "metrics.json").unlink()
    life_end.life.log.event("train", "the agent's last line")
    result = life_end.end(LifeEnd.COMPLETED, max_consecutive_failures=1)
    assert result == LifeResult(LifeEnd.GAVE_UP)
    model, metrics = life_end.output / "model.pt", life_end.output / "metrics.json"
    reason = f"trainer exited 0 but {model}, {metrics} is missing"
    [alert] = stack.alerts()
    lines = alert["Message"].splitlines()
    assert lines[1] == f"Last failure on {life_end.life.identity.instance_id}: {reason}"
    assert any("the agent's last line" in line for line in lines), "the agent's own last lines"


def test_a_users_job_completes_with_whatever_it_wrote(life_end: Ending, stack: LocalStack) -> None:
    (life_end.output / "model.pt").unlink()
    (life_end.output / "metrics.json").unlink()
    (life_end.output / "report.txt").write_text("done")
    result = life_end.end(LifeEnd.COMPLETED, builtin_trainer=False)
    assert result.outcome is LifeEnd.COMPLETED
    assert _results(stack) == ["results/report.txt"]
    assert life_end.ledger()["status"] == "completed"


def test_a_results_upload_that_fails_is_a_failure_the_next_life_retries(
    life_end: Ending, stack: LocalStack
) -> None:
    real = life_end.life.s3
    handlers = life_end.handlers()
    handlers.s3 = Broken(real, RuntimeError("S3 said no\nsecond line"), "upload_file", "put_object")
    result = handlers.finish(LifeEnd.COMPLETED, life_end.facts())
    assert result.outcome is LifeEnd.FAILED
    [failed] = life_end.said("life failed; systemd starts the next life")
    assert failed["reason"] == "results upload failed: S3 said no"
    assert life_end.ledger()["status"] == "running" and stack.alerts() == []
    assert life_end.desired() == 1

    life_end.new_life()
    life_end.life.log.event("results", "the agent's last line")
    result = handlers.finish(LifeEnd.COMPLETED, life_end.facts())
    assert result.outcome is LifeEnd.FAILED
    limited = life_end.handlers(max_consecutive_failures=1)
    limited.s3 = handlers.s3
    life_end.new_life()
    assert limited.finish(LifeEnd.COMPLETED, life_end.facts()) == LifeResult(LifeEnd.GAVE_UP)
    [alert] = stack.alerts()
    lines = alert["Message"].splitlines()
    assert (
        lines[1] == f"Last failure on {life_end.life.identity.instance_id}: results upload failed: S3 said no"
    )
    assert any("the agent's last line" in line for line in lines)


def test_a_link_the_job_left_in_its_output_is_not_uploaded_and_is_said(
    life_end: Ending, stack: LocalStack, tmp_path: Path
) -> None:
    secret = tmp_path / "secret"
    secret.write_text("root's")
    (life_end.output / "leak").symlink_to(secret)
    assert life_end.end(LifeEnd.COMPLETED).outcome is LifeEnd.COMPLETED
    assert sorted(_results(stack)) == ["results/metrics.json", "results/model.pt"]
    warned = [e for e in life_end.events if e["stage"] == "results" and e.get("level") == "warning"]
    assert len(warned) == 1 and "leak" in warned[0]["message"]


def test_a_follower_node_completes_without_results_status_mail_or_scale_in(
    life_end: Ending, stack: LocalStack
) -> None:
    handlers = life_end.handlers(next_job=lambda: "next-1a2b3c4d")
    result = handlers.finish(LifeEnd.COMPLETED, life_end.facts(follower=True, output_dir=None))
    assert result == LifeResult(LifeEnd.COMPLETED, next_job="next-1a2b3c4d"), "every node goes on"
    ledger = life_end.ledger()
    assert ledger["lives"][-1]["outcome"] == "completed" and ledger["status"] == "running"
    assert _results(stack) == [] and stack.alerts() == [] and life_end.desired() == 1
    assert life_end.said("completed; the node that ran rank 0 uploaded the results")


def test_a_preempted_life_counts_an_interruption_and_leaves_the_job_to_the_replacement(
    life_end: Ending, stack: LocalStack
) -> None:
    result = life_end.end(LifeEnd.PREEMPTED, phase="restore")
    assert result == LifeResult(LifeEnd.PREEMPTED) and result.exit_code == 0
    ledger = life_end.ledger()
    assert ledger["interruptions"] == 1 and ledger["status"] == "running"
    assert (ledger["lives"][-1]["outcome"], ledger["lives"][-1]["phase"]) == ("preempted", "restore")
    [said] = life_end.said("preempted: the group's replacement resumes from the confirmed checkpoint")
    assert (said["stage"], said["interruptions"]) == ("end", 1)
    assert stack.alerts() == [] and life_end.desired() == 1


def test_a_stop_ends_the_job_mails_how_to_resume_and_scales_to_zero(
    life_end: Ending, stack: LocalStack
) -> None:
    result = life_end.end(LifeEnd.STOPPED)
    assert result == LifeResult(LifeEnd.STOPPED)
    ledger = life_end.ledger()
    assert ledger["status"] == "stopped" and ledger["lives"][-1]["outcome"] == "stopped"
    [alert] = stack.alerts()
    assert alert["Subject"] == SUBJECT + "stopped on request; group scaled to zero"
    assert alert["Message"].splitlines() == [
        "Training stopped on `trainstack stop`; the newest confirmed checkpoint is kept.",
        f"Checkpoints: s3://{stack.bucket}/checkpoints/",
        f"Resume with: {RESUME_COMMAND}",
    ]
    assert life_end.desired() == 0
    [scaled] = life_end.said("group desired capacity set to 0")
    assert (scaled["stage"], scaled["group"]) == ("fleet", stack.group_name)


@pytest.mark.parametrize(
    ("end", "status"),
    [(LifeEnd.STOPPED, "stopped"), (LifeEnd.COST_CAP, "cost_cap"), (LifeEnd.CANCELLED, "cancelled")],
)
def test_a_node_whose_job_another_node_ended_the_same_way_mails_nothing_and_scales_nothing(
    life_end: Ending, stack: LocalStack, end: LifeEnd, status: str
) -> None:
    life_end.seed(status=status)
    result = life_end.end(end, next_job=lambda: "next-1a2b3c4d")
    expected_next = None if end is LifeEnd.STOPPED else "next-1a2b3c4d"
    assert result == LifeResult(end, next_job=expected_next), "it goes on with the queue as the first did"
    assert stack.alerts() == [] and life_end.desired() == 1
    assert life_end.ledger()["lives"][-1]["outcome"] == status
    assert life_end.said(f"{status}: another node of this job already said so")


def test_the_cost_cap_ends_the_job_naming_the_cost_and_the_cap(life_end: Ending, stack: LocalStack) -> None:
    result = life_end.end(LifeEnd.COST_CAP, max_cost_usd=2.5)
    assert result == LifeResult(LifeEnd.COST_CAP)
    ledger = life_end.ledger()
    assert ledger["status"] == "cost_cap" and ledger["lives"][-1]["outcome"] == "cost_cap"
    [alert] = stack.alerts()
    assert alert["Subject"] == SUBJECT + "cost cap reached; group scaled to zero"
    lines = alert["Message"].splitlines()
    assert re.fullmatch(
        r"The job's estimated cost \$\d+\.\d{4} reached the cap trainstack:maxCostUsd = \$2\.5\.", lines[0]
    )
    assert lines[1:] == [
        f"The latest checkpoint is kept in s3://{stack.bucket}/checkpoints/.",
        f"Raise trainstack:maxCostUsd, run pulumi up, then continue from it with: {RESUME_COMMAND}",
    ]
    assert life_end.desired() == 0
    [said] = life_end.said("cost cap reached; scaled to zero")
    assert said["cost_usd"] == ledger["total_cost_usd"]


def test_the_cost_cap_with_a_job_queued_goes_on_to_it(life_end: Ending, stack: LocalStack) -> None:
    result = life_end.end(LifeEnd.COST_CAP, next_job=lambda: "next-1a2b3c4d", max_cost_usd=2.5)
    assert result == LifeResult(LifeEnd.COST_CAP, next_job="next-1a2b3c4d")
    assert life_end.desired() == 1 and life_end.ledger()["status"] == "cost_cap"
    [alert] = stack.alerts()
    assert alert["Subject"] == SUBJECT + "cost cap reached; next: next-1a2b3c4d"
    [said] = life_end.said("cost cap reached")
    assert (said["next_job"], said["cost_usd"]) == ("next-1a2b3c4d", life_end.ledger()["total_cost_usd"])


def test_a_cancel_ends_the_job_and_goes_on_with_the_queue_or_scales_to_zero(
    life_end: Ending, stack: LocalStack
) -> None:
    result = life_end.end(LifeEnd.CANCELLED, next_job=lambda: "next-1a2b3c4d")
    assert result == LifeResult(LifeEnd.CANCELLED, next_job="next-1a2b3c4d")
    assert life_end.ledger()["status"] == "cancelled" and life_end.desired() == 1
    [alert] = stack.alerts()
    assert alert["Subject"] == SUBJECT + "cancelled; next: next-1a2b3c4d"
    assert alert["Message"].splitlines()[0] == (
        "The job was cancelled (`trainstack cancel`); its newest confirmed checkpoint is kept in "
        f"s3://{stack.bucket}/checkpoints/."
    )
    assert life_end.said("cancelled")[0]["next_job"] == "next-1a2b3c4d"

    life_end.new_life()
    result = life_end.end(LifeEnd.CANCELLED)
    assert result == LifeResult(LifeEnd.CANCELLED)
    assert life_end.desired() == 0
    assert [a["Subject"] for a in stack.alerts()] == [SUBJECT + "cancelled; group scaled to zero"]
    assert life_end.said("cancelled; scaled to zero")


def test_a_job_without_its_dataset_says_how_to_push_it_and_scales_to_zero(
    life_end: Ending, stack: LocalStack
) -> None:
    result = life_end.end(LifeEnd.NO_DATA, data_wait_minutes=2.5)
    assert result == LifeResult(LifeEnd.NO_DATA)
    ledger = life_end.ledger()
    assert ledger["status"] == "no_data" and ledger["lives"][-1]["outcome"] == "no_data"
    [alert] = stack.alerts()
    assert alert["Subject"] == SUBJECT + "no dataset; group scaled to zero"
    assert alert["Message"].splitlines() == [
        f"s3://{stack.bucket}/data/ stayed empty for 2.5 minutes, so this instance stopped billing.",
        "Upload the dataset: trainstack data push DIR   (train/<class>/…, val/<class>/…)",
        f"Then start training: {RESUME_COMMAND}",
    ]
    assert life_end.desired() == 0

    life_end.new_life()
    life_end.end(LifeEnd.NO_DATA, builtin_trainer=False)
    assert stack.alerts()[0]["Message"].splitlines()[1] == "Upload the dataset: trainstack data push DIR"

    life_end.new_life()
    life_end.end(LifeEnd.NO_DATA, prefixes=Prefixes(data="inputs/"))
    assert stack.alerts()[0]["Message"].startswith(f"s3://{stack.bucket}/inputs/ stayed empty")
    life_end.new_life()
    life_end.end(LifeEnd.NO_DATA, dataset="flowers", builtin_trainer=False)
    lines = stack.alerts()[0]["Message"].splitlines()
    assert lines[0].startswith(f"s3://{stack.bucket}/datasets/flowers/ stayed empty")
    assert lines[1] == "Upload the dataset: trainstack data push DIR --name flowers"


def test_a_job_that_yielded_waits_in_the_queue_again_without_a_mail(
    life_end: Ending, stack: LocalStack
) -> None:
    result = life_end.end(LifeEnd.YIELDED, phase="training", next_job=lambda: "urgent-1a2b3c4d")
    assert result == LifeResult(LifeEnd.YIELDED, next_job="urgent-1a2b3c4d")
    ledger = life_end.ledger()
    assert ledger["status"] == "queued"
    assert (ledger["lives"][-1]["outcome"], ledger["lives"][-1]["phase"]) == ("yielded", "training")
    assert stack.alerts() == [] and life_end.desired() == 1
    said = life_end.said("yielded to a --now job: back in the queue, resumes from its confirmed checkpoint")
    assert said[0]["next_job"] == "urgent-1a2b3c4d"
    life_end.new_life()
    assert life_end.end(LifeEnd.YIELDED) == LifeResult(LifeEnd.YIELDED, next_job="legacy"), (
        "the --now job went away: this job again"
    )


# -- failures, the crash counter and giving up --------------------------------------------------------


def test_a_failure_below_the_limit_ends_the_life_and_lets_systemd_start_the_next(
    life_end: Ending, stack: LocalStack
) -> None:
    failure = Failure(LifeEnd.FAILED, "trainer exited 1", ["boom"], signature={"exit_code": 1, "step": 40})
    result = life_end.end(failure)
    assert result == LifeResult(LifeEnd.FAILED) and result.exit_code == 1
    ledger = life_end.ledger()
    assert ledger["status"] == "running" and ledger["consecutive_failures"] == 1
    assert ledger["lives"][-1]["outcome"] == "failed"
    assert ledger["lives"][-1]["failure"] == {"exit_code": 1, "step": 40}
    [said] = life_end.said("life failed; systemd starts the next life")
    assert (said["reason"], said["consecutive_failures"], said["limit"]) == ("trainer exited 1", 1, 3)
    assert stack.alerts() == [] and life_end.desired() == 1


def unreadable_ledger(life_end: Ending) -> Any:
    store = life_end.life.job.ledger_store
    real = store._s3
    store._s3 = Broken(real, RuntimeError("S3 unreachable"), "get_object", "put_object")
    return real


def test_a_failure_while_s3_refuses_the_ledger_still_ends_the_life(life_end: Ending) -> None:
    unreadable_ledger(life_end)
    result = life_end.end(Failure(LifeEnd.FAILED, "trainer exited 1", []))
    assert result == LifeResult(LifeEnd.FAILED), "the next life closes this one from its heartbeat"
    [said] = life_end.said("life failed; systemd starts the next life")
    assert said["consecutive_failures"] == 0, "as the ledger was last read"


def test_a_stop_while_s3_refuses_the_ledger_still_scales_to_zero_and_mails(
    life_end: Ending, stack: LocalStack
) -> None:
    unreadable_ledger(life_end)
    assert life_end.end(LifeEnd.STOPPED) == LifeResult(LifeEnd.STOPPED)
    assert life_end.desired() == 0, "nothing bills after a stop, ledger or not"
    assert [a["Subject"] for a in stack.alerts()] == [SUBJECT + "stopped on request; group scaled to zero"]


def test_a_stall_is_a_failure_of_its_own_kind(life_end: Ending) -> None:
    result = life_end.end(Failure(LifeEnd.STALLED, "trainer stalled", []))
    assert result == LifeResult(LifeEnd.STALLED)
    life = life_end.ledger()["lives"][-1]
    assert life["outcome"] == "stalled" and "failure" not in life


def test_the_limit_of_failures_in_a_row_gives_the_job_up_mails_and_scales_to_zero(
    life_end: Ending, stack: LocalStack
) -> None:
    life_end.seed(consecutive_failures=1)
    lines = [f"line {n}" for n in range(30)]
    result = life_end.end(Failure(LifeEnd.FAILED, "trainer exited 1", lines), max_consecutive_failures=2)
    assert result == LifeResult(LifeEnd.GAVE_UP) and result.exit_code == 0
    ledger = life_end.ledger()
    assert ledger["status"] == "failed" and ledger["consecutive_failures"] == 2
    [alert] = stack.alerts()
    assert alert["Subject"] == SUBJECT + "training failed 2 times in a row; group scaled to zero"
    assert alert["Message"].splitlines() == [
        "The job failed 2 times in a row (trainstack:maxConsecutiveFailures = 2).",
        f"Last failure on {life_end.identity.instance_id}: trainer exited 1",  # type: ignore[union-attr]
        "The group has been scaled to zero so that nothing bills. Last log lines:",
        *[f"  line {n}" for n in range(5, 30)],
        f"Fix the cause, then start again: {RESUME_COMMAND}",
    ]
    assert life_end.desired() == 0
    [said] = life_end.said("training failed 2 times in a row; group scaled to zero")
    assert (said["reason"], said["consecutive_failures"]) == ("trainer exited 1", 2)


def test_a_permanent_failure_gives_up_at_once_with_its_fix(life_end: Ending, stack: LocalStack) -> None:
    failure = Failure(LifeEnd.FAILED, "bad config", ["x"], fix="correct train.lr", permanent=True)
    result = life_end.end(failure)
    assert result == LifeResult(LifeEnd.GAVE_UP)
    assert life_end.ledger()["status"] == "failed" and life_end.ledger()["consecutive_failures"] == 1
    [alert] = stack.alerts()
    assert alert["Subject"] == SUBJECT + "training failed: bad config; group scaled to zero"
    lines = alert["Message"].splitlines()
    assert lines[0] == "This failure is permanent (bad config): another instance cannot fix it."
    assert lines[-1] == "Fix: correct train.lr"
    assert life_end.desired() == 0


def test_the_same_failure_at_the_same_step_twice_gives_up_before_the_limit(
    life_end: Ending, stack: LocalStack
) -> None:
    signature = {"exit_code": 1, "step": 40}
    assert life_end.end(Failure(LifeEnd.FAILED, "trainer exited 1", [], signature=signature)).outcome is (
        LifeEnd.FAILED
    )
    life_end.new_life()
    other = {"exit_code": 1, "step": 41}
    assert life_end.end(Failure(LifeEnd.FAILED, "trainer exited 1", [], signature=other)).outcome is (
        LifeEnd.FAILED
    ), "another step: not the same failure"
    life_end.new_life()
    result = life_end.end(
        Failure(LifeEnd.FAILED, "trainer exited 1", [], signature=other), max_consecutive_failures=10
    )
    assert result == LifeResult(LifeEnd.GAVE_UP)
    [alert] = stack.alerts()
    assert alert["Subject"] == SUBJECT + "training failed twice at the same step; group scaled to zero"
    assert alert["Message"].splitlines()[0] == (
        "The job failed the same way twice in a row (trainer exited 1 at the same step)."
    )


def test_a_failure_without_a_signature_is_never_the_same_failure(life_end: Ending) -> None:
    life_end.end(Failure(LifeEnd.FAILED, "trainer exited 1", []))
    life_end.new_life()
    result = life_end.end(Failure(LifeEnd.FAILED, "trainer exited 1", []), max_consecutive_failures=10)
    assert result == LifeResult(LifeEnd.FAILED)


def test_the_same_signature_after_a_life_that_did_not_fail_is_no_repeat(life_end: Ending) -> None:
    signature = {"exit_code": 1, "step": 40}
    life_end.end(Failure(LifeEnd.FAILED, "trainer exited 1", [], signature=signature))
    life_end.new_life()
    life_end.end(LifeEnd.PREEMPTED)
    life_end.seed(
        lives=[*life_end.ledger()["lives"][:-1], life_end.ledger()["lives"][-1] | {"failure": signature}]
    )
    life_end.new_life()
    result = life_end.end(
        Failure(LifeEnd.FAILED, "trainer exited 1", [], signature=signature), max_consecutive_failures=10
    )
    assert result == LifeResult(LifeEnd.FAILED)


def test_a_job_another_node_gave_up_on_is_not_mailed_again(life_end: Ending, stack: LocalStack) -> None:
    life_end.seed(status="failed")
    failure = Failure(LifeEnd.FAILED, "bad config", [], permanent=True)
    result = life_end.end(failure, next_job=lambda: "next-1a2b3c4d")
    assert result == LifeResult(LifeEnd.GAVE_UP, next_job="next-1a2b3c4d")
    assert stack.alerts() == [] and life_end.desired() == 1
    [said] = life_end.said("the job had already been given up by another node")
    assert said["reason"] == "bad config"


def test_a_job_given_up_with_another_queued_mails_and_goes_on_to_it(
    life_end: Ending, stack: LocalStack
) -> None:
    failure = Failure(LifeEnd.FAILED, "bad config", ["x"], permanent=True)
    result = life_end.end(failure, next_job=lambda: "next-1a2b3c4d")
    assert result == LifeResult(LifeEnd.GAVE_UP, next_job="next-1a2b3c4d")
    assert life_end.desired() == 1 and life_end.ledger()["status"] == "failed"
    [alert] = stack.alerts()
    assert alert["Subject"] == SUBJECT + "training failed: bad config; next: next-1a2b3c4d"
    lines = alert["Message"].splitlines()
    assert "Last log lines:" in lines and not any("scaled to zero" in line for line in lines)
    [said] = life_end.said("training failed: bad config")
    assert (said["consecutive_failures"], said["reason"]) == (1, "bad config")


def test_a_life_without_an_identity_that_gives_up_says_so(life_end: Ending, stack: LocalStack) -> None:
    failure = Failure(LifeEnd.FAILED, "bad config", [], permanent=True)
    result = life_end.handlers().finish(failure, life_end.facts(identity=None))
    assert result == LifeResult(LifeEnd.GAVE_UP)
    assert stack.alerts()[0]["Message"].splitlines()[1] == "Last failure on ?: bad config"


def test_a_failure_of_a_life_a_successor_already_closed_is_not_counted_twice(life_end: Ending) -> None:
    ledger = life_end.ledger()
    closed = ledger["lives"][-1] | {"outcome": "interrupted"}
    life_end.seed(lives=[*ledger["lives"][:-1], closed])
    life_end.life.job.ledger_store.load()
    result = life_end.end(Failure(LifeEnd.FAILED, "trainer exited 1", [], signature={"exit_code": 1}))
    assert result == LifeResult(LifeEnd.FAILED)
    after = life_end.ledger()
    assert after["consecutive_failures"] == 0 and after["lives"][-1]["outcome"] == "interrupted"


def test_an_agent_that_keeps_failing_to_start_gives_the_job_up(life_end: Ending, stack: LocalStack) -> None:
    identity = life_end.identity
    assert identity is not None
    result = life_end.handlers().gave_up_on_starting(identity)
    assert result == LifeResult(LifeEnd.GAVE_UP)
    assert life_end.ledger()["status"] == "failed" and life_end.desired() == 0
    [alert] = stack.alerts()
    assert alert["Subject"] == SUBJECT + "the agent keeps failing; group scaled to zero"
    assert alert["Message"].splitlines() == [
        f"The trainstack agent on {identity.instance_id} failed to start repeatedly.",
        "Read why with: trainstack logs  (or journalctl -u trainstack-agent on the instance).",
    ]


def test_an_agent_without_a_job_that_keeps_failing_touches_no_ledger(
    life_end: Ending, stack: LocalStack
) -> None:
    before = life_end.ledger()
    assert life_end.identity is not None
    life_end.handlers().gave_up_on_starting(life_end.identity, has_job=False)
    assert life_end.ledger() == before and life_end.desired() == 0
    assert len(stack.alerts()) == 1


def test_a_broken_gpu_is_replaced_unless_the_job_is_given_up(life_end: Ending, stack: LocalStack) -> None:
    identity = life_end.identity
    assert identity is not None
    for n in range(12):
        life_end.life.log.event("gpu", f"nvidia-smi line {n}")
    result = life_end.end(LifeEnd.REPLACE)
    assert result == LifeResult(LifeEnd.REPLACED) and result.exit_code == 0
    [failed] = life_end.said("life failed; systemd starts the next life")
    assert failed["reason"] == "GPU preflight failed after the driver repair"
    ledger = life_end.ledger()
    assert ledger["consecutive_failures"] == 1 and ledger["lives"][-1]["outcome"] == "failed"
    [alert] = stack.alerts()
    assert alert["Subject"] == SUBJECT + f"GPU broken on {identity.instance_id}; replacing it"
    lines = alert["Message"].splitlines()
    assert lines[0] == (
        f"nvidia-smi / torch CUDA failed on {identity.instance_id} ({identity.instance_type}, {identity.az}) "
        "even after reinstalling the driver."
    )
    assert lines[1] == "The instance is marked unhealthy; the group launches a replacement."
    tail = list(life_end.life.log.tail)
    assert lines[2:] == [f"  {line}" for line in tail[-12:-2]], "the agent's last ten lines before the mail"
    health = stack.client("autoscaling").describe_auto_scaling_instances(InstanceIds=[identity.instance_id])
    assert health["AutoScalingInstances"][0]["HealthStatus"].upper() == "UNHEALTHY"
    assert life_end.said("instance marked unhealthy; the group replaces it")

    life_end.new_life()
    result = life_end.end(LifeEnd.REPLACE, max_consecutive_failures=1)
    assert result == LifeResult(LifeEnd.GAVE_UP), "given up: no replacement is launched for it"
    assert [a["Subject"] for a in stack.alerts()] == [
        SUBJECT + "training failed 2 times in a row; group scaled to zero"
    ]


# -- one writer: handed over, superseded, surplus, a standby's end ------------------------------------------


def test_a_life_that_handed_over_leaves_the_group_without_lowering_it_at_its_size(
    life_end: Ending, stack: LocalStack
) -> None:
    identity = life_end.identity
    assert identity is not None
    result = life_end.end(LifeEnd.HANDED_OVER, phase="training")
    assert result == LifeResult(LifeEnd.HANDED_OVER) and result.exit_code == 0
    ledger = life_end.ledger()
    assert (ledger["lives"][-1]["outcome"], ledger["lives"][-1]["phase"]) == ("handed_over", "training")
    assert (
        ledger["consecutive_failures"] == 0 and ledger["interruptions"] == 0 and ledger["status"] == "running"
    )
    assert life_end.said("handed over: the standby continues from the confirmed step")
    [left] = life_end.said("left the group")
    assert (left["decrement"], left["group"]) == (False, stack.group_name)
    assert identity.instance_id not in stack.instance_ids() or stack.lifecycle_state(identity.instance_id)
    assert stack.alerts() == []


@pytest.mark.parametrize(
    ("end", "message"),
    [
        (LifeEnd.SURPLUS, "surplus: the job has its writer and its standby"),
        (LifeEnd.SUPERSEDED, "superseded: another instance holds the lease; this one stopped writing"),
    ],
)
def test_a_surplus_or_superseded_instance_leaves_and_lowers_a_group_above_the_jobs_size(
    life_end: Ending, stack: LocalStack, end: LifeEnd, message: str
) -> None:
    stack.client("autoscaling").set_desired_capacity(AutoScalingGroupName=stack.group_name, DesiredCapacity=2)
    result = life_end.end(end)
    assert result == LifeResult(end)
    assert life_end.ledger()["lives"][-1]["outcome"] == end.value
    assert life_end.said(message)
    assert life_end.said("left the group")[0]["decrement"] is True
    assert life_end.desired() == 1


def test_a_multi_node_node_superseded_names_its_generation(life_end: Ending) -> None:
    life_end.end(LifeEnd.SUPERSEDED, instance_count=2)
    assert life_end.said("superseded: a newer generation owns the job; this node stopped writing")
    life_end.new_life()
    life_end.end(LifeEnd.SUPERSEDED, instance_count=2, user_job={"name": "mine", "command": ["x"]})
    assert len(life_end.said("superseded: another instance holds the lease; this one stopped writing")) == 1


def test_a_group_that_refuses_the_leave_is_only_said(life_end: Ending, stack: LocalStack) -> None:
    fleet = Broken(life_end.life.fleet, RuntimeError("AccessDenied\nmore"), "leave")
    result = life_end.end(LifeEnd.SURPLUS, fleet=fleet)
    assert result == LifeResult(LifeEnd.SURPLUS)
    [said] = life_end.said("could not leave the group")
    assert (said["stage"], said["error"], said["level"]) == ("fleet", "AccessDenied", "warning")
    assert life_end.said("left the group") == []


def test_a_life_without_an_identity_leaves_nothing(life_end: Ending, stack: LocalStack) -> None:
    fleet = Broken(life_end.life.fleet, RuntimeError("must not be called"), "leave")
    result = life_end.handlers(fleet=fleet).finish(LifeEnd.SURPLUS, life_end.facts(identity=None))
    assert result == LifeResult(LifeEnd.SURPLUS) and fleet.calls == []


@pytest.mark.parametrize(("status", "goes_on"), [("running", False), ("completed", True), ("queued", True)])
def test_a_standby_whose_wait_ended_stays_and_goes_on_with_the_queue_only_once_the_job_is_over(
    life_end: Ending, stack: LocalStack, status: str, goes_on: bool
) -> None:
    life_end.seed(status=status)
    fleet = Broken(life_end.life.fleet, RuntimeError("a standby's end must not leave"), "leave")
    result = life_end.end(LifeEnd.STANDBY_ENDED, next_job=lambda: "next-1a2b3c4d", fleet=fleet)
    assert result == LifeResult(LifeEnd.STANDBY_ENDED, next_job="next-1a2b3c4d" if goes_on else None)
    assert fleet.calls == [] and life_end.said("standby ended without taking the job over")
    assert life_end.ledger()["lives"][-1]["outcome"] == "standby_ended"


def test_a_standby_that_cannot_read_the_ledger_exits_as_before(life_end: Ending) -> None:
    """Whether the job is over is unknown: the agent exits and the next boot binds afresh, never idling."""
    life_end.seed(status="completed")
    store = life_end.life.job.ledger_store
    real_s3 = store._s3
    store._s3 = Broken(real_s3, RuntimeError("no"), "get_object")
    try:
        result = life_end.end(LifeEnd.STANDBY_ENDED, next_job=lambda: "next-1a2b3c4d")
    finally:
        store._s3 = real_s3
    assert result == LifeResult(LifeEnd.STANDBY_ENDED)


# -- scaling in and the drain hook ------------------------------------------------------------------


def test_a_scale_to_zero_that_fails_still_mails_saying_so_and_raises(
    life_end: Ending, stack: LocalStack
) -> None:
    fleet = Broken(life_end.life.fleet, RuntimeError("Throttling\nx"), "scale_to_zero")
    with pytest.raises(RuntimeError, match="Throttling"):
        life_end.end(LifeEnd.STOPPED, fleet=fleet)
    [alert] = stack.alerts()
    assert alert["Subject"] == SUBJECT + "stopped on request; group scaled to zero (scale to zero FAILED)"
    [said] = life_end.said("scale to zero FAILED: set the group's desired capacity to 0 by hand")
    assert (said["stage"], said["group"], said["error"]) == ("fleet", stack.group_name, "Throttling")
    assert life_end.said("group desired capacity set to 0") == []


def test_no_job_and_an_empty_queue_scale_the_group_to_zero_without_a_ledger(
    life_end: Ending, stack: LocalStack
) -> None:
    before = life_end.ledger()
    result = life_end.handlers().nothing_queued()
    assert result == LifeResult(LifeEnd.NO_JOB) and result.exit_code == 0
    assert life_end.desired() == 0 and life_end.ledger() == before and stack.alerts() == []
    assert life_end.said("no job is running and the queue holds none: scaling the group to zero")
    [scaled] = life_end.said("group desired capacity set to 0")
    assert scaled["group"] == stack.group_name

    fleet = Broken(life_end.life.fleet, RuntimeError("Throttling"), "scale_to_zero")
    with pytest.raises(RuntimeError):
        life_end.handlers(fleet=fleet).nothing_queued()
    [said] = life_end.said("scale to zero FAILED: set the group's desired capacity to 0 by hand")
    assert (said["stage"], said["group"], said["error"]) == ("fleet", stack.group_name, "Throttling")


class Imds:
    """The instance's lifecycle state as IMDS says it, one answer a call (the last repeats)."""

    def __init__(self, *answers: str | Exception) -> None:
        self.answers = list(answers)
        self.asked: list[str] = []

    def get(self, path: str) -> str:
        self.asked.append(path)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


class Hook:
    """The fleet's drain hook: completes, or refuses with `error`."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.completed: list[tuple[str, str]] = []

    def complete_lifecycle_action(self, hook: str, instance_id: str) -> None:
        if self.error is not None:
            raise self.error
        self.completed.append((hook, instance_id))


def test_a_terminating_instance_completes_its_drain_hook_at_once(
    life_end: Ending, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bootstrap.outcomes as outcomes

    slept: list[float] = []
    now = [0.0]

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    monkeypatch.setattr(outcomes.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(outcomes.time, "sleep", sleep)
    identity = life_end.identity
    assert identity is not None
    imds = Imds(ImdsUnavailableError("no answer"), "InService", "Terminated")
    hook = Hook()
    life_end.handlers(imds=imds, fleet=hook, release_wait_seconds=60).release_instance(identity)
    assert hook.completed == [("trainstack-drain", identity.instance_id)]
    assert imds.asked == ["autoscaling/target-lifecycle-state"] * 3 and slept == [2, 2]
    [said] = life_end.said("drain hook completed; the group terminates this instance now")
    assert (said["stage"], said["hook"]) == ("release", "trainstack-drain")


def test_an_instance_that_is_not_terminating_leaves_its_drain_hook_alone(
    life_end: Ending, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bootstrap.outcomes as outcomes

    now = [0.0]
    monkeypatch.setattr(outcomes.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(outcomes.time, "sleep", lambda seconds: now.__setitem__(0, now[0] + seconds))
    assert life_end.identity is not None
    hook = Hook()
    imds = Imds("InService")
    life_end.handlers(imds=imds, fleet=hook, release_wait_seconds=8).release_instance(life_end.identity)
    assert hook.completed == [] and len(imds.asked) == 4, "asked every 2 s within the 8 s"
    [said] = life_end.said("instance not terminating; drain hook left alone")
    assert (said["stage"], said["hook"]) == ("release", "trainstack-drain")


def test_a_drain_hook_the_group_refuses_is_left_to_its_timeout(life_end: Ending) -> None:
    assert life_end.identity is not None
    error = ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "CompleteLifecycleAction")
    hook = Hook(error)
    life_end.handlers(imds=Imds("Terminated"), fleet=hook, release_wait_seconds=5).release_instance(
        life_end.identity
    )
    [said] = [e for e in life_end.events if e["stage"] == "release"]
    assert said["message"] == (
        "drain hook not completed (moto lacks CompleteLifecycleAction; on AWS this is a permission or API "
        "problem); the group releases the instance at the hook's timeout"
    )
    assert (said["hook"], said["reason"]) == ("trainstack-drain", "AccessDenied")


def test_a_group_without_a_drain_hook_asks_imds_nothing(life_end: Ending) -> None:
    assert life_end.identity is not None
    imds = Imds("Terminated")
    life_end.handlers(imds=imds, fleet=Hook(), release_wait_seconds=5, lifecycle_hook=None).release_instance(
        life_end.identity
    )
    assert imds.asked == [] and [e for e in life_end.events if e["stage"] == "release"] == []


# -- a pool running several jobs at once (`lanes` > 1): billing stops per instance ---------------------------


class Recording:
    """The fleet, passing every call through and keeping the names and arguments of those asked for."""

    def __init__(self, inner: Any, *methods: str) -> None:
        self._inner = inner
        self._methods = set(methods)
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._inner, name)
        if name not in self._methods:
            return method

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args))
            return method(*args, **kwargs)

        return call


def two_instances(life_end: Ending) -> str:
    """The pool's group at two instances; this life's instance id."""
    stack = life_end.stack
    stack.client("autoscaling").set_desired_capacity(AutoScalingGroupName=stack.group_name, DesiredCapacity=2)
    assert life_end.identity is not None
    return life_end.identity.instance_id


def test_in_a_pool_of_several_lanes_a_jobs_end_takes_only_its_instance_out(
    life_end: Ending, stack: LocalStack
) -> None:
    me = two_instances(life_end)
    fleet = Recording(life_end.life.fleet, "protect", "scale_to_zero", "leave_for_good")
    result = life_end.end(LifeEnd.STOPPED, lanes=2, instance_id=lambda: me, fleet=fleet)
    assert result == LifeResult(LifeEnd.STOPPED)
    assert life_end.desired() == 1, "one instance fewer wanted: the pool's other jobs run on"
    assert me not in stack.instance_ids()
    assert fleet.calls == [("leave_for_good", (me,))], "never the whole group to zero"
    [alert] = stack.alerts()
    assert alert["Subject"] == SUBJECT + "stopped on request; its instance left the group"
    [said] = life_end.said("left the group, one instance fewer wanted; the pool's other jobs run on")
    assert said["group"] == stack.group_name


@pytest.mark.parametrize(("lanes", "known"), [(1, True), (2, False)])
def test_a_single_lane_or_an_instance_not_yet_known_scales_the_group_to_zero(
    life_end: Ending, stack: LocalStack, lanes: int, known: bool
) -> None:
    me = two_instances(life_end)
    result = life_end.end(LifeEnd.COST_CAP, lanes=lanes, instance_id=lambda: me if known else None)
    assert result == LifeResult(LifeEnd.COST_CAP)
    assert life_end.desired() == 0
    assert [a["Subject"] for a in stack.alerts()] == [SUBJECT + "cost cap reached; group scaled to zero"]
    assert life_end.said("group desired capacity set to 0")


def test_a_pool_of_several_lanes_whose_agent_gives_no_instance_id_scales_the_group_to_zero(
    life_end: Ending, stack: LocalStack
) -> None:
    two_instances(life_end)
    assert life_end.end(LifeEnd.CANCELLED, lanes=2) == LifeResult(LifeEnd.CANCELLED)
    assert life_end.desired() == 0
    assert [a["Subject"] for a in stack.alerts()] == [SUBJECT + "cancelled; group scaled to zero"]


def test_with_nothing_to_run_an_instance_of_a_pool_of_several_lanes_leaves_alone(
    life_end: Ending, stack: LocalStack
) -> None:
    me = two_instances(life_end)
    result = life_end.handlers(lanes=3, instance_id=lambda: me).nothing_queued()
    assert result == LifeResult(LifeEnd.NO_JOB)
    assert life_end.desired() == 1 and me not in stack.instance_ids()
    assert life_end.said("no job of the pool needs this instance: it leaves the group")
    assert life_end.said("no job is running and the queue holds none: scaling the group to zero") == []
    [left] = life_end.said("left the group, one instance fewer wanted; the pool's other jobs run on")
    assert left["group"] == stack.group_name


def test_a_surplus_instance_of_a_pool_of_several_lanes_drops_its_protection_before_it_leaves(
    life_end: Ending, stack: LocalStack
) -> None:
    me = two_instances(life_end)
    fleet = Recording(life_end.life.fleet, "protect", "leave")
    assert life_end.end(LifeEnd.SURPLUS, lanes=2, fleet=fleet) == LifeResult(LifeEnd.SURPLUS)
    assert fleet.calls == [("protect", (me, False)), ("leave", (me,))]
    single = Recording(life_end.life.fleet, "protect", "leave")
    life_end.new_life()
    life_end.end(LifeEnd.SURPLUS, lanes=1, fleet=single)
    assert [name for name, _ in single.calls] == ["leave"], "one lane: no protection to drop"


@pytest.mark.parametrize(
    ("lanes", "queued", "leaves"), [(2, None, True), (2, "next-1a2b3c4d", False), (1, None, False)]
)
def test_a_standby_of_a_pool_of_several_lanes_whose_job_ended_leaves_unless_a_job_is_queued(
    life_end: Ending, stack: LocalStack, lanes: int, queued: str | None, leaves: bool
) -> None:
    me = two_instances(life_end)
    life_end.seed(status="completed")
    result = life_end.end(LifeEnd.STANDBY_ENDED, lanes=lanes, instance_id=lambda: me, next_job=lambda: queued)
    assert result == LifeResult(LifeEnd.STANDBY_ENDED, next_job=queued)
    assert (me not in stack.instance_ids()) is leaves
    assert life_end.desired() == (1 if leaves else 2)
    left = life_end.said("left the group, one instance fewer wanted; the pool's other jobs run on")
    assert len(left) == (1 if leaves else 0)
    if leaves:
        assert left[0]["group"] == stack.group_name

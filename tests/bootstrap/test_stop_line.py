"""The agent's stop line says what really happened to the job after a stop request (issue 23): only an exit
75 is a stop with a checkpoint; a job that completed first, died of the signal or exited otherwise says so,
and `checkpoint_confirmed` is true only for a stop that confirmed its checkpoint. No process, no AWS."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from bootstrap.agent_config import AgentConfig
from bootstrap.eventlog import EventLog
from bootstrap.outcomes import LifeEnd
from bootstrap.persist import PersistResult
from bootstrap.stops import StopRequests
from bootstrap.supervisor import Supervisor, TrainerExit
from bootstrap.trainer import TrainerPaths, TrainerProcess

PREEMPTED = LifeEnd.PREEMPTED
CONFIG = AgentConfig(region="us-east-1", bucket="b", group_name="g", topic_arn="arn:t", log_group="/l")


def _stop_line(tmp_path: Path, code: TrainerExit, persisted: PersistResult) -> tuple[Any, dict[str, Any]]:
    log = EventLog(io.StringIO())
    lines: list[dict[str, Any]] = []
    log.add_sink(lambda line: lines.append(json.loads(line)))
    stops = StopRequests(log, deadline_seconds=100)
    stops.request("spot")
    supervisor = Supervisor(
        CONFIG, log, stops, user_job=None, job_root=tmp_path, trainer_command=None, tick_seconds=0.1
    )
    trainer = TrainerProcess(["true"], TrainerPaths(tmp_path), {}, lambda _: None)
    outcome = supervisor.classify_exit(code, "spot", persisted, trainer)
    (line,) = [entry for entry in lines if entry["stage"] == "stop" and entry["message"] != "stop requested"]
    return outcome, line


@pytest.mark.parametrize(
    ("code", "persisted", "outcome", "message", "confirmed"),
    [
        (75, PersistResult(40, 40), LifeEnd.PREEMPTED, "trainer stopped; checkpoint confirmed in S3", True),
        # Stopped while its rendezvous formed (issue 25): nothing saved, so no step is named as confirmed.
        (
            75,
            PersistResult(None, None),
            LifeEnd.PREEMPTED,
            "trainer stopped before it saved a checkpoint; nothing new to confirm",
            True,
        ),
        (
            75,
            PersistResult(None, 20),
            LifeEnd.PREEMPTED,
            "trainer stopped before it saved a checkpoint; nothing new to confirm, the job's is step 20",
            True,
        ),
        (
            75,
            PersistResult(40, 30),
            LifeEnd.PREEMPTED,
            "trainer stopped WITHOUT its newest checkpoint",
            False,
        ),
        # The case: the job had finished its steps (checkpoint confirmed) and exited by itself.
        (0, PersistResult(50, 50), LifeEnd.COMPLETED, "trainer completed before the stop took effect", False),
        (
            -15,
            PersistResult(30, 30),
            LifeEnd.PREEMPTED,
            "killed by signal 15 before it could checkpoint",
            False,
        ),
        (LifeEnd.KILLED, PersistResult(30, 30), LifeEnd.PREEMPTED, "missed the stop deadline", False),
        (
            1,
            PersistResult(30, 30),
            LifeEnd.PREEMPTED,
            "trainer exited 1 after the stop request instead of 75",
            False,
        ),
    ],
)
def test_the_stop_line_says_how_the_job_really_ended(
    tmp_path: Path,
    code: TrainerExit,
    persisted: PersistResult,
    outcome: LifeEnd,
    message: str,
    confirmed: bool,
) -> None:
    end, line = _stop_line(tmp_path, code, persisted)
    assert end == outcome
    assert message in line["message"]
    assert line["checkpoint_confirmed"] is confirmed, (
        "confirmed only for an exit 75 whose checkpoint is in S3"
    )
    assert line["exit_code"] == (code.value if isinstance(code, LifeEnd) else code)
    if not confirmed and code != 0:
        assert f"the confirmed checkpoint (step {persisted.confirmed_step}) is kept" in line["message"]

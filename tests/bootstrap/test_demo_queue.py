"""`python -m demo` (make demo; `--queue` names the same story) end to end: the real agent, `trainstack data
push`, `run` and `cancel`. The suite's one single-instance end-to-end story.

It keeps, for the built-in trainer and for an example as shipped (shortened only through its job file), the
spot promise: the notice stops the job mid-run with a checkpoint confirmed within the notice's two minutes, a
replacement resumes from that step, 0 steps lost, its own results in S3. The trainer's replacement is another
GPU type in another zone (g6.xlarge bf16 -> g4dn.xlarge fp16: the checkpoint crosses precisions) and it ends
above the accuracy floor; every job that ran is priced at simulated spot prices; the user-data is valid and
fits; the timeline is drawn. On top of that the queue's: the second job runs on the instance that completed
the first without a new boot, a cancelled job never runs, nothing of one job lands among another's objects,
and the group is at zero once the queue is empty.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

import demo.moto_server
import demo.queue
from demo.__main__ import main
from demo.queue import Boot, CliCall, JobStart, Notice, QueuedJob, QueueResult, Sample
from demo.report_queue import checks, plot_timeline, report
from demo.run import ISOLATED_ENV
from tests.bootstrap.test_demo import run_demo
from tests.forkserver import ForkServer


@pytest.mark.slow(seconds=67)
def test_the_trainer_then_an_example_through_spot_notices_on_one_instance_and_a_cancelled_third(
    tmp_path: Path, fork_server: ForkServer
) -> None:
    # Three boots and five job lives; under pytest-timeout's 300 s. No flag: what `make demo` runs (the
    # built-in trainer's lives forked from the worker's fork server).
    output = run_demo(tmp_path, timeout=280, forked=fork_server)
    checks = [line for line in output.splitlines() if line.startswith(("PASS ", "FAIL "))]
    assert checks and not [line for line in checks if line.startswith("FAIL")], output[-6000:]
    for job in ("job 1", "job 2"):
        for promise in (
            "the notice interrupted it mid-run",
            "stopped with a confirmed checkpoint",
            "steps lost = 0",
            "resumed at the checkpoint step",
            "checkpoint confirmed within the 2-minute notice",
            "completed, its ledger its own",
            "its own results in S3",
        ):
            assert f"PASS {job}: {promise}" in output, output[-6000:]
    for promise in (
        "user-data is the environment only, valid and fits",
        "trainstack run queued each job and woke the group",
        "submitting never changed the launch template",
        "job 2 ran after job 1 on the same instance, no new boot",
        "job 2: Lightning itself restored the confirmed checkpoint",
        "job 3: cancelled before it ran, never ran",
        "job 1: resumed on another GPU type and zone, across precisions",
        "job 1: final accuracy ≥ 0.5",
        "nothing mixed between jobs",
        "each job that ran has its cost at simulated spot prices",
        "every agent exited 0",
        "group scaled to zero once the queue was empty",
        "one completion notification per completed job",
    ):
        assert f"PASS {promise}" in output, output[-6000:]
    # The trainer's results under its own job's prefix; Lightning's own restore line.
    results = next(line for line in output.splitlines() if line.startswith("PASS job 1: its own results"))
    assert "jobs/tiny-" in results and "metrics.json" in results and "model.pt" in results, results
    assert "Restored all states from the checkpoint at" in output
    # `trainstack jobs` at the end, as the user would see it: two completed, one cancelled.
    table = output[output.index("$ trainstack jobs") :].split("timeline", 1)[0]
    assert table.count("│ completed │") == 2 and table.count("│ cancelled │") == 1, table
    # An L4 life in bf16, a T4 replacement in fp16 (device profiles on this CPU), the trainer resumed across.
    assert "device profile g6.xlarge: 1x L4 24 GiB, bf16" in output
    assert "device profile g4dn.xlarge: 1x T4 16 GiB, fp16" in output
    assert "precision bf16 -> fp16, fresh fp16 loss scaler" in output
    # Piped, the demo's report is not cut at 80 columns: whole artifact names, whole lines (the CLI's own
    # progress bars before it, echoed as they were drawn, may shorten a long path).
    report = output[output.index("─ timeline ─") :]
    assert "s3://trainstack-demo-data/jobs/tiny-" in report and "/results/metrics.json" in report
    # The one cut allowed is the agent's own, at the end of a notification subject over SNS's 100 characters
    # (bootstrap/notify.py: job 1's names the next job).
    assert "…" not in re.sub(
        r"trainstack \[trainstack-demo\]: job \S+: training completed; next: \S*…", "", report
    )
    costs = [line for line in output.splitlines() if "estimated cost" in line]
    assert "at simulated spot prices (g6.xlarge $0.38/h, g4dn.xlarge $0.22/h)" in costs[0], costs
    assert len(costs) == 2 and not [line for line in costs if "$0.0000 " in line], costs
    assert (tmp_path / "demo" / "timeline.png").stat().st_size > 10_000
    assert (tmp_path / "demo" / "user-data.yaml").read_text().startswith("#cloud-config")


@contextmanager
def _no_moto() -> Iterator[str]:
    yield "http://127.0.0.1:9"


def test_no_flag_and_queue_tell_the_same_story_and_refuse_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m demo` and `python -m demo --queue` both run the queue story (stopped here at its start, no
    server); with `--job`, `--nodes` or `--rebalance` `--queue` is refused in one line."""
    for key in [*ISOLATED_ENV, "AWS_ENDPOINT_URL", "AWS_PROFILE"]:  # main() sets them: restored after
        # setenv records the value to restore, the absence included: delenv alone records nothing for an
        # absent key, and the endpoint main() sets then leaked into the next test on this worker.
        absent = key not in os.environ
        monkeypatch.setenv(key, os.environ.get(key, ""))
        if absent:
            monkeypatch.delenv(key)
    monkeypatch.setattr(demo.moto_server, "moto_server", _no_moto)

    def reached(self: demo.queue.QueueDemo) -> QueueResult:
        raise RuntimeError(f"queue story reached in {self.workdir.name}")

    monkeypatch.setattr(demo.queue.QueueDemo, "run", reached)
    for argv in ([], ["--queue"]):
        assert main([*argv, "--workdir", str(tmp_path / "story")]) == 1
        assert "demo failed: RuntimeError: queue story reached in story" in capsys.readouterr().out
    for other in (["--nodes", "2"], ["--rebalance"]):
        assert main(["--queue", *other]) == 2
        assert "leave out --job, --nodes and --rebalance" in capsys.readouterr().out


# -- the checks on synthetic results: each fails when its promise is broken (no process, no AWS) -------------

TINY, LIGHTNING, CHARLM = "tiny-0000000a", "lightning-mnist-like-0000000b", "charlm-0000000c"


def _ledger(first: str, second: str) -> dict[str, Any]:
    return {
        "status": "completed",
        "interruptions": 1,
        "total_cost_usd": 0.0021,
        "lives": [
            {
                "instance_id": first,
                "outcome": "preempted",
                "instance_type": "g6.xlarge",
                "price_usd_per_hour": 0.38,
            },
            {
                "instance_id": second,
                "outcome": "completed",
                "instance_type": "g4dn.xlarge",
                "price_usd_per_hour": 0.22,
            },
        ],
    }


def _passing() -> QueueResult:
    """A run that keeps every promise: the trainer on instances 1 then 2, Lightning on 2 then 3, charlm
    cancelled."""
    result = QueueResult(started=0.0, workdir=Path(), user_data_job="", user_data_bytes=15000)
    result.desired_before, result.desired_after_submit, result.desired_capacity = 0, 1, 0
    result.template_versions = 1
    result.cli = [CliCall(["data", "push", "dataset"], 0, "pushed", 0.5)]
    result.cli += [CliCall(["run", name], 0, name, 1.0) for name in (TINY, LIGHTNING, CHARLM)]
    result.alerts = [{"Subject": f"job {j}: training completed", "Message": ""} for j in (TINY, LIGHTNING)]
    one, two, three = (
        Boot(f"instance-{n}", f"i-{n}", kind, az, 10.0 * n, device=f"device profile {kind}")
        for n, (kind, az) in enumerate(demo.queue.INSTANCES, start=1)
    )
    one.bound, one.starts = [(11.0, TINY)], [JobStart(11.5, TINY, None)]
    two.bound = [(21.0, TINY), (31.0, LIGHTNING)]
    two.starts = [JobStart(21.5, TINY, 50), JobStart(31.5, LIGHTNING, None)]
    two.hops = [(30.5, TINY, LIGHTNING)]
    three.bound, three.starts = [(41.0, LIGHTNING)], [JobStart(41.5, LIGHTNING, 58)]
    three.trainer_lines = [(42.0, "Restored all states from the checkpoint at /x/step-58/lightning.ckpt")]
    for boot in (one, two, three):
        boot.exit_code = 0
    result.boots = [one, two, three]

    def interrupted(label: str, job_id: str, at: float, stop: int, on: Boot, to: Boot) -> QueuedJob:
        """A job noticed at `at` on `on`, stopped at `stop`, resumed and completed on `to`."""
        steps = 120
        job = QueuedJob(label, job_id, [], notice_from=stop - 10, total_steps=steps, job_id=job_id)
        job.notice = Notice(at, on.name, stop - 2, steps, resumed_boot=to.name, resumed_step=stop)
        job.notice.resumed_at = to.booted_at + 1.5
        job.notice.stop_confirmed_at = at + 3.0
        job.notice.stop_event = {
            "exit_code": 75,
            "checkpoint_confirmed": True,
            "checkpoint_step": stop,
            "reached_step": stop,
        }
        job.notice.stopped_step = stop
        job.samples = [Sample(at, on.name, stop - 2), Sample(to.booted_at + 5, to.name, steps)]
        job.ledger = _ledger(on.instance_id, to.instance_id)
        job.checkpoints = [f"step-{steps}/manifest.json", "latest.json"]
        return job

    tiny = interrupted("job 1", TINY, 15.0, 50, one, two)
    tiny.what, tiny.completed_at = "the built-in trainer", 30.0
    tiny.builtin, tiny.metrics = True, {"final": {"val_accuracy": 0.9}}
    tiny.resumed_as = (
        "checkpoint step 50 resumes as g4dn.xlarge: precision bf16 -> fp16, fresh fp16 loss scaler"
    )
    tiny.own_results = ("metrics.json", "model.pt")
    tiny.writes = ("curves.png", "metrics.json", "model.pt", "progress.json")
    tiny.results = list(tiny.writes)
    tiny.checkpoints.append(f"step-{120}/state.pt")
    lightning = interrupted("job 2", LIGHTNING, 35.0, 58, two, three)
    lightning.what, lightning.own_results, lightning.completed_at = (
        "examples/lightning-mnist-like",
        ("model.pt",),
        45.0,
    )
    lightning.writes = ("metrics.json", "model.pt", "progress.json")
    lightning.results = list(lightning.writes)
    lightning.checkpoints.append(f"step-{120}/lightning.ckpt")
    charlm = QueuedJob("job 3", "examples/charlm", [], notice_from=None, total_steps=None)
    charlm.job_id, charlm.cancelled_at, charlm.cancel_request = CHARLM, 2.0, True
    charlm.ledger = {"status": "cancelled", "lives": []}
    result.jobs = [tiny, lightning, charlm]
    return result


def _failed(result: QueueResult) -> set[str]:
    return {check.name for check in checks(result) if not check.passed}


def test_a_run_that_keeps_every_promise_passes_every_check() -> None:
    result = _passing()
    assert _failed(result) == set()
    # 3 for the stack, 7 per interrupted job and 2 more for the trainer's, then no reboot, Lightning's
    # restore, the cancel and 6 more.
    assert len(checks(result)) == 27


def test_a_job_that_finished_before_its_notice_fails_saying_to_lengthen_it() -> None:
    result = _passing()
    notice = result.job("job 1").notice
    assert notice is not None
    notice.stop_event["exit_code"], notice.stopped_step = 0, 120
    assert {"job 1: the notice interrupted it mid-run", "job 1: steps lost = 0"} <= _failed(result)
    assert "lengthen it" in next(
        c.detail for c in checks(result) if c.name.endswith("interrupted it mid-run")
    )


def test_a_job_whose_own_result_is_missing_fails_its_results_check() -> None:
    result = _passing()
    result.job("job 1").results.remove("model.pt")  # the trainer's model never reached its prefix
    assert {"job 1: its own results in S3", "nothing mixed between jobs"} <= _failed(result)


def test_steps_trained_past_the_confirmed_checkpoint_are_lost_steps() -> None:
    result = _passing()
    job = result.job("job 2")
    job.samples.insert(1, Sample(26.0, "instance-2", 61))  # the stopped boot had reported step 61
    assert "job 2: steps lost = 0" in _failed(result)


def test_the_second_job_on_a_new_boot_or_from_the_first_jobs_checkpoint_fails_no_reboot() -> None:
    name = "job 2 ran after job 1 on the same instance, no new boot"
    result = _passing()
    result.boots[1].hops = []  # instance 2's agent never went on to job 2 itself
    assert name in _failed(result)
    result = _passing()
    result.boots[1].starts[1].restored_step = 120  # job 2 started from job 1's local checkpoint
    assert name in _failed(result)
    result = _passing()
    result.job("job 2").ledger["lives"][0]["instance_id"] = "i-9"  # its ledger names another instance
    assert {name, "job 2: completed, its ledger its own"} <= _failed(result)


def test_a_cancelled_job_that_ran_or_left_objects_fails() -> None:
    name = "job 3: cancelled before it ran, never ran"
    for change in (
        lambda job: job.ledger.update(lives=[{"instance_id": "i-2", "outcome": "running"}]),
        lambda job: job.checkpoints.append("latest.json"),
        lambda job: setattr(job, "cancel_request", False),
    ):
        result = _passing()
        change(result.job("job 3"))
        assert name in _failed(result)


def test_one_jobs_files_among_anothers_fail_nothing_mixed() -> None:
    for change in (
        lambda r: r.job("job 2").results.append("curves.png"),  # the trainer's plot among Lightning's results
        lambda r: r.job("job 2").checkpoints.append("step-60/state.pt"),  # the trainer's checkpoint file kind
        lambda r: r.legacy_objects.append("results/model.pt"),  # the stack's own top-level prefix
    ):
        result = _passing()
        change(result)
        assert "nothing mixed between jobs" in _failed(result)


def test_a_group_left_up_or_a_changed_launch_template_fails() -> None:
    result = _passing()
    result.desired_capacity, result.template_versions = 1, 2
    assert {
        "group scaled to zero once the queue was empty",
        "submitting never changed the launch template",
    } <= _failed(result)


def test_a_resume_on_the_same_gpu_type_or_precision_fails_across_precisions() -> None:
    name = "job 1: resumed on another GPU type and zone, across precisions"
    result = _passing()
    result.boots[1].instance_type, result.boots[1].az = "g6.xlarge", "us-east-1a"  # the same type and zone
    assert name in _failed(result)
    result = _passing()
    result.job("job 1").resumed_as = ""  # the trainer never said the checkpoint changed precision
    assert name in _failed(result)


def test_a_low_accuracy_a_late_confirmation_or_an_unpriced_life_fails() -> None:
    result = _passing()
    result.job("job 1").metrics = {"final": {"val_accuracy": 0.3}}
    notice = result.job("job 2").notice
    assert notice is not None
    notice.stop_confirmed_at = notice.at + 130  # after the notice's two minutes
    result.job("job 1").ledger["lives"][1]["price_usd_per_hour"] = None
    assert {
        "job 1: final accuracy ≥ 0.5",
        "job 2: checkpoint confirmed within the 2-minute notice",
        "each job that ran has its cost at simulated spot prices",
    } <= _failed(result)
    result = _passing()
    result.job("job 1").metrics = {}  # no metrics.json: no accuracy to show
    assert "job 1: final accuracy ≥ 0.5" in _failed(result)


def test_the_timeline_png_draws_each_job_that_ran(tmp_path: Path) -> None:
    result = _passing()
    png = plot_timeline(result, tmp_path / "timeline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_the_timeline_tells_the_queue_in_order() -> None:
    result = _passing()
    result.boots[2].notes = [(50.0, "the queue is empty: instance-3's agent scales the group to zero")]
    console = Console(file=io.StringIO(), width=200)
    assert report(result, console) == checks(result)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    rows = [
        "instance-1 boots",
        "spot notice on instance-1 during job 1",
        "job 1 resumes on instance-2 at step 50",
        "instance-2 goes on to the next queued job " + LIGHTNING,
        "job 2 resumes on instance-3 at step 58",
        "scales the group to zero",
    ]
    positions = [text.index(row) for row in rows]
    assert positions == sorted(positions), text


def test_the_report_ends_with_each_lifes_time_to_first_step_and_data_wait() -> None:
    result = _passing()
    tiny = result.job("job 1")
    for life, started, first, wait in zip(
        tiny.ledger["lives"],
        ("2026-12-06T10:00:00Z", "2026-12-06T10:05:00Z"),
        (7.5, None),
        (0.05, None),
        strict=True,
    ):
        life["started_at"] = started
        if first is not None:
            life["first_step_seconds"], life["data_wait_fraction"] = first, wait
    console = Console(file=io.StringIO(), width=200)
    report(result, console)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    table = text[text.index("lives: time to first step and data wait") :]
    lines = [line for line in table.splitlines() if "job 1" in line]
    assert len(lines) == 2, table
    assert "preempted" in lines[0] and "7.5s" in lines[0] and "5%" in lines[0]
    assert "completed" in lines[1] and lines[1].count("–") == 2, "unknown, never 0"

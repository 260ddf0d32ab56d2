"""`python -m bench.scheduling`: the scheduling core (pools, lanes, the lease, the ledger) under load, in
moto.

Issue 32, item 7. Not the full agent and trainer (a life costs seconds of CPU: 200 of them do not fit 2
cores),
but the real scheduling code, driven the way `bootstrap/lifecycle.py` and `bootstrap/outcomes.py` drive it.
Each
simulated instance is a thread holding one real instance of its pool's Auto Scaling group (moto), and loops:

1. look for work: `bind_job` with its pool's agent config (`job_id ""`, `pool`, `lanes`);
   nothing: it leaves the group (`Fleet.leave_for_good`: protection off, terminate with decrement);
2. open a life in the job's ledger (`LedgerStore.begin_life`) and take the job's lease with the real
   `OneWriter.take` (holder, standby or surplus);
3. as the holder: protect the instance from scale-in (`Fleet.protect`), "train" (a sleep of a random
   0.05-0.3 s),
   prove the lease (`OneWriter.confirm`), write the job's end to the ledger (`end_life` completed,
   `set_status` completed), ask what it does next (`work_in_lanes`, the agent's `_queued_next`), release the
   lease; with a next job, back to 1 (`after` = the job it ended), else leave;
4. as the standby: wait for the lease (`OneWriter.wait_for_lease`, polled every STANDBY_POLL_S instead of the
   agent's 1 s, in proportion to the short jobs); once taken, a job that has ended is let go
   (`standby_ended`) and the instance goes on with the queue as in 3; a job still running is trained;
5. surplus: the life ends `surplus` and the instance leaves (`Fleet.leave`).

Every S3 and Auto Scaling call is counted with botocore's event hooks (one count per API call; a 412/409 lost
conditional write is a request too and is also counted apart). Each `bind_job` / `work_in_lanes` call is one
scheduling decision; its requests are counted on their own.

The moto server runs in a child process (`--serve`), so the instances' threads and the server use both cores,
and it handles one request at a time: moto checks a conditional write (If-Match / If-None-Match) and then
stores
the object in two steps, which two request threads can interleave (tests/bootstrap/test_lease.py says the
same);
S3 does both atomically. Serialising the server's requests gives moto S3's atomicity; which write gets in and
the 412 the other gets are still moto's answers.

Runs (sizes are flags; `--quick` is the test's size):
- `pools`: 200 jobs over 32 instances in 2 pools (the default pool: 24 instances, 24 lanes; pool `b`: 8 and
  8),
  each job's entry naming its pool (3 of 4 jobs in the default pool);
- `sweep`: a 16-point sweep (`sweep.parallel` 2, `_held_back`) on a pool of 4 lanes and 4 instances;
- `burst`: 50 submissions within one second while 16 instances (16 lanes) start, which drain them; a scale-in
  thread lowers the group's desired capacity towards what the unfinished jobs need (the scheduler Lambda's
  rule), so AWS (moto) takes instances away: protected (training) ones must never go.

Pass conditions (per run): every job ran exactly once (one completed holder life per job, nothing run
twice, nothing left unrun); never two writers at once (the lease-holding intervals of each job, recorded in
this
process on one monotonic clock, never overlap; an interval starts after the acquiring write returned and ends
before the releasing write is sent); no job's lease lost (every holder's `confirm` True, every release done);
no busy instance scaled in (an instance terminated by scale-in was not protected and training at the time).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# S3 Standard request prices, us-east-1 (https://aws.amazon.com/s3/pricing/, "Requests & data
# retrievals"), as read on 2026-12-06: PUT, COPY, POST, LIST $0.005 per 1,000; GET, SELECT and all other
# requests $0.0004 per 1,000; DELETE free.
PRICE_NOTE = (
    "S3 Standard request prices, us-east-1, https://aws.amazon.com/s3/pricing/ as of 2026-12-06: "
    "PUT/COPY/POST/LIST $0.005 per 1,000, GET and other requests $0.0004 per 1,000, DELETE free"
)
PUT_LIST_USD = 0.005 / 1000
GET_USD = 0.0004 / 1000
ENDED_TEXT = frozenset({"completed", "failed", "cancelled", "stopped", "cost_cap", "no_data"})
GET_OPS = frozenset({"GetObject", "HeadObject"})
LIST_OPS = frozenset({"ListObjectsV2", "ListObjects"})
PUT_OPS = frozenset({"PutObject", "CopyObject", "PostObject", "CreateMultipartUpload"})
FREE_OPS = frozenset({"DeleteObject"})

# A lease or standby silent this long is dead (the agent's 3 polls + 30 s): nobody dies here, so it only
# matters as the agent's own setting.
STALE_SECONDS = 60.0
# The standby polls the lease this often (the agent: every 1 s, for jobs of hours; here jobs last 0.05-0.3 s).
STANDBY_POLL_S = 0.1
# No run may take longer than this: a hung instance must not hold the bench for ever.
RUN_TIMEOUT_S = 1800.0
# The simulated agents' event lines on stdout (`--verbose`).
VERBOSE = False
POOL_B = "b"


# -- counting requests ------------------------------------------------------------------------------


@dataclass
class Tally:
    """Requests by kind: S3 GET/LIST/PUT/other (DELETE is free) and Auto Scaling calls by operation."""

    s3: Counter[str] = field(default_factory=Counter)
    autoscaling: Counter[str] = field(default_factory=Counter)
    conflicts: int = 0

    def add(self, service: str, operation: str) -> None:
        (self.s3 if service == "s3" else self.autoscaling)[operation] += 1

    def kinds(self) -> dict[str, int]:
        found = {"GET": 0, "LIST": 0, "PUT": 0, "DELETE": 0, "other": 0}
        for operation, count in self.s3.items():
            kind = (
                "GET"
                if operation in GET_OPS
                else "LIST"
                if operation in LIST_OPS
                else "PUT"
                if operation in PUT_OPS
                else "DELETE"
                if operation in FREE_OPS
                else "other"
            )
            found[kind] += count
        return found

    def usd(self) -> float:
        kinds = self.kinds()
        return (kinds["PUT"] + kinds["LIST"]) * PUT_LIST_USD + (kinds["GET"] + kinds["other"]) * GET_USD


class Meter:
    """Counts every API call made through the clients it is attached to: in total, and for the thread's open
    decision (`decision()`), so each scheduling decision's own requests are known."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = Tally()
        self._local = threading.local()

    def attach(self, client: Any, service: str) -> None:
        events = client.meta.events
        service_id = client.meta.service_model.service_id.hyphenize()
        events.register(f"before-call.{service_id}", self._before(service))
        events.register(f"after-call.{service_id}", self._after)

    def _before(self, service: str) -> Callable[..., None]:
        def count(event_name: str, **_: Any) -> None:
            operation = event_name.rsplit(".", 1)[-1]
            with self._lock:
                self.total.add(service, operation)
            open_tally: Tally | None = getattr(self._local, "tally", None)
            if open_tally is not None:
                open_tally.add(service, operation)

        return count

    def _after(self, http_response: Any = None, **_: Any) -> None:
        if http_response is not None and http_response.status_code in (409, 412):
            with self._lock:
                self.total.conflicts += 1
            open_tally: Tally | None = getattr(self._local, "tally", None)
            if open_tally is not None:
                open_tally.conflicts += 1

    @contextlib.contextmanager
    def decision(self) -> Iterator[Tally]:
        tally = Tally()
        self._local.tally = tally
        try:
            yield tally
        finally:
            self._local.tally = None


# -- the runs -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolSpec:
    name: str  # "" = the stack's default pool
    instances: int
    lanes: int

    @property
    def label(self) -> str:
        return self.name or "default"


@dataclass(frozen=True)
class JobSpec:
    job_id: str
    pool: str
    train_s: float
    sweep: dict[str, Any] | None = None


@dataclass(frozen=True)
class RunSpec:
    name: str
    title: str
    pools: tuple[PoolSpec, ...]
    jobs: tuple[JobSpec, ...]
    # 0: every job is queued before the instances start; > 0: the jobs are submitted over this many seconds
    # while the instances start (the first submission woke the group).
    submit_over_s: float = 0.0
    scale_in: bool = False


def _job_id(name: str, index: int) -> str:
    return f"{name}-{index:08x}"


def _train_times(count: int, rng: random.Random, low: float, high: float) -> list[float]:
    return [round(rng.uniform(low, high), 3) for _ in range(count)]


def pools_run(
    jobs: int, instances_a: int, lanes_a: int, instances_b: int, lanes_b: int, seed: int
) -> RunSpec:
    rng = random.Random(seed)
    times = _train_times(jobs, rng, 0.05, 0.3)
    # Jobs split between the pools in proportion to their lanes (3:1 at the default sizes), interleaved.
    share_b = lanes_b / (lanes_a + lanes_b)
    specs = []
    for i in range(jobs):
        pool = POOL_B if int((i + 1) * share_b) > int(i * share_b) else ""
        specs.append(JobSpec(_job_id("job", i), pool, times[i]))
    return RunSpec(
        "pools",
        f"{jobs} jobs over {instances_a + instances_b} instances in 2 pools "
        f"(default: {instances_a} instances, {lanes_a} lanes; "
        f"{POOL_B}: {instances_b} instances, {lanes_b} lanes)",
        (PoolSpec("", instances_a, lanes_a), PoolSpec(POOL_B, instances_b, lanes_b)),
        tuple(specs),
    )


def sweep_run(points: int, lanes: int, instances: int, parallel: int, seed: int) -> RunSpec:
    rng = random.Random(seed + 1)
    times = _train_times(points, rng, 0.05, 0.3)
    sweep: dict[str, Any] = {"name": "lr", "point": {}}
    if parallel:
        sweep["parallel"] = parallel
    specs = tuple(
        JobSpec(_job_id(f"lr-p{i}", i), "", times[i], {**sweep, "point": {"lr": i}}) for i in range(points)
    )
    limit = f", --parallel {parallel}" if parallel else ""
    return RunSpec(
        "sweep",
        f"a {points}-point sweep on a pool of {lanes} lanes and {instances} instances{limit}",
        (PoolSpec("", instances, lanes),),
        specs,
    )


def burst_run(jobs: int, lanes: int, instances: int, seed: int, scale_in: bool = True) -> RunSpec:
    rng = random.Random(seed + 2)
    times = _train_times(jobs, rng, 0.05, 0.3)
    specs = tuple(JobSpec(_job_id("burst", i), "", times[i]) for i in range(jobs))
    return RunSpec(
        "burst",
        f"a burst of {jobs} submissions within 1 s, drained by {instances} instances ({lanes} lanes)"
        + (", scale-in on" if scale_in else ""),
        (PoolSpec("", instances, lanes),),
        specs,
        submit_over_s=1.0,
        scale_in=scale_in,
    )


# -- what happened --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    kind: str  # "bind" (bind_job) or "look" (work_in_lanes, after a job's end)
    pool: str
    instance: str
    started: float
    seconds: float
    job: str | None
    queue_entries: int  # entries in the queue listing when it ran (nothing deletes an entry)
    get: int
    list: int
    put: int
    conflicts: int


@dataclass(frozen=True)
class Holding:
    """One life's hold of a job's lease: from after its acquiring write returned to before its releasing
    write was sent. `trained`: it trained the job (the holder); else a standby that took the lease of a job
    that had ended and let it go."""

    job: str
    instance: str
    start: float
    end: float
    trained: bool
    completed: bool
    # The job's ledger status when this life began (read by the bench, uncounted): "completed" here means the
    # life bound a job that ended meanwhile, and `begin_life` set it back to running.
    status_at_begin: str | None = None


@dataclass
class Journal:
    """Everything the simulated instances report, under one lock, on the bench's monotonic clock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    submitted: dict[str, float] = field(default_factory=dict)
    decisions: list[Decision] = field(default_factory=list)
    holdings: list[Holding] = field(default_factory=list)
    roles: Counter[str] = field(default_factory=Counter)
    # Instance → (when it started looking, when it got the lease): the dispatch latency of each trained job.
    dispatch: list[tuple[str, float]] = field(default_factory=list)  # (job, seconds)
    queue_wait: list[tuple[str, float]] = field(default_factory=list)  # (job, submit → lease)
    busy: Counter[str] = field(default_factory=Counter)  # instance → seconds training
    alive: dict[str, tuple[float, float | None]] = field(default_factory=dict)  # instance → (start, left)
    protected: dict[str, bool] = field(default_factory=dict)
    lease_problems: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    scaled_in: list[tuple[str, bool]] = field(default_factory=list)  # (instance, busy when it went)
    left: set[str] = field(default_factory=set)  # instances that left on their own
    holding_now: set[str] = field(default_factory=set)  # instances holding a lease right now
    notes: list[str] = field(default_factory=list)

    def note(self, action: Callable[[Journal], None]) -> None:
        with self.lock:
            action(self)


# -- the embedded AWS -----------------------------------------------------------------------------------


def serve() -> None:
    """The child process: a moto server on 127.0.0.1 that handles one request at a time; prints its port."""
    import logging

    from demo.moto_server import MOTO_SETTINGS, cache_moto_service_list

    os.environ.update(MOTO_SETTINGS)
    logging.getLogger("werkzeug").setLevel(logging.CRITICAL)
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    cache_moto_service_list()
    app = DomainDispatcherApplication(create_backend_app)
    lock = threading.Lock()

    def one_at_a_time(environ: Any, start_response: Any) -> list[bytes]:
        with lock:
            return [b"".join(app(environ, start_response))]

    server = make_server("127.0.0.1", 0, one_at_a_time, True, request_handler=MotoRequestHandler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


@contextlib.contextmanager
def embedded_aws() -> Iterator[str]:
    """The demo's isolated environment and a fresh moto server in a child process; yields its endpoint."""
    from demo.moto_server import MOTO_SETTINGS
    from demo.run import ISOLATED_ENV

    os.environ.update(ISOLATED_ENV)
    os.environ.update(MOTO_SETTINGS)
    os.environ.pop("AWS_PROFILE", None)
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.scheduling", "--serve"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert child.stdout is not None
        port = child.stdout.readline().strip()
        if not port.isdigit():
            raise RuntimeError(f"the moto server did not start (said {port!r})")
        endpoint = f"http://127.0.0.1:{port}"
        previous = os.environ.get("AWS_ENDPOINT_URL")
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        try:
            yield endpoint
        finally:
            if previous is None:
                os.environ.pop("AWS_ENDPOINT_URL", None)
            else:
                os.environ["AWS_ENDPOINT_URL"] = previous
    finally:
        child.terminate()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _reset(endpoint: str) -> None:
    import urllib.request

    request = urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")
    with urllib.request.urlopen(request, timeout=30):
        pass


# -- the simulated instances ---------------------------------------------------------------------------


def _for_job(config: Any, job_id: str) -> Any:
    """The agent config with the job's own prefixes (bootstrap/lifecycle.py `_for_job`)."""
    from trainstack_job.jobs import JobPrefixes

    job = JobPrefixes.of(job_id)
    prefixes = replace(config.prefixes, checkpoints=job.checkpoints, results=job.results, state=job.state)
    return replace(config, prefixes=prefixes, job_id=job_id)


class World:
    """One run's stack, clients, journal and the knowledge the simulated instances share (none of it is read
    by the scheduling code: that reads S3 only)."""

    def __init__(self, spec: RunSpec, meter: Meter, seed: int) -> None:
        import boto3
        from botocore.config import Config

        from demo.stack import create_stack

        self.spec = spec
        self.meter = meter
        self.journal = Journal()
        self.stop = threading.Event()
        self.rng = random.Random(seed)
        self.train_s = {job.job_id: job.train_s for job in spec.jobs}
        self.stack = create_stack(name="bench-sched", desired=0)
        config = Config(retries={"mode": "standard"}, max_pool_connections=128)
        # Counted clients (what the instances use) and one uncounted client for the bench's own look at S3.
        self.s3: Any = boto3.client("s3", region_name=self.stack.region, config=config)
        self.autoscaling: Any = boto3.client("autoscaling", region_name=self.stack.region, config=config)
        meter.attach(self.s3, "s3")
        meter.attach(self.autoscaling, "autoscaling")
        self.quiet_s3: Any = boto3.client("s3", region_name=self.stack.region, config=config)
        self.quiet_autoscaling: Any = boto3.client(
            "autoscaling", region_name=self.stack.region, config=config
        )
        self.entries = 0  # queue entries written so far
        self.groups: dict[str, str] = {}
        subnets = self.stack.group()["VPCZoneIdentifier"]
        for pool in spec.pools:
            group = self.stack.group_name if not pool.name else f"{self.stack.name}-gpu-{pool.name}"
            self.groups[pool.name] = group
            size: dict[str, Any] = {"MinSize": 0, "MaxSize": pool.lanes * 2, "DesiredCapacity": 0}
            if pool.name:
                self.quiet_autoscaling.create_auto_scaling_group(
                    AutoScalingGroupName=group,
                    LaunchTemplate={
                        "LaunchTemplateName": f"{self.stack.name}-instance",
                        "Version": "$Latest",
                    },
                    VPCZoneIdentifier=subnets,
                    **size,
                )
            else:
                self.quiet_autoscaling.update_auto_scaling_group(AutoScalingGroupName=group, **size)

    def config(self, pool: PoolSpec) -> Any:
        return self.stack.agent_config(
            job_id="", pool=pool.name, lanes=pool.lanes, group_name=self.groups[pool.name]
        )

    def submit(self, job: JobSpec) -> None:
        """What `trainstack run` writes: the record, then the entry (tests/bootstrap/test_queue_agent.py)."""
        from bootstrap.eventlog import iso
        from trainstack_job.queue import SOURCE_RUN, job_record, queue_entry, queue_key

        at = iso(datetime.now(timezone.utc))
        name = job.job_id.rsplit("-", 1)[0]
        agent: dict[str, Any] = {
            "job_id": job.job_id,
            "job_name": name,
            "job": {"fake": {}},
            "user_job": None,
        }
        record = job_record(
            job_id=job.job_id,
            name=name,
            agent=agent,
            submitted_at=at,
            source=SOURCE_RUN,
            sweep=job.sweep,
            pool=job.pool,
        )
        bucket = self.stack.bucket
        self.quiet_s3.put_object(
            Bucket=bucket, Key=f"jobs/{job.job_id}/job.json", Body=json.dumps(record).encode()
        )
        body = json.dumps(queue_entry(job.job_id, at, pool=job.pool)).encode()
        self.quiet_s3.put_object(Bucket=bucket, Key=queue_key(job.job_id), Body=body)
        moment = time.monotonic()
        with self.journal.lock:
            self.entries += 1
            self.journal.submitted[job.job_id] = moment

    def launch(self, pool: PoolSpec) -> list[str]:
        """The pool's group at its instance count: moto launches the instances the threads stand for."""
        group = self.groups[pool.name]
        self.quiet_autoscaling.set_desired_capacity(
            AutoScalingGroupName=group, DesiredCapacity=pool.instances, HonorCooldown=False
        )
        found = self.quiet_autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[group])
        return [i["InstanceId"] for i in found["AutoScalingGroups"][0]["Instances"]]

    def in_group(self, instance: str) -> bool:
        found = self.quiet_autoscaling.describe_auto_scaling_instances(InstanceIds=[instance])
        states = [i.get("LifecycleState", "") for i in found.get("AutoScalingInstances", [])]
        return bool(states) and not all(s.startswith("Terminat") for s in states)


class Instance:
    """One simulated instance: the agent's lives on it, one after another, with the real scheduling code."""

    def __init__(self, world: World, pool: PoolSpec, instance_id: str) -> None:
        from bootstrap.eventlog import EventLog
        from bootstrap.fleet import Fleet
        from bootstrap.imds import InstanceIdentity

        self.world = world
        self.pool = pool
        self.instance_id = instance_id
        self.config = world.config(pool)
        self.fleet = Fleet(world.autoscaling, self.config.group_name)
        self.identity = InstanceIdentity(instance_id, "g6.xlarge", "us-east-1a", "us-east-1", "spot")
        self.log = EventLog(stream=io.StringIO() if not VERBOSE else None)
        self.status_at_begin: str | None = None
        self.reported: set[str] = set()
        self.thread = threading.Thread(target=self.run, name=instance_id, daemon=True)

    # -- helpers

    def _decide(self, kind: str, after: str | None) -> str | None:
        from bootstrap.jobbinding import bind_job, work_in_lanes

        world = self.world
        started = time.monotonic()
        entries = world.entries
        with world.meter.decision() as tally:
            now = datetime.now(timezone.utc)
            if kind == "bind":
                binding = bind_job(
                    world.s3,
                    self.config,
                    now,
                    after=after,
                    log=self.log,
                    group_max=self.pool.lanes * 2,
                    reported=self.reported,
                    stale_seconds=STALE_SECONDS,
                )
                job = binding.job_id if binding is not None else None
            else:
                job = work_in_lanes(
                    world.s3,
                    self.config,
                    now,
                    after=after,
                    log=self.log,
                    group_max=self.pool.lanes * 2,
                    reported=self.reported,
                    stale_seconds=STALE_SECONDS,
                )
        kinds = tally.kinds()
        decision = Decision(
            kind,
            self.pool.label,
            self.instance_id,
            started,
            time.monotonic() - started,
            job,
            entries,
            kinds["GET"],
            kinds["LIST"],
            kinds["PUT"],
            tally.conflicts,
        )
        world.journal.note(lambda j: j.decisions.append(decision))
        return job

    def _protect(self, on: bool) -> None:
        self.fleet.protect(self.instance_id, on)
        self.world.journal.note(lambda j: j.protected.__setitem__(self.instance_id, on))

    def _leave(self) -> None:
        """No work here: the instance leaves its group, one fewer wanted (a pool of several lanes)."""
        self.world.journal.note(lambda j: j.protected.__setitem__(self.instance_id, False))
        self.world.journal.note(lambda j: j.left.add(self.instance_id))
        if self.config.lanes > 1:
            self.fleet.leave_for_good(self.instance_id)
        else:
            self.fleet.scale_to_zero()

    def _note(self, note: str) -> None:
        self.world.journal.note(lambda j: j.notes.append(note))

    def _quiet_status(self, job_id: str) -> str | None:
        try:
            body = self.world.quiet_s3.get_object(
                Bucket=self.config.bucket, Key=f"jobs/{job_id}/state/ledger.json"
            )["Body"].read()
        except self.world.quiet_s3.exceptions.NoSuchKey:
            return None
        value = json.loads(body)
        return str(value.get("status")) if isinstance(value, dict) else None

    def _gone(self) -> bool:
        """Scaled in while idle (the bench's own look, uncounted: the agent learns it from IMDS)."""
        return self.world.spec.scale_in and not self.world.in_group(self.instance_id)

    # -- one instance's lives

    def run(self) -> None:
        world = self.world
        world.journal.note(lambda j: j.alive.__setitem__(self.instance_id, (time.monotonic(), None)))
        try:
            self._lives()
        except Exception as exc:  # reported as a failed check, never swallowed
            message = f"{self.instance_id}: {type(exc).__name__}: {exc}"
            world.journal.note(lambda j: j.errors.append(message))
        finally:
            ended = time.monotonic()
            world.journal.note(
                lambda j: j.alive.__setitem__(self.instance_id, (j.alive[self.instance_id][0], ended))
            )

    def _lives(self) -> None:
        after: str | None = None
        free_since = time.monotonic()
        while not self.world.stop.is_set():
            if self._gone():
                return
            job = self._decide("bind", after)
            if job is None:
                self._leave()
                return
            if self._gone():
                self._note(f"{self.instance_id} was scaled in after it bound {job}, before it took the lease")
                return
            next_job = self._life(job, free_since)
            if next_job is None:
                return
            after, free_since = next_job, time.monotonic()

    def _life(self, job_id: str, free_since: float) -> str | None:
        """One life serving `job_id`; the job it ended when the instance goes on with the queue, else None."""
        from bootstrap.ledger import JobEndedError, LedgerStore
        from bootstrap.standby import OneWriter, Role
        from trainstack_job.contract import LifeOutcome
        from trainstack_job.jobs import JobPrefixes

        world = self.world
        config = _for_job(self.config, job_id)
        store = LedgerStore(world.s3, config.bucket, JobPrefixes.of(job_id).state + "ledger.json")
        self.status_at_begin = self._quiet_status(job_id)
        now = datetime.now(timezone.utc)
        try:
            # As the agent: a job bound while it ran is never restarted if it ended since (no resumes here).
            store.begin_life(self.identity, 0.35, now, stale_after_seconds=STALE_SECONDS, restart=False)
        except JobEndedError:
            return job_id  # it ended while this instance bound it: look for work again, past it
        writer = OneWriter(
            world.s3,
            config,
            self.log,
            instance_id=self.instance_id,
            life_id=store.life_id or self.instance_id,
            stale_seconds=STALE_SECONDS,
            instance_gone=self.fleet.instance_gone,
        )
        role = writer.take(floor=0)
        world.journal.note(lambda j: j.roles.update([role.value]))
        if role is Role.SURPLUS:
            store.update(lambda ledger: ledger.end_life(LifeOutcome.SURPLUS, datetime.now(timezone.utc)))
            if self.config.lanes > 1:
                self._protect(False)
            self.fleet.leave(self.instance_id, instance_count=self.config.instance_count)
            world.journal.note(lambda j: j.left.add(self.instance_id))
            return None
        if role is Role.STANDBY:
            store.update(lambda ledger: ledger.mark_standby(datetime.now(timezone.utc)))
            token = writer.wait_for_lease(
                stopping=lambda _timeout: world.stop.wait(STANDBY_POLL_S) or self._gone(),
                job_ended=lambda: _ended(store),
                floor=0,
            )
            if token is None and self._gone():
                return None  # scaled in while it waited: the instance is gone
            if token is None:
                writer.end_standby()
                store.update(
                    lambda ledger: ledger.end_life(LifeOutcome.STANDBY_ENDED, datetime.now(timezone.utc))
                )
                return self._go_on(job_id)
            took = time.monotonic()
            world.journal.note(lambda j: j.holding_now.add(self.instance_id))
            store.update(lambda ledger: ledger.end_standby(datetime.now(timezone.utc)))
            if self.config.lanes > 1:
                self._protect(True)
            if _ended(store):
                # The holder completed just before it let go: nothing to continue (lifecycle's own check).
                store.update(
                    lambda ledger: ledger.end_life(LifeOutcome.STANDBY_ENDED, datetime.now(timezone.utc))
                )
                following = self._go_on(job_id, keep_lease=True)
                self._release(writer, job_id, took, trained=False, completed=False)
                return following
            return self._train(writer, store, job_id, took, free_since)
        acquired = time.monotonic()
        world.journal.note(lambda j: j.holding_now.add(self.instance_id))
        if self.config.lanes > 1:
            self._protect(True)
        return self._train(writer, store, job_id, acquired, free_since)

    def _train(self, writer: Any, store: Any, job_id: str, acquired: float, free_since: float) -> str | None:
        from trainstack_job.contract import JobStatus, LifeOutcome

        world = self.world
        submitted = world.journal.submitted[job_id]
        world.journal.note(lambda j: j.dispatch.append((job_id, acquired - max(submitted, free_since))))
        world.journal.note(lambda j: j.queue_wait.append((job_id, acquired - submitted)))
        seconds = world.train_s[job_id]
        time.sleep(seconds)
        world.journal.note(lambda j: j.busy.update({self.instance_id: seconds}))
        proven = writer.confirm(retry_seconds=0.05)
        if proven is not True:
            message = f"{job_id}: {self.instance_id} could not prove its lease at the job's end ({proven})"
            world.journal.note(lambda j: j.lease_problems.append(message))
            self._release(writer, job_id, acquired, trained=True, completed=False)
            return None

        def complete(ledger: Any) -> None:
            ledger.end_life(LifeOutcome.COMPLETED, datetime.now(timezone.utc))
            ledger.set_status(JobStatus.COMPLETED)

        store.update(complete)
        following = self._go_on(job_id, keep_lease=True)
        self._release(writer, job_id, acquired, trained=True, completed=True)
        return following

    def _release(self, writer: Any, job_id: str, start: float, *, trained: bool, completed: bool) -> None:
        end = time.monotonic()  # before the releasing write is sent: the hold ends no later than this
        holding = Holding(job_id, self.instance_id, start, end, trained, completed, self.status_at_begin)

        def note(journal: Journal) -> None:
            journal.holdings.append(holding)
            journal.holding_now.discard(self.instance_id)

        self.world.journal.note(note)
        if not writer.lease.release(time.time(), None):
            message = f"{job_id}: {self.instance_id}'s release found the lease no longer its own"
            self.world.journal.note(lambda j: j.lease_problems.append(message))

    def _go_on(self, job_id: str, keep_lease: bool = False) -> str | None:
        """After a job's end (the agent's `_queued_next`): the job a look for work gives this instance, or
        None, and then it leaves (the lease, when held, is released by the caller after this, as the agent
        releases it in its life's `finally`)."""
        following = self._decide("look", job_id)
        if following is None:
            self._leave()
            return None
        return job_id


def _ended(store: Any) -> bool:
    from bootstrap.ledger import TERMINAL_STATUSES

    return store.load().status in TERMINAL_STATUSES


class Scaler:
    """The scheduler's rule for lowering capacity (issue 32, item 3): a pool's desired capacity is what its
    unfinished jobs need; above that, it is lowered by one at a time, and AWS (moto) picks the instance to
    terminate, never a protected one. Which instances went, and whether each held a lease then, is noted."""

    def __init__(self, world: World, every_s: float = 0.2) -> None:
        self.world = world
        self.every_s = every_s
        self.thread = threading.Thread(target=self.run, name="scaler", daemon=True)
        self.done = threading.Event()
        self.lowered = 0

    def run(self) -> None:
        world = self.world
        while not self.done.wait(self.every_s):
            for pool in world.spec.pools:
                try:
                    self._once(pool)
                except Exception as exc:
                    self._error(f"scaler: {type(exc).__name__}: {exc}")

    def _error(self, message: str) -> None:
        self.world.journal.note(lambda j: j.errors.append(message))

    def _once(self, pool: PoolSpec) -> None:
        world = self.world
        group_name = world.groups[pool.name]
        with world.journal.lock:
            completed = {h.job for h in world.journal.holdings if h.completed}
            submitted = set(world.journal.submitted)
        need = len(
            [job for job in world.spec.jobs if job.pool == pool.name and job.job_id in submitted]
        ) - len([job for job in world.spec.jobs if job.pool == pool.name and job.job_id in completed])
        group = world.quiet_autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[group_name])
        found = group["AutoScalingGroups"][0]
        desired = int(found["DesiredCapacity"])
        if desired <= max(need, 0):
            return
        before = {i["InstanceId"] for i in found["Instances"]}
        with world.journal.lock:
            holding = set(world.journal.holding_now)
        world.autoscaling.set_desired_capacity(
            AutoScalingGroupName=group_name, DesiredCapacity=desired - 1, HonorCooldown=False
        )
        self.lowered += 1
        after = world.quiet_autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[group_name])
        now_there = {i["InstanceId"] for i in after["AutoScalingGroups"][0]["Instances"]}
        with world.journal.lock:
            holding |= world.journal.holding_now
            for instance in sorted(before - now_there):
                if instance not in world.journal.left:
                    world.journal.scaled_in.append((instance, instance in holding))


# -- one run, its checks and figures ---------------------------------------------------------------------


def _percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class RunResult:
    spec: RunSpec
    seconds: float
    journal: Journal
    tally: Tally
    lowered: int
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)


def overlaps(holdings: list[Holding]) -> list[str]:
    """Pairs of lease holds of one job that overlap in time: two writers at once."""
    found: list[str] = []
    by_job: dict[str, list[Holding]] = {}
    for holding in holdings:
        by_job.setdefault(holding.job, []).append(holding)
    for job, held in sorted(by_job.items()):
        held.sort(key=lambda h: h.start)
        for first, second in itertools.pairwise(held):
            if second.start < first.end:
                found.append(
                    f"{job}: {first.instance} held it until +{first.end - second.start:.3f} s after "
                    f"{second.instance} took it"
                )
    return found


def check_run(spec: RunSpec, journal: Journal) -> list[Check]:
    jobs = [job.job_id for job in spec.jobs]
    completed = Counter(h.job for h in journal.holdings if h.completed)
    trained = Counter(h.job for h in journal.holdings if h.trained)
    twice = sorted(job for job in jobs if completed[job] > 1 or trained[job] > 1)
    never = sorted(job for job in jobs if completed[job] == 0)
    once_detail = f"{sum(1 for job in jobs if completed[job] == 1 and trained[job] == 1)} of {len(jobs)} once"
    if twice:
        once_detail += f"; twice: {', '.join(twice[:5])}" + (" ..." if len(twice) > 5 else "")
        reborn = [
            h for h in journal.holdings if h.trained and h.job in twice and h.status_at_begin in ENDED_TEXT
        ]
        if reborn:
            once_detail += (
                f" ({len(reborn)} of the second runs began their life on a ledger already "
                f"{reborn[0].status_at_begin!r}: bound while the job still ran, its life began after it "
                "ended)"
            )
    if never:
        once_detail += f"; never: {', '.join(never[:5])}" + (" ..." if len(never) > 5 else "")
    double = overlaps(journal.holdings)
    busy_gone = [instance for instance, busy in journal.scaled_in if busy]
    return [
        Check("every job ran exactly once", not twice and not never, once_detail),
        Check(
            "never two writers at once",
            not double,
            f"{len(journal.holdings)} lease holds, {len(double)} overlapping"
            + (f": {double[0]}" if double else ""),
        ),
        Check(
            "no job's lease lost",
            not journal.lease_problems,
            "; ".join(journal.lease_problems[:3])
            or "every holder proved its lease at the end and released it",
        ),
        Check(
            "no busy instance scaled in",
            not busy_gone,
            f"{len(journal.scaled_in)} instances scaled in, {len(busy_gone)} of them holding a lease"
            if spec.scale_in
            else "no scale-in in this run (holders protected; checked in the burst run)",
        ),
        Check("no errors", not journal.errors, "; ".join(journal.errors[:3]) or "none"),
    ]


def figures(result: RunResult) -> dict[str, Any]:
    journal, tally, spec = result.journal, result.tally, result.spec
    jobs = len(spec.jobs)
    kinds = tally.kinds()
    dispatch = [seconds for _, seconds in journal.dispatch]
    waits = [seconds for _, seconds in journal.queue_wait]
    lived = sum((end if end is not None else start) - start for start, end in journal.alive.values())
    busy = sum(journal.busy.values())
    decisions = journal.decisions
    binds = [d for d in decisions if d.kind == "bind"]
    looks = [d for d in decisions if d.kind == "look"]
    decision_seconds = [d.seconds for d in decisions]
    return {
        "jobs": jobs,
        "instances": sum(pool.instances for pool in spec.pools),
        "wall_s": round(result.seconds, 2),
        "dispatch_p50_s": round(_percentile(dispatch, 0.5), 3),
        "dispatch_p95_s": round(_percentile(dispatch, 0.95), 3),
        "queue_wait_p50_s": round(_percentile(waits, 0.5), 3),
        "queue_wait_p95_s": round(_percentile(waits, 0.95), 3),
        "utilisation": round(busy / lived, 3) if lived else 0.0,
        "busy_s": round(busy, 2),
        "instance_s": round(lived, 2),
        "s3_requests": dict(kinds),
        "s3_per_job": {kind: round(count / jobs, 1) for kind, count in kinds.items()},
        "s3_usd_per_job": round(tally.usd() / jobs, 6),
        "s3_usd_total": round(tally.usd(), 5),
        "conflicts_412": tally.conflicts,
        "autoscaling_calls": dict(tally.autoscaling),
        "scaler_lowered": result.lowered,
        "decisions": len(decisions),
        "decisions_bind": len(binds),
        "decisions_look": len(looks),
        "decision_p50_s": round(_percentile(decision_seconds, 0.5), 3),
        "decision_p95_s": round(_percentile(decision_seconds, 0.95), 3),
        "decision_get_mean": round(statistics.fmean(d.get for d in decisions), 1) if decisions else 0.0,
        "decision_get_max": max((d.get for d in decisions), default=0),
        "decision_list_mean": round(statistics.fmean(d.list for d in decisions), 2) if decisions else 0.0,
        "decision_put_mean": round(statistics.fmean(d.put for d in decisions), 2) if decisions else 0.0,
        "decision_s3_share": round(
            sum(d.get + d.list + d.put for d in decisions) / max(1, sum(kinds.values())), 3
        ),
        "roles": dict(journal.roles),
        "notes": list(journal.notes),
    }


def run_one(spec: RunSpec, endpoint: str, seed: int, say: Callable[[str], None] = print) -> RunResult:
    """One run in a fresh moto state: submit, start the instances, wait for all of them to leave."""
    _reset(endpoint)
    meter = Meter()
    world = World(spec, meter, seed)
    started = time.monotonic()
    if spec.submit_over_s <= 0:
        for job in spec.jobs:
            world.submit(job)
    else:
        gap = spec.submit_over_s / max(1, len(spec.jobs))
        for job in spec.jobs:
            world.submit(job)
            pause = started + gap * (len(world.journal.submitted)) - time.monotonic()
            if pause > 0:
                time.sleep(pause)
    say(f"  {spec.name}: {len(spec.jobs)} jobs queued in {time.monotonic() - started:.2f} s; instances start")
    instances = [
        Instance(world, pool, instance_id) for pool in spec.pools for instance_id in world.launch(pool)
    ]
    scaler = Scaler(world) if spec.scale_in else None
    began = time.monotonic()
    for instance in instances:
        instance.thread.start()
    if scaler is not None:
        scaler.thread.start()
    deadline = began + RUN_TIMEOUT_S
    for instance in instances:
        instance.thread.join(max(0.0, deadline - time.monotonic()))
    if any(instance.thread.is_alive() for instance in instances):
        world.stop.set()
        world.journal.errors.append(f"the run did not end within {RUN_TIMEOUT_S:.0f} s")
        for instance in instances:
            instance.thread.join(30)
    if scaler is not None:
        scaler.done.set()
        scaler.thread.join(10)
    seconds = time.monotonic() - began
    result = RunResult(spec, seconds, world.journal, meter.total, scaler.lowered if scaler else 0)
    result.checks = check_run(spec, world.journal)
    result.figures = figures(result)
    return result


# -- the report -------------------------------------------------------------------------------------------


def hardware() -> dict[str, str]:
    facts = {"nproc": str(os.cpu_count()), "python": platform.python_version()}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                facts["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(ImportError):
        import moto

        facts["moto"] = moto.__version__
    return facts


def describe(result: RunResult) -> list[str]:
    f = result.figures
    per = f["s3_per_job"]
    lines = [
        f"run {result.spec.name}: {result.spec.title}",
        f"  wall {f['wall_s']} s; {f['decisions']} scheduling decisions ({f['decisions_bind']} bind_job, "
        f"{f['decisions_look']} work_in_lanes), each p50 {f['decision_p50_s']} s, "
        f"p95 {f['decision_p95_s']} s",
        f"  free instance -> lease (dispatch): p50 {f['dispatch_p50_s']} s, p95 {f['dispatch_p95_s']} s; "
        f"submit -> lease (queue wait): p50 {f['queue_wait_p50_s']} s, p95 {f['queue_wait_p95_s']} s",
        f"  utilisation {f['utilisation']:.1%} (busy {f['busy_s']} s of {f['instance_s']} instance-s)",
        f"  S3 per job: GET {per['GET']}, LIST {per['LIST']}, PUT {per['PUT']}, DELETE {per['DELETE']} "
        f"(total {f['s3_requests']}); ${f['s3_usd_per_job']:.6f} per job, ${f['s3_usd_total']:.4f} in all; "
        f"{f['conflicts_412']} lost conditional writes (412/409)",
        f"  per decision: GET mean {f['decision_get_mean']} (max {f['decision_get_max']}), LIST mean "
        f"{f['decision_list_mean']}, PUT mean {f['decision_put_mean']}; decisions made "
        f"{f['decision_s3_share']:.0%} of all S3 requests",
        f"  Auto Scaling calls: {f['autoscaling_calls'] or 'none'}"
        + (
            f"; the scaler lowered desired capacity {f['scaler_lowered']} times"
            if result.spec.scale_in
            else ""
        ),
        f"  roles taken: {f['roles']}",
    ]
    lines += [f"  note: {note}" for note in f["notes"][:5]]
    lines += [f"  [{'PASS' if c.passed else 'FAIL'}] {c.name}: {c.detail}" for c in result.checks]
    return lines


def _sizes(args: argparse.Namespace) -> list[RunSpec]:
    if args.quick:
        runs = {
            "pools": pools_run(4, 2, 2, 1, 1, args.seed),
            "sweep": sweep_run(3, 2, 2, 1, args.seed),
            "burst": burst_run(4, 2, 2, args.seed),
        }
    else:
        runs = {
            "pools": pools_run(
                args.jobs, args.instances_a, args.lanes_a, args.instances_b, args.lanes_b, args.seed
            ),
            "sweep": sweep_run(
                args.sweep_points, args.sweep_lanes, args.sweep_lanes, args.sweep_parallel, args.seed
            ),
            "burst": burst_run(
                args.burst_jobs, args.burst_lanes, args.burst_lanes, args.seed, not args.no_scale_in
            ),
        }
    return [runs[name] for name in args.runs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scheduling", description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--quick", action="store_true", help="a few jobs and instances per run (the test's size)"
    )
    parser.add_argument(
        "--runs", nargs="+", choices=("pools", "sweep", "burst"), default=["pools", "sweep", "burst"]
    )
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--instances-a", type=int, default=24)
    parser.add_argument("--lanes-a", type=int, default=24)
    parser.add_argument("--instances-b", type=int, default=8)
    parser.add_argument("--lanes-b", type=int, default=8)
    parser.add_argument("--sweep-points", type=int, default=16)
    parser.add_argument("--sweep-lanes", type=int, default=4)
    parser.add_argument("--sweep-parallel", type=int, default=2, help="sweep.parallel (0: no limit)")
    parser.add_argument("--burst-jobs", type=int, default=50)
    parser.add_argument("--burst-lanes", type=int, default=16)
    parser.add_argument("--no-scale-in", action="store_true", help="the burst run without the scaler")
    parser.add_argument("--seed", type=int, default=32)
    parser.add_argument("--json", type=Path, help="write the figures and checks here")
    parser.add_argument("--verbose", action="store_true", help="the simulated agents' event lines")
    args = parser.parse_args(argv)
    global VERBOSE
    VERBOSE = args.verbose
    if args.serve:
        serve()
        return 0
    facts = hardware()
    print(f"bench.scheduling, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {facts}")
    print(f"prices: {PRICE_NOTE}")
    results: list[RunResult] = []
    with embedded_aws() as endpoint:
        for spec in _sizes(args):
            result = run_one(spec, endpoint, args.seed)
            results.append(result)
            print("\n".join(describe(result)), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "hardware": facts,
            "prices": PRICE_NOTE,
            "runs": [
                {
                    "name": r.spec.name,
                    "title": r.spec.title,
                    "figures": r.figures,
                    "checks": [{"name": c.name, "passed": c.passed, "detail": c.detail} for c in r.checks],
                    "decisions": [
                        {
                            k: getattr(d, k)
                            for k in ("kind", "pool", "seconds", "job", "queue_entries", "get", "list", "put")
                        }
                        for d in r.journal.decisions
                    ],
                }
                for r in results
            ],
        }
        args.json.write_text(json.dumps(report, indent=1, default=str))
    failed = [f"{r.spec.name}: {c.name}" for r in results for c in r.checks if not c.passed]
    print("all pass conditions hold" if not failed else f"FAILED: {'; '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

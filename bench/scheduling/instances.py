"""The scheduling bench's simulated instances (the agent's lives with the real scheduling code) and its
scaler."""

from __future__ import annotations

import io
import json
import queue
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone
from functools import partial
from typing import Any

from bench.scheduling.journal import Decision, Holding, Journal
from bench.scheduling.metering import Meter
from bench.scheduling.runs import JobSpec, PoolSpec, RunSpec

# A lease or standby silent this long is dead (the agent's 3 polls + 30 s): nobody dies here, so it only
# matters as the agent's own setting.
STALE_SECONDS = 60.0
# The standby polls the lease this often (the agent: every 1 s, for jobs of hours; here jobs last 0.05-0.3 s).
STANDBY_POLL_S = 0.1
# The simulated agents' event lines on stdout (`--verbose`).
VERBOSE = False


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
        # What EventBridge sends the scheduler function (a queue entry created, an instance ended): set by
        # the run when the function drives the pools.
        self.on_submit: Callable[[], None] = lambda: None
        self.on_instance_end: Callable[[], None] = lambda: None
        subnets = self.stack.group()["VPCZoneIdentifier"]
        for pool in spec.pools:
            group = self.stack.group_name if not pool.name else f"{self.stack.name}-gpu-{pool.name}"
            self.groups[pool.name] = group
            # Driven by the scheduler, the group's maximum is the pool's size (what the function caps at).
            maximum = pool.instances if spec.scheduler else pool.lanes * 2
            size: dict[str, Any] = {"MinSize": 0, "MaxSize": maximum, "DesiredCapacity": 0}
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
            job_id="",
            pool=pool.name,
            lanes=pool.lanes,
            group_name=self.groups[pool.name],
            max_concurrent_jobs=self.spec.max_concurrent_jobs,
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
        self.on_submit()

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
            world.on_instance_end()  # EC2 Instance Terminate Successful, as the function's rule sees it

    def _lives(self) -> None:
        after: str | None = None
        free_since = time.monotonic()
        while not self.world.stop.is_set():
            if self._gone():
                return
            if self.config.lanes > 1:
                # As the agent (`_leaving_before_binding`): protected before its claim, so scale-in never
                # takes a claimed job's instance; one chosen before that claims nothing.
                self._protect(True)
                if self.fleet.leaving(self.instance_id):
                    self._note(f"{self.instance_id} was scaled in before it claimed a job; it claimed none")
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
            if self.config.lanes > 1:
                self._protect(False)  # a standby trains nothing: scale-in may take it
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

        ran_until = time.monotonic()  # before its end is written: the job holds its run slot until then
        store.update(complete)
        following = self._go_on(job_id, keep_lease=True)
        self._release(writer, job_id, acquired, trained=True, completed=True, ran_until=ran_until)
        return following

    def _release(
        self,
        writer: Any,
        job_id: str,
        start: float,
        *,
        trained: bool,
        completed: bool,
        ran_until: float | None = None,
    ) -> None:
        end = time.monotonic()  # before the releasing write is sent: the hold ends no later than this
        holding = Holding(
            job_id, self.instance_id, start, end, trained, completed, self.status_at_begin, ran_until
        )

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


def _error(message: str, journal: Journal) -> None:
    journal.errors.append(message)


# Not an event: wakes the function's loop at the run's end.
STOP = "stop"


class SchedulerFunction:
    """The scheduler function (lambdas/scheduler/handler.py, the real code) invoked as EventBridge invokes
    it: once per queue entry created, once per instance of a pool that ends, and on a schedule (every
    `schedule_s` here for the stack's 5 minutes, in proportion to jobs of a fraction of a second). One
    invocation at a time, as its reserved concurrency of 1 makes it; each stamped to the second as
    EventBridge stamps an event, counted by its trigger, and skipped as the handler skips it when a pass that
    began after it already read the state (`Passes`)."""

    def __init__(self, world: World, schedule_s: float = 1.0) -> None:
        from lambdas.scheduler.handler import Passes, PoolSettings

        self.world = world
        self.schedule_s = schedule_s
        self.pools = [
            PoolSettings(pool.name, world.groups[pool.name], pool.lanes, 1) for pool in world.spec.pools
        ]
        self.triggers: queue.Queue[tuple[str, datetime]] = queue.Queue()
        self.invocations: Counter[str] = Counter()
        self.passes_run = 0
        self.raised = 0
        self._passes = Passes()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, name="scheduler-function", daemon=True)

    def trigger(self, kind: str) -> None:
        self.triggers.put((kind, datetime.now(timezone.utc).replace(microsecond=0)))

    def run(self) -> None:
        from lambdas.scheduler.handler import run

        world = self.world
        tick = time.monotonic() + self.schedule_s
        # Once the run is over, the events already sent are still delivered (each instance's end included).
        while not (self.done.is_set() and self.triggers.empty()):
            try:
                kind, sent = self.triggers.get(timeout=max(0.0, tick - time.monotonic()))
            except queue.Empty:
                kind, sent = "schedule", datetime.now(timezone.utc).replace(microsecond=0)
                tick = time.monotonic() + self.schedule_s
            if kind == STOP:
                continue
            self.invocations[kind] += 1
            if self._passes.covered(sent):
                continue
            started = datetime.now(timezone.utc)
            try:
                decisions = run(
                    world.autoscaling,
                    world.s3,
                    world.stack.bucket,
                    "state/",
                    self.pools,
                    world.spec.max_concurrent_jobs,
                )
            except Exception as exc:  # reported as a failed check
                world.journal.note(partial(_error, f"scheduler function: {type(exc).__name__}: {exc}"))
                continue
            self._passes.last_started = started
            self.passes_run += 1
            self.raised += sum(1 for decision in decisions if decision.action == "raised")


class Launcher:
    """What EC2 does once a group's desired capacity rises: each instance it launches boots the agent. Here a
    thread per instance, started as the group lists it (moto launches at once)."""

    def __init__(self, world: World, every_s: float = 0.05) -> None:
        self.world = world
        self.every_s = every_s
        self.instances: list[Instance] = []
        self._seen: set[str] = set()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, name="launcher", daemon=True)

    def run(self) -> None:
        world = self.world
        while not self.done.wait(self.every_s):
            for pool in world.spec.pools:
                try:
                    found = world.quiet_autoscaling.describe_auto_scaling_groups(
                        AutoScalingGroupNames=[world.groups[pool.name]]
                    )["AutoScalingGroups"][0]["Instances"]
                except Exception as exc:
                    world.journal.note(partial(_error, f"launcher: {type(exc).__name__}: {exc}"))
                    continue
                for item in found:
                    instance_id = item["InstanceId"]
                    if instance_id in self._seen or item.get("LifecycleState") != "InService":
                        continue
                    self._seen.add(instance_id)
                    instance = Instance(world, pool, instance_id)
                    self.instances.append(instance)
                    instance.thread.start()

    def running(self) -> bool:
        return any(instance.thread.is_alive() for instance in list(self.instances))

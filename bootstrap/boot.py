"""A life's first steps before any training: who this instance is, its logs, whether the job is still on
(the group not at zero), its price, the GPU preflight and the wait for a dataset."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from bootstrap import aws
from bootstrap.agent_config import AgentConfig
from bootstrap.datasync import DataSync
from bootstrap.errors import one_line
from bootstrap.eventlog import EventLog, utc_now
from bootstrap.fleet import Fleet
from bootstrap.imds import ImdsClient, ImdsUnavailableError, InstanceIdentity
from bootstrap.jobstate import JobState
from bootstrap.logshipper import LogShipper, close_all
from bootstrap.preflight import GpuPreflight
from bootstrap.pricing import CostMeter, LifeQuote, PriceLookup
from bootstrap.stops import StopRequests
from bootstrap.trainer import trainer_python
from trainstack_job.contract import JobStatus
from trainstack_job.jobs import JobPrefixes


@dataclass
class AwsClients:
    s3: Any
    autoscaling: Any
    sns: Any
    logs: Any
    ec2: Any
    cloudwatch: Any

    @classmethod
    def for_region(cls, region: str, config: Any = aws.RETRY_CONFIG) -> AwsClients:
        names = ("s3", "autoscaling", "sns", "logs", "ec2", "cloudwatch")
        return cls(*(aws.client(name, region, config) for name in names))


class Boot:
    """What a life finds out and sets up before it trains; also owns the life's log shippers."""

    def __init__(
        self,
        config: AgentConfig,
        log: EventLog,
        imds: ImdsClient,
        clients: AwsClients,
        fleet: Fleet,
        price_lookup: PriceLookup | None,
        identity_wait_seconds: float,
    ) -> None:
        self.config = config
        self.log = log
        self.imds = imds
        self._logs = clients.logs
        self.fleet = fleet
        self.cost_meter = CostMeter.for_agent(
            ec2=clients.ec2,
            s3=clients.s3,
            region=config.region,
            bucket=config.bucket,
            storage_prefixes=[config.prefixes.checkpoints, config.prefixes.data],
            root_volume_gb=config.root_volume_gb,
            fixed_price=price_lookup,
        )
        self._identity_wait_seconds = identity_wait_seconds
        self._shippers: list[LogShipper] = []

    def identify(self) -> InstanceIdentity:
        deadline = time.monotonic() + self._identity_wait_seconds
        while True:
            try:
                return self.imds.identity(self.config.region)
            except ImdsUnavailableError as exc:
                if time.monotonic() > deadline:
                    self.log.event(
                        "start", "IMDS unavailable; running with a host-derived identity", error=str(exc)
                    )
                    host = socket.gethostname()
                    return InstanceIdentity(
                        f"local-{host}", "unknown", "unknown", self.config.region, "on-demand"
                    )
                time.sleep(2)

    # -- logs ---------------------------------------------------------------------------------------

    def _stream(self, identity: InstanceIdentity, source: str) -> str:
        """`<job-id>/<instance-id>/agent|trainer`: `trainstack logs --job` finds a job's lines by prefix."""
        return JobPrefixes.of(self.config.job_id).log_stream(identity.instance_id, source)

    def ship_logs(self, identity: InstanceIdentity) -> None:
        shipper = LogShipper(self._logs, self.config.log_group, self._stream(identity, "agent"))
        self._shippers.append(shipper)
        self.log.add_sink(shipper)

    def trainer_log_sink(self, identity: InstanceIdentity) -> Callable[[str], None]:
        """The trainer's lines: to the journal (stdout) and to CloudWatch."""
        shipper = LogShipper(self._logs, self.config.log_group, self._stream(identity, "trainer"))
        self._shippers.append(shipper)

        def sink(line: str) -> None:
            print(line, flush=True)
            shipper(line)

        return sink

    def close_logs(self) -> None:
        close_all(self._shippers)

    # -- is the job still on, what does this instance cost ------------------------------------------

    def group_scaled_to_zero(self) -> bool:
        try:
            desired = self.fleet.desired_capacity()
        except Exception as exc:  # not fatal: the worst case is one life that finds nothing to do
            self.log.event(
                "start",
                "cannot read the group's desired capacity",
                group=self.config.group_name,
                error=one_line(exc),
            )
            return False
        if desired == 0:
            self.log.event(
                "start",
                "group is scaled to zero: the job is over, nothing to do",
                group=self.config.group_name,
            )
            return True
        return False

    def price(
        self, identity: InstanceIdentity, started: datetime | None, announce: bool = False
    ) -> LifeQuote | None:
        """This life's cost so far and its prices (bootstrap/pricing.py); None leaves the ledger at the last
        known price."""
        try:
            quote = self.cost_meter.quote(identity, started or utc_now(), utc_now())
        except Exception as exc:
            if announce:
                self.log.event("cost", "price unavailable; cost not tracked until it is", error=one_line(exc))
            return None
        if announce:
            self.log.event(
                "cost",
                "price of this instance",
                usd_per_hour=quote.price_usd_per_hour,
                lifecycle=identity.lifecycle,
                source=quote.price_source,
            )
        return quote

    # -- the GPU and the dataset --------------------------------------------------------------------

    def preflight(self) -> int | None:
        """GPU count (0 when no GPU is required), or None when the GPU is broken beyond the one repair."""
        if not self.config.gpu_required:
            self.log.event("preflight", "skipped: gpu_required is false")
            return 0
        result = GpuPreflight(trainer_python(), self.log).run()
        self.log.event("preflight", "GPU ok" if result.ok else "GPU broken", detail=result.detail)
        return result.gpu_count if result.ok else None

    def wait_for_dataset(
        self, dataset: DataSync, job: JobState, stops: StopRequests, poll_seconds: float
    ) -> bool:
        """True once the job's dataset is there; False after `data_wait_minutes` without one or on a stop."""
        if dataset.present():
            return True
        source = dataset.source  # the job's dataset: data/, or datasets/<name>/
        minutes = self.config.data_wait_minutes
        # Not "running": `trainstack data push` must not take this wait for a training run to protect.
        job.record(lambda ledger: ledger.set_status(JobStatus.WAITING_FOR_DATA))
        self.log.event(
            "data", "no dataset yet: waiting for `trainstack data push`", source=source, minutes=minutes
        )
        deadline = time.monotonic() + minutes * 60
        while time.monotonic() < deadline:
            if stops.wait(max(0.0, min(poll_seconds, deadline - time.monotonic()))):
                job.record(lambda ledger: ledger.set_status(JobStatus.RUNNING))
                return False
            if dataset.present():
                job.record(lambda ledger: ledger.set_status(JobStatus.RUNNING))
                self.log.event("data", "dataset arrived", source=source)
                return True
        return False

"""The embedded AWS endpoint: one moto server on 127.0.0.1, as the demo, benches and tests start it."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

# For every moto server that holds an embedded stack: moto otherwise builds its catalogue of 1,300 public
# AMIs, a volume and a snapshot each, for every EC2 backend it creates (again after each reset), about a
# second of CPU each time, and no part of the stack looks an AMI up (demo.stack.STAND_IN_AMI stands in).
MOTO_SETTINGS = {"MOTO_EC2_LOAD_DEFAULT_AMIS": "false"}


def cache_moto_service_list() -> None:
    """Make moto's server list its own service packages once, not twice per request.

    moto's dispatcher asks `moto.backends.list_of_moto_modules()` for every request, which lists moto's
    package folder and stats each of its ~180 entries: about 3 ms of CPU per request, a third of what an
    S3 GET costs, and the demo makes ~2,000 of them. The folder does not change while the server runs, so
    the answer is computed once. Idempotent."""
    from moto import backends

    listed = backends.list_of_moto_modules
    if getattr(listed, "cached", False):
        return
    services = tuple(listed())

    def list_of_moto_modules() -> Iterable[str]:
        return iter(services)

    list_of_moto_modules.cached = True  # type: ignore[attr-defined]
    list_of_moto_modules.__wrapped__ = listed  # type: ignore[attr-defined]
    backends.list_of_moto_modules = list_of_moto_modules


def answer_as_aws() -> None:
    """Teach moto what AWS says where moto says nothing useful. Idempotent.

    - TerminateInstanceInAutoScalingGroup for an instance its group no longer has (a scale-in took it a
      moment before): AWS refuses with a ValidationError, "Instance Id not found - No managed instance found
      for instance ID: ..."; moto fails inside with StopIteration, an HTTP 500 that botocore retries and
      then cannot parse."""
    from moto.autoscaling.exceptions import ValidationError
    from moto.autoscaling.models import AutoScalingBackend

    terminate = AutoScalingBackend.terminate_instance
    if getattr(terminate, "as_aws", False):
        return

    def terminate_instance(self: AutoScalingBackend, instance_id: str, should_decrement: bool) -> Any:
        managed = {
            state.instance.id for group in self.autoscaling_groups.values() for state in group.instance_states
        }
        if instance_id not in managed:
            raise ValidationError(
                f"Instance Id not found - No managed instance found for instance ID: {instance_id}"
            )
        return terminate(self, instance_id, should_decrement)

    terminate_instance.as_aws = True  # type: ignore[attr-defined]
    AutoScalingBackend.terminate_instance = terminate_instance


@contextmanager
def moto_server() -> Iterator[str]:
    """A moto server on 127.0.0.1, on a port the OS picks; yields its endpoint URL, stops it on exit."""
    os.environ.update(MOTO_SETTINGS)
    # moto's server logs every request and each unimplemented call; the callers' own lines tell the story.
    logging.getLogger("werkzeug").setLevel(logging.CRITICAL)
    from moto.server import ThreadedMotoServer

    cache_moto_service_list()
    answer_as_aws()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()

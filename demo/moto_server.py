"""The embedded AWS endpoint: one moto server on 127.0.0.1, as the demo, benches and tests start it."""

from __future__ import annotations

import logging
import os
import re
import threading
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


# A ranged GET that S3 answers with exactly those bytes: "bytes=FIRST-LAST", both given. (A suffix, an open
# end or several ranges are left to moto as before.)
_ONE_RANGE = re.compile(r"bytes=(\d+)-(\d+)")
_ranged = threading.local()


class _RangeOfValue:
    """A stored object's bytes as moto's range handling uses them: its length, and the slice asked for, read
    from the object's own buffer. A whole answer after all (a range moto decides to ignore) is the bytes."""

    def __init__(self, key: Any) -> None:
        self._key = key

    def __len__(self) -> int:
        return int(self._key.size)

    def __getitem__(self, part: slice) -> bytes:
        start, stop, _ = part.indices(len(self))
        with self._key.lock:
            self._key._value_buffer.seek(start)
            return bytes(self._key._value_buffer.read(max(0, stop - start)))

    def __iter__(self) -> Iterator[bytes]:
        yield self[:]


def serve_ranges_as_s3() -> None:
    """Teach moto to read only the bytes a ranged GET asks for, as S3 does. Idempotent.

    moto reads the whole object for every GET and then slices it, one request at a time per object (its
    lock): a 64 MB shard fetched in 8 ranges of 8 MiB is 512 MB read on the server, and the ranges of one
    object queue behind each other. S3's first byte and rate do not depend on the object's size, nor do its
    ranges wait for each other. The streaming bench's cold first step measured that, not the trainer."""
    from moto.s3.models import FakeKey
    from moto.s3.responses import S3Response

    get_object = S3Response.get_object
    if getattr(get_object, "as_s3", False):
        return
    whole = FakeKey.value
    if not isinstance(whole, property) or whole.fget is None:
        return  # another moto than the one this was written for: its own behaviour stays
    read_whole = whole.fget

    def value(self: FakeKey) -> Any:
        if getattr(_ranged, "active", False) and hasattr(self, "_value_buffer") and hasattr(self, "lock"):
            return _RangeOfValue(self)
        return read_whole(self)

    def ranged_get_object(self: S3Response) -> Any:
        asked = _ONE_RANGE.fullmatch(str(self.headers.get("range") or ""))
        if asked is None or "partNumber" in self.querystring or int(asked[1]) > int(asked[2]):
            return get_object(self)
        _ranged.active = True
        try:
            return get_object(self)
        finally:
            _ranged.active = False

    ranged_get_object.as_s3 = True  # type: ignore[attr-defined]
    FakeKey.value = property(value, whole.fset)
    S3Response.get_object = ranged_get_object


# Two first Signs of one key at once (the server is threaded) must not make two different pairs; one lock for
# every key is enough, as only signing keys ever make one.
_key_pair_lock = threading.Lock()


class _KeyPairOnDemand:
    """A KMS key's pair, generated the first time it is read (Sign, Verify, GetPublicKey), then kept.

    Shared by a key and moto's copies of it (a replica signs with its primary's pair, as before)."""

    def __init__(self, key_spec: str) -> None:
        self.key_spec = key_spec
        self._pair: Any = None

    def get(self) -> Any:
        with _key_pair_lock:
            if self._pair is None:
                from moto.kms import utils

                self._pair = utils.generate_private_key(self.key_spec)
            return self._pair


def make_key_pairs_on_demand() -> None:
    """Teach moto's KMS to generate a key's pair when it is first used, not at CreateKey. Idempotent.

    moto generates an RSA-2048 private key for every CreateKey, a symmetric key's too: about 50 ms of CPU,
    and a stack's deploy creates a key each time. A symmetric AWS key has no key pair at all; an asymmetric
    key's pair is generated as before, by moto, the first time `Key.private_key` is read."""
    from moto.kms import models

    if isinstance(getattr(models.Key, "private_key", None), property):
        return

    def pair_on_demand(key_spec: str) -> _KeyPairOnDemand:
        return _KeyPairOnDemand(key_spec)

    def read_pair(key: Any) -> Any:
        return key.__dict__["_key_pair"].get()

    def keep_pair(key: Any, pair: Any) -> None:
        if not isinstance(pair, _KeyPairOnDemand):  # a pair someone set: it is the key's from now on
            held, pair = pair, _KeyPairOnDemand(key.key_spec)
            pair._pair = held
        key.__dict__["_key_pair"] = pair

    # Key.__init__ sets `self.private_key = generate_private_key(self.key_spec)`: that name now makes the
    # promise, and the property keeps it when read.
    models.generate_private_key = pair_on_demand
    models.Key.private_key = property(read_pair, keep_pair)


_sns_key_lock = threading.Lock()


def sign_sns_with_one_key() -> None:
    """Teach moto's SNS to sign every message of a region with one key, as SNS signs with its region's one
    certificate. Idempotent.

    moto generates an RSA-2048 key for each subscription at its first delivery (about 50 ms of CPU each), and
    every stack subscribes its alerts queue to its topic."""
    from moto.sns.models import Subscription

    private_key = Subscription.private_key
    if getattr(private_key, "one_key", False):
        return
    made: list[Any] = []

    def one_private_key(self: Subscription) -> Any:
        with _sns_key_lock:
            if not made:
                made.append(private_key(self))
            return made[0]

    one_private_key.one_key = True  # type: ignore[attr-defined]
    Subscription.private_key = one_private_key


def regions_once_per_service() -> None:
    """Teach moto to list a service's regions once per process, not once per backend it creates. Idempotent.

    moto asks botocore for every partition's regions each time it creates a service's backend for an
    account (its cache is per backend object), and a reset creates them all again: the same list each time."""
    from moto.core.base_backend import AccountSpecificBackend

    generate = AccountSpecificBackend._generate_regions
    if getattr(generate, "once_per_service", False):
        return
    listed: dict[str, list[str]] = {}
    lock = threading.Lock()

    def _generate_regions(self: AccountSpecificBackend, service_name: str) -> list[str]:
        with lock:
            if service_name not in listed:
                listed[service_name] = list(generate(self, service_name))
            return list(listed[service_name])

    _generate_regions.once_per_service = True  # type: ignore[attr-defined]
    AccountSpecificBackend._generate_regions = _generate_regions


@contextmanager
def moto_server() -> Iterator[str]:
    """A moto server on 127.0.0.1, on a port the OS picks; yields its endpoint URL, stops it on exit."""
    os.environ.update(MOTO_SETTINGS)
    # moto's server logs every request and each unimplemented call; the callers' own lines tell the story.
    logging.getLogger("werkzeug").setLevel(logging.CRITICAL)
    from moto.server import ThreadedMotoServer

    cache_moto_service_list()
    answer_as_aws()
    serve_ranges_as_s3()
    make_key_pairs_on_demand()
    sign_sns_with_one_key()
    regions_once_per_service()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()

"""Run the whole Pulumi program under mocks and record what it registers (for infra and policy tests)."""

from __future__ import annotations

import asyncio
import contextvars
import copy
import functools
import json
import logging
import runpy
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import pulumi
import yaml
from pulumi.runtime import mocks as pulumi_mocks
from pulumi.runtime import resource as pulumi_resource
from pulumi.runtime import rpc
from pulumi.runtime.proto import source_pb2

REPO_ROOT = Path(__file__).resolve().parents[2]
PROGRAM = REPO_ROOT / "infra" / "__main__.py"
EXAMPLE_STACK = REPO_ROOT / "Pulumi.dev.yaml"
ACCOUNT_ID = "123456789012"
REGION = "us-east-1"
AMI_ID = "ami-0123456789abcdef0"
ROOT_DEVICE = "/dev/sda1"
# What the mocked EC2 says each zone offers: use1-az3 (us-east-1c) offers none of the default types.
DEFAULT_OFFERINGS: dict[str, tuple[str, ...]] = {
    "us-east-1a": ("g6.xlarge", "g5.xlarge", "g6e.xlarge", "g4dn.xlarge", "p5.48xlarge"),
    "us-east-1b": ("g5.xlarge", "g4dn.xlarge"),
    "us-east-1c": (),
    "us-east-1d": ("g6.xlarge", "g4dn.xlarge"),
}
# A trainer config small enough to embed, used while training/configs/default.yaml does not exist yet.
FALLBACK_JOB = {
    "data": {"image_size": 64, "num_workers": 2},
    "model": {"name": "resnet18"},
    "train": {"epochs": 2, "batch_size": 32, "lr": 0.1, "seed": 0, "precision": "auto"},
    "checkpoint": {"every_steps": 100, "every_minutes": 10, "keep": 3},
}


@dataclass(frozen=True)
class RecordedResource:
    """One registered resource: type token, logical name, inputs, parent's logical name, options."""

    type: str
    name: str
    inputs: dict[str, Any]
    parent: str = ""
    ignore_changes: tuple[str, ...] = ()
    retain_on_delete: bool = False
    # The logical names of the resources it was declared to wait for (`depends_on`).
    depends_on: tuple[str, ...] = ()
    # Its URN as the mock monitor makes it (type, parent's type and name: what `pulumi up` diffs by).
    urn: str = ""


@dataclass
class StackRun:
    """Everything one program run produced."""

    resources: list[RecordedResource] = field(default_factory=list)
    outputs: dict[str, Any] = field(default_factory=dict)

    def of_type(self, type_token: str) -> list[RecordedResource]:
        return of_type(self.resources, type_token)

    def one(self, type_token: str) -> RecordedResource:
        found = self.of_type(type_token)
        assert len(found) == 1, f"expected one {type_token}, found {[r.name for r in found]}"
        return found[0]


def of_type(resources: Iterable[RecordedResource], type_token: str) -> list[RecordedResource]:
    return [r for r in resources if r.type == type_token]


def example_config() -> dict[str, Any]:
    """The example stack's config (Pulumi.dev.yaml), plus a small inline job if the default is missing."""
    config: dict[str, Any] = copy.deepcopy(_example_stack_file_config())  # each caller's own to change
    if not (REPO_ROOT / str(config["trainstack:trainingConfig"])).is_file():
        config["trainstack:trainingConfig"] = str(_fallback_job_file())
    return config


@functools.lru_cache(maxsize=1)
def _example_stack_file_config() -> dict[str, Any]:
    """Pulumi.dev.yaml's config, read once per process: the tests ask for it ~300 times, 2 ms a parse."""
    return dict(yaml.safe_load(EXAMPLE_STACK.read_text())["config"])


def _fallback_job_file() -> Path:
    import tempfile

    # A file of its own per call: parallel test workers must not write the same path.
    with tempfile.NamedTemporaryFile("w", prefix="trainstack-job-", suffix=".yaml", delete=False) as file:
        file.write(yaml.safe_dump(FALLBACK_JOB))
    return Path(file.name)


class _Mocks(pulumi.runtime.Mocks):
    """Answers the program's data-source calls and gives every resource plausible computed outputs."""

    def __init__(
        self, offerings: Mapping[str, Iterable[str]], architecture: str, ami_parameter_found: bool
    ) -> None:
        self.offerings = {zone: tuple(types) for zone, types in offerings.items()}
        self.architecture = architecture
        self.ami_parameter_found = ami_parameter_found

    def call(self, args: pulumi.runtime.MockCallArgs) -> dict[str, Any]:  # type: ignore[override]
        token = args.token
        if token == "aws:index/getCallerIdentity:getCallerIdentity":
            arn = f"arn:aws:iam::{ACCOUNT_ID}:user/deployer"
            return {"accountId": ACCOUNT_ID, "arn": arn, "userId": "AIDEXAMPLE", "id": ACCOUNT_ID}
        if token == "aws:index/getPartition:getPartition":
            return {
                "partition": "aws",
                "dnsSuffix": "amazonaws.com",
                "reverseDnsPrefix": "com.amazonaws",
                "id": "aws",
            }
        if token == "aws:index/getAvailabilityZones:getAvailabilityZones":
            names = sorted(self.offerings)
            return {"names": names, "zoneIds": [f"use1-az{i + 1}" for i in range(len(names))], "id": REGION}
        if token == "aws:ec2/getInstanceTypeOfferings:getInstanceTypeOfferings":
            wanted = set(args.args["filters"][0]["values"])
            pairs = [
                (t, zone) for zone, types in sorted(self.offerings.items()) for t in types if t in wanted
            ]
            return {
                "instanceTypes": [t for t, _ in pairs],
                "locations": [zone for _, zone in pairs],
                "locationTypes": ["availability-zone"] * len(pairs),
                "id": REGION,
            }
        if token == "aws:ssm/getParameter:getParameter":
            if not self.ami_parameter_found:
                # What the engine reports for a failed lookup: a check failure, not a crash of the mock.
                return ({}, [("name", f"ParameterNotFound: {args.args['name']}")])  # type: ignore[return-value]
            return {"name": args.args["name"], "value": AMI_ID, "type": "String", "id": args.args["name"]}
        if token == "aws:ec2/getAmi:getAmi":
            image_id = args.args["filters"][0]["values"][0]
            return {
                "id": image_id,
                "imageId": image_id,
                "architecture": self.architecture,
                "rootDeviceName": ROOT_DEVICE,
            }
        raise NotImplementedError(f"the infra test mocks do not answer {token}")

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str | None, dict[str, Any]]:
        state = dict(args.inputs)
        service = args.typ.split(":")[1].split("/")[0]
        state.setdefault("arn", f"arn:aws:{service}:{REGION}:{ACCOUNT_ID}:{args.name}")
        if args.typ == "aws:s3/bucket:Bucket":
            state["bucket"] = f"{args.inputs.get('bucketPrefix', '')}0123456789"
            state["arn"] = f"arn:aws:s3:::{state['bucket']}"
        if args.typ == "aws:kms/key:Key":
            state["keyId"] = "1234abcd-12ab-34cd-56ef-1234567890ab"
            state["arn"] = f"arn:aws:kms:{REGION}:{ACCOUNT_ID}:key/{state['keyId']}"
        if args.typ == "aws:ec2/launchTemplate:LaunchTemplate":
            state["latestVersion"] = 1
        if args.typ == "aws:cloudwatch/logGroup:LogGroup":
            state["arn"] = (
                f"arn:aws:logs:{REGION}:{ACCOUNT_ID}:log-group:{args.inputs.get('name', args.name)}"
            )
        if args.typ == "aws:sns/topic:Topic":
            state["arn"] = f"arn:aws:sns:{REGION}:{ACCOUNT_ID}:{args.inputs.get('name', args.name)}"
        state.setdefault("name", args.name)
        return f"{args.name}-id", state


class _RecordingMonitor(pulumi_mocks.MockMonitor):
    """The mock monitor, also keeping each registration's options and the stack's outputs."""

    def __init__(self, mocks: _Mocks) -> None:
        super().__init__(mocks)
        self.run = StackRun()

    def RegisterResource(self, request: Any) -> Any:  # noqa: N802 - the gRPC method name
        response = super().RegisterResource(request)
        if request.type != "pulumi:pulumi:Stack":
            self.run.resources.append(
                RecordedResource(
                    type=request.type,
                    name=request.name,
                    inputs=rpc.deserialize_properties(request.object),
                    parent=request.parent.rsplit("::", 1)[-1] if request.parent else "",
                    ignore_changes=tuple(request.ignoreChanges),
                    retain_on_delete=bool(request.retainOnDelete),
                    depends_on=tuple(urn.rsplit("::", 1)[-1] for urn in request.dependencies),
                    urn=response.urn,
                )
            )
        return response


def _encode(value: Any) -> str:
    """Config values reach a program as strings; structured ones as JSON, as the Pulumi engine passes them."""
    if isinstance(value, str):
        return value
    return json.dumps(value)


def _report_without_traceback(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's report of a future whose exception nobody retrieved, as one line.

    A stack run that fails (a test expecting StackConfigError) leaves such futures behind, and asyncio reports
    each one when the garbage collector frees it: at any later moment, from inside whatever allocation started
    the collection. Formatting the exception's traceback there runs `ast.parse` (Python 3.11's traceback
    carets), and if the collection began inside another `ast.parse` the outer one fails with "SystemError:
    AST constructor recursion depth mismatch" (CPython issue 106905): a later, unrelated test fails at random.
    """
    exception = context.get("exception")
    logging.getLogger("asyncio").warning("%s: %s", context.get("message"), repr(exception))


def _stack_trace() -> source_pb2.StackTrace:
    """What pulumi.runtime.resource._get_stack_trace sends the engine with each registration, made cheaply.

    Pulumi's: the frames below the resource's own constructor (the third `__init__` up the stack), each as
    its file's URI and line. It reads every frame's source line, stats every file and builds a Path per
    frame to get there; under pytest the stack is ~60 frames deep and a run registers ~70 resources: a
    fifth of a mocked run's CPU (60 of 300 ms). The same frames, files and lines are taken straight from the
    frames here (test_program.py holds it to pulumi's own)."""
    stack: list[tuple[str, str, int | None]] = []
    frame: FrameType | None = sys._getframe()
    while frame is not None:
        stack.append((frame.f_code.co_name, frame.f_code.co_filename, frame.f_lineno))
        frame = frame.f_back
    stack.reverse()  # outermost first, as traceback.extract_stack lists them
    inits = 0
    for i in range(len(stack) - 1, -1, -1):
        if stack[i][0] == "__init__":
            inits += 1
            if inits == 3:
                break
    if i < 1:
        return source_pb2.StackTrace()
    return source_pb2.StackTrace(
        frames=[
            source_pb2.StackFrame(pc=_source_position(file, line)) for _, file, line in reversed(stack[:i])
        ]
    )


def _source_position(filename: str, line: int | None) -> source_pb2.SourcePosition | None:
    if filename == "" or line is None:
        return None
    uri = _file_uri(filename)
    return None if uri is None else source_pb2.SourcePosition(uri=uri, line=line)


@functools.cache
def _file_uri(filename: str) -> str | None:
    try:
        return Path(filename).as_uri()
    except ValueError:  # a relative name ("<frozen runpy>"): no position, as in pulumi's
        return None


def _run(
    config: Mapping[str, Any],
    stack: str,
    offerings: Mapping[str, Iterable[str]],
    architecture: str,
    ami_parameter_found: bool,
) -> StackRun:
    mocks = _Mocks(offerings, architecture, ami_parameter_found)
    monitor = _RecordingMonitor(mocks)
    pulumi.runtime.set_mocks(mocks, project="trainstack", stack=stack, preview=False, monitor=monitor)
    # The loop pulumi.runtime.test runs the program on (this thread's); its futures report through it.
    pulumi.runtime.sync_await._ensure_event_loop().set_exception_handler(_report_without_traceback)
    pulumi.runtime.set_all_config({key: _encode(value) for key, value in config.items()})

    @pulumi.runtime.test
    def program() -> None:
        runpy.run_path(str(PROGRAM), run_name="__main__")

    pulumis_stack_trace = pulumi_resource._get_stack_trace
    pulumi_resource._get_stack_trace = _stack_trace
    try:
        program()
        root = pulumi.runtime.settings.get_root_resource()
        outputs: dict[str, Any] = {}
        for name, value in getattr(root, "outputs", {}).items():
            outputs[name] = pulumi.runtime.sync_await._sync_await(pulumi.Output.from_input(value).future())
        monitor.run.outputs = outputs
        return monitor.run
    finally:
        pulumi_resource._get_stack_trace = pulumis_stack_trace
        # What the next run would do first (pulumi.runtime.test): most of a failed run's futures are freed,
        # and reported, here, in the test that made them; the rest go with its exception, reported in one
        # line by the handler above wherever the collector frees them.
        pulumi.runtime.settings.SETTINGS.rpc_manager.clear()
        pulumi.runtime.settings.SETTINGS.outputs.clear()
        _cancel_leftover_tasks()


def _cancel_leftover_tasks() -> None:
    """A failed run leaves its registrations' tasks waiting on the loop (this thread's, kept for the session):
    their frames hold the whole program (its components, outputs and unretrieved futures) until the process
    exits. Cancelled here, the run's futures are freed, and reported, in the test that made them, whichever
    of the program's objects its module happens to keep."""
    loop = pulumi.runtime.sync_await._ensure_event_loop()
    leftover = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in leftover:
        task.cancel()
    if leftover:
        loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))


def run_stack(
    config: Mapping[str, Any] | None = None,
    *,
    stack: str = "dev",
    offerings: Mapping[str, Iterable[str]] = DEFAULT_OFFERINGS,
    architecture: str = "x86_64",
    ami_parameter_found: bool = True,
) -> StackRun:
    """Run infra/__main__.py once under mocks with `config` (default: the example stack); resources + outputs.

    Each run gets a fresh context, so runs are independent and any number may share one test session.
    """
    values = example_config() if config is None else dict(config)
    context = contextvars.Context()
    return context.run(_run, values, stack, offerings, architecture, ami_parameter_found)


# The runs shared_run has made in this process, by their overrides.
_shared_runs: dict[str, StackRun] = {}


def shared_run(overrides: Mapping[str, Any] | None = None) -> StackRun:
    """The example stack with `overrides` (full keys), as run_stack runs it, run once per process; each
    caller gets its own copy. A run is ~0.3 s of CPU and tests in many modules only read the same one. Only
    where nothing the program reads is patched (a test that patches, or changes a file, runs its own)."""
    key = json.dumps(overrides or {}, sort_keys=True)
    if key not in _shared_runs:
        _shared_runs[key] = run_stack({**example_config(), **(overrides or {})})
    return copy.deepcopy(_shared_runs[key])


def run_program(config: Mapping[str, Any] | None = None) -> list[RecordedResource]:
    """The resources the whole program registers for `config` (full keys, e.g. 'trainstack:instanceCount')."""
    return run_stack(config).resources

"""`python -m training --config FILE [dotted.key=value ...]`: train, resume, stop with exit 75 on request.

Exit codes: 0 completed; 75 stopped on SIGTERM/SIGINT or the stop file, checkpoint saved; 2 config error,
every problem of the file, the data folders and the S3 URIs at once, one line each; 1 failed, including an S3
that could not be reached at start (transient: the next start may succeed); 65 dataset error: more undecodable
images than data.max_bad_fraction allows (permanent: do not retry).

With TRAINSTACK_RDZV_ENDPOINT set (the agent's multi-node jobs), this process is one node's launcher: it joins
the node rendezvous and runs this node's ranks of the job (training/launch.py).

The trainer keeps its checkpoints in checkpoint.dir; the agent uploads them. Run by hand with checkpoint.uri,
`python -m bootstrap.standalone` (same arguments) gives it the agent's persister: this package never imports
the agent, which imports it.
"""

from __future__ import annotations

# Only cheap imports above main(): it installs the stop handler first, and until then a SIGTERM kills.
import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.stop import STOP_SIGNALS, StopRequest
from trainstack_job.contract import ExitCode, JobEnv

if TYPE_CHECKING:
    from training.checkpoint import PersisterFactory
    from training.config import Config
    from training.launch import NodeRendezvous

# The module every rank of a `python -m training` run is started as (training/launch.py).
MODULE = "training"
# checkpoint.uri without a persister: the trainer alone never uploads (bootstrap/standalone.py gives it one).
NO_PERSISTER = (
    "checkpoint.uri: `python -m training` keeps checkpoints in checkpoint.dir only; run `python -m "
    "bootstrap.standalone` with the same arguments to persist them to checkpoint.uri, or leave it empty"
)

# Seconds, not boto3's 60 s timeouts and retries: a start-up check must not hold a spot instance for minutes.
_CHECK_TIMEOUTS: dict[str, Any] = {
    "connect_timeout": 3,
    "read_timeout": 5,
    "retries": {"mode": "standard", "max_attempts": 2},
}
# What S3 answers for a bucket that is not there or not ours: retrying on another instance cannot help.
_MISSING = {"NoSuchBucket", "NotFound", "404"}
_DENIED = {"AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"}

log = logging.getLogger("training")


class S3UnreachableError(Exception):
    """S3 could not be asked whether a configured bucket exists: a network or credentials hiccup."""


def _setup_logging() -> None:
    rank = os.environ.get("RANK", "0")
    # Only rank 0 talks at INFO: N identical progress lines per step help nobody.
    level = logging.INFO if rank == "0" else logging.WARNING
    prefix = "" if os.environ.get("WORLD_SIZE", "1") == "1" else f"[rank {rank}] "
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {prefix}%(levelname)s %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S",
        stream=sys.stderr,
    )
    # boto3 narrates every endpoint lookup and retry at INFO; the trainer's own lines are what users read.
    for noisy in ("boto3", "botocore", "s3transfer", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _processes(setting: int | str) -> int:
    if isinstance(setting, int):
        return setting
    import torch

    return max(1, torch.cuda.device_count())


def remote_uri_problems(config: Config, client: Any = None) -> list[str]:
    """One line per configured S3 URI whose bucket is missing or denied (malformed URIs are the config's own
    check); raises S3UnreachableError when S3 cannot be asked."""
    from training.config import is_s3_uri

    uris = [
        (key, uri)
        for key, uri in (("checkpoint.uri", config.checkpoint.uri), ("output.uri", config.output.uri))
        if uri and is_s3_uri(uri)
    ]
    if not uris:
        return []
    import boto3
    from botocore.config import Config as BotoConfig
    from botocore.exceptions import BotoCoreError, ClientError

    from training.store import split_uri

    client = client or boto3.client("s3", config=BotoConfig(**_CHECK_TIMEOUTS))
    problems: list[str] = []
    for key, uri in uris:
        bucket, prefix = split_uri(uri)
        try:
            # A listing under the prefix, not HeadBucket: the instance role may list only its own prefixes.
            client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/" if prefix else "", MaxKeys=1)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in _MISSING:
                problems.append(
                    f"{key}: bucket {bucket} does not exist ({uri}); "
                    f"create it or point {key} at an existing bucket"
                )
            elif code in _DENIED:
                problems.append(
                    f"{key}: access to {uri} denied ({code}); allow these credentials s3:ListBucket, "
                    f"s3:GetObject and s3:PutObject there, or fix {key}"
                )
            else:
                raise S3UnreachableError(
                    f"{key}: S3 answered {code or exc} for {uri}; the next start retries"
                ) from None
        except BotoCoreError as exc:
            raise S3UnreachableError(
                f"{key}: could not check {uri} ({exc}); a network or credentials problem, "
                "the next start retries"
            ) from None
    return problems


def start_gate_problems(config: Config, env: Mapping[str, str]) -> list[str]:
    """The start gate is a single machine's warm standby (the lease): a multi-node job's nodes are joined by
    their rendezvous generation instead, and a gated node would hold every other node's ranks waiting.
    The agent names the gate on every start; only a gate that exists (the trainer would wait) is refused."""
    gate = config.train.start_gate_file
    if gate and Path(gate).exists() and env.get(JobEnv.RDZV_ENDPOINT.value, "").strip():
        return [
            f"train.start_gate_file: a multi-node job ({JobEnv.RDZV_ENDPOINT.value} is set) cannot start "
            f"gated; the start gate is for one machine's standby: remove {gate} or leave the key empty"
        ]
    return []


def _checked_config(path: str, overrides: list[str]) -> Config:
    """The config, or one ConfigError with every problem: keys and values, data folders, S3 buckets."""
    from training.config import ConfigError, load_config
    from training.dataset_layout import data_dir_problems

    problems: list[str] = []
    config: Config | None
    try:
        config = load_config(path, overrides)
    except ConfigError as exc:
        problems, config = list(exc.problems), exc.config
    if config is None:
        raise ConfigError(problems)
    later = data_dir_problems(config) + start_gate_problems(config, os.environ)
    unreachable: S3UnreachableError | None = None
    # One bucket check per job, not one per rank.
    if os.environ.get("RANK", "0") == "0":
        try:
            later += remote_uri_problems(config)
        except S3UnreachableError as exc:
            unreachable = exc  # the permanent problems, if any, matter more: they need the user
    # A key already reported (a bad value left at its default) is not reported again as a missing folder.
    reported = {problem.split(":", 1)[0] for problem in problems}
    problems += [problem for problem in later if problem.split(":", 1)[0] not in reported]
    if problems:
        raise ConfigError(problems)
    if unreachable is not None:
        raise unreachable
    return config


def main(
    argv: list[str] | None = None,
    *,
    process_exit: bool = False,
    persister_factory: PersisterFactory | None = None,
    module: str = MODULE,
) -> int:
    """`process_exit`: this call is the process's whole work (`python -m training`, every rank and launcher):
    from its end on, stop signals are ignored until the process exits instead of going back to their default
    action. `persister_factory`: what uploads checkpoint.dir to checkpoint.uri (None: checkpoint.uri is
    refused); `module`: the entry point that gave it (`python -m <module>`), which each rank is started as, so
    the main rank has it too."""
    # First thing: from here on SIGTERM/SIGINT only raise a flag, so a stop at any moment of start-up (config,
    # slow imports, restore) ends in the Trainer's clean exit 75, never a traceback or death by signal.
    stop = StopRequest()
    stop.install()
    started = time.monotonic()
    from training.launch import rank_started

    rank_started()  # under the launcher: this rank ran, so its generation trained whatever ends it
    try:
        return _main(argv, stop, started, persister_factory, module)
    finally:
        if process_exit:
            # Stops are idempotent: this process has ended its work, and a stop arriving now (a second
            # notice, another node's stop reaching a rank that already stopped at the common step) has
            # nothing left to stop. The default action would turn its exit 75 into death by signal (-15)
            # and fail the whole group. Ignored, not only blocked: a signal sent to the process goes to any
            # of its threads that does not block it (torch's, gloo's, the engine's all exist by now), and
            # the default action there ends the whole process. The ignore replaces the handler in one step,
            # so no moment is left uncovered, and it outlasts the interpreter's own shutdown.
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
        else:
            stop.uninstall()


def _main(
    argv: list[str] | None,
    stop: StopRequest,
    started: float,
    persister_factory: PersisterFactory | None,
    module: str,
) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=__doc__)
    parser.add_argument("--config", required=True, help="YAML config file (see training/configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value, e.g. train.epochs=3")
    # Overrides may come before or after --config (`python -m training k=v --config f` reads naturally too).
    args = parser.parse_intermixed_args(argv)
    _setup_logging()
    from training.launch import NodeExit, NodeRendezvous

    try:
        # A rank (WORLD_SIZE set by the engine) inherits the agent's rendezvous variables: only the
        # launcher joins the node rendezvous.
        nodes = None if "WORLD_SIZE" in os.environ else NodeRendezvous.from_env()
    except ValueError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    code, launched = _run(args, argv, stop, nodes, started, persister_factory, module)
    if nodes is not None and nodes.exit_file is not None and not launched:
        # Ended before the launcher ran (config, data, a stop): the agent still gets its node's record.
        NodeExit(exit_code=int(code)).write(nodes.exit_file)
    return code


def one_line(exc: BaseException) -> str:
    """An error's own message on one line. A DataLoader worker's error reaches the trainer as torch re-raises
    it: the same type, its message "Caught X in DataLoader worker process N.\\nOriginal Traceback ...", whose
    last line is the original "X: message" (a bad shard, a full disk); the traceback itself is for the
    worker's own log, not the one line the agent reports."""
    text = str(exc)
    if text.startswith("Caught ") and "\nOriginal Traceback" in text:
        last = text.rstrip().splitlines()[-1]
        return last.split(": ", 1)[1] if ": " in last else last
    return text


def _run(
    args: argparse.Namespace,
    argv: list[str] | None,
    stop: StopRequest,
    nodes: NodeRendezvous | None,
    started: float,
    persister_factory: PersisterFactory | None,
    module: str,
) -> tuple[int, bool]:
    """(exit code, whether the elastic launcher ran)."""
    from botocore.exceptions import BotoCoreError, ClientError

    from training.config import ConfigError
    from training.dataset_layout import BadDataError
    from trainstack_job.layout import CheckpointRefusedError

    try:
        config = _checked_config(args.config, args.overrides)
        if config.checkpoint.uri and persister_factory is None:
            raise ConfigError([NO_PERSISTER])
        stop.watch(config.train.stop_file, config.train.checkpoint_request_file)
        processes = _processes(config.train.processes)
        # On several nodes always through the launcher, even with one process per node: it joins the
        # node rendezvous and gives this node's ranks their global ranks.
        if nodes is not None or (processes > 1 and "WORLD_SIZE" not in os.environ):
            if stop.signal_name:
                # No rank has run, so the last checkpoint is still the job's state: nothing to save.
                log.warning(
                    "%s received before training started; exit %d", stop.signal_name, ExitCode.STOPPED
                )
                return ExitCode.STOPPED, False
            from training.launch import launch

            argv = sys.argv[1:] if argv is None else argv
            return launch(argv, processes, nodes, stopped=lambda: stop.signal_name, module=module), True
        from training.loop import Trainer  # torch import: only after the config, data and buckets are good

        return Trainer(config, stop, started=started, persister_factory=persister_factory).run(), False
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"config error: {problem}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR, False
    except BadDataError as exc:
        print(f"data error: {one_line(exc)}", file=sys.stderr)
        return ExitCode.DATA_ERROR, False
    except (S3UnreachableError, CheckpointRefusedError) as exc:  # each names the object and the fix
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.FAILED, False
    except (ClientError, BotoCoreError) as exc:
        print(
            f"error: S3 request failed: {exc}; check checkpoint.uri/output.uri and the credentials",
            file=sys.stderr,
        )
        return ExitCode.FAILED, False
    except OSError as exc:
        problem = exc.strerror or one_line(exc)
        print(f"error: {exc.filename or ''}: {problem}; check the path and free disk space", file=sys.stderr)
        return ExitCode.FAILED, False


if __name__ == "__main__":
    from training.launch import rank_exit

    sys.exit(rank_exit(main(process_exit=True)))

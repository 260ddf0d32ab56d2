"""`python -m training --config FILE [dotted.key=value ...]`: train, resume, stop with exit 75 on request."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from botocore.exceptions import BotoCoreError, ClientError

from training.config import ConfigError, load_config
from training.stop import StopRequest

EXIT_CONFIG = 2
EXIT_FAILED = 1


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training", description=__doc__)
    parser.add_argument("--config", required=True, help="YAML config file (see training/configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value, e.g. train.epochs=3")
    # Overrides may come before or after --config (`python -m training k=v --config f` reads naturally too).
    args = parser.parse_intermixed_args(argv)
    _setup_logging()
    try:
        config = load_config(args.config, args.overrides)
        from training.dataset_layout import check_data_dirs

        check_data_dirs(config)
        processes = _processes(config.train.processes)
        if processes > 1 and "WORLD_SIZE" not in os.environ:
            from training.launch import launch

            return launch(sys.argv[1:] if argv is None else argv, processes)
        # Catch SIGTERM before the slow imports: a stop during start-up is still a clean exit 75.
        stop = StopRequest(config.train.stop_file, config.train.checkpoint_request_file)
        stop.install()
        from training.loop import Trainer  # torch import: only after the config is known good

        return Trainer(config, stop).run()
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"config error: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    except (ClientError, BotoCoreError) as exc:
        print(
            f"error: S3 request failed: {exc}; check checkpoint.uri/output.uri and the credentials",
            file=sys.stderr,
        )
        return EXIT_FAILED
    except OSError as exc:
        print(
            f"error: {exc.filename or ''}: {exc.strerror or exc}; check the path and free disk space",
            file=sys.stderr,
        )
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())

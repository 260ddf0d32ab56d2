"""Test-double trainer honouring the trainer ↔ agent contract: stop file/SIGTERM → checkpoint → exit 75,
checkpoint-request file, progress.json, S3 checkpoints with latest.json written last, artifacts on completion.

Behaviour is steered by the job config's `fake:` mapping: steps, step_seconds, checkpoint_every,
crash_at_step, hang_at_step.
"""

from __future__ import annotations

import hashlib
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import boto3
import yaml
from botocore.config import Config

STOP = {"requested": False}


def parse(argv: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    config_file = Path(argv[argv.index("--config") + 1])
    overrides = dict(arg.split("=", 1) for arg in argv if "=" in arg and not arg.startswith("--"))
    return yaml.safe_load(config_file.read_text()) or {}, overrides


def split_uri(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, prefix.rstrip("/")


def write_json_atomically(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


def main() -> int:
    job, overrides = parse(sys.argv[1:])
    fake = job.get("fake", {})
    steps = int(fake.get("steps", 30))
    step_seconds = float(fake.get("step_seconds", 0.05))
    every = int(fake.get("checkpoint_every", 10))
    s3 = boto3.client("s3", config=Config(retries={"mode": "standard", "max_attempts": 8}))
    ckpt_bucket, ckpt_prefix = split_uri(overrides["checkpoint.uri"])
    out_bucket, out_prefix = split_uri(overrides["output.uri"])
    output_dir = Path(overrides["output.dir"])
    output_dir.mkdir(parents=True, exist_ok=True)
    stop_file = Path(overrides["train.stop_file"])
    request_file = Path(overrides["train.checkpoint_request_file"])
    signal.signal(signal.SIGTERM, lambda *_: STOP.update(requested=True))

    def save(step: int) -> None:
        state = json.dumps({"step": step}).encode()
        base = f"{ckpt_prefix}/step-{step}"
        s3.put_object(Bucket=ckpt_bucket, Key=f"{base}/state.json", Body=state)
        manifest = {
            "step": step,
            "epoch": 0,
            "world_size": 1,
            "files": {"state.json": {"sha256": hashlib.sha256(state).hexdigest(), "size": len(state)}},
        }
        s3.put_object(Bucket=ckpt_bucket, Key=f"{base}/manifest.json", Body=json.dumps(manifest).encode())
        latest = {"step": step, "epoch": 0, "dir": f"step-{step}", "written_at": time.time()}
        s3.put_object(Bucket=ckpt_bucket, Key=f"{ckpt_prefix}/latest.json", Body=json.dumps(latest).encode())
        print(json.dumps({"event": "checkpoint", "step": step}), flush=True)

    try:
        latest = json.loads(
            s3.get_object(Bucket=ckpt_bucket, Key=f"{ckpt_prefix}/latest.json")["Body"].read()
        )
        step = int(latest["step"])
        print(json.dumps({"event": "resumed", "step": step}), flush=True)
    except s3.exceptions.NoSuchKey:
        step = 0
    while step < steps:
        if step == fake.get("hang_at_step"):
            time.sleep(3600)
        if step == fake.get("crash_at_step"):
            print("RuntimeError: simulated trainer crash", flush=True)
            return 1
        time.sleep(step_seconds)
        step += 1
        write_json_atomically(output_dir / "progress.json", {"step": step, "total_steps": steps, "epoch": 0})
        if request_file.exists():
            save(step)
            request_file.unlink()
        elif step % every == 0:
            save(step)
        if STOP["requested"] or stop_file.exists():
            save(step)
            return 75
    s3.put_object(Bucket=out_bucket, Key=f"{out_prefix}/model.pt", Body=b"fake weights")
    metrics = {"val_accuracy": 0.5, "steps": step}
    s3.put_object(Bucket=out_bucket, Key=f"{out_prefix}/metrics.json", Body=json.dumps(metrics).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())

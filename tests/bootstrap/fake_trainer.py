"""Test-double trainer honouring the trainer ↔ agent contract (docs/job-contract.md): stop file/SIGTERM →
committed local checkpoint → exit 75; checkpoint-request file; progress.json; results in output.dir.
Checkpoints and results stay local: the agent uploads them.

Behaviour is steered by the job config's `fake:` mapping: steps, step_seconds, checkpoint_every,
crash_at_step, exit_code (of the crash), hang_at_step, ignore_stop, checkpoint_bytes, complete_on_stop,
log_steps (one `{"event": "step", "step": N, "pid": P}` line per step: what the one-writer tests read),
hold_at_step and hold_until. A fresh trainer (one that restored nothing) holds at `hold_at_step` until the
stop comes (then it checkpoints that step and exits 75, as mid-run) or the file `hold_until` exists (then it
trains on): a test that injects a notice, stop or second instance "while the job trains" holds it there, so
a fast machine cannot finish the job before the event lands. A resumed trainer never holds.
A `train.start_gate_file` that exists at start holds it warm, as the built-in trainer does: no checkpoint is
restored or written until the file is gone; a stop while held exits 75 without writing anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import yaml

STOP = {"requested": False}


def parse(argv: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    config_file = Path(argv[argv.index("--config") + 1])
    overrides = dict(arg.split("=", 1) for arg in argv if "=" in arg and not arg.startswith("--"))
    return yaml.safe_load(config_file.read_text()) or {}, overrides


def write_json_atomically(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


def restore(root: Path) -> int:
    """The newest committed step (a step-N directory with its manifest)."""
    steps = [
        int(p.name.removeprefix("step-"))
        for p in root.glob("step-*")
        if p.is_dir() and (p / "manifest.json").is_file()
    ]
    if not steps:
        return 0
    step = max(steps)
    state = json.loads((root / f"step-{step}" / "state.json").read_text())
    return int(state["step"])


def main() -> int:
    job, overrides = parse(sys.argv[1:])
    fake = job.get("fake", {})
    steps = int(fake.get("steps", 30))
    step_seconds = float(fake.get("step_seconds", 0.05))
    every = int(fake.get("checkpoint_every", 10))
    padding = int(fake.get("checkpoint_bytes", 0))
    root = Path(overrides["checkpoint.dir"])
    root.mkdir(parents=True, exist_ok=True)
    assert not overrides.get("checkpoint.uri"), "under the agent the trainer must not upload checkpoints"
    assert not overrides.get("output.uri"), "under the agent the trainer must not upload its results"
    assert os.environ["TRAINSTACK_CHECKPOINT_DIR"] == str(root), (
        "the contract's variables name the same places"
    )
    output_dir = Path(overrides["output.dir"])
    output_dir.mkdir(parents=True, exist_ok=True)
    stop_file = Path(overrides["train.stop_file"])
    request_file = Path(overrides["train.checkpoint_request_file"])
    if not fake.get("ignore_stop"):
        signal.signal(signal.SIGTERM, lambda *_: STOP.update(requested=True))
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def save(step: int) -> None:
        if (root / f"step-{step}" / "manifest.json").is_file():
            return  # committed already (a periodic checkpoint at the very step the stop came)
        staging = root / f".step-{step}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        files = {"state.json": json.dumps({"step": step}).encode()}
        if padding:
            files["weights.bin"] = os.urandom(padding)
        for name, data in files.items():
            (staging / name).write_bytes(data)
        manifest = {
            "step": step,
            "epoch": 0,
            "world_size": 1,
            "files": {n: {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d)} for n, d in files.items()},
        }
        (staging / "manifest.json").write_text(json.dumps(manifest))
        staging.rename(root / f"step-{step}")
        print(json.dumps({"event": "checkpoint", "step": step}), flush=True)

    def stop_requested() -> bool:
        return STOP["requested"] or stop_file.exists()

    gate = Path(overrides["train.start_gate_file"]) if overrides.get("train.start_gate_file") else None
    if gate is not None and gate.exists():
        print(
            f"standby: warm (model built, first batch loaded) in 0.0s; waiting for the start gate {gate}",
            flush=True,
        )
        waited = time.monotonic()
        while gate.exists():
            if stop_requested():
                print("standby: stopped before the start gate opened; no checkpoint written", flush=True)
                return 75
            time.sleep(0.02)
        print(f"standby: start gate opened after {time.monotonic() - waited:.1f}s; restoring", flush=True)
    step = restore(root)
    if step:
        print(json.dumps({"event": "resumed", "step": step}), flush=True)
    hold_at = fake.get("hold_at_step") if not step else None
    release = Path(str(fake["hold_until"])) if fake.get("hold_until") else None
    while step < steps:
        if step == fake.get("hang_at_step"):
            time.sleep(3600)
        if step == fake.get("crash_at_step"):
            print("RuntimeError: simulated trainer crash", flush=True)
            return int(fake.get("exit_code", 1))
        time.sleep(step_seconds)
        step += 1
        if fake.get("log_steps"):
            print(json.dumps({"event": "step", "step": step, "pid": os.getpid()}), flush=True)
        write_json_atomically(output_dir / "progress.json", {"step": step, "total_steps": steps, "epoch": 0})
        if request_file.exists():
            save(step)
            request_file.unlink()
        elif step % every == 0:
            save(step)
        if step == hold_at:
            while not stop_requested() and not (release is not None and release.exists()):
                time.sleep(0.02)
        stop = stop_requested()
        if stop and not fake.get("ignore_stop") and not fake.get("complete_on_stop"):
            # As python -m training does: once stopping, a later SIGTERM (a second notice, the drain) must not
            # kill the exit at interpreter shutdown, when Python has put the default handler back.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            save(step)
            return 75
        if stop and fake.get("complete_on_stop"):
            step = steps  # the stop came at the very end: finish instead
    (output_dir / "model.pt").write_bytes(b"fake weights")
    (output_dir / "metrics.json").write_text(json.dumps({"val_accuracy": 0.5, "steps": step}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

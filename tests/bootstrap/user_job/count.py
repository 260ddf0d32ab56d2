"""A user's job as docs/job-contract.md describes it, through the trainstack_job helper: counts steps,
checkpoints every N, stops with exit 75 on request, writes its result to the output directory."""

from __future__ import annotations

import json
import os
import sys
import time

from trainstack_job import Job


def main() -> int:
    steps, every = int(sys.argv[1]), int(os.environ.get("COUNT_EVERY", "5"))
    job = Job.from_env()
    job.watch_signals()
    found = job.latest_checkpoint()
    step = json.loads((found.directory / "count.json").read_text())["step"] if found else 0
    print(json.dumps({"event": "resumed" if found else "fresh", "step": step}), flush=True)
    while step < steps:
        time.sleep(0.02)
        step += 1
        job.report_progress(step, total_steps=steps)
        if step % every == 0 or job.checkpoint_requested() or job.should_stop():
            # Leaving the block commits the checkpoint (and answers a checkpoint request).
            with job.save_checkpoint(step) as directory:
                (directory / "count.json").write_text(json.dumps({"step": step}))
        if job.should_stop():
            job.exit_stopped(step)
    (job.output_dir / "result.json").write_text(json.dumps({"steps": step}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

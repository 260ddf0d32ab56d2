"""The scheduling bench's report and its command line (`main`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path

from bench import scheduling
from bench.scheduling import instances
from bench.scheduling.checks import RunResult, run_one
from bench.scheduling.embedded_aws import embedded_aws, serve
from bench.scheduling.metering import PRICE_NOTE
from bench.scheduling.runs import RunSpec, burst_run, limit_run, pools_run, sweep_run


def hardware() -> dict[str, str]:
    facts = {"nproc": str(os.cpu_count()), "python": platform.python_version()}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                facts["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(ImportError):
        import moto

        facts["moto"] = moto.__version__
    return facts


def describe(result: RunResult) -> list[str]:
    f = result.figures
    per = f["s3_per_job"]
    lines = [
        f"run {result.spec.name}: {result.spec.title}",
        f"  wall {f['wall_s']} s; {f['decisions']} scheduling decisions ({f['decisions_bind']} bind_job, "
        f"{f['decisions_look']} work_in_lanes), each p50 {f['decision_p50_s']} s, "
        f"p95 {f['decision_p95_s']} s",
        f"  free instance -> lease (dispatch): p50 {f['dispatch_p50_s']} s, p95 {f['dispatch_p95_s']} s; "
        f"submit -> lease (queue wait): p50 {f['queue_wait_p50_s']} s, p95 {f['queue_wait_p95_s']} s",
        f"  utilisation {f['utilisation']:.1%} (busy {f['busy_s']} s of {f['instance_s']} instance-s)",
        f"  S3 per job: GET {per['GET']}, LIST {per['LIST']}, PUT {per['PUT']}, DELETE {per['DELETE']} "
        f"(total {f['s3_requests']}); ${f['s3_usd_per_job']:.6f} per job, ${f['s3_usd_total']:.4f} in all; "
        f"{f['conflicts_412']} lost conditional writes (412/409)",
        f"  per decision: GET mean {f['decision_get_mean']} (max {f['decision_get_max']}), LIST mean "
        f"{f['decision_list_mean']}, PUT mean {f['decision_put_mean']}; decisions made "
        f"{f['decision_s3_share']:.0%} of all S3 requests",
        f"  Auto Scaling calls: {f['autoscaling_calls'] or 'none'}"
        + (
            f"; the scaler lowered desired capacity {f['scaler_lowered']} times"
            if result.spec.scale_in
            else ""
        ),
        f"  roles taken: {f['roles']}",
    ]
    if result.spec.scheduler:
        lines.append(
            f"  scheduler function: {sum(f['lambda_invocations'].values())} invocations "
            f"({f['lambda_invocations']}), {f['lambda_passes']} of them read the state (the others a pass "
            f"had covered), {f['lambda_raised']} raised a pool; at most {f['most_at_once']} jobs trained at "
            "once"
        )
    lines += [f"  note: {note}" for note in f["notes"][:5]]
    lines += [f"  [{'PASS' if c.passed else 'FAIL'}] {c.name}: {c.detail}" for c in result.checks]
    return lines


def _sizes(args: argparse.Namespace) -> list[RunSpec]:
    if args.quick:
        runs = {
            "pools": pools_run(4, 2, 2, 1, 1, args.seed),
            "sweep": sweep_run(3, 2, 2, 1, args.seed),
            "burst": burst_run(4, 2, 2, args.seed),
            "limit": limit_run(6, 2, 2, 2, args.seed),
        }
    else:
        runs = {
            "pools": pools_run(
                args.jobs, args.instances_a, args.lanes_a, args.instances_b, args.lanes_b, args.seed
            ),
            "sweep": sweep_run(
                args.sweep_points, args.sweep_lanes, args.sweep_lanes, args.sweep_parallel, args.seed
            ),
            "burst": burst_run(
                args.burst_jobs, args.burst_lanes, args.burst_lanes, args.seed, not args.no_scale_in
            ),
            "limit": limit_run(args.limit_jobs, args.limit_lanes, args.limit_lanes, args.limit, args.seed),
        }
    return [runs[name] for name in args.runs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scheduling", description=scheduling.__doc__.splitlines()[0]
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--quick", action="store_true", help="a few jobs and instances per run (the test's size)"
    )
    parser.add_argument(
        "--runs",
        nargs="+",
        choices=("pools", "sweep", "burst", "limit"),
        default=["pools", "sweep", "burst", "limit"],
    )
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--instances-a", type=int, default=24)
    parser.add_argument("--lanes-a", type=int, default=24)
    parser.add_argument("--instances-b", type=int, default=8)
    parser.add_argument("--lanes-b", type=int, default=8)
    parser.add_argument("--sweep-points", type=int, default=16)
    parser.add_argument("--sweep-lanes", type=int, default=4)
    parser.add_argument("--sweep-parallel", type=int, default=2, help="sweep.parallel (0: no limit)")
    parser.add_argument("--burst-jobs", type=int, default=50)
    parser.add_argument("--burst-lanes", type=int, default=16)
    parser.add_argument("--no-scale-in", action="store_true", help="the burst run without the scaler")
    parser.add_argument("--limit-jobs", type=int, default=60, help="the limit run's jobs (half per pool)")
    parser.add_argument("--limit-lanes", type=int, default=8, help="each pool's lanes and instances")
    parser.add_argument("--limit", type=int, default=6, help="the limit run's maxConcurrentJobs")
    parser.add_argument("--seed", type=int, default=32)
    parser.add_argument("--json", type=Path, help="write the figures and checks here")
    parser.add_argument("--verbose", action="store_true", help="the simulated agents' event lines")
    args = parser.parse_args(argv)
    instances.VERBOSE = args.verbose
    if args.serve:
        serve()
        return 0
    facts = hardware()
    print(f"bench.scheduling, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {facts}")
    print(f"prices: {PRICE_NOTE}")
    results: list[RunResult] = []
    with embedded_aws() as endpoint:
        for spec in _sizes(args):
            result = run_one(spec, endpoint, args.seed)
            results.append(result)
            print("\n".join(describe(result)), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "hardware": facts,
            "prices": PRICE_NOTE,
            "runs": [
                {
                    "name": r.spec.name,
                    "title": r.spec.title,
                    "figures": r.figures,
                    "checks": [{"name": c.name, "passed": c.passed, "detail": c.detail} for c in r.checks],
                    "decisions": [
                        {
                            k: getattr(d, k)
                            for k in ("kind", "pool", "seconds", "job", "queue_entries", "get", "list", "put")
                        }
                        for d in r.journal.decisions
                    ],
                }
                for r in results
            ],
        }
        args.json.write_text(json.dumps(report, indent=1, default=str))
    failed = [f"{r.spec.name}: {c.name}" for r in results for c in r.checks if not c.passed]
    print("all pass conditions hold" if not failed else f"FAILED: {'; '.join(failed)}")
    return 1 if failed else 0

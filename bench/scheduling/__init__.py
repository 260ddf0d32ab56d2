"""`python -m bench.scheduling`: the scheduling core (pools, lanes, the lease, the ledger) under load, in
moto.

Issue 32, item 7. Not the full agent and trainer (a life costs seconds of CPU: 200 of them do not fit 2
cores),
but the real scheduling code, driven the way `bootstrap/lifecycle.py` and `bootstrap/outcomes.py` drive it.
Each
simulated instance is a thread holding one real instance of its pool's Auto Scaling group (moto), and loops:

1. look for work: `bind_job` with its pool's agent config (`job_id ""`, `pool`, `lanes`);
   nothing: it leaves the group (`Fleet.leave_for_good`: protection off, terminate with decrement);
2. open a life in the job's ledger (`LedgerStore.begin_life`) and take the job's lease with the real
   `OneWriter.take` (holder, standby or surplus);
3. as the holder: protect the instance from scale-in (`Fleet.protect`), "train" (a sleep of a random
   0.05-0.3 s),
   prove the lease (`OneWriter.confirm`), write the job's end to the ledger (`end_life` completed,
   `set_status` completed), ask what it does next (`work_in_lanes`, the agent's `_queued_next`), release the
   lease; with a next job, back to 1 (`after` = the job it ended), else leave;
4. as the standby: wait for the lease (`OneWriter.wait_for_lease`, polled every STANDBY_POLL_S instead of the
   agent's 1 s, in proportion to the short jobs); once taken, a job that has ended is let go
   (`standby_ended`) and the instance goes on with the queue as in 3; a job still running is trained;
5. surplus: the life ends `surplus` and the instance leaves (`Fleet.leave`).

Every S3 and Auto Scaling call is counted with botocore's event hooks (one count per API call; a 412/409 lost
conditional write is a request too and is also counted apart). Each `bind_job` / `work_in_lanes` call is one
scheduling decision; its requests are counted on their own.

The moto server runs in a child process (`--serve`), so the instances' threads and the server use both cores,
and it handles one request at a time: moto checks a conditional write (If-Match / If-None-Match) and then
stores
the object in two steps, which two request threads can interleave (tests/bootstrap/test_lease.py says the
same);
S3 does both atomically. Serialising the server's requests gives moto S3's atomicity; which write gets in and
the 412 the other gets are still moto's answers.

Runs (sizes are flags; `--quick` is the test's size):
- `pools`: 200 jobs over 32 instances in 2 pools (the default pool: 24 instances, 24 lanes; pool `b`: 8 and
  8),
  each job's entry naming its pool (3 of 4 jobs in the default pool);
- `sweep`: a 16-point sweep (`sweep.parallel` 2, `_held_back`) on a pool of 4 lanes and 4 instances;
- `burst`: 50 submissions within one second while 16 instances (16 lanes) start, which drain them; a scale-in
  thread lowers the group's desired capacity towards what the unfinished jobs need (the scheduler Lambda's
  rule), so AWS (moto) takes instances away: protected (training) ones must never go.

- `limit`: 60 jobs over 2 pools of 8 lanes and at most 8 instances each, under a stack-wide maxConcurrentJobs
  of 6, and no instance started by the bench: the groups start at zero and the scheduler function (the real
  `lambdas/scheduler/handler.py run`, invoked once per queue entry, once per instance that ends and on a
  schedule, one at a time as its reserved concurrency makes it) raises them; a launcher thread boots an
  instance for each one the group lists. Its invocations are counted by trigger.

Pass conditions (per run): every job ran exactly once (one completed holder life per job, nothing run
twice, nothing left unrun); never two writers at once (the lease-holding intervals of each job, recorded in
this
process on one monotonic clock, never overlap; an interval starts after the acquiring write returned and ends
before the releasing write is sent); no job's lease lost (every holder's `confirm` True, every release done);
no busy instance scaled in (an instance terminated by scale-in was not protected and training at the time);
in the limit run, never more than maxConcurrentJobs jobs at once (from a holder's lease taken until the job's
end was written to its ledger, which is when its run slot frees).

The package, one module per part, each importing only those above it: `metering` (counting requests),
`runs` (the runs' specs), `journal` (what happened), `embedded_aws` (the moto server), `instances` (the
simulated instances and the scaler), `checks` (one run, its checks and figures), `report` (the report and
`main`); `__main__` runs `report.main`.
"""

"""`make mutate`: mutation testing (mutmut) of the modules that carry trainstack's guarantees.

Each target mutates its module(s) and runs only the fast tests that exercise them (no trainer processes), so
a run fits a 2-core machine. mutmut rewrites the files it mutates: every target runs in a private copy of the
working tree (tracked and untracked, not ignored, files) under `--workdir` (default
$TMPDIR/trainstack-mutate), never in the checkout itself, so colleagues' test runs never import a mutant.

    python -m bench.mutate                        # every target, most important first
    python -m bench.mutate persist lease          # some targets
    python -m bench.mutate --changed-since origin/main   # what changed since (CI; before each resolve)
    python -m bench.mutate --again persist        # the last run's survivors against the current tests
    python -m bench.mutate --source HEAD ledger   # the sources as committed, not others' edits in progress
    python -m bench.mutate --only '*__mutmut_*[13579]' persist   # a deterministic sample: odd-numbered
    python -m bench.mutate --list

Per target it prints killed / checked and the survivors (with their diffs, also saved in
`<workdir>/<target>/survivors.txt`); it exits 1 when a target scores under `--min-score` (90 %).
A mutant counts as killed when a selected test fails or times out with it; one no selected test reaches
counts as surviving. Mutants left out by `--only` (or by a run stopped early) are "not checked": reported
as such, never counted as killed. Scores and the equivalent survivors are recorded in bench/RESULTS.md.
A test written to kill a survivor goes into the test file of the module it checks, which its target lists.

`--changed-since REF` runs what changed since REF, and no more: a target new or redefined since REF in full;
in a target whose modules changed, the mutants of the functions whose code changed (compared by their AST,
so a moved function or an edited docstring is not new); in a target whose own test files changed only, a
fifth of its mutants (TESTS_CHANGED_SAMPLE), to see that the tests still kill them.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Copied into mutmut's mutants/ folder whole, so every import of the project comes from the private copy.
# Every first-party package: mutmut copies them into its mutants/ tree, where the tests run (the Lambdas and
# the policy pack moved to folders of their own: without them there, their targets and every test that
# imports them fail before a mutant runs).
PACKAGES = ("bootstrap", "infra", "training", "trainstack", "trainstack_job", "demo", "lambdas", "policypack")
KILLED = {"killed", "timeout"}
UNCHECKED = "not checked"
# mutmut's own per-mutant limit, in CPU seconds: (the mutant's tests' clean time + 1) × this × 2, for a mutant
# that spins (a retry loop without its sleep); pytest's --timeout (wall time, below) ends one that waits.
# mutmut's default, 15: at 5 a failing test's report and the session's end (the moto server, the IAM check)
# passed the limit, and a mutant the tests fail counted as a timeout instead of killed.
TIMEOUT_MULTIPLIER = 15.0


@dataclass(frozen=True)
class Target:
    modules: tuple[str, ...]
    tests: tuple[str, ...]
    # Tests of the selected files left out (node ids): they start what a forked mutmut worker cannot run.
    deselect: tuple[str, ...] = ()


FAULTS = "tests/faults/test_nothing_lost_nothing_billed.py"

# Most important first. Tests: files or node ids; those that do not exist are left out (a `--source REF` copy
# may predate them); tests/test_mutate_targets.py keeps every one present in the checkout.
TARGETS: dict[str, Target] = {
    "persist": Target(
        ("bootstrap/persist.py", "bootstrap/checkpoint_store.py", "bootstrap/checkpoint_restore.py"),
        (
            "tests/bootstrap/test_persist.py",
            "tests/bootstrap/test_fencing.py",
            # The persister's side of the multi-node fence: `latest.json`'s generation, the superseded node.
            "tests/bootstrap/test_generation_fence.py",
            # The job is contained: a forged token in latest.json never stops its holder nor raises the next
            # lease's floor (the token record); a restore that would write outside its step is refused.
            "tests/bootstrap/test_forged_token.py",
            "tests/bootstrap/test_refused_restore.py",
            *(
                f"tests/bootstrap/test_contained_paths.py::{name}"
                for name in (
                    "test_a_manifest_naming_a_file_outside_its_step_is_never_restored_and_the_line_names_the_object",
                    "test_with_an_older_checkpoint_the_outside_one_is_skipped_saying_why_and_the_older_restored",
                    "test_a_staging_folder_the_job_swaps_for_a_link_mid_restore_is_never_written_through",
                    "test_a_file_swapped_for_a_link_after_the_uploads_check_is_never_read_through_it",
                    "test_a_step_with_sub_folders_still_goes_up_and_comes_back_whole",
                    "test_a_step_whose_folder_is_a_link_out_is_never_uploaded",
                    "test_a_link_at_latest_jsons_temporary_name_never_makes_root_write_its_target",
                    "test_a_link_at_latest_json_itself_is_replaced_not_followed_and_said_once",
                )
            ),
            # The persister alone against the S3 fault proxy (a few seconds each; no agent, no trainer).
            f"{FAULTS}::test_after_an_s3_outage_at_a_stop_latest_names_the_newest_step_and_never_moved_back",
            f"{FAULTS}::test_a_draining_old_life_cannot_move_latest_back",
            f"{FAULTS}::test_an_upload_overtaken_by_a_newer_step_is_dropped_and_the_newest_goes_first",
            f"{FAULTS}::test_nothing_confirmed_is_claimed_when_s3_never_comes_back",
        ),
    ),
    "lease": Target(
        ("bootstrap/lease.py",),
        ("tests/bootstrap/test_lease.py", "tests/bootstrap/test_fencing.py"),
    ),
    # The lease's counterpart on a multi-node job: the generation record as the fencing token.
    "fence": Target(
        ("bootstrap/generation_fence.py",),
        ("tests/bootstrap/test_generation_fence.py", "tests/bootstrap/test_fencing.py"),
    ),
    "ledger": Target(
        ("bootstrap/ledger.py",),
        (
            "tests/bootstrap/test_ledger.py",
            "tests/bootstrap/test_agent_parts.py",
            "tests/bootstrap/test_ledger_handover.py",
            "tests/bootstrap/test_multinode_ledger.py",
            "tests/bootstrap/test_outcomes.py",
            # A life bound to a running job never reopens it once ended (JobEndedError).
            "tests/bootstrap/test_pool_binding.py",
        ),
    ),
    # The records every process shares (trainstack_job/records.py): each reads whatever its object holds
    # without raising, writes back what it read; the one conditional write and the ended statuses.
    "records": Target(
        ("trainstack_job/records.py",),
        ("tests/job/test_records.py", "tests/bootstrap/test_lease.py", "tests/bootstrap/test_ledger.py"),
        # Reads the module's source for its imports: a mutated copy imports mutmut's trampoline.
        deselect=("tests/job/test_records.py::test_records_load_only_the_standard_library",),
    ),
    # The cost cap on the instance (`trainstack stop` and the cap as each life reads them; the agent's own
    # tests start trainers) and from outside it (the capacity Lambda, whose spot fallback shares the file).
    "costcap": Target(
        ("bootstrap/jobstate.py", "lambdas/capacity_fallback/handler.py", "trainstack_job/launches.py"),
        (
            "tests/bootstrap/test_jobstate.py",
            # The launch history: a spot drought as both the function and `trainstack jobs` read it.
            "tests/job/test_launches.py",
            # The cap from outside, and the spot fallback's decision with the line saying why.
            "tests/infra/test_cost_cap.py",
            # The fallback's decisions against moto's group (not the Pulumi program's preview tests).
            *(
                f"tests/infra/test_capacity.py::{name}"
                for name in (
                    "test_no_launch_for_fifteen_minutes_while_wanted_switches_to_on_demand",
                    "test_on_demand_instance_runs_its_life_then_spot_is_tried_first",
                    "test_group_scaled_to_zero_returns_to_spot",
                    "test_zero_minutes_never_falls_back",
                    "test_an_old_drought_does_not_count_after_a_pause",
                    "test_a_group_with_its_instance_is_left_alone",
                    "test_never_touches_another_group",
                    "test_handler_reads_its_settings_from_the_environment",
                    "test_the_update_names_no_launch_template_so_aws_checks_no_launch_permissions",
                )
            ),
        ),
    ),
    # The queue and its entry parser: every malformed entry is the queue's own one-line error, never a
    # KeyError or TypeError that escapes the agent's reader; entries and records are created once.
    "queue": Target(("trainstack_job/queue.py",), ("tests/job/test_queue.py",)),
    # The stack's maxConcurrentJobs: no more jobs start than the run slots, a job's end or a start that never
    # came frees its slot, a job named twice holds one.
    "slots": Target(("trainstack_job/slots.py",), ("tests/job/test_slots.py",)),
    # A stop is acted on in every phase: before the launch nothing starts, each reason ends its own way.
    "stops": Target(("bootstrap/stops.py",), ("tests/bootstrap/test_stops.py",)),
    # The pools' scheduler: each pool raised to what its waiting jobs need, never lowered, concurrent passes
    # agreeing (infra/scheduler.py invokes it).
    "scheduler": Target(("lambdas/scheduler/handler.py",), ("tests/infra/test_scheduler_fn.py",)),
    # One writer per single-node job: the lease taken, the warm standby and its take-over, the holder's own
    # clock (bootstrap/lease.py is the lease target's).
    "standby": Target(
        ("bootstrap/standby.py",),
        ("tests/bootstrap/test_standby.py", "tests/bootstrap/test_lease.py"),
    ),
    # How each life ends: completion and its results, the job's end by the lease's holder only, failures and
    # giving up, scale-in, handed-over, superseded and surplus lives, the queue's next job.
    "outcomes": Target(
        ("bootstrap/outcomes.py",),
        ("tests/bootstrap/test_outcomes.py",),
    ),
    # Which job a life serves: the current-job pointer moved only by conditional writes, the queue's head, a
    # job's record checked (only the environment's code re-executed), cancel and stop requests, a pool's
    # lanes (claimed once), damaged objects named once, the legacy job. Against a bare bucket in moto, no
    # agent or trainer (not test_pool_binding.py: a whole stack per test; its promises are in this file too).
    "binding": Target(("bootstrap/jobbinding.py",), ("tests/bootstrap/test_jobbinding.py",)),
    # The job's process on the instance: the stall watchdog's one restart, the kill at the stop deadline or
    # the lease's end, what each exit means for the life; its environment and secrets (test_secrets.py).
    "supervisor": Target(
        ("bootstrap/supervisor.py",),
        (
            "tests/bootstrap/test_supervisor.py",
            "tests/bootstrap/test_stop_line.py",
            "tests/bootstrap/test_secrets.py",
        ),
    ),
    # The job user's credentials: a role session scoped to the job's own prefixes, refreshed by a credential
    # process, never the instance role's; the job's user, home and files apart from root's and other jobs'.
    "jobuser": Target(
        ("bootstrap/jobuser.py", "trainstack_job/credentials.py"),
        ("tests/bootstrap/test_jobuser.py", "tests/job/test_credentials.py"),
    ),
    # The Auto Scaling group as the agent sees it (billing stops, a replacement asked for, scale-in
    # protection) and the scratch space a life trains in (instance store first, never a mounted device twice).
    "fleet": Target(
        ("bootstrap/fleet.py", "bootstrap/scratch.py"),
        ("tests/bootstrap/test_fleet.py", "tests/bootstrap/test_scratch.py"),
    ),
    # The queue writes of `trainstack run`, `cancel` and `sweep`: an entry and its record created once, a
    # cancel request for a queued or running job, a sweep's points each one job.
    "submit": Target(
        ("trainstack/run.py", "trainstack/cancel.py", "trainstack/sweep.py"),
        (
            "tests/cli/test_run.py",
            "tests/cli/test_run_pools.py",
            "tests/cli/test_cancel.py",
            "tests/cli/test_sweep.py",
        ),
    ),
    # The built-in trainer's promises in-process: the checkpoint written whole and read back exactly, the
    # resume at the checkpoint's step and sample, the stop checkpoint on SIGTERM, bad samples named and
    # skipped (the trainer's processes are the stories' tests; a forked mutmut worker cannot run them).
    "trainer": Target(
        ("training/checkpoint.py", "training/resume.py", "training/stop.py", "training/data.py"),
        (
            "tests/training/test_checkpoint.py",
            "tests/training/test_checkpoint_store.py",
            "tests/training/test_resume.py",
            "tests/training/test_stop.py",
            "tests/training/test_data.py",
            "tests/training/test_checkpoint_policy.py",
            # The streamed dataset's order and position (data.py's shard-aware sampler).
            "tests/training/test_streaming.py",
            # Not test_startup.py: each of its tests starts `python -m training` (tests/training/test_stop.py
            # holds the signal handling's promises in-process).
        ),
        # Trainer lives (forked or `python -m training`, the baseline included): they import the checkout's
        # modules, not the mutant, and take seconds each.
        deselect=(
            *(
                f"tests/training/test_resume.py::{name}"
                for name in (
                    "test_stops_signals_a_checkpoint_request_and_a_replacement_from_s3_resume_bitwise_exact",
                    "test_resume_after_sigkills_during_checkpoint_writes_and_at_random_is_bitwise_exact",
                    "test_progress_json_has_the_agent_fields",
                    "test_completed_run_writes_loadable_artifacts",
                )
            ),
            "tests/training/test_data.py::test_training_completes_past_bad_images_and_metrics_lists_them",
            "tests/training/test_data.py::test_too_many_bad_images_stop_the_job_with_exit_65_naming_them",
        ),
    ),
    # The phases of a life (bootstrap/phases/): nothing spent before the GPUs answer, a stop before the
    # launch means the trainer never starts, the one writer decided before the data sync (a surplus instance
    # leaves, a standby waits warm), a dataset that cannot be had ends the life with its own line, the
    # restore, the standby's take-over and the last upload within the stop's deadline. Each phase in-process
    # with a fake life (its whole lives are the agent's tests: seconds each, and they add no kills).
    "phases": Target(
        (
            "bootstrap/phases/base.py",
            "bootstrap/phases/gpu.py",
            "bootstrap/phases/workspace.py",
            "bootstrap/phases/writer.py",
            "bootstrap/phases/data.py",
            "bootstrap/phases/training.py",
        ),
        ("tests/bootstrap/test_phases.py",),
        # A whole life against moto with the test-double trainer (seconds, and a moto server per session).
        deselect=(
            "tests/bootstrap/test_phases.py::"
            "test_a_phase_added_to_one_lifes_list_runs_with_what_the_earlier_phases_set_up_and_its_end_is_the_lifes",
        ),
    ),
    # Streamed datasets: the shard cache (bounded, content-addressed, one download per shard per machine,
    # checked against the index), the read-ahead in the sampler's order, S3 outages waited out, a corrupt or
    # missing shard named. The loader's position (the shard-aware order) is the trainer target's data.py.
    "streaming": Target(
        ("training/streaming.py",),
        (
            "tests/training/test_streaming.py",
            "tests/training/test_streaming_cache.py",
            "tests/training/test_streaming_faults.py",
            "tests/training/test_data.py",
        ),
        deselect=(
            "tests/training/test_data.py::test_training_completes_past_bad_images_and_metrics_lists_them",
            "tests/training/test_data.py::test_too_many_bad_images_stop_the_job_with_exit_65_naming_them",
        ),
    ),
    # A dataset as shards: the index's columns (each sample's shard, offset, size, label and name, the first
    # format still read), the one-line error for an index that cannot be used, and shards that hold every
    # image byte for byte in webdataset's layout.
    "shards": Target(
        ("trainstack_job/shards.py",),
        (
            "tests/job/test_shards_index.py",
            "tests/job/test_shards_writer.py",
            "tests/job/test_shards_webdataset.py",
            "tests/cli/test_datapush_shards.py",
            "tests/training/test_streaming.py",
        ),
    ),
    # One run in the tracker across lives: the run id, the resume step (a dead life's steps replayed once,
    # never twice), the main rank only, the one-line error for a missing package. In-process, with fakes of
    # the MLflow and W&B clients and TensorBoard's own files; the trainer lives are the stories' proof.
    "tracker": Target(
        ("training/tracker.py",),
        ("tests/training/test_tracker.py",),
        deselect=(
            "tests/training/test_tracker.py::"
            "test_a_tensorboard_run_across_a_spot_stop_and_a_kill_mid_checkpoint_has_every_step_once",
            "tests/training/test_tracker.py::"
            "test_an_mlflow_run_in_a_file_store_across_a_spot_stop_and_a_kill_mid_checkpoint_has_every_step_once",
            "tests/training/test_tracker.py::"
            "test_a_missing_tracker_package_stops_the_trainer_with_one_line_naming_the_key_and_the_install",
            "tests/training/test_tracker.py::"
            "test_tracking_is_off_by_default_and_a_trainer_without_it_imports_no_tracker",
        ),
    ),
    # Goodput per dollar: each life's samples/s folded into the stack's table once, the weights AWS allocates
    # by, capacity in units, and the types a job drops for losing on samples per dollar.
    "throughput": Target(
        ("trainstack_job/throughput.py",),
        ("tests/job/test_throughput.py",),
    ),
    "watcher": Target(
        ("bootstrap/watcher.py",),
        ("tests/bootstrap/test_imds_and_watcher.py",),
    ),
    "policy": Target(
        # patterns.py: the ARN matchers the identity rules judge resources with (the KMS "every key" rule).
        (
            "policypack/identity.py",
            "policypack/patterns.py",
            "policypack/network.py",
            "policypack/storage.py",
        ),
        (
            "tests/policy/test_rules.py",
            "tests/policy/test_rule_variants.py",
            "tests/policy/test_capacity_rules.py",
            "tests/policy/test_multinode_rules.py",
            "tests/policy/test_kms_all_keys.py",
            "tests/policy/test_effective_permissions.py",
            # Not test_pack_process.py: the pack it starts as a process imports the mutants outside
            # mutmut's folder, where mutmut cannot find its settings.
        ),
        # The Pulumi program under its mocks talks gRPC, which hangs in a forked worker (no CPU spent, so
        # mutmut's limit never ends it); it judges the capacity rules, not these modules.
        deselect=("tests/policy/test_capacity_rules.py::test_the_programs_fallback_passes_the_pack",),
    ),
    "config": Target(
        (
            "infra/config/values.py",
            "infra/config/groups.py",
            "infra/config/pools.py",
            "infra/config/jobs.py",
            "infra/config/network.py",
            "infra/config/stack.py",
            "training/config.py",
            "bootstrap/agent_config.py",
        ),
        (
            "tests/infra/test_config.py",
            "tests/infra/test_config_security.py",
            "tests/training/test_config.py",
            # The pools' keys as preview reads them (not the tests that run the Pulumi program: gRPC; nor the
            # default job's fit, which loads examples/ from the checkout and fails in mutmut's copy).
            *(
                f"tests/infra/test_pools.py::{name}"
                for name in (
                    "test_a_bad_pool_is_one_line_naming_its_key_and_a_fix_that_is_accepted",
                    "test_a_pool_that_is_not_a_mapping_is_one_line",
                    "test_pools_that_are_not_a_short_list_are_one_line_with_an_example_that_is_accepted",
                    "test_a_pool_name_too_long_for_its_aws_names_is_refused_with_one_that_fits",
                    "test_pools_together_with_the_single_groups_keys_is_one_line_saying_which_to_keep",
                    "test_an_efa_pool_in_public_subnets_is_refused_as_the_single_group_is",
                    "test_a_pool_without_types_still_has_its_size_checked",
                    "test_a_pool_keeps_every_setting_it_was_given",
                    "test_an_empty_pools_list_is_the_single_group",
                    "test_the_single_groups_fields_describe_the_first_pool",
                    "test_the_readme_and_example_stack_pools_are_accepted",
                    "test_the_cli_reads_pools_from_the_stack_file_as_preview_does",
                    "test_several_jobs_at_once_are_refused_on_a_multi_node_pool_and_out_of_range",
                )
            ),
        ),
        # The Pulumi program under its mocks (gRPC: hangs in a forked worker); the validators they reach
        # are the ones test_config.py calls directly. The trainer's command line in a process and against
        # moto (training/__main__.py's checks; a moto server and a process per mutant made the run take
        # hours): the trainer config's own promises are tests/training/test_config.py's in-memory tests. Not
        # tests/bootstrap/test_jobbinding.py either (the agent against moto): tests/infra/test_config.py
        # holds the agent config's.
        deselect=(
            *(
                f"tests/infra/test_config.py::{name}"
                for name in (
                    "test_program_stops_with_the_config_error_before_creating_anything",
                    "test_missing_ami_parameter_names_the_key",
                    "test_arm64_ami_is_refused",
                )
            ),
            *(
                f"tests/training/test_config.py::{name}"
                for name in (
                    "test_cli_prints_one_line_per_problem_and_exits_2",
                    "test_cli_names_a_missing_config_file",
                    "test_config_and_data_folder_problems_are_reported_in_one_run",
                    "test_a_key_with_a_bad_value_is_reported_once_not_again_as_a_missing_folder",
                    "test_a_missing_output_bucket_is_a_config_error_before_torch_is_imported",
                    "test_a_missing_checkpoint_bucket_is_named_too",
                    "test_an_unreachable_s3_is_a_transient_failure_in_one_line",
                )
            ),
        ),
    ),
}


def own_test_files(target: Target) -> list[str]:
    """The target's own test files (its tests' files, node ids or not) that the checkout has now."""
    return [
        name for name in sorted({test.split("::")[0] for test in target.tests}) if (ROOT / name).is_file()
    ]


def private_copy(destination: Path, target: Target, source: str | None = None) -> None:
    """The working tree as it is now (tracked and untracked files git does not ignore) under `destination`;
    with `source` (a git ref), the files as committed there plus the target's own test files as the working
    tree has them: colleagues' uncommitted edits elsewhere in a shared checkout cannot break the copy's
    imports. A copied test that needs a source newer than `source` fails mutmut's clean run, which stops the
    run: never a false kill."""
    shutil.rmtree(destination, ignore_errors=True)
    destination.mkdir(parents=True)
    if source is not None:
        archive = subprocess.run(["git", "archive", source], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(destination)], input=archive, check=True)
        for name in own_test_files(target):
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, destination / name)
        return
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source_file = ROOT / name
        if not source_file.is_file():  # deleted in the working tree, or a submodule
            continue
        copied = destination / name
        copied.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source_file, copied)


def toml_list(values: list[str]) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


SETTINGS_MARK = "\n# bench/mutate.py: mutmut's settings for this target\n"


def configure(tree: Path, target: Target) -> list[str]:
    """mutmut's settings for `target` in the copy's pyproject.toml (replacing the ones an earlier run wrote);
    returns the tests selected."""
    tests = [t for t in target.tests if (tree / t.split("::")[0]).exists()]
    settings = {
        "source_paths": list(PACKAGES),
        # The project's top-level files (Pulumi.yaml and its stack file, which the program's tests read
        # from the working directory): mutmut runs the tests in mutants/.
        "also_copy": sorted(p.name for p in tree.iterdir() if p.is_file()),
        "only_mutate": list(target.modules),
        "pytest_add_cli_args_test_selection": tests,
        # One process per mutant run: no xdist workers, no cache written into the copy. mutmut's own time
        # limit counts CPU seconds, which a mutant that makes a test wait never spends: 60 s of wall time
        # per test (the selected tests take a few seconds at most on a loaded 2-core machine).
        "pytest_add_cli_args": [
            *("-p", "no:cacheprovider", "-p", "no:xdist", "-q", "--timeout=60"),
            *(arg for test in target.deselect for arg in ("--deselect", test)),
        ],
        "timeout_multiplier": TIMEOUT_MULTIPLIER,
        "use_git_change_detection": False,
    }
    lines = ["[tool.mutmut]"]
    for key, value in settings.items():
        lines.append(f"{key} = {toml_list(value) if isinstance(value, list) else json.dumps(value)}")
    pyproject = tree / "pyproject.toml"
    # (A copy configured before the mark was written ends with the bare table.)
    project = pyproject.read_text().split(SETTINGS_MARK)[0].split("\n\n[tool.mutmut]\n")[0]
    pyproject.write_text(project + SETTINGS_MARK + "\n".join(lines) + "\n")
    return tests


@dataclass
class Score:
    name: str
    killed: int
    total: int
    statuses: dict[str, int]
    survivors: list[str]

    @property
    def percent(self) -> float:
        return 100.0 * self.killed / self.total if self.total else 100.0


def mutmut(tree: Path, *args: str, capture: bool = False) -> str:
    command = [str(Path(sys.executable).with_name("mutmut")), *args]
    # The copy's packages, not the editable install's (the checkout), for anything the tests start too.
    env = {**os.environ, "PYTHONPATH": str(tree / "mutants")}
    if not capture:
        subprocess.run(command, cwd=tree, env=env, check=True)
        return ""
    return subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True, text=True).stdout


def results(tree: Path) -> dict[str, str]:
    """Each mutant's status in mutmut's last run under `tree`."""
    statuses = {}
    for line in mutmut(tree, "results", "--all", "true", capture=True).splitlines():
        key, _, status = line.strip().rpartition(": ")
        if key:
            statuses[key] = status
    return statuses


def recorded(tree: Path) -> dict[str, str]:
    """Each mutant's status over every run under `tree`: the first run's, each `--again` run's for the
    survivors it ran (bench/mutate.py keeps them in `results.json`: mutmut forgets its results when the
    selected tests change, and `--again` selects the test files written since)."""
    merged = tree / "results.json"
    if merged.is_file():
        return dict(json.loads(merged.read_text()))
    return results(tree)


def refresh_tests(tree: Path, target: Target) -> None:
    """The target's own test files as they are now, into an earlier run's copy (new tests get mutmut's
    stats); a test added to a target's file since would otherwise be rerun as it was. Only those: other
    tests may have moved on with sources the copy does not have. One of these that needs such a source fails
    mutmut's clean run, which stops the rerun: never a false kill."""
    for name in own_test_files(target):
        for base in (tree, tree / "mutants"):
            (base / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, base / name)


def run_target(
    name: str,
    target: Target,
    workdir: Path,
    children: int,
    *,
    again: bool = False,
    source: str | None = None,
    only: tuple[str, ...] = (),
) -> Score:
    tree = workdir / name
    print(f"==> {name}: {', '.join(target.modules)} in {tree}", flush=True)
    if again and (tree / "mutants").is_dir():
        # The same mutants as last time; only the survivors run again, against the tests as they are now
        # (the target's test files written since the last run are selected too).
        before = recorded(tree)
        # Not "not checked": a run stopped early leaves those for a plain `mutmut run` in the same folder.
        survivors = [
            k
            for k, status in before.items()
            if status not in {*KILLED, UNCHECKED} and (not only or any(fnmatch(k, p) for p in only))
        ]
        print(
            f"    again: the {len(survivors)} survivors of the last run, with the current tests", flush=True
        )
        refresh_tests(tree, target)
        tests = configure(tree, target)
        print(f"    tests: {' '.join(tests)}", flush=True)
        if survivors:
            mutmut(tree, "run", "--max-children", str(children), *survivors)
        after = results(tree)
        rerun = set(survivors)
        merged = {
            key: after[key] if key in rerun and after.get(key, UNCHECKED) != UNCHECKED else status
            for key, status in before.items()
        }
        (tree / "results.json").write_text(json.dumps(merged, indent=1, sort_keys=True))
    else:
        private_copy(tree, target, source)
        tests = configure(tree, target)
        # mutmut's first run in a fresh folder fails to import the `tests` package of its own copy (its
        # import caches see mutants/ empty); a run over a mutants/ already holding the sources does not.
        # Same files, same mtimes (copy2): mutmut still takes them for unmutated and mutates them.
        for package in (*PACKAGES, "tests"):
            shutil.copytree(tree / package, tree / "mutants" / package, copy_function=shutil.copy2)
        print(f"    tests: {' '.join(tests)}", flush=True)
        if only:
            print(f"    only the mutants named by {' '.join(only)}", flush=True)
        mutmut(tree, "run", "--max-children", str(children), *only)
    statuses: dict[str, int] = {}
    survivors = []
    for key, status in recorded(tree).items():
        statuses[status] = statuses.get(status, 0) + 1
        if status not in {*KILLED, UNCHECKED}:
            survivors.append(key)
    killed = sum(n for status, n in statuses.items() if status in KILLED)
    checked = sum(n for status, n in statuses.items() if status != UNCHECKED)
    score = Score(name, killed, checked, statuses, survivors)
    diffs = subprocess.run(
        [sys.executable, "-c", SHOW_DIFFS, *survivors],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree / "mutants")},
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    (tree / "survivors.txt").write_text(diffs)
    return score


# `mutmut show` for many mutants in one process (a process each takes a second apiece).
SHOW_DIFFS = """
import sys
from mutmut.__main__ import find_mutant, get_diff_for_mutant
for name in sys.argv[1:]:
    print(f"# {name}")
    print(get_diff_for_mutant(name, path=find_mutant(name).path))
"""


# A target whose own test files changed (and none of its modules) is checked on this sample: a fifth of its
# mutants (every one whose number ends in 0 or 5, so each function's first mutant is in).
TESTS_CHANGED_SAMPLE = "*__mutmut_*[05]"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def _committed(ref: str, path: str) -> str | None:
    """The file as committed at `ref`; None when it did not exist there."""
    try:
        return _git("show", f"{ref}:{path}")
    except subprocess.CalledProcessError:
        return None


def _code(function: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """A function's code without its docstring (which mutmut leaves alone) and without line numbers."""
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return "\n".join(ast.dump(statement) for statement in [*function.decorator_list, function.args, *body])


def _functions(source: str | None) -> dict[str, str]:
    """Each function and method of a module (by mutmut's name for it) and its code: what mutmut mutates."""
    found: dict[str, str] = {}
    if source is None:
        return found
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[f"x_{node.name}"] = _code(node)
        elif isinstance(node, ast.ClassDef):
            for method in node.body:
                if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[f"xǁ{node.name}ǁ{method.name}"] = _code(method)
    return found


def changed_functions(since: str, module: str, path_then: str | None = None) -> list[str]:
    """mutmut name patterns for the functions of `module` whose code differs from `since` (by their AST:
    a moved function, or one whose comments or docstring changed, is not new); every function of a new
    module. `path_then`: where the module was at `since`, when it has moved since."""
    before = _functions(_committed(since, path_then or module))
    now = _functions((ROOT / module).read_text(encoding="utf-8"))
    dotted = module.removesuffix(".py").replace("/", ".")
    return [f"{dotted}.{name}__mutmut_*" for name, tree in now.items() if before.get(name) != tree]


Definition = tuple[tuple[str, ...], ...]


def _definition(target: object) -> Definition:
    """What a target is made of (compared across two versions of this file, whose Target classes differ)."""
    return tuple(tuple(getattr(target, field, ())) for field in ("modules", "tests", "deselect"))


def _targets_at(ref: str) -> dict[str, Definition]:
    """Each target's definition as bench/mutate.py had it at `ref` (none when it did not exist there)."""
    source = _committed(ref, "bench/mutate.py")
    if source is None:
        return {}
    name = "bench._mutate_at_ref"
    module = types.ModuleType(name)
    module.__file__ = __file__  # its ROOT is this checkout's
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    try:
        exec(compile(source, f"{ref}:bench/mutate.py", "exec"), module.__dict__)
    finally:
        del sys.modules[name]
    targets = getattr(module, "TARGETS", {})
    return {key: _definition(target) for key, target in targets.items()}


def renamed_since(since: str) -> tuple[dict[str, str], set[str]]:
    """The files git sees as moved since `since`: each one's path then, by its path now; and the paths now
    of those moved unchanged (100 % similar), which are no change to test."""
    then_by_now: dict[str, str] = {}
    unchanged: set[str] = set()
    for line in _git("diff", "--name-status", "-M", since, "--").splitlines():
        fields = line.split("\t")
        if len(fields) == 3 and fields[0].startswith("R"):
            then_by_now[fields[2]] = fields[1]
            if fields[0] == "R100":
                unchanged.add(fields[2])
    return then_by_now, unchanged


def _moved(definition: Definition, now_by_then: dict[str, str]) -> Definition:
    """A target's definition at the base with each moved file's path (test ids included) as it is now."""

    def path_now(entry: str) -> str:
        path, sep, rest = entry.partition("::")
        return now_by_then.get(path, path) + sep + rest

    return tuple(tuple(path_now(entry) for entry in part) for part in definition)


def changed_targets(since: str) -> dict[str, tuple[str, ...]]:
    """What changed since `since`, as each target's mutants to run (an empty tuple: all of them):
    - a target new or redefined (its modules, tests or deselected tests) since: all of its mutants;
    - a target whose modules changed: the mutants of the functions that changed;
    - a target whose own test files changed only: the sample TESTS_CHANGED_SAMPLE.
    A file git sees as moved is compared with itself where it was: a target whose files only moved is not
    redefined, and a module moved unchanged has no changed function. Targets with no change are left out."""
    then_by_now, moved_unchanged = renamed_since(since)
    now_by_then = {then: now for now, then in then_by_now.items()}
    changed = set(_git("diff", "--name-only", since, "--").split())
    now = {name: _definition(target) for name, target in TARGETS.items()}
    before = _targets_at(since) if "bench/mutate.py" in changed else now
    selected: dict[str, tuple[str, ...]] = {}
    for name, target in TARGETS.items():
        then = before.get(name)
        if then is None or _moved(then, now_by_then) != now[name]:
            selected[name] = ()
            continue
        patterns = [
            pattern
            for module in target.modules
            if module in changed
            for pattern in changed_functions(since, module, then_by_now.get(module))
        ]
        if patterns:
            selected[name] = tuple(patterns)
        elif (changed - moved_unchanged) & {test.split("::")[0] for test in target.tests}:
            selected[name] = (TESTS_CHANGED_SAMPLE,)
    return selected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.mutate", description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", help=f"of {', '.join(TARGETS)} (default: all, in this order)")
    parser.add_argument("--changed-since", metavar="REF", help="only targets whose modules or tests changed")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "trainstack-mutate")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--min-score", type=float, default=90.0)
    parser.add_argument(
        "--again",
        action="store_true",
        help="rerun only the last run's survivors (same mutants; with --only, those it names) against the "
        "current tests",
    )
    parser.add_argument(
        "--source",
        metavar="REF",
        help="mutate the files as committed at REF, not the working tree (each target's own test files "
        "are the checkout's, as they are now)",
    )
    parser.add_argument(
        "--only",
        metavar="PATTERN",
        action="append",
        default=[],
        help="only the mutants whose names match (fnmatch; repeatable): a deterministic sample, e.g. "
        "'*__mutmut_*[13579]' (odd-numbered) or 'bootstrap.persist.xǁCheckpointPersisterǁ_upload*'",
    )
    parser.add_argument("--list", action="store_true", help="print the targets and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, target in TARGETS.items():
            print(f"{name}: {' '.join(target.modules)}  <-  {' '.join(target.tests)}")
        return 0
    unknown = [n for n in args.targets if n not in TARGETS]
    if unknown:
        parser.error(f"unknown target(s) {', '.join(unknown)}; known: {', '.join(TARGETS)}")
    names = list(args.targets) or list(TARGETS)
    only = {name: tuple(args.only) for name in names}
    if args.changed_since and args.only:
        parser.error("--changed-since chooses the mutants itself: leave out --only")
    if args.changed_since:
        changed = changed_targets(args.changed_since)
        names = [n for n in names if n in changed]
        if not names:
            print(f"no guarantee module changed since {args.changed_since}")
            return 0
        for name in names:
            only[name] = changed[name]
            what = " ".join(changed[name]) or "all (a new or redefined target)"
            print(f"==> {name}: changed since {args.changed_since}: {what}", flush=True)
    workdir = args.workdir.resolve()
    if workdir == ROOT or ROOT in workdir.parents:
        parser.error("--workdir must be outside the checkout: mutmut rewrites the files it mutates")
    scores = [
        run_target(
            name,
            TARGETS[name],
            workdir,
            args.max_children,
            again=args.again,
            source=args.source,
            only=only[name],
        )
        for name in names
    ]
    print("\n==> mutation scores (killed / checked; a timeout counts as killed; not checked: left out)")
    for score in scores:
        detail = ", ".join(f"{status} {n}" for status, n in sorted(score.statuses.items()))
        print(f"    {score.name:8} {score.killed:4} / {score.total:<4} {score.percent:5.1f} %  ({detail})")
        for key in score.survivors:
            print(f"        survived: {key}")
    print(f"    survivors' diffs: {workdir}/<target>/survivors.txt")
    low = [s.name for s in scores if s.percent < args.min_score]
    if low:
        print(f"under {args.min_score:.0f} %: {', '.join(low)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`trainstack weights` (issue 36): the stack's measured lives (state/throughput.json, in moto's S3) become
a table of each pool's weights now and from the measurements, `--apply` sets trainstack:measuredThroughput
with the pulumi CLI (a fake on PATH records what it was asked), and the program's pool_weights, reading that
config, gives the weights the table promised."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest

from infra.fleet import pool_weights
from tests.cli.conftest import BUCKET, REGION, STACK, Result, create_stack_resources, write_project
from trainstack.stack import Stack
from trainstack_job.records import Life
from trainstack_job.throughput import ThroughputStore

KEY = "trainstack:measuredThroughput"
# The pool that is weighted (one instance, one job) and one that never is (two jobs at once).
POOLS = [
    {"name": "default", "instanceTypes": ["g4dn.xlarge", "g6.xlarge", "g6e.xlarge"], "maxInstances": 1},
    {"name": "lanes", "instanceTypes": ["g4dn.xlarge", "g6e.xlarge"], "maxInstances": 1, "maxJobs": 2},
]
# resnet50's lives: 2 h on T4s at 100 samples/s, 3 h on an L4 at 310, half an hour on an L40S (too little).
# The L4 measured 310 / 1.86 T4-equivalents = 166.5 per estimated T4, the T4 100: their geometric mean, 129,
# scales the L40S's estimate (5.57) to 719. Relative to the T4: L4 3.1 -> 3, L40S 7.2 -> 7 (today 2 and 6).
MEASURED_WEIGHTS = {"g4dn.xlarge": 1, "g6.xlarge": 3, "g6e.xlarge": 7}
SHIPPED_WEIGHTS = {"g4dn.xlarge": 1, "g6.xlarge": 2, "g6e.xlarge": 6}


def _life(life_id: str, instance_type: str, hours: float, speed: float, family: str | None) -> Life:
    minutes = round(hours * 60)
    return Life(
        life_id=life_id,
        instance_id=f"i-{life_id}",
        started_at="2030-01-01T00:00:00Z",
        ended_at=f"2030-01-01T{minutes // 60:02d}:{minutes % 60:02d}:00Z",
        outcome="preempted",
        instance_type=instance_type,
        samples_per_second=speed,
        model_family=family,
    )


@dataclass
class Weighed:
    project: Path
    outputs_file: Path
    calls: Path
    run: Callable[..., Result]

    def stack_config(self) -> dict[str, Any]:
        return dict(json.loads((self.project / f"Pulumi.{STACK}.yaml").read_text())["config"])

    def set_config(self, config: dict[str, Any]) -> None:
        write_project(self.project, config)

    def pulumi_calls(self) -> list[list[str]]:
        if not self.calls.is_file():
            return []
        text = self.calls.read_text()
        return [call.strip("\n").split("\n") for call in text.split("--end--\n") if call.strip()]


def _fake_pulumi(bin_dir: Path, calls: Path, *, fail: str = "") -> None:
    """A `pulumi` that records each call's arguments (one a line) and succeeds, or fails with `fail`."""
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "pulumi"
    script.write_text(
        "#!/bin/sh\n"
        f"printf '%s\\n' \"$@\" >> '{calls}'\n"
        f"echo '--end--' >> '{calls}'\n" + (f'echo "error: {fail}" >&2\nexit 255\n' if fail else "exit 0\n")
    )
    script.chmod(0o755)


@pytest.fixture()
def weighed(
    aws: Any, tmp_path: Path, cli: Callable[..., Result], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Weighed]:
    create_stack_resources()
    project = tmp_path / "project"
    project.mkdir()
    write_project(project, {"aws:region": REGION, "trainstack:pools": POOLS})
    outputs_file = tmp_path / "outputs.json"
    outputs = {"region": REGION, "bucket_name": BUCKET, "state_prefix": "state/", "group_name": "g"}
    outputs_file.write_text(json.dumps(outputs), encoding="utf-8")
    calls = tmp_path / "pulumi-calls.txt"
    _fake_pulumi(tmp_path / "bin", calls)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    store = ThroughputStore(boto3.client("s3", region_name=REGION), BUCKET, "state/throughput.json")
    store.merge(
        "j-resnet-1",
        [
            _life("a", "g4dn.xlarge", 1.0, 100.0, "resnet50"),
            _life("b", "g4dn.xlarge", 1.0, 100.0, "resnet50"),
            _life("c", "g6.xlarge", 3.0, 310.0, "resnet50"),
            _life("d", "g6e.xlarge", 0.5, 700.0, "resnet50"),
        ],
    )
    # Another model, measured less: not chosen by default, offered by name.
    store.merge("j-charlm-1", [_life("e", "g6.xlarge", 1.5, 9000.0, "charlm")])

    def run(*argv: str) -> Result:
        return cli(*argv, "--cwd", str(project), "--stack", STACK, "--outputs", str(outputs_file))

    yield Weighed(project, outputs_file, calls, run)


def _config_after(calls: list[list[str]], before: dict[str, Any]) -> dict[str, Any]:
    """The stack config the recorded `pulumi config rm` and `set-all --path` calls leave, as pulumi would
    write it."""
    config = dict(before)
    for call in calls:
        if call[:2] == ["config", "rm"]:
            config.pop(call[-1], None)
        if call[:2] == ["config", "set-all"]:
            assert "--path" in call
            for argument in call[call.index("--path") + 1 :]:
                if argument == "--plaintext":
                    continue
                match = re.fullmatch(r'(trainstack:measuredThroughput)\["([^"]+)"\]=(.+)', argument)
                assert match, argument
                config.setdefault(match[1], {})[match[2]] = float(match[3])
    return config


def _weights_of(project: Path) -> dict[str, dict[str, int] | None]:
    settings = Stack(STACK, project_dir=project).config.settings
    assert settings is not None
    return {pool.name: pool_weights(pool) for pool in settings.pools}


def test_the_table_shows_each_pools_weights_now_and_from_the_measured_lives(weighed: Weighed) -> None:
    result = weighed.run("weights", "--json")
    assert result.code == 0, result.err
    proposal = result.json()
    assert proposal["scope"] == "model family resnet50"
    assert proposal["to_set"] == {"g4dn.xlarge": 100.0, "g6.xlarge": 310.0}
    assert proposal["current"] == {} and proposal["changes"] and not proposal["applied"]
    default, lanes = proposal["pools"]
    rows = {row["instance_type"]: row for row in default["types"]}
    assert {t: r["weight_now"] for t, r in rows.items()} == SHIPPED_WEIGHTS
    assert {t: r["weight_to_set"] for t, r in rows.items()} == MEASURED_WEIGHTS
    assert rows["g6.xlarge"]["hours"] == 3.0 and rows["g4dn.xlarge"]["lives"] == 2
    assert rows["g6e.xlarge"]["measured"] == 700.0 and not rows["g6e.xlarge"]["used"]
    assert lanes["unweighted_because"].startswith("2 jobs at once")
    assert all(r["weight_to_set"] is None for r in lanes["types"])
    assert proposal["left_out"] == [
        "g6e.xlarge: 0.50 h measured (1 life), under the 1 h needed; keeps its estimate"
    ]
    assert "--family charlm" in proposal["other_scopes"]
    assert weighed.pulumi_calls() == [], "without --apply nothing is set"

    table = weighed.run("weights")
    assert table.code == 0, table.err
    g6_row = next(line for line in table.out.splitlines() if "g6.xlarge" in line and "default" in line)
    assert re.search(r"310\.0\s.*3\.00\s.*\b1\s.*\b2\s.*\b3\s.*measured", g6_row), g6_row
    assert "not used: g6e.xlarge: 0.50 h measured" in table.out
    assert "pool lanes: unweighted whatever is measured" in table.out
    assert f"`trainstack weights --apply` sets {KEY}" in table.out


def test_apply_sets_the_config_that_gives_the_program_the_weights_shown(weighed: Weighed) -> None:
    result = weighed.run("weights", "--apply")
    assert result.code == 0, result.err
    assert f"set {KEY} for stack {STACK}" in result.out
    calls = weighed.pulumi_calls()
    assert calls == [
        [
            "config", "set-all", "--stack", STACK, "--path",
            "--plaintext", f'{KEY}["g4dn.xlarge"]=100',
            "--plaintext", f'{KEY}["g6.xlarge"]=310',
        ]
    ]  # fmt: skip
    # Pulumi writes the stack file; the program (pool_weights) then weighs the pools as the table said.
    weighed.set_config(_config_after(calls, weighed.stack_config()))
    assert _weights_of(weighed.project) == {"default": MEASURED_WEIGHTS, "lanes": None}

    again = weighed.run("weights", "--apply")
    assert again.code == 0, again.err
    assert f"{KEY} already holds these figures" in again.out
    assert len(weighed.pulumi_calls()) == 1, "nothing set twice"


def test_apply_removes_figures_the_new_ones_leave_out_before_setting_them(weighed: Weighed) -> None:
    weighed.set_config({**weighed.stack_config(), KEY: {"g6e.xlarge": 900}})
    result = weighed.run("weights", "--apply", "--json")
    assert result.code == 0, result.err
    assert result.json()["current"] == {"g6e.xlarge": 900.0}
    calls = weighed.pulumi_calls()
    assert calls[0] == ["config", "rm", "--stack", STACK, KEY]
    assert calls[1][:2] == ["config", "set-all"]
    weighed.set_config(_config_after(calls, weighed.stack_config()))
    assert weighed.stack_config()[KEY] == {"g4dn.xlarge": 100.0, "g6.xlarge": 310.0}


def test_another_model_family_is_chosen_by_name_and_an_unknown_one_is_one_line(weighed: Weighed) -> None:
    charlm = weighed.run("weights", "--family", "charlm", "--json").json()
    assert charlm["scope"] == "model family charlm" and charlm["to_set"] == {"g6.xlarge": 9000.0}
    # One measured type scales the others' estimates alike: the shipped weights again.
    default = charlm["pools"][0]
    assert {r["instance_type"]: r["weight_to_set"] for r in default["types"]} == SHIPPED_WEIGHTS
    missing = weighed.run("weights", "--family", "gpt2")
    assert missing.code == 1
    assert missing.err.count("\n") == 1
    assert "no lives of model family gpt2" in missing.err and "--family resnet50" in missing.err


def test_apply_with_nothing_measured_long_enough_changes_nothing_and_says_so(weighed: Weighed) -> None:
    boto3.client("s3", region_name=REGION).delete_object(Bucket=BUCKET, Key="state/throughput.json")
    shown = weighed.run("weights")
    assert shown.code == 0, shown.err
    assert "no measured lives on the pools' types yet" in shown.out
    applied = weighed.run("weights", "--apply")
    assert applied.code == 1
    assert "nothing to set" in applied.err and applied.err.count("\n") == 1
    assert weighed.pulumi_calls() == []


def test_a_failing_pulumi_is_one_line_naming_the_key(weighed: Weighed, tmp_path: Path) -> None:
    _fake_pulumi(tmp_path / "bin", weighed.calls, fail="the stack is locked by another update")
    result = weighed.run("weights", "--apply")
    assert result.code == 1
    assert result.err.count("\n") == 1
    assert "the stack is locked by another update" in result.err and KEY in result.err


def test_lives_that_named_no_model_are_weighed_by_their_jobs_own_measurements() -> None:
    """A user's job whose trainer reports no model has its lives under its job only: with no model family
    measured on the pools' types, the job measured longest speaks for them."""
    from infra.config import Pool
    from trainstack.weights import propose
    from trainstack_job.throughput import ThroughputTable

    table = ThroughputTable()
    table.merge(
        "j-user-1",
        [_life("u1", "g4dn.xlarge", 2.0, 50.0, None), _life("u2", "g6e.xlarge", 1.0, 600.0, None)],
    )
    table.merge("j-user-2", [_life("u3", "g4dn.xlarge", 1.0, 40.0, None)])
    pool = Pool("default", "trainstack-test-gpu", ("g4dn.xlarge", "g6e.xlarge"), max_instances=1)
    proposal = propose(table, [pool], {})
    assert proposal.scope == "job j-user-1" and proposal.other_scopes == ["--job j-user-2"]
    assert proposal.to_set == {"g4dn.xlarge": 50.0, "g6e.xlarge": 600.0}
    assert {t.instance_type: t.weight_to_set for t in proposal.pools[0].types} == {
        "g4dn.xlarge": 1,
        "g6e.xlarge": 12,
    }

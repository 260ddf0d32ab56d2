"""trainstack_job.contract is the one home of the contracts: light, never defined twice, documented."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from bootstrap.imds import InstanceIdentity
from bootstrap.ledger import JobLedger
from trainstack_job.contract import (
    CONTROL,
    DATA_MANIFEST,
    LATEST,
    LEDGER,
    MANIFEST,
    PROGRESS,
    BucketPrefix,
    ExitCode,
    JobEnv,
    JobStatus,
    LifeOutcome,
    StackOutput,
)

ROOT = Path(__file__).resolve().parent.parent
# Every part that keeps a contract; trainstack_job/ is where the contract is defined.
PARTS = ("training", "bootstrap", "trainstack", "infra", "demo")
FILE_NAMES = {MANIFEST, LATEST, LEDGER, PROGRESS, CONTROL, DATA_MANIFEST}
# Exit codes nothing else means; 0, 1 and 2 are everywhere for other reasons.
DISTINCT_EXIT_CODES = {ExitCode.STOPPED.value, ExitCode.DATA_ERROR.value}
INTERNALS = (ROOT / "docs" / "internals.md").read_text()
JOB_CONTRACT = (ROOT / "docs" / "job-contract.md").read_text()


def _second_definitions(path: Path) -> list[str]:
    """`NAME = <a contract value>` (or a comparison with a contract exit code) in one source file."""
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Constant):
            value = node.value.value
            if (isinstance(value, str) and value in FILE_NAMES) or (
                type(value) is int and value in DISTINCT_EXIT_CODES
            ):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                value = operand.value if isinstance(operand, ast.Constant) else None
                if type(value) is int and value in DISTINCT_EXIT_CODES:
                    found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def _section(text: str, heading: str) -> str:
    """The text of one `## heading` section of a Markdown page."""
    match = re.search(rf"^## {re.escape(heading)}.*?$(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"no section '## {heading}'"
    return match.group(1)


def test_importing_the_contract_loads_only_the_standard_library() -> None:
    # -I: no PYTHONPATH, no user site; the repository root alone is put on the path, so the import finds
    # this checkout and nothing else, and what it adds to sys.modules is all its own.
    script = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); before = set(sys.modules); "
        "import trainstack_job.contract; print('\\n'.join(sorted(set(sys.modules) - before)))"
    )
    result = subprocess.run(
        [sys.executable, "-I", "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = {name.split(".")[0] for name in result.stdout.split()}
    foreign = loaded - set(sys.stdlib_module_names) - {"trainstack_job"}
    assert not foreign, (
        f"trainstack_job.contract pulls in {sorted(foreign)}; it must stay standard-library only"
    )


def test_no_part_defines_a_contract_value_a_second_time() -> None:
    sources = [path for part in PARTS for path in sorted((ROOT / part).rglob("*.py"))]
    assert sources, "no sources found"
    found = [line for path in sources for line in _second_definitions(path)]
    assert not found, "import these from trainstack_job.contract instead:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    ["EXIT_STOPPED = 75", 'LEDGER = "ledger.json"', 'NAME: str = "latest.json"', "if code == 65: pass"],
)
def test_the_guard_catches_a_second_definition(tmp_path: Path, source: str) -> None:
    module = tmp_path / "probe.py"
    module.write_text(source + "\n")
    assert _second_definitions(module)


def test_the_ledger_stays_plain_json_strings() -> None:
    ledger = JobLedger()
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    ledger.begin_life(InstanceIdentity("i-1", "g6.xlarge", "us-east-1a", "us-east-1", "spot"), 0.5, now)
    ledger.end_life(LifeOutcome.COST_CAP, now)
    ledger.set_status(JobStatus.COST_CAP)
    assert type(ledger.data["status"]) is str and type(ledger.data["lives"][0]["outcome"]) is str
    assert json.loads(json.dumps(ledger.data))["status"] == "cost_cap"


def test_the_job_contract_page_lists_every_variable_and_exit_code() -> None:
    variables = set(re.findall(r"^\| `(TRAINSTACK_\w+)` \|", JOB_CONTRACT, re.MULTILINE))
    assert variables == {env.value for env in JobEnv}
    exits = _section(JOB_CONTRACT, "Exit codes")
    documented = {int(code) for code in re.findall(r"^\| (\d+)\b", exits, re.MULTILINE)}
    assert documented == {code.value for code in ExitCode}


def test_internals_documents_the_exit_codes_ledger_outputs_and_bucket_layout() -> None:
    exits = re.search(r"^- Trainer exit codes.*?(?=^\S|^- )", INTERNALS, re.MULTILINE | re.DOTALL)
    assert exits, "docs/internals.md: no '- Trainer exit codes' item"
    for code in ExitCode:
        assert re.search(rf"(?<![\w.]){code.value}(?![\w.])", exits.group(0)), f"exit {code.value}"
    statuses = re.search(r'"status": "([\w|]+)"', INTERNALS)
    outcomes = re.search(r'"outcome": "([\w|]+)"', INTERNALS)
    assert statuses and set(statuses.group(1).split("|")) == {status.value for status in JobStatus}
    assert outcomes and set(outcomes.group(1).split("|")) == {outcome.value for outcome in LifeOutcome}
    outputs = _section(INTERNALS, "Stack outputs")
    assert set(re.findall(r"`(\w+)`", outputs)) == {output.value for output in StackOutput}
    layout = _section(INTERNALS, "Bucket layout")
    for prefix in BucketPrefix:
        assert re.search(rf"^{re.escape(prefix.value)}", layout, re.MULTILINE), prefix.value
    for name in (LEDGER, PROGRESS, CONTROL, DATA_MANIFEST):
        assert f"{BucketPrefix.STATE.value}{name}" in layout
    assert LATEST in layout and MANIFEST in layout

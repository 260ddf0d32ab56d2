"""SECURITY.md's "Enforced at every preview" table and the pack stay in step: one row per policy of the pack,
each naming the mutations and weakenings that its policy alone catches, and every test it cites exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from policypack.rules import POLICIES
from tests.policy.test_pack_guards import CASES
from tests.policy.test_rules import MUTATIONS

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parent
_ID = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)+")


def _rows() -> dict[str, str]:
    """Policy name -> the row's Test cell, for each row of the table."""
    text = (ROOT / "SECURITY.md").read_text()
    section = text[text.index("## Enforced at every preview") :]
    table = section[section.index("| Control") :].split("\n\n", 1)[0].splitlines()[2:]
    rows: dict[str, str] = {}
    for row in table:
        cells = re.split(r"(?<!\\)\|", row)
        assert len(cells) == 5, row  # | control | policy | test |
        policies = re.findall(r"`([^`]+)`", cells[2])
        assert len(policies) == 1, row
        assert policies[0] not in rows, f"two rows for {policies[0]}"
        rows[policies[0]] = cells[3]
    return rows


def _cited(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_the_table_lists_every_policy_of_the_pack_and_no_other() -> None:
    rows = _rows()
    pack = [policy.name for policy in POLICIES]
    assert sorted(set(pack) - set(rows)) == [], "policies of the pack without a row"
    assert sorted(set(rows) - set(pack)) == [], "rows for policies the pack does not have"


def _checks() -> list[tuple[str, str]]:
    return [(m[0], m[2]) for m in MUTATIONS] + [(c[0], c[3]) for c in CASES]


@pytest.mark.parametrize(("check", "policy"), _checks(), ids=[name for name, _ in _checks()])
def test_every_mutation_and_weakening_is_cited_in_its_policys_row(check: str, policy: str) -> None:
    assert check in _cited(_rows()[policy]), f"{check} is not in the row of {policy}"


def test_every_id_and_test_the_table_cites_exists() -> None:
    ids = {name for name, _ in _checks()}
    sources = {path.name: path.read_text() for path in TESTS.glob("test_*.py")}
    for policy, cell in _rows().items():
        for cited in _cited(cell):
            if _ID.fullmatch(cited):
                assert cited in ids, (policy, cited)
            elif "::" in cited:
                module, test = cited.split("::")
                assert f"def {test}(" in sources.get(module, ""), (policy, cited)
            elif cited.endswith(".py"):
                assert cited in sources, (policy, cited)
            elif cited.startswith("test_"):
                assert any(f"def {cited}(" in source for source in sources.values()), (policy, cited)

"""`make mutate`'s targets (bench/mutate.py) and the workflow that runs them on a pull request: a guarantee
module left out of either is one nobody mutation-tests again after a change."""

from __future__ import annotations

import ast
from pathlib import Path

import yaml

from bench.mutate import TARGETS

ROOT = Path(__file__).resolve().parents[1]


def test_every_targets_modules_and_tests_exist() -> None:
    """bench/mutate.py leaves out a test it cannot find (an older `--source` copy may lack it): a test file
    or function renamed in the checkout would silently stop killing the target's mutants."""
    for name, target in TARGETS.items():
        for module in target.modules:
            assert (ROOT / module).is_file(), f"target {name}: no module {module}"
        for test in (*target.tests, *target.deselect):
            path, _, function = test.partition("::")
            assert (ROOT / path).is_file(), f"target {name}: no test file {path}"
            if function:
                defined = {
                    node.name
                    for node in ast.walk(ast.parse((ROOT / path).read_text(encoding="utf-8")))
                    if isinstance(node, ast.FunctionDef)
                }
                assert function in defined, f"target {name}: no test {function} in {path}"


def test_a_pull_request_changing_any_targets_module_or_test_file_runs_the_mutate_workflow() -> None:
    """A changed test file can stop killing a target's mutants as surely as a changed module can let new ones
    survive; a path left over from a renamed file triggers nothing and hides the one that should."""
    workflow = yaml.safe_load((ROOT / ".github/workflows/mutate.yml").read_text(encoding="utf-8"))
    # PyYAML reads the bare key `on` as True (YAML 1.1).
    paths = set(workflow[True]["pull_request"]["paths"])
    modules = {module for target in TARGETS.values() for module in target.modules}
    tests = {test.partition("::")[0] for target in TARGETS.values() for test in target.tests}
    assert not modules - paths, f"add to mutate.yml's pull_request paths: {sorted(modules - paths)}"
    assert not tests - paths, f"add to mutate.yml's pull_request paths: {sorted(tests - paths)}"
    assert "bench/mutate.py" in paths
    stale = paths - modules - tests - {"bench/mutate.py"}
    assert not stale, f"no target's module or test file, in mutate.yml's pull_request paths: {sorted(stale)}"

"""`make mutate`'s targets (bench/mutate.py) and the workflow that runs them on a pull request: a guarantee
module left out of either is one nobody mutation-tests again after a change."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from bench import mutate
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


OLD_MODULE = '''
def kept(x):
    """Said once."""
    return x + 1


def edited(x):
    return x - 1


class Store:
    def reworded(self):
        """Old words."""
        return 1

    def fixed(self):
        return 1
'''

NEW_MODULE = '''
def kept(x):
    """Said again, in other words; a comment moved too."""
    # moved
    return x + 1


def edited(x):
    return x + 1


class Store:
    def reworded(self):
        """New words."""
        return 1

    def fixed(self):
        return 2

    def added(self):
        return 3


def brand_new():
    return 4
'''


def test_changed_since_names_only_the_functions_whose_code_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A docstring or comment edit is no new code to mutate; an edited or added function is, by mutmut's
    name for it; a module that did not exist at the base is new in every function."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/mod.py").write_text(NEW_MODULE)
    monkeypatch.setattr(mutate, "ROOT", tmp_path)
    monkeypatch.setattr(mutate, "_committed", lambda ref, path: OLD_MODULE if ref == "base" else None)
    assert mutate.changed_functions("base", "pkg/mod.py") == [
        "pkg.mod.x_edited__mutmut_*",
        "pkg.mod.xǁStoreǁfixed__mutmut_*",
        "pkg.mod.xǁStoreǁadded__mutmut_*",
        "pkg.mod.x_brand_new__mutmut_*",
    ]
    assert len(mutate.changed_functions("older", "pkg/mod.py")) == 6


def test_changed_since_runs_new_targets_whole_changed_functions_and_a_sample_for_changed_tests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    targets = {
        "new": mutate.Target(("a.py",), ("tests/test_a.py",)),
        "redefined": mutate.Target(("b.py",), ("tests/test_b.py", "tests/test_b2.py")),
        "code": mutate.Target(("c.py",), ("tests/test_c.py",)),
        "tests": mutate.Target(("d.py",), ("tests/test_d.py::test_one",)),
        "quiet": mutate.Target(("e.py",), ("tests/test_e.py",)),
    }
    before = {name: mutate._definition(t) for name, t in targets.items() if name != "new"}
    before["redefined"] = mutate._definition(mutate.Target(("b.py",), ("tests/test_b.py",)))
    changed = "bench/mutate.py\nc.py\ntests/test_d.py\nunrelated.py\n"
    monkeypatch.setattr(mutate, "TARGETS", targets)
    monkeypatch.setattr(mutate, "_git", lambda *args: changed)
    monkeypatch.setattr(mutate, "_targets_at", lambda ref: before)
    monkeypatch.setattr(mutate, "changed_functions", lambda ref, module, path_then: [f"{module}:f*"])
    assert mutate.changed_targets("base") == {
        "new": (),
        "redefined": (),
        "code": ("c.py:f*",),
        "tests": (mutate.TESTS_CHANGED_SAMPLE,),
    }
    # Without a change to bench/mutate.py the targets are compared with themselves: none is new.
    monkeypatch.setattr(mutate, "_git", lambda *args: "c.py\n")
    assert mutate.changed_targets("base") == {"code": ("c.py:f*",)}


def test_changed_since_follows_moves_a_target_whose_files_only_moved_is_not_run_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A module moved to another folder is compared with itself where it was: moved unchanged, nothing of it
    runs; moved with one function edited, that function's mutants; its test file moved unchanged is no
    change to test. A target that gained a module is still redefined."""
    targets = {
        "moved": mutate.Target(("lambdas/f.py",), ("tests/test_f.py::test_one",)),
        "moved_and_edited": mutate.Target(("policypack/g.py",), ("tests/policy/test_g.py",)),
        "grown": mutate.Target(("lambdas/h.py", "lambdas/i.py"), ("tests/test_h.py",)),
    }
    before = {
        "moved": mutate._definition(mutate.Target(("infra/f.py",), ("tests/infra/test_f.py::test_one",))),
        "moved_and_edited": mutate._definition(mutate.Target(("infra/g.py",), ("tests/test_g.py",))),
        "grown": mutate._definition(mutate.Target(("infra/h.py",), ("tests/test_h.py",))),
    }
    name_status = (
        "M\tbench/mutate.py\nR100\tinfra/f.py\tlambdas/f.py\nR100\ttests/infra/test_f.py\ttests/test_f.py\n"
        "R091\tinfra/g.py\tpolicypack/g.py\nR100\ttests/test_g.py\ttests/policy/test_g.py\n"
        "R100\tinfra/h.py\tlambdas/h.py\nA\tlambdas/i.py\n"
    )
    names = "\n".join(
        [
            "bench/mutate.py",
            "lambdas/f.py",
            "tests/test_f.py",
            "policypack/g.py",
            "tests/policy/test_g.py",
            "lambdas/h.py",
        ]
    )
    calls: list[tuple[str, str | None]] = []

    def changed_functions(ref: str, module: str, path_then: str | None) -> list[str]:
        calls.append((module, path_then))
        return [f"{module}:edited*"] if module == "policypack/g.py" else []

    monkeypatch.setattr(mutate, "TARGETS", targets)
    monkeypatch.setattr(mutate, "_git", lambda *args: name_status if "--name-status" in args else names)
    monkeypatch.setattr(mutate, "_targets_at", lambda ref: before)
    monkeypatch.setattr(mutate, "changed_functions", changed_functions)
    assert mutate.changed_targets("base") == {"moved_and_edited": ("policypack/g.py:edited*",), "grown": ()}
    assert calls == [("lambdas/f.py", "infra/f.py"), ("policypack/g.py", "infra/g.py")]


def test_a_moved_module_is_compared_with_its_old_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/mod.py").write_text(OLD_MODULE)
    monkeypatch.setattr(mutate, "ROOT", tmp_path)
    monkeypatch.setattr(mutate, "_committed", lambda ref, path: OLD_MODULE if path == "old/mod.py" else None)
    assert mutate.changed_functions("base", "pkg/mod.py", "old/mod.py") == []
    # Looked up under its new path, where it did not exist at the base, every function would be new.
    assert len(mutate.changed_functions("base", "pkg/mod.py")) == 4


def test_renames_are_read_from_git_with_their_similarity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        mutate, "_git", lambda *args: "M\ta.py\nR100\told/b.py\tnew/b.py\nR087\told/c.py\tnew/c.py\nD\td.py\n"
    )
    assert mutate.renamed_since("base") == ({"new/b.py": "old/b.py", "new/c.py": "old/c.py"}, {"new/b.py"})


def test_the_targets_of_an_older_bench_mutate_are_read_from_git() -> None:
    """The base's TARGETS come from its own bench/mutate.py, run apart from this one; a base without the
    file has none (every target is new)."""
    head = mutate._targets_at("HEAD")
    assert head["persist"] == mutate._definition(mutate.TARGETS["persist"])
    assert mutate._targets_at("no-such-ref") == {}


def test_mutmuts_copy_holds_every_first_party_package() -> None:
    """The tests run in mutmut's mutants/ tree, which holds PACKAGES only: a package left out (the Lambdas'
    and the policy pack's folders once were) fails every target whose tests import it, before any mutant."""
    import tomllib

    project = tomllib.loads((mutate.ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    included = project["tool"]["setuptools"]["packages"]["find"]["include"]
    assert set(mutate.PACKAGES) == {pattern.removesuffix("*") for pattern in included}

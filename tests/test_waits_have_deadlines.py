"""No test uses the global timeout as its oracle: every wait in tests/ has a deadline of its own.

pytest-timeout (`timeout` in pyproject.toml) kills a test that runs too long, but says only that: not what
the test was waiting for. A wait with its own deadline fails instead with a message naming what did not
happen (tests/waiting.py has `join_all` and `wait_until` for that). This test parses every tests/**/*.py
and names, file:line, each wait of these kinds that has no deadline:

- `Barrier(...)` / `threading.Barrier(...)` without a `timeout`: a thread that dies before the barrier
  leaves the others waiting for ever; with a timeout the barrier breaks and every waiter raises.
- `x.join()` with no argument: a thread's (or process's) join. A string join always has an argument
  (`", ".join(parts)`), so a join without one is a wait.
- `x.wait()` / `x.communicate()` with no argument, unless the same function called `.kill()` on an earlier
  line (a killed process ends, so the wait that reaps it needs no deadline) or `x` was assigned a
  `Barrier(..., timeout=...)` in the same file (its wait has the barrier's deadline).
- `Event().wait()` without a timeout, even after a kill: an event nobody else holds is never set.
- `subprocess.run/call/check_call/check_output(...)` without a `timeout`: with one, a child that hangs
  fails the test with TimeoutExpired, which names the command.

A call that has the shape of a wait but waits on nothing (a helper's `join` that decides at once) carries
`# not a wait: <why>` on its line. Polling loops (`while not cond: sleep`) and `Future.result()` are not
checked here: they cannot be told from other loops and calls without reading them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).parent
REPO = TESTS.parent
NOT_A_WAIT = "# not a wait:"
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
SUBPROCESS_WAITS = ("run", "call", "check_call", "check_output")


def _called_name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    if isinstance(call.func, ast.Name):
        return call.func.id
    return None


def _is_event(node: ast.expr) -> bool:
    """`Event()` or `threading.Event()`: a fresh event, which only its own holder could set."""
    return isinstance(node, ast.Call) and _called_name(node) == "Event"


def _barrier_with_timeout(node: ast.expr) -> bool:
    return any(
        isinstance(call, ast.Call)
        and _called_name(call) == "Barrier"
        and any(keyword.arg == "timeout" for keyword in call.keywords)
        for call in ast.walk(node)
    )


def _bounded_barriers(tree: ast.Module) -> set[str]:
    """The names (`start`, `self._race`) assigned a Barrier with a timeout anywhere in the module."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            # `together, lock = threading.Barrier(2, timeout=30), threading.Lock()`: pair them up.
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(target.elts, node.value.elts, strict=False))
            else:
                pairs = [(target, node.value)]
            names.update(ast.unparse(name) for name, value in pairs if _barrier_with_timeout(value))
    return names


def _is_kill(call: ast.Call) -> bool:
    """`process.kill()` (not `os.kill(pid, signal)`, which may ask rather than kill)."""
    return isinstance(call.func, ast.Attribute) and call.func.attr == "kill" and not call.args


def _unbounded(call: ast.Call, kills: list[int], barriers: set[str]) -> bool:
    """Whether `call` waits without a deadline; `kills`: the lines of the `.kill()` calls in its function."""
    name = _called_name(call)
    no_timeout = all(keyword.arg != "timeout" for keyword in call.keywords)
    if name == "Barrier":
        return len(call.args) < 3 and no_timeout
    if name in SUBPROCESS_WAITS and isinstance(call.func, ast.Attribute):
        return ast.unparse(call.func.value) == "subprocess" and no_timeout
    if call.args or call.keywords or not isinstance(call.func, ast.Attribute):
        return False
    receiver = call.func.value
    if name == "join":
        return not isinstance(receiver, ast.Constant)
    if name == "wait" and _is_event(receiver):
        return True
    if name == "wait" and ast.unparse(receiver) in barriers:
        return False
    if name in ("wait", "communicate"):
        return not any(line < call.lineno for line in kills)
    return False


def _calls(scope: ast.AST) -> Iterator[ast.Call]:
    """The calls in `scope`'s own body, not those in the functions defined in it (they have their own)."""
    for child in ast.iter_child_nodes(scope):
        if isinstance(child, FUNCTIONS):
            continue
        if isinstance(child, ast.Call):
            yield child
        yield from _calls(child)


def unbounded_waits(source: str, filename: str = "<test>") -> list[tuple[int, str]]:
    """(line, call) for each wait in `source` without a deadline of its own, less those marked NOT_A_WAIT."""
    tree = ast.parse(source, filename)
    barriers = _bounded_barriers(tree)
    lines = source.splitlines()
    found: list[tuple[int, str]] = []
    for scope in [tree, *(node for node in ast.walk(tree) if isinstance(node, FUNCTIONS))]:
        calls = list(_calls(scope))
        kills = [call.lineno for call in calls if _is_kill(call)]
        found += [
            (call.lineno, ast.unparse(call))
            for call in calls
            if _unbounded(call, kills, barriers) and NOT_A_WAIT not in lines[call.lineno - 1]
        ]
    return sorted(found)


def test_every_wait_in_the_tests_has_a_deadline_of_its_own() -> None:
    unbounded = [
        f"{path.relative_to(REPO).as_posix()}:{line}: {call}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, call in unbounded_waits(path.read_text(), str(path))
    ]
    assert not unbounded, "waits without a deadline of their own (see this file's docstring):\n" + "\n".join(
        unbounded
    )


def test_the_finder_sees_each_kind_of_unbounded_wait() -> None:
    """The guard's own check: each kind it promises to find, found; each bounded form, left alone."""
    source = """
import os, subprocess, threading
def waits(thread, process, lines):
    threading.Barrier(2)
    thread.join()
    process.wait()
    process.communicate()
    threading.Event().wait()
    threading.Barrier(2, timeout=30)
    thread.join(5)
    process.wait(timeout=5)
    ", ".join(lines)
    start = threading.Barrier(2, timeout=30)
    start.wait()
    subprocess.run(["true"])
    subprocess.run(["true"], timeout=5)
def reaps(process):
    os.kill(process.pid, 15)
    process.wait()
    process.kill()
    process.wait()
    process.communicate()
    threading.Event().wait()
def marked(group):
    group.join()  # not a wait: decides at once
"""
    lines = [line for line, _ in unbounded_waits(source)]
    assert lines == [4, 5, 6, 7, 8, 15, 19, 23], lines

"""The first-party import graph has no cycles and no back arrows (issue 37, "a house without circles").

Read from the source with `ast`, never by importing it: every `import` and `from ... import` counts, those
inside a function and those under `if TYPE_CHECKING:` included. A function-local import only hides a cycle
until the function runs, and a type-only one still makes two modules each need the other to be read or
checked, so neither is a way out. A package's own `__init__` is not an edge of its submodules (Python
imports it first, whatever the order of the modules' imports), so `trainstack_job.jobs` importing
`trainstack_job.text` does not count as importing `trainstack_job`.

The layers, bottom up: trainstack_job/ (the contracts, records and schemas every part shares: standard library
and PyYAML), training/ (the built-in trainer), bootstrap/ (the agent), then the CLI (trainstack/), the Pulumi
program (infra/), demo/ and bench/. An arrow may only point down: training/ and trainstack_job/ never import
the agent, the CLI or the program, and trainstack_job/ imports only itself. The Lambdas (lambdas/) and the
policy pack (policypack/) are deployed apart from the rest: they import trainstack_job/ and nothing else.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "bootstrap",
    "trainstack",
    "trainstack_job",
    "training",
    "infra",
    "policypack",
    "lambdas",
    "demo",
    "bench",
)
# What each lower layer must never import: the parts built on top of it.
FORBIDDEN = {
    "trainstack_job": ("bootstrap", "infra", "trainstack", "training", "demo", "bench"),
    "training": ("bootstrap", "infra", "trainstack", "demo", "bench"),
    # Deployed on their own (a Lambda's package, the policy pack's virtualenv): only the shared contracts.
    "lambdas": ("bootstrap", "infra", "trainstack", "training", "policypack", "demo", "bench"),
    "policypack": ("bootstrap", "infra", "trainstack", "training", "lambdas", "demo", "bench"),
}
# Not sources: caches, virtualenvs (the policy pack's policypack/.venv) and bench/out/, runs' copies of the
# bundle.
_SKIPPED = {"__pycache__", "out"}
FIX = (
    "move what both sides need into a module both may import (trainstack_job/ for what the agent, the "
    "trainer, the CLI and the Pulumi program share), pass it in (a parameter, a Protocol the lower module "
    "names), or split the module; an import moved into a function or under TYPE_CHECKING still counts"
)


@dataclass(frozen=True)
class Edge:
    """`source` imports `target` at `where` (its file relative to the checkout, and the line)."""

    source: str
    target: str
    where: str

    def __str__(self) -> str:
        return self.where


def modules(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> its source file, for every module of `packages` under `root`."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if any(part in _SKIPPED or part.startswith(".") for part in parts[:-1]):
                continue
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _known(name: str, known: dict[str, Path]) -> str | None:
    """`name` or its nearest enclosing first-party module (`a.b.c` names an attribute of `a.b`), or None."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> Iterator[str]:
    """The dotted names one import statement brings in (relative ones resolved against `module`)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        parts = package.split(".")
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join([*parts, base] if base else parts)
    for alias in node.names:
        # `from pkg import name`: the submodule pkg.name when there is one, else pkg itself.
        yield f"{base}.{alias.name}"


def edges(known: dict[str, Path], root: Path) -> list[Edge]:
    found: list[Edge] = []
    for module, path in known.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for name in _imported(node, module, is_package):
                target = _known(name, known)
                if target is None or target == module or module.startswith(f"{target}."):
                    continue  # not ours, itself, or its own package's __init__ (imported first anyway)
                found.append(Edge(module, target, f"{path.relative_to(root).as_posix()}:{node.lineno}"))
    return found


def cycles(found: list[Edge]) -> list[list[Edge]]:
    """One cycle (as its edges, in order) for each strongly connected group of modules (Tarjan)."""
    graph: dict[str, dict[str, Edge]] = {}
    for edge in found:
        graph.setdefault(edge.source, {}).setdefault(edge.target, edge)
        graph.setdefault(edge.target, {})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_one_cycle(graph, group) for group in groups]


def _one_cycle(graph: dict[str, dict[str, Edge]], group: set[str]) -> list[Edge]:
    """The shortest way from the group's first module back to itself, inside the group (breadth first)."""
    start = min(group)
    came: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt, edge in sorted(graph[node].items()):
                if nxt not in group or nxt in came:
                    continue
                came[nxt] = edge
                if nxt == start:
                    path = [edge]
                    while path[0].source != start:
                        path.insert(0, came[path[0].source])
                    return path
                following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(group)}")  # Tarjan's groups always have one


def describe(cycle: list[Edge]) -> str:
    names = " -> ".join([cycle[0].source, *(edge.target for edge in cycle)])
    where = "; ".join(f"{edge} imports {edge.target}" for edge in cycle)
    return f"import cycle {names} ({where})"


def back_arrows(found: list[Edge]) -> list[Edge]:
    return [
        edge
        for edge in found
        if edge.target.split(".")[0] in FORBIDDEN.get(edge.source.split(".")[0], ())
        and edge.target.split(".")[0] != edge.source.split(".")[0]
    ]


def first_party_edges() -> list[Edge]:
    known = modules(ROOT)
    # An empty or partial scan (a package renamed, a path gone wrong) would pass every check below.
    assert {name.split(".")[0] for name in known} == set(PACKAGES), f"not every package found under {ROOT}"
    found = edges(known, ROOT)
    assert len(found) > 100, f"only {len(found)} imports found under {ROOT}"
    return found


def test_the_first_party_import_graph_has_no_cycle() -> None:
    found = cycles(first_party_edges())
    assert not found, "\n".join(describe(cycle) for cycle in found) + f"\nFix: {FIX}."


def test_the_trainer_and_the_shared_contracts_never_import_the_parts_built_on_them() -> None:
    found = back_arrows(first_party_edges())
    assert not found, (
        "\n".join(f"{edge} ({edge.source}) imports {edge.target}" for edge in found)
        + "\nThe layers, bottom up: trainstack_job/, training/, bootstrap/, then trainstack/, infra/, demo/, "
        f"bench/; an import may only point down. Fix: {FIX}."
    )


def test_the_check_sees_a_cycle_closed_inside_a_function(tmp_path: Path) -> None:
    """A checker that found nothing would pass the two tests above: a cycle it must see, through a relative
    import and a function-local one, and the module it names."""
    package = tmp_path / "trainstack_job"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "contract.py").write_text("from .layout import STEP\n")
    (package / "layout.py").write_text("def write():\n    from trainstack_job import contract\n")
    (package / "atomic.py").write_text("import trainstack_job.contract\n")
    found = cycles(edges(modules(tmp_path, ["trainstack_job"]), tmp_path))
    assert [describe(cycle) for cycle in found] == [
        "import cycle trainstack_job.contract -> trainstack_job.layout -> trainstack_job.contract "
        "(trainstack_job/contract.py:1 imports trainstack_job.layout; "
        "trainstack_job/layout.py:2 imports trainstack_job.contract)"
    ]


def test_the_check_sees_a_back_arrow_under_type_checking(tmp_path: Path) -> None:
    for package, source in (("training", "if TYPE_CHECKING:\n    from bootstrap.persist import P\n"),
                            ("bootstrap", "")):  # fmt: skip
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "checkpoint.py").write_text(source)
    (tmp_path / "bootstrap" / "persist.py").write_text("")
    found = back_arrows(edges(modules(tmp_path, ["training", "bootstrap"]), tmp_path))
    assert [(edge.source, edge.target, str(edge)) for edge in found] == [
        ("training.checkpoint", "bootstrap.persist", "training/checkpoint.py:2")
    ]

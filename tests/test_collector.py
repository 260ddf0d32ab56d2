"""demo/collector.py: imports are frozen after a full collection, a process's later data is not."""

from __future__ import annotations

import gc
import sys
import types
from collections.abc import Iterator

import pytest

from demo.collector import ImportsFrozen


@pytest.fixture()
def policy(collector_alone: None) -> Iterator[ImportsFrozen]:
    watched = ImportsFrozen()
    watched.watch()
    yield watched
    watched.unwatch()


def walked(obj: object) -> bool:
    """Whether a full collection walks `obj` (a frozen object is in none of the three generations)."""
    return any(any(o is obj for o in gc.get_objects(generation)) for generation in range(3))


def test_after_a_full_collection_with_new_imports_what_is_alive_is_frozen_and_later_data_is_not(
    policy: ImportsFrozen, monkeypatch: pytest.MonkeyPatch
) -> None:
    gc.collect()
    frozen = policy.freezes
    module = types.ModuleType("tests_collector_imported")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    gc.collect(1)
    assert policy.freezes == frozen and walked(module), "a young collection is not a full one"

    gc.collect()
    assert policy.freezes == frozen + 1
    assert not walked(module), "the module is frozen"

    # Another full collection with no module imported since: what was made meanwhile stays collectable.
    held = types.SimpleNamespace()
    gc.collect()
    assert policy.freezes == frozen + 1 and walked(held)

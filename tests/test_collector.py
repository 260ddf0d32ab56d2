"""tests/collector.py: a worker's imports are frozen after a full collection, a test's own data is not."""

from __future__ import annotations

import gc
import sys
import types
from collections.abc import Iterator

import pytest

from tests.collector import ImportsFrozen


@pytest.fixture()
def policy() -> Iterator[ImportsFrozen]:
    watched = ImportsFrozen()
    watched.watch()
    yield watched
    watched.unwatch()


def test_after_a_full_collection_and_new_imports_what_is_alive_is_frozen_once(
    policy: ImportsFrozen, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert policy.after_test() is False, "no full collection yet: nothing to freeze"
    module = types.ModuleType("tests_collector_imported")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    gc.collect(1)
    assert policy.after_test() is False, "a young collection is not a full one"
    gc.collect()
    frozen_before = gc.get_freeze_count()
    assert policy.after_test() is True
    assert gc.get_freeze_count() > frozen_before
    assert not any(any(o is module for o in gc.get_objects(g)) for g in range(3)), "the module is frozen"

    # Another full collection with no module imported since: a test's own objects stay collectable.
    held = types.SimpleNamespace()
    gc.collect()
    assert policy.after_test() is False
    assert any(any(o is held for o in gc.get_objects(g)) for g in range(3))

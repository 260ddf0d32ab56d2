"""CLI sessions share botocore's parsed models but still read profile, region and data path per command."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainstack.aws import new_session


def test_sessions_share_the_parsed_models_and_the_loader_does_not_grow() -> None:
    first, second = new_session(), new_session()
    loader = first._session.get_component("data_loader")
    assert second._session.get_component("data_loader") is loader
    paths = list(loader.search_paths)
    for _ in range(3):
        new_session()
    assert loader.search_paths == paths, "each new session must not add boto3's folder again"
    assert len(paths) == len(set(paths))


def test_each_session_reads_the_region_when_it_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    assert new_session().region_name == "eu-west-1"
    monkeypatch.setenv("AWS_DEFAULT_REGION", "ap-south-1")
    assert new_session().region_name == "ap-south-1"


def test_a_custom_data_path_gets_its_own_loader(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    plain = new_session()._session.get_component("data_loader")
    monkeypatch.setenv("AWS_DATA_PATH", str(tmp_path))
    custom = new_session()._session.get_component("data_loader")
    assert custom is not plain
    assert str(tmp_path) in custom.search_paths and str(tmp_path) not in plain.search_paths

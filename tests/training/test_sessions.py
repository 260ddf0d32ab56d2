"""training/sessions.py: sessions (the CLI's, the trainer's shard readers) share botocore's parsed models but
still read profile, region and data path each time."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.sessions import new_session


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


def test_the_trainers_shard_readers_parse_the_s3_model_once_per_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import botocore.loaders

    from training.streaming import _s3_client

    _s3_client()  # whatever this process parsed before, the models are in the shared loader now
    read: list[str] = []
    load_file = botocore.loaders.JSONFileLoader.load_file

    def counted(self: botocore.loaders.JSONFileLoader, file_path: str) -> object:
        read.append(file_path)
        return load_file(self, file_path)

    monkeypatch.setattr(botocore.loaders.JSONFileLoader, "load_file", counted)
    first, second = _s3_client(), _s3_client()
    assert first is not second and first.meta.service_model.service_name == "s3"
    assert read == [], f"a second shard reader parsed {read} again"

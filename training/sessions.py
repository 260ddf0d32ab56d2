"""boto3 sessions sharing botocore's parsed service models within a process (the CLI's, the trainer's)."""

from __future__ import annotations

import functools

import boto3
import botocore.loaders
import botocore.session


@functools.cache
def _service_models(data_path: str | None) -> botocore.loaders.Loader:
    """botocore's service and endpoint models, parsed once per process for every session that reads them
    from the same places (botocore's own, plus AWS_DATA_PATH / `data_path` when set): they are data files,
    the same whatever the profile, region or credentials. A session of its own would parse them again,
    ~70 ms of CPU per client; a process that makes several sessions (the tests, a notebook, the trainer's
    shard readers) pays that once. The loader only caches what it read; its cache tolerates concurrent
    first reads."""
    return botocore.loaders.create_loader(data_path)


def new_session() -> boto3.Session:
    """A boto3 session as `boto3.Session()` makes it (AWS_PROFILE, region and credentials read now and on
    first use; not shared, so a thread may make clients from it while another makes its own), sharing the
    parsed service models."""
    core = botocore.session.get_session()
    models = _service_models(core.get_config_variable("data_path"))
    core.register_component("data_loader", models)
    session = boto3.Session(botocore_session=core)
    # boto3 adds its own data folder to the loader of each session it makes: once is enough for a shared one.
    models.search_paths[:] = list(dict.fromkeys(models.search_paths))
    return session

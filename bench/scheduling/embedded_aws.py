"""The scheduling bench's embedded AWS: a moto server in a child process (`--serve`)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def serve() -> None:
    """The child process: a moto server on 127.0.0.1 that handles one request at a time; prints its port."""
    import logging

    from demo.moto_server import (
        MOTO_SETTINGS,
        answer_as_aws,
        cache_moto_service_list,
        make_key_pairs_on_demand,
    )

    os.environ.update(MOTO_SETTINGS)
    logging.getLogger("werkzeug").setLevel(logging.CRITICAL)
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    cache_moto_service_list()
    answer_as_aws()
    make_key_pairs_on_demand()
    app = DomainDispatcherApplication(create_backend_app)
    lock = threading.Lock()

    def one_at_a_time(environ: Any, start_response: Any) -> list[bytes]:
        with lock:
            return [b"".join(app(environ, start_response))]

    server = make_server("127.0.0.1", 0, one_at_a_time, True, request_handler=MotoRequestHandler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


@contextlib.contextmanager
def embedded_aws() -> Iterator[str]:
    """The demo's isolated environment and a fresh moto server in a child process; yields its endpoint."""
    from demo.moto_server import MOTO_SETTINGS
    from demo.run import ISOLATED_ENV

    os.environ.update(ISOLATED_ENV)
    os.environ.update(MOTO_SETTINGS)
    os.environ.pop("AWS_PROFILE", None)
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.scheduling", "--serve"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert child.stdout is not None
        port = child.stdout.readline().strip()
        if not port.isdigit():
            raise RuntimeError(f"the moto server did not start (said {port!r})")
        endpoint = f"http://127.0.0.1:{port}"
        previous = os.environ.get("AWS_ENDPOINT_URL")
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        try:
            yield endpoint
        finally:
            if previous is None:
                os.environ.pop("AWS_ENDPOINT_URL", None)
            else:
                os.environ["AWS_ENDPOINT_URL"] = previous
    finally:
        child.terminate()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def reset(endpoint: str) -> None:
    import urllib.request

    request = urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")
    with urllib.request.urlopen(request, timeout=30):
        pass

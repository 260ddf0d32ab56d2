"""cloud-init's own schema validator, for the tests that check rendered user-data."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def assert_valid_cloud_config(user_data: str, workdir: Path) -> None:
    """Fail unless `cloud-init schema -c` accepts the document; skip without cloud-init, except in CI."""
    binary = shutil.which("cloud-init")
    if binary is None:
        if os.environ.get("TRAINSTACK_REQUIRE_CLOUD_INIT") == "1":
            pytest.fail(
                "cloud-init is not installed but TRAINSTACK_REQUIRE_CLOUD_INIT=1: apt-get install cloud-init"
            )
        pytest.skip(
            "cloud-init is not installed (apt-get install cloud-init); its schema validator checks user-data"
        )
    path = workdir / "user-data.yaml"
    path.write_text(user_data)
    result = subprocess.run(
        [binary, "schema", "-c", str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Valid cloud-config" in result.stdout, result.stdout + result.stderr

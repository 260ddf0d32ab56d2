"""cloud-init's own schema validator, for the tests that check rendered user-data."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.tools import require_tool


def assert_valid_cloud_config(user_data: str, workdir: Path) -> None:
    """Fail unless `cloud-init schema -c` accepts the document; skip without cloud-init, except in CI."""
    binary = require_tool(
        "cloud-init", "its schema validator checks the rendered user-data (apt-get install cloud-init)"
    )
    path = workdir / "user-data.yaml"
    path.write_text(user_data)
    result = subprocess.run(
        [binary, "schema", "-c", str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Valid cloud-config" in result.stdout, result.stdout + result.stderr

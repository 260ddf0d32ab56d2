"""A submitter is not root (SECURITY.md, "A submitter"): the agent re-executes only the environment's code
(written by `pulumi up`), runs a submitted job's own code as the job, and refuses a record naming code from
anywhere else, in one line. Tried as an attacker who may submit jobs (the dev role) would."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from bootstrap.agent import Lives
from bootstrap.agent_config import AgentConfig
from bootstrap.jobbinding import bind_job
from bootstrap.pinned import PinnedCodeError, prepare_job_code
from demo.stack import LocalStack
from tests.bootstrap.test_jobbinding import _bundle
from tests.bootstrap.test_queue_agent import NOW, MakeLife, ledger, submit

A, B = "alpha-aaaaaaaa", "bravo-bbbbbbbb"
SHORT = {"steps": 4, "step_seconds": 0.02, "checkpoint_every": 2}


@pytest.fixture()
def stack_config(stack: LocalStack) -> AgentConfig:
    return stack.agent_config(job_id="")


def _upload(stack: LocalStack, prefix: str, data: bytes) -> tuple[str, str]:
    sha = hashlib.sha256(data).hexdigest()
    key = f"{prefix}{sha}/bundle.tar.gz"
    stack.client("s3").put_object(Bucket=stack.bucket, Key=key, Body=data)
    return key, sha


def _evil_agent(marker: Path) -> str:
    """An agent that would prove it ran (as root, on an instance) by writing `marker`."""
    return f"from pathlib import Path\nPath({str(marker)!r}).write_text('root')\n"


def test_a_record_naming_code_outside_the_environments_is_refused_never_hopped_to(
    stack: LocalStack, stack_config: AgentConfig, tmp_path: Path
) -> None:
    # The dev role may write dev/ (its own folder) and, before this fix, code/: a record naming a bundle there
    # made every agent re-execute it as root. Now only the environment's code/ is ever hopped to.
    data = _bundle({"bootstrap/agent.py": _evil_agent(tmp_path / "pwned"), "training/__init__.py": ""})
    key, sha = _upload(stack, "dev/", data)
    submit(stack, A, SHORT, "2026-12-01T12:00:01.000Z", bundle_key=key, bundle_sha256=sha)
    submit(stack, B, SHORT, "2026-12-01T12:00:02.000Z")
    binding = bind_job(stack.client("s3"), stack_config, NOW)
    assert binding is not None and binding.job_id == B, "the refused job blocks nothing"
    assert binding.pinned is None
    reason = ledger(stack, A)["reason"]
    assert ledger(stack, A)["status"] == "failed"
    assert f"its bundle_key '{key}' is neither the environment's code (code/" in reason
    assert "job-code/" in reason and "\n" not in reason
    assert not (tmp_path / "pwned").exists()


def test_a_submitted_jobs_code_runs_as_the_job_from_its_own_folder_and_its_agent_never_runs(
    stack: LocalStack, make_life: MakeLife, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    probe = (
        "import json, os, sys\n"
        "from pathlib import Path\n"
        "out = Path(os.environ['TRAINSTACK_OUTPUT_DIR'])\n"
        "out.mkdir(parents=True, exist_ok=True)\n"
        "(out / 'where.json').write_text(json.dumps({'cwd': os.getcwd(), "
        "'path': os.environ.get('PYTHONPATH', '')}))\n"
    )
    data = _bundle(
        {
            # What a malicious submitter would put where the agent's code lives in a bundle.
            "bootstrap/agent.py": _evil_agent(marker),
            "bootstrap/__init__.py": _evil_agent(marker),
            "training/__init__.py": "",
            "job/probe.py": probe,
        }
    )
    key, sha = _upload(stack, "job-code/", data)
    user_job = {"name": "probe", "command": ["python", "probe.py"], "workdir": ".", "data": {"sync": False}}
    submit(stack, A, {}, "2026-12-01T12:00:01.000Z", bundle_key=key, bundle_sha256=sha, user_job=user_job)
    life = make_life(job_id="")
    hops: list[Any] = []
    life.run_pinned = lambda *args, **kwargs: hops.append(args)
    install = tmp_path / "install"
    life.prepare_job_code = functools.partial(prepare_job_code, install_root=install)
    result = Lives(life).run()
    assert hops == [], "a submitted job's code is never re-executed as the agent"
    assert not marker.exists(), "nothing of the submitted bundle ran in the agent"
    assert ledger(stack, A)["status"] == "completed", result
    code = install / "job-code" / sha
    where = json.loads((Path(str(life.config.scratch_dir)) / "output" / "where.json").read_text())
    assert where["cwd"] == str(code / "job")
    assert where["path"].split(":")[0] == str(code), "the job imports its own code, not the agent's"


def test_a_submitted_bundle_with_links_or_paths_out_unpacks_nothing_outside(
    stack: LocalStack, stack_config: AgentConfig, tmp_path: Path
) -> None:
    # Root unpacks the submitter's tar: the data filter refuses absolute names, `..` and links out.
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name in ("training/__init__.py", "../escaped.txt"):
            info = tarfile.TarInfo(name)
            info.size = 1
            archive.addfile(info, io.BytesIO(b"x"))
    key, sha = _upload(stack, "job-code/", buffer.getvalue())
    record = {"job_id": A, "bundle_key": key, "bundle_sha256": sha}
    install = tmp_path / "deep" / "install"
    with pytest.raises(PinnedCodeError, match=f"{key}: job {A}'s code bundle cannot be unpacked"):
        prepare_job_code(stack.client("s3"), stack_config, record, install_root=install)
    assert not (tmp_path / "deep" / "escaped.txt").exists()
    assert not (install / "job-code" / sha).exists()

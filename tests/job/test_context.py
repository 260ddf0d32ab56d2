"""`trainstack_job`'s side of checkpoint contexts: what a user's job records and reads back."""

from __future__ import annotations

import json
from pathlib import Path

from trainstack_job import CheckpointContext, Job
from trainstack_job.contract import SYNC_MANIFEST, JobEnv


def job(tmp_path: Path, **env: str) -> Job:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    environ = {
        JobEnv.CHECKPOINT_DIR.value: str(tmp_path / "checkpoints"),
        JobEnv.OUTPUT_DIR.value: str(tmp_path / "output"),
        JobEnv.DATA_DIR.value: str(data),
        **env,
    }
    return Job.from_env(environ=environ)


def test_a_checkpoint_records_what_the_agent_said_and_the_dataset_version(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / SYNC_MANIFEST).write_text(json.dumps({"train/a.png": [3, '"e1"']}))
    t4 = job(
        tmp_path,
        TRAINSTACK_JOB_ID="j-7",
        TRAINSTACK_CODE_HASH="c0de",
        TRAINSTACK_INSTANCE_TYPE="g4dn.xlarge",
        TRAINSTACK_GPU_MODEL="T4",
        TRAINSTACK_GPU_COUNT="1",
        TRAINSTACK_PRECISION="fp16",
    )
    assert t4.precision == "fp16"
    with t4.save_checkpoint(3, context=t4.checkpoint_context(model="charlm", optimizer="AdamW")) as folder:
        (folder / "state.bin").write_bytes(b"x")
    restored = t4.latest_checkpoint()
    assert restored is not None and restored.context is not None
    saved = restored.context
    assert (saved.job_id, saved.code_hash, saved.gpu_model, saved.gpu_count, saved.precision) == (
        "j-7",
        "c0de",
        "T4",
        1,
        "fp16",
    )
    assert saved.dataset_version is not None and saved.dataset_version.startswith("sha256:")
    # "(emulated on cpu)" follows when torch is imported here without a GPU (as in this test process).
    assert saved.describe().startswith("charlm, AdamW, fp16 on 1x T4")

    # The next life on an L4: the job sees what changed and can, e.g., skip the fp16 scaler's state.
    (tmp_path / "data" / SYNC_MANIFEST).write_text(json.dumps({"train/a.png": [4, '"e2"']}))
    l4 = job(tmp_path, TRAINSTACK_JOB_ID="j-7", TRAINSTACK_GPU_MODEL="L4", TRAINSTACK_PRECISION="bf16")
    now = l4.checkpoint_context(model="charlm", optimizer="AdamW")
    changes = saved.differences(now)
    assert any(change.startswith("device 1x T4 -> 1x L4") for change in changes), changes
    assert "precision fp16 -> bf16" in changes
    assert any(change.startswith("dataset ") for change in changes), changes


def test_without_an_agent_the_context_is_mostly_unknown(tmp_path: Path) -> None:
    local = Job(tmp_path / "checkpoints", tmp_path / "output", environ={})
    local.checkpoint_dir.mkdir()
    assert local.precision is None
    with local.save_checkpoint(1) as folder:
        (folder / "f").write_text("x")
    restored = local.latest_checkpoint()
    assert restored is not None and restored.context is not None
    context = restored.context
    assert (context.job_id, context.gpu_model, context.precision, context.dataset_version) == (None,) * 4
    assert context.describe().startswith("unknown precision on ")


def test_a_manifest_without_or_with_a_bad_context(tmp_path: Path) -> None:
    assert CheckpointContext.from_dict(None) is None
    odd = CheckpointContext.from_dict({"gpu_count": "8", "precision": 16, "emulated": "yes", "new": 1})
    assert odd == CheckpointContext()

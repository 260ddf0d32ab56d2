"""bench/streaming.py run tiny: the three cases side by side, each reading one whole epoch, and the warm
cache case fetching no shard from S3."""

from __future__ import annotations

from pathlib import Path

import pytest

import training.streaming
from bench.streaming import main, run


@pytest.mark.slow(seconds=20)
def test_the_bench_measures_sync_stream_and_warm_stream_side_by_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    downloads: list[int] = []
    original = training.streaming.ShardCache._download

    def counted(self: training.streaming.ShardCache, shard: int, target: Path) -> None:
        downloads.append(shard)
        original(self, shard, target)

    monkeypatch.setattr(training.streaming.ShardCache, "_download", counted)

    report = run(
        tmp_path, 0.002, image_kb=8, shard_mb=0.2, workers=0, batch=16, image_size=16, window=2, read_ahead=1
    )

    cases = {case["case"]: case for case in report["cases"]}
    assert list(cases) == ["sync", "stream", "stream-warm"]
    expected = report["train_images"] // 16 * 16 - 16  # one epoch, less the first batch
    for case in cases.values():
        assert case["samples"] == expected
        assert case["first_batch_s"] > 0 and case["steady_samples_per_s"] > 0
    assert cases["sync"]["prepare_s"] > 0
    # Every shard fetched once, by the cold case; the warm case reads its cache only.
    assert sorted(downloads) == list(range(report["shards"]))
    assert report["shards"] > 2 and report["dataset_bytes"] > 0


def test_the_command_line_prints_the_table_and_writes_the_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        "bench.streaming.run",
        lambda *args: {"cases": [{"case": "sync", "first_batch_s": 1.5, "steady_samples_per_s": 9.0}]},
    )
    main(["--out", str(tmp_path / "r.json")])
    assert "sync" in capsys.readouterr().out and '"first_batch_s": 1.5' in (tmp_path / "r.json").read_text()

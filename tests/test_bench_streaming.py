"""bench/streaming.py run tiny: the three cases side by side, each reading one whole epoch, the warm cache
case fetching no shard from S3, and the throttled network (the fault proxy in the path, moto in a child
process)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import training.streaming
from bench.streaming import goals, main, run, table

TINY: dict[str, Any] = {
    "image_kb": 8,
    "shard_mb": 0.2,
    "workers": 0,
    "batch": 16,
    "image_size": 16,
    "window": 2,
    "read_ahead": 1,
}


def counted_downloads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    downloads: list[int] = []
    original = training.streaming.ShardCache._download

    def counted(self: training.streaming.ShardCache, shard: int, target: Path) -> None:
        downloads.append(shard)
        original(self, shard, target)

    monkeypatch.setattr(training.streaming.ShardCache, "_download", counted)
    return downloads


def check_cases(report: dict[str, Any], downloads: list[int]) -> dict[str, dict[str, Any]]:
    cases = {case["case"]: case for case in report["cases"]}
    assert list(cases) == ["sync", "stream", "stream-warm"]
    expected = report["train_images"] // 16 * 16 - 16  # one epoch, less the first batch
    for case in cases.values():
        assert case["samples"] == expected
        assert case["first_batch_s"] > 0 and case["steady_samples_per_s"] > 0
        assert 0 < case["steady_wait_s"] <= case["steady_s"]
        # The trainer side decodes every sample: some CPU each, and less than the whole steady time's 4 cores.
        assert 0 < case["cpu_ms_per_sample"] < 4000 * case["steady_s"] / case["samples"]
    assert cases["sync"]["prepare_s"] > 0
    # Every shard fetched once, by the cold case; the warm case reads its cache only.
    assert sorted(downloads) == list(range(report["shards"]))
    assert report["shards"] > 2 and report["dataset_bytes"] > 0
    assert cases["sync"]["fetched_bytes"] > report["dataset_bytes"]  # train and val
    assert cases["stream"]["fetched_bytes"] > report["dataset_bytes"]  # the train shards: images and headers
    assert cases["stream-warm"]["fetched_bytes"] == 0
    return cases


@pytest.mark.slow(seconds=20)
def test_the_bench_measures_sync_stream_and_warm_stream_side_by_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    downloads = counted_downloads(monkeypatch)
    report = run(tmp_path, 0.002, **TINY, moto_process=False)
    cases = check_cases(report, downloads)
    assert all(case["proxy_bytes"] == 0 for case in cases.values())  # no proxy unthrottled
    assert report["throttle_mbps"] is None and report["part_mib"] == 8  # part_size(0.2 MB)


@pytest.mark.slow(seconds=30)
def test_a_throttled_run_reads_through_the_proxy_from_moto_in_its_own_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    downloads = counted_downloads(monkeypatch)
    report = run(tmp_path, 0.002, **TINY, throttle_mbps=50, part_mb=8, step_ms=1)
    cases = check_cases(report, downloads)
    # What the cases fetched went through the proxy (plus the requests and headers); the warm case's
    # index read only.
    for case in ("sync", "stream"):
        assert cases[case]["proxy_bytes"] > cases[case]["fetched_bytes"]
    assert 0 < cases["stream-warm"]["proxy_bytes"] < cases["stream"]["fetched_bytes"]
    assert (report["throttle_mbps"], report["moto_process"], report["part_mib"]) == (50, True, 8)


def test_the_command_line_prints_the_table_and_the_goals_and_writes_the_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    asked: dict[str, Any] = {}
    cases = [
        {"case": "sync", "first_batch_s": 1.5, "steady_samples_per_s": 100.0},
        {"case": "stream", "first_batch_s": 0.5, "steady_samples_per_s": 94.0},
        {"case": "stream-warm", "first_batch_s": 0.2, "steady_samples_per_s": 95.0},
    ]

    def fake_run(*args: Any, **options: Any) -> dict[str, Any]:
        asked.update(options)
        return {"cases": cases}

    monkeypatch.setattr("bench.streaming.run", fake_run)
    main(["--out", str(tmp_path / "r.json"), "--throttle-mbps", "25", "--no-moto-process", "--part-mb", "8"])
    out = capsys.readouterr().out
    assert "sync" in out and '"first_batch_s": 1.5' in (tmp_path / "r.json").read_text()
    assert asked == {"throttle_mbps": 25.0, "moto_process": False, "part_mb": 8.0, "step_ms": 0.0}
    main([])
    assert asked == {"throttle_mbps": None, "moto_process": True, "part_mb": None, "step_ms": 0.0}
    assert out.rstrip().endswith(
        "stream: steady 0.94x sync: goal (>= 0.95x) NOT met\n"
        "stream-warm: steady 0.95x sync: goal (>= 0.95x) met"
    )
    assert goals({"cases": cases[1:]}) == [] and "0.94" in table({"cases": cases})


@pytest.mark.parametrize("option", ["--throttle-mbps", "--part-mb"])
def test_a_limit_of_zero_or_less_is_refused_naming_the_option(
    option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([option, "0"])
    assert f"{option} must be above 0, got 0.0" in capsys.readouterr().err

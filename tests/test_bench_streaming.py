"""bench/streaming.py run tiny: the three cases side by side, each reading one whole epoch, the warm cache
case fetching no shard from S3, and the throttled network (the fault proxy in the path, moto in a child
process)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

import training.streaming
from bench.streaming import PHOTO_SIZE, goals, index_cost, main, run, table, write_images
from tests.training.conftest import hash_counter

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


def check_cases(
    report: dict[str, Any],
    downloads: list[int],
    names: tuple[str, ...] = ("sync", "stream", "stream-warm"),
    rounds: int = 1,
) -> dict[str, dict[str, Any]]:
    cases = {case["case"]: case for case in report["cases"]}
    assert tuple(cases) == names
    expected = report["train_images"] // 16 * 16 - 16  # one epoch, less the first batch
    for case in cases.values():
        assert case["samples"] == expected
        assert case["first_batch_s"] > 0 and case["steady_samples_per_s"] > 0
        assert 0 < case["steady_wait_s"] <= case["steady_s"]
        # The trainer side decodes every sample: some CPU each, and less than the whole steady time's 4 cores.
        assert 0 < case["cpu_ms_per_sample"] < 4000 * case["steady_s"] / case["samples"]
        assert 0 <= case["worker_cpu_ms_per_sample"] <= case["cpu_ms_per_sample"]
        assert 0 < case["open_s"] < case["first_batch_s"]
    if "sync" not in cases:
        return cases
    assert cases["sync"]["prepare_s"] > 0
    # Every shard fetched once a round, by the cold case; the warm case reads its cache only.
    assert sorted(downloads) == sorted(list(range(report["shards"])) * rounds)
    assert report["shards"] > 2 and report["dataset_bytes"] > 0
    assert cases["sync"]["fetched_bytes"] > report["dataset_bytes"]  # train and val
    assert cases["stream"]["fetched_bytes"] > report["dataset_bytes"]  # the train shards: images and headers
    assert cases["stream-warm"]["fetched_bytes"] == 0
    return cases


@pytest.mark.slow(seconds=20)
def test_the_bench_measures_the_three_cases_side_by_side_in_rounds_that_alternate_and_reports_the_median(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One run of three rounds for what a one-round run also showed (its own test until the thirteenth
    # session): the cases measured side by side, unthrottled, with the index pinned.
    import bench.streaming

    downloads = counted_downloads(monkeypatch)
    hashed = hash_counter(monkeypatch)
    read: list[str] = []
    real_read = bench.streaming.read_epoch

    def recorded(root: str, settings: Any, *args: Any) -> Any:
        read.append("sync" if settings is None else "stream")
        return real_read(root, settings, *args)

    monkeypatch.setattr(bench.streaming, "read_epoch", recorded)
    report = run(tmp_path, 0.002, **TINY, moto_process=False, rounds=3)

    first, second = ["sync", "stream", "stream"], ["stream", "stream", "sync"]  # cold then warm, each time
    assert read == [*first, *second, *first]
    # Each round's cold stream fetched every shard again (an empty cache, as a new instance has).
    cases = check_cases(report, downloads, rounds=3)
    assert report["rounds"] == 3
    assert all(case["proxy_bytes"] == 0 for case in cases.values())  # no proxy unthrottled
    assert report["throttle_mbps"] is None and report["part_mib"] == 8  # part_size(0.2 MB)
    # The index as the agent places it: every shard pinned to its ETag, none hashed after its download.
    assert report["pinned"] is True and hashed == []
    assert all(case["worker_cpu_ms_per_sample"] == 0 for case in cases.values())  # no loader workers
    for case in report["cases"]:
        rates = case["rounds_samples_per_s"]
        assert len(rates) == 3 and case["steady_samples_per_s"] == sorted(rates)[1]
        assert (case["fetched_bytes"] == 0) == (case["case"] == "stream-warm")
    assert "sync: rounds' steady samples/s " in table(report)


@pytest.mark.slow(seconds=30)
def test_a_throttled_run_reads_through_the_proxy_from_moto_in_its_own_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    downloads = counted_downloads(monkeypatch)
    hashed = hash_counter(monkeypatch)
    report = run(tmp_path, 0.002, **TINY, throttle_mbps=50, part_mb=8, step_ms=1, pinned=False)
    cases = check_cases(report, downloads)
    assert report["pinned"] is False and len(hashed) == report["shards"]  # each shard hashed once, downloaded
    # What the cases fetched went through the proxy (plus the requests and headers); the warm case's
    # index read only (unpinned, the index is read from S3).
    for case in ("sync", "stream"):
        assert cases[case]["proxy_bytes"] > cases[case]["fetched_bytes"]
    assert 0 < cases["stream-warm"]["proxy_bytes"] < cases["stream"]["fetched_bytes"]
    assert (report["throttle_mbps"], report["moto_process"], report["part_mib"]) == (50, True, 8)


@pytest.mark.slow(seconds=30)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="moto on a CPU of its own needs two")
def test_a_run_can_leave_out_the_sync_and_give_moto_its_own_cpu_and_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    downloads = counted_downloads(monkeypatch)
    ours = os.sched_getaffinity(0)
    moto_cpu = min(ours)
    seen: list[set[int]] = []
    original = training.streaming.ShardCache._download

    def where(self: training.streaming.ShardCache, shard: int, target: Path) -> None:
        seen.append(os.sched_getaffinity(0))  # the loader's side, while the cases run
        original(self, shard, target)

    monkeypatch.setattr(training.streaming.ShardCache, "_download", where)
    options = {**TINY, "image_kb": 0, "shard_mb": 0.5}
    report = run(
        tmp_path,
        0.006,  # 54 photos of about 110 KB: a few shards, more than one batch
        **options,
        cases=("stream", "stream-warm"),
        s3_cores=frozenset({moto_cpu}),
        s3_in_memory=True,
        image_format="jpeg",
    )
    cases = check_cases(report, downloads, ("stream", "stream-warm"))
    # The cold case fetched each shard the epoch read, once (the dropped last partial batch may leave some
    # unread); the warm one none.
    assert downloads and len(downloads) == len(set(downloads)) <= report["shards"]
    assert cases["stream"]["fetched_bytes"] > 0 and cases["stream-warm"]["fetched_bytes"] == 0
    assert seen and all(cpus == ours - {moto_cpu} for cpus in seen)
    assert os.sched_getaffinity(0) == ours  # given back after the run
    assert (report["s3_cores"], report["s3_in_memory"], report["image_format"]) == ([moto_cpu], True, "jpeg")
    assert not (tmp_path / "synced").exists()  # no sync, so no file copy of the dataset pushed either


def test_jpeg_images_are_photos_of_imagenets_usual_size(tmp_path: Path) -> None:
    count = write_images(tmp_path, 0.0011, 0, classes=2, image_format="jpeg")
    assert count == 10  # 1.1 MB of 110 KB photos
    photos = sorted((tmp_path / "train").rglob("*.jpg"))
    assert len(photos) == count and len(list((tmp_path / "val").rglob("*.jpg"))) == 2
    with Image.open(photos[0]) as photo:
        assert (photo.format, photo.size, photo.mode) == ("JPEG", PHOTO_SIZE, "RGB")
    # About ImageNet's mean of 110 KB, not noise (several times that) nor a flat picture (a few KB).
    assert 60_000 < sum(p.stat().st_size for p in photos) / count < 200_000


def test_the_index_cost_opens_both_formats_of_the_same_samples(tmp_path: Path) -> None:
    cost = index_cost(tmp_path, samples=50, shards=3, rounds=1)
    assert (cost["samples"], cost["shards"]) == (50, 3)
    assert list(cost["formats"]) == ["first", "current"]
    for figures in cost["formats"].values():
        assert figures["bytes"] > 50 * 20 and 0 < figures["open_s"] < 60


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
    defaults = {
        "cases": ("sync", "stream", "stream-warm"),
        "s3_in_memory": False,
        "image_format": "png",
        "pinned": True,
        "rounds": 1,
    }
    assert asked == {
        "throttle_mbps": 25.0,
        "moto_process": False,
        "part_mb": 8.0,
        "step_ms": 0.0,
        **defaults,
        "s3_cores": frozenset(),
    }
    cpu = min(os.sched_getaffinity(0))
    cores = ["--s3-cores", str(cpu)] if len(os.sched_getaffinity(0)) > 1 else []
    main(["--cases", "stream, stream-warm", "--s3-in-memory", "--image-format", "jpeg", *cores, "--unpinned"])
    assert (asked["cases"], asked["s3_in_memory"], asked["image_format"], asked["s3_cores"]) == (
        ("stream", "stream-warm"),
        True,
        "jpeg",
        frozenset({cpu}) if cores else frozenset(),
    )
    assert asked["pinned"] is False
    main([])
    assert asked == {
        "throttle_mbps": None,
        "moto_process": True,
        "part_mb": None,
        "step_ms": 0.0,
        **defaults,
        "s3_cores": frozenset(),
    }
    assert out.rstrip().endswith(
        "stream: steady 0.94x sync: goal (>= 0.95x) NOT met\n"
        "stream-warm: steady 0.95x sync: goal (>= 0.95x) met"
    )
    assert goals({"cases": cases[1:]}) == [] and "0.94" in table({"cases": cases})


def test_index_samples_prints_both_formats_instead_of_the_cases(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("bench.streaming.run", lambda *a, **k: pytest.fail("the cases ran"))
    main(["--index-samples", "40", "--index-shards", "4"])
    out = capsys.readouterr().out
    assert '"samples": 40' in out and '"shards": 4' in out
    assert "first    index:" in out and "current  index:" in out


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--cases", "sync,fast"], "--cases: fast is not one of sync,stream,stream-warm"),
        (["--cases", ","], "--cases: none is not one of"),
        (["--cases", "sync,stream-warm"], "stream-warm reads the cache that stream leaves; add stream"),
        (["--s3-in-memory", "--no-moto-process"], "--s3-in-memory: moto's buffer is set in its own process"),
        (
            ["--s3-cores", "0", "--no-moto-process"],
            "--s3-cores: moto runs on its own cores in its own process",
        ),
        (["--s3-cores", "999"], "--s3-cores 999: name some of the CPUs"),
        (["--index-samples", "0"], "--index-samples and --index-shards must be at least 1"),
    ],
)
def test_options_that_cannot_be_run_are_refused_naming_them(
    argv: list[str], error: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("bench.streaming.run", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(SystemExit):
        main(argv)
    assert error in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--throttle-mbps", "--part-mb"])
def test_a_limit_of_zero_or_less_is_refused_naming_the_option(
    option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([option, "0"])
    assert f"{option} must be above 0, got 0.0" in capsys.readouterr().err


def test_fewer_than_one_round_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--rounds", "0"])
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err

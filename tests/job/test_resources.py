"""What a job asks for and which pool serves it: read once, refused in one line naming every pool."""

from __future__ import annotations

import pytest

from trainstack_job.resources import (
    PoolOffer,
    ResourceError,
    ResourceRequest,
    TypeOffer,
    match_pool,
    parse_gpus,
    parse_resources,
)

L4 = TypeOffer("g6.xlarge", "L4", 1, 24)
A10G = TypeOffer("g5.xlarge", "A10G", 1, 24)
T4 = TypeOffer("g4dn.xlarge", "T4", 1, 16)
A100X8 = TypeOffer("p4d.24xlarge", "A100", 8, 40)
SMALL = PoolOffer("small", (L4, A10G), max_instances=2, default=True)
CHEAP = PoolOffer("cheap", (T4,), max_instances=4)
BIG = PoolOffer("big", (A100X8,), max_instances=2)
POOLS = [SMALL, CHEAP, BIG]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("L4:1", ("L4", 1)), ("A100:8", ("A100", 8)), ("L4", ("L4", 1)), ("2", (None, 2)), (4, (None, 4))],
)
def test_gpus_read_as_model_and_count(text: object, expected: tuple[str | None, int]) -> None:
    assert parse_gpus(text, "--gpus") == expected


@pytest.mark.parametrize("text", ["L4:0", "L4:x", ":1", "", "0", True, 1.5, ["L4"]])
def test_a_gpu_request_that_is_not_one_is_one_line_naming_it(text: object) -> None:
    with pytest.raises(ResourceError) as caught:
        parse_gpus(text, "job.yaml: resources.gpus")
    (problem,) = caught.value.problems
    assert (
        problem.startswith("job.yaml: resources.gpus: ") and "MODEL:COUNT" in problem and "\n" not in problem
    )


def test_a_resources_mapping_reports_every_problem_each_naming_its_key() -> None:
    with pytest.raises(ResourceError) as caught:
        parse_resources(
            {"gpu": "L4", "gpus": "L4:0", "min_gpu_memory_gb": True, "instances": 0, "pool": "Big Pool"},
            "job.yaml: resources",
        )
    problems = caught.value.problems
    assert len(problems) == 5, problems
    for key in ("resources.gpu:", "resources.gpus:", "resources.min_gpu_memory_gb:", "resources.instances:"):
        assert any(key in p for p in problems), key
    assert any("resources.pool: 'Big Pool' is not a pool name" in p for p in problems)


def test_an_absent_request_asks_for_nothing_and_round_trips() -> None:
    assert parse_resources(None, "r").empty
    asked = parse_resources({"gpus": "L4:2", "min_gpu_memory_gb": 24, "instances": 2}, "r")
    assert asked == ResourceRequest(gpu_model="L4", gpus=2, min_gpu_memory_gb=24.0, instances=2)
    assert parse_resources(asked.to_mapping(), "r") == asked


def test_nothing_asked_goes_to_the_default_pool() -> None:
    assert match_pool(ResourceRequest(), POOLS, instances=1, where="job") is SMALL


def test_a_gpu_model_goes_to_the_pool_whose_every_type_has_it() -> None:
    # `small` launches L4 or A10G: a job asking for an L4 cannot be promised one there.
    with pytest.raises(ResourceError, match="no pool serves 1x L4 per instance"):
        match_pool(ResourceRequest(gpu_model="L4", gpus=1), POOLS, instances=1, where="job")
    assert match_pool(ResourceRequest(gpu_model="t4"), POOLS, instances=1, where="job") is CHEAP
    assert match_pool(ResourceRequest(gpu_model="A100", gpus=8), POOLS, instances=2, where="job") is BIG
    assert match_pool(ResourceRequest(min_gpu_memory_gb=24), POOLS, instances=1, where="job") is SMALL
    assert match_pool(ResourceRequest(min_gpu_memory_gb=32), POOLS, instances=1, where="job") is BIG


def test_an_unservable_request_is_one_line_naming_every_pool_and_what_it_offers() -> None:
    with pytest.raises(ResourceError) as caught:
        match_pool(ResourceRequest(gpu_model="H100", gpus=8), POOLS, instances=1, where="the job")
    (line,) = caught.value.problems
    assert line.startswith("the job: no pool serves 8x H100 per instance")
    for offer in ("small offers 1x L4 24 GiB (g6.xlarge), 1x A10G 24 GiB (g5.xlarge), up to 2 instances",
                  "cheap offers 1x T4 16 GiB (g4dn.xlarge), up to 4 instances",
                  "big offers 8x A100 40 GiB (p4d.24xlarge), up to 2 instances"):  # fmt: skip
        assert offer in line, offer
    assert "trainstack:pools" in line and "\n" not in line


def test_a_named_pool_must_exist_and_serve_the_instances_asked() -> None:
    assert match_pool(ResourceRequest(pool="cheap"), POOLS, instances=3, where="job") is CHEAP
    with pytest.raises(ResourceError, match="no pool named 'huge' in this stack"):
        match_pool(ResourceRequest(pool="huge"), POOLS, instances=1, where="job")
    with pytest.raises(ResourceError, match="no pool serves pool small, 3 instances"):
        match_pool(ResourceRequest(pool="small"), POOLS, instances=3, where="job")


def test_a_type_the_catalogue_does_not_know_is_never_promised_gpus() -> None:
    unknown = PoolOffer("odd", (TypeOffer("x9.large", None, 0, 0),), max_instances=1, default=True)
    assert match_pool(ResourceRequest(), [unknown], instances=1, where="job") is unknown
    with pytest.raises(ResourceError, match=r"odd offers x9.large \(GPUs unknown\)"):
        match_pool(ResourceRequest(gpus=1), [unknown], instances=1, where="job")

"""benchmarks/published_runs.yaml: every row is complete, cited and self-consistent (no planning here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from pipectl.catalog import get_device

ROOT = Path(__file__).resolve().parent.parent
RUNS = yaml.safe_load((ROOT / "benchmarks" / "published_runs.yaml").read_text())
ROWS = RUNS["runs"]


def _benchmark_module():
    spec = importlib.util.spec_from_file_location("published_runs", ROOT / "benchmarks" / "published_runs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ids_are_unique_and_there_are_enough_rows():
    ids = [row["id"] for row in ROWS]
    assert len(ids) == len(set(ids))
    compared = [row for row in ROWS if row["published"]]
    assert len(compared) >= 10
    assert len({row["devices"]["kind"] for row in compared}) >= 3


@pytest.mark.parametrize("row", ROWS, ids=[row["id"] for row in ROWS])
def test_row_is_complete_and_cited(row):
    for key in ("id", "name", "source", "model", "devices", "layout", "global_batch", "attention", "published"):
        assert key in row, key
    source = row["source"]
    assert source["url"].startswith("https://")
    assert source["reference"].strip()
    assert all(url.startswith("https://") for url in source.get("evidence", []))
    assert source["verified"] in (True, "secondary", False)
    if source["verified"] is False:
        assert row["published"] is None  # an unverified throughput is never compared

    model = row["model"]
    for key in ("layers", "hidden", "heads", "seq_len", "vocab"):
        assert isinstance(model[key], int) and model[key] > 0, key
    get_device(row["devices"]["kind"])  # a catalog device

    layout, devices = row["layout"], row["devices"]
    assert layout["t"] * layout["p"] * layout["d"] == devices["count"]
    assert model["heads"] % layout["t"] == 0
    if layout.get("micro_batch_size"):
        assert row["global_batch"] % (layout["d"] * layout["micro_batch_size"]) == 0
    if layout.get("v") and layout["v"] > 1:
        assert layout["schedule"] == "interleaved"
    assert row["attention"] in ("flash", "unfused")
    assert row.get("recompute") in ("full", "selective", "none", None)

    published = row["published"]
    if published:
        assert published.get("step_seconds") or (
            published.get("tflops_per_gpu") and published.get("flops_formula") in RUNS["flops_formulas"])


def test_every_row_becomes_a_model_and_a_cluster():
    benchmark = _benchmark_module()
    for row in ROWS:
        config = benchmark.model_config(row)
        cluster = benchmark.cluster_of(row)
        assert config.layers == row["model"]["layers"]
        assert cluster.node_types[0].nodes * cluster.node_types[0].devices_per_node >= row["devices"]["count"]


@pytest.mark.parametrize("row", [r for r in ROWS if r["published"] and r["published"].get("step_seconds")
                                 and r["published"].get("tflops_per_gpu")], ids=lambda r: r["id"])
def test_flop_count_matches_rows_that_publish_both_step_time_and_tflops(row):
    """Where a source gives both, its TFLOP/s and step time agree through the FLOP count used."""
    benchmark = _benchmark_module()
    published = row["published"]
    step_from_tflops = benchmark.step_flops(row) / (published["tflops_per_gpu"] * 1e12 * row["devices"]["count"])
    assert step_from_tflops == pytest.approx(published["step_seconds"], rel=0.01)


def test_ptdp_1t_published_step():
    """Narayanan et al. 2021 Eq. 3 for the 1 T row: 163 TFLOP/s on 3072 GPUs is about 102.6 s per step."""
    benchmark = _benchmark_module()
    row = next(r for r in ROWS if r["id"] == "ptdp-1t")
    seconds, _ = benchmark.published_step(row)
    assert seconds == pytest.approx(102.6, rel=0.002)


def test_phase_breakdown_splits_the_simulated_step():
    """The benchmark's split of a pinned step reads the simulator's phases (a plan of 16 A100s)."""
    from pipectl.artifacts.plan import PlanRequest
    from pipectl.cluster import load_cluster
    from pipectl.plan.search import plan
    from pipectl.testing.profiles import synthetic_profile

    profile = synthetic_profile(blocks=8, micro_batch_sizes=[1, 2], device="a100-80gb")
    cluster = load_cluster("a100-8x8")
    request = PlanRequest(global_batch=32, devices=16, tensor_parallel=2, pipeline_parallel=2, data_parallel=4)
    chosen = plan(profile, cluster, request).chosen
    phases = _benchmark_module().phase_breakdown(chosen, profile, cluster)
    split = phases["split"]
    assert phases["forward_seconds"] > 0
    assert phases["end_of_step_seconds"] == pytest.approx(
        split["data_parallel_exposed_seconds"] + split["optimizer_seconds"], abs=2e-4)
    assert sum(split.values()) == pytest.approx(phases["step_seconds"], abs=1e-3)
    assert split["tensor_parallel_exposed_seconds"] > 0  # t = 2: collectives inside the blocks

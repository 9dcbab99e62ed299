"""Clusters: shipped examples, link precedence (YAML > links.json > catalog), local ranks."""

from __future__ import annotations

import json

import pytest
import yaml

from pipectl.artifacts.cluster import ClusterSpec
from pipectl.artifacts.profile import LinkClass, LinkClassFit, LinksProfile
from pipectl.catalog import get_device
from pipectl.cluster import (
    LinkCost,
    link_between_node_types,
    load_cluster,
    local_cluster,
    plan_cluster_spec,
    price_per_device_hour,
    resolve_links,
)
from pipectl.errors import PipectlError, UserInputError
from pipectl.paths import configs_dir

SHIPPED = sorted(p.stem for p in (configs_dir() / "clusters").glob("*.yaml"))


def test_the_required_examples_are_shipped():
    assert {"local", "a100-8x8", "a100-384x8", "v100-4vm", "mixed-v100-p100"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_cluster_loads_and_resolves(name):
    cluster = load_cluster(name)
    assert cluster.total_devices > 0
    for node_type in cluster.node_types:
        links = resolve_links(cluster, node_type)
        assert links.intra_bandwidth_bytes_per_second > 0 and links.inter_bandwidth_bytes_per_second > 0
        assert links.intra_latency_seconds >= 0 and links.inter_latency_seconds >= 0
        assert price_per_device_hour(cluster, node_type) >= 0


def test_shipped_shapes():
    assert load_cluster("a100-8x8").total_devices == 64
    assert load_cluster("a100-384x8").total_devices == 3072
    assert load_cluster("v100-4vm").total_devices == 4
    mixed = load_cluster("mixed-v100-p100")
    assert mixed.heterogeneous and mixed.device_kinds == ["p100", "v100-16gb"]
    local = load_cluster("local")
    assert local.local and local.total_devices == 2


def test_an_emulated_slower_kind_is_a_kind_of_its_own_on_its_device():
    mixed = load_cluster("local-mixed")
    assert mixed.heterogeneous and mixed.device_kinds == ["cpu", "cpu-slowed-2x"]
    assert {n.device for n in mixed.node_types} == {"cpu"}
    assert [n.name for n in mixed.nodes_of_kind("cpu-slowed-2x")] == ["cpu-half-speed"]


def test_a_one_host_cluster_has_one_node_of_each_type(tmp_path):
    spec = yaml.safe_load((configs_dir() / "clusters" / "local-mixed.yaml").read_text())
    assert spec["one_host"] is True
    spec["node_types"][0]["nodes"] = 2
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(PipectlError, match="one machine: every node type has nodes: 1"):
        load_cluster(path)


@pytest.mark.parametrize("slowdown", [0.5, 0, -1, 1e9])
def test_a_compute_slowdown_below_one_or_absurd_is_refused(tmp_path, slowdown):
    spec = yaml.safe_load((configs_dir() / "clusters" / "local-mixed.yaml").read_text())
    spec["node_types"][1]["compute_slowdown"] = slowdown
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(PipectlError, match="compute_slowdown"):
        load_cluster(path)


def test_a100_links_are_nvlink_and_infiniband_per_device():
    links = resolve_links(load_cluster("a100-8x8"), "a100-nodes")
    assert links.intra_bandwidth_bytes_per_second == 300e9  # NVLink 600 GB/s both ways
    assert links.inter_bandwidth_bytes_per_second == 25e9  # 8 x 200 Gb/s per node / 8 GPUs
    assert links.inter.seconds(25e9) == pytest.approx(1.0 + 5e-6)
    # The cluster file sets the NVLink figure and NCCL's bus bandwidth apart: collectives run at the latter.
    assert links.allreduce_intra_bandwidth_bytes_per_second == 230e9


def _catalog_links(device: str):
    node_type = {"name": "nodes", "device": device, "devices_per_node": 8, "nodes": 2}
    return resolve_links(ClusterSpec(name="c", node_types=[node_type]), "nodes")


def test_collectives_inside_a_node_run_at_the_catalogs_measured_bus_bandwidth():
    """Without a cluster figure, point-to-point transfers take the link's datasheet rate and
    collectives the NCCL bus bandwidth the catalog records (A100: ~230 of 300 GB/s, H100 370 of 450,
    and 47 of 50 between H100 nodes); a device without that figure prices both at the link's rate."""
    a100, h100, v100 = _catalog_links("a100-80gb"), _catalog_links("h100-80gb"), _catalog_links("v100-32gb")
    assert (a100.intra_bandwidth_bytes_per_second, a100.allreduce_intra_bandwidth_bytes_per_second) == (300e9, 230e9)
    assert (h100.intra_bandwidth_bytes_per_second, h100.allreduce_intra_bandwidth_bytes_per_second) == (450e9, 370e9)
    assert v100.allreduce_intra_bandwidth_bytes_per_second == v100.intra_bandwidth_bytes_per_second == 150e9
    assert a100.allreduce_inter_bandwidth_bytes_per_second == a100.inter_bandwidth_bytes_per_second == 25e9
    # Between nodes too where the catalog has NCCL's figure: NDR's 46-48 of the NIC's 50 GB/s.
    assert (h100.inter_bandwidth_bytes_per_second, h100.allreduce_inter_bandwidth_bytes_per_second) == (50e9, 47e9)


def test_a_clusters_own_collective_figure_replaces_only_the_collectives():
    """A node type may state NCCL's bus bandwidth apart from its link's rate: transfers keep the
    link's figure (the cluster's, or the catalog's), collectives inside a node take the stated one."""
    def links(**own):
        node_type = {"name": "nodes", "device": "a100-80gb", "devices_per_node": 8, "nodes": 2, "links": own}
        return resolve_links(ClusterSpec(name="c", node_types=[node_type]), "nodes")

    both = links(intra_node_bandwidth_gbytes_per_second=150, intra_node_allreduce_bandwidth_gbytes_per_second=210)
    assert (both.intra_bandwidth_bytes_per_second, both.allreduce_intra_bandwidth_bytes_per_second) == (150e9, 210e9)
    alone = links(intra_node_allreduce_bandwidth_gbytes_per_second=210)
    assert (alone.intra_bandwidth_bytes_per_second, alone.allreduce_intra_bandwidth_bytes_per_second) == (300e9, 210e9)
    assert alone.sources["allreduce_intra_bandwidth"] == both.sources["intra_bandwidth"]


def test_a_measured_collective_figure_across_nodes_replaces_only_the_collectives():
    """A cluster's NCCL all-reduce across nodes (busbw over whole nodes / devices a node) prices the
    gradient reductions; transfers between nodes keep the link's rate."""
    def links(**own):
        node_type = {"name": "nodes", "device": "v100-32gb", "devices_per_node": 4, "nodes": 16, "links": own}
        return resolve_links(ClusterSpec(name="c", node_types=[node_type]), "nodes")

    measured = links(inter_node_bandwidth_gbytes_per_second=12.5, inter_node_allreduce_bandwidth_gbytes_per_second=1.72)
    assert (measured.inter_bandwidth_bytes_per_second, measured.allreduce_inter_bandwidth_bytes_per_second) == (
        12.5e9, 1.72e9)
    assert measured.sources["allreduce_inter_bandwidth"] == measured.sources["inter_bandwidth"]
    shared = ClusterSpec(name="c", node_types=[{"name": "n", "device": "v100-32gb", "devices_per_node": 4, "nodes": 2}],
                         inter_node_links={"inter_node_allreduce_bandwidth_gbytes_per_second": 2.0})
    assert resolve_links(shared, "n").allreduce_inter_bandwidth_bytes_per_second == 2e9


def test_yaml_path_by_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text((configs_dir() / "clusters" / "v100-4vm.yaml").read_text())
    assert load_cluster(path).name == "v100-4vm"
    assert load_cluster(str(path)).total_devices == 4


def test_local_cluster_with_n_ranks():
    cluster = local_cluster(5)
    assert cluster.local and cluster.total_devices == 5 and cluster.node_types[0].device == "cpu"
    assert load_cluster("local").total_devices == 2  # the shipped default is untouched


@pytest.mark.parametrize("devices", [0, -1, True, 2.5])
def test_local_cluster_rejects_bad_counts(devices):
    with pytest.raises(UserInputError, match="device"):
        local_cluster(devices)


def test_a_plan_is_repriced_on_the_cluster_it_was_made_for():
    from pipectl.artifacts.plan import PlanRequest
    from tests.builders import gpt_tiny_candidate, plan_of

    four_ranks = plan_of(gpt_tiny_candidate(p=2, d=2, m=2))
    # Made on the shipped two-rank default, it uses four: priced as four ranks on one machine.
    assert plan_cluster_spec(four_ranks).node_types[0].devices_per_node == 4
    # Made with --devices 6 and using 4 of them: the six-rank machine it was priced on.
    asked_six = four_ranks.model_copy(update={"request": PlanRequest(global_batch=16, devices=6)})
    assert plan_cluster_spec(asked_six).total_devices == 6
    # Fewer ranks than the default: the default machine (what `plan` priced it on).
    one_rank = plan_of(gpt_tiny_candidate(p=1, d=1))
    assert plan_cluster_spec(one_rank) == load_cluster("local")
    # A real cluster is its file, whatever the plan uses.
    assert plan_cluster_spec(four_ranks.model_copy(update={"cluster": "a100-8x8"})) == load_cluster("a100-8x8")


def test_local_cluster_refuses_a_real_cluster():
    with pytest.raises(UserInputError, match="a100-8x8"):
        local_cluster(4, base=load_cluster("a100-8x8"))


def _write_links(path, intra: LinkClassFit | None = None, inter: LinkClassFit | None = None) -> None:
    fits = [fit for fit in (intra, inter) if fit is not None]
    path.write_text(LinksProfile(backend="gloo", device="cpu", fits=fits).model_dump_json())


def _write_cluster(path, node_links: dict, inter_node_links: dict | None = None, device: str = "cpu") -> None:
    spec = {
        "schema_version": 1,
        "name": "tmp",
        "node_types": [{"name": "n", "device": device, "devices_per_node": 4, "nodes": 2, "links": node_links}],
    }
    if inter_node_links is not None:
        spec["inter_node_links"] = inter_node_links
    path.write_text(yaml.safe_dump(spec))


INTRA_FIT = LinkClassFit(
    link_class=LinkClass.INTRA_NODE,
    p2p_latency_seconds=20e-6,
    p2p_bandwidth_bytes_per_second=5e9,
    p2p_jitter_seconds=1e-6,
    allreduce_latency_seconds=30e-6,
    allreduce_bandwidth_bytes_per_second=4e9,
)


def test_precedence_yaml_over_links_file_over_catalog(tmp_path, monkeypatch):
    folder = tmp_path / "clusters"
    folder.mkdir()
    _write_links(folder / "links.json", intra=INTRA_FIT)
    _write_cluster(
        folder / "c.yaml",
        {"links_file": "links.json", "intra_node_bandwidth_gbytes_per_second": 7},
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # links_file is relative to the YAML, not to the working directory

    links = resolve_links(load_cluster(folder / "c.yaml"), "n")
    cpu = get_device("cpu")
    # YAML override wins for intra bandwidth, for p2p and all-reduce alike.
    assert links.intra_bandwidth_bytes_per_second == 7e9
    assert links.allreduce_intra_bandwidth_bytes_per_second == 7e9
    assert links.sources["intra_bandwidth"] == "cluster"
    # links.json supplies intra latency (p2p and all-reduce fits) and jitter.
    assert links.intra_latency_seconds == 20e-6
    assert links.allreduce_intra_latency_seconds == 30e-6
    assert links.intra_jitter_seconds == 1e-6
    assert links.sources["intra_latency"] == "links.json"
    # No inter-node fit and no override: the catalog.
    assert links.inter_bandwidth_bytes_per_second == cpu.inter_node_bandwidth_gbytes_per_second * 1e9
    assert links.inter_latency_seconds == pytest.approx(cpu.inter_node_latency_us * 1e-6)
    assert links.sources["inter_bandwidth"] == "catalog"


def test_links_files_are_read_when_the_cluster_loads_not_while_planning(tmp_path):
    """The planner prices layouts from the cluster it was given: the links file is read once, by
    `load_cluster`; removing it afterwards changes nothing, and no file is opened to price."""
    _write_links(tmp_path / "links.json", intra=INTRA_FIT)
    _write_cluster(tmp_path / "c.yaml", {"links_file": "links.json"})
    cluster = load_cluster(tmp_path / "c.yaml")
    (tmp_path / "links.json").unlink()
    links = resolve_links(cluster, "n")
    assert links.intra_latency_seconds == 20e-6 and links.sources["intra_latency"] == "links.json"
    assert resolve_links(cluster.model_copy(update={"pricing": "spot"}), "n") == links  # copies keep them


def test_catalog_only_when_nothing_overrides(tmp_path):
    _write_cluster(tmp_path / "c.yaml", {}, device="h100-80gb")
    links = resolve_links(load_cluster(tmp_path / "c.yaml"), "n")
    h100 = get_device("h100-80gb")
    assert links.intra_bandwidth_bytes_per_second == h100.intra_node_bandwidth_gbytes_per_second * 1e9
    assert set(links.sources.values()) == {"catalog"}


def test_cluster_wide_inter_node_links_sit_below_the_node_types_own(tmp_path):
    _write_cluster(
        tmp_path / "c.yaml",
        {"inter_node_latency_us": 7},
        inter_node_links={"inter_node_latency_us": 99, "inter_node_bandwidth_gbytes_per_second": 2},
    )
    links = resolve_links(load_cluster(tmp_path / "c.yaml"), "n")
    assert links.inter_latency_seconds == pytest.approx(7e-6)
    assert links.inter_bandwidth_bytes_per_second == 2e9


def test_unknown_device_kind_names_it_and_lists_known_ones(tmp_path):
    _write_cluster(tmp_path / "c.yaml", {}, device="tpu-v9")
    with pytest.raises(UserInputError) as info:
        load_cluster(tmp_path / "c.yaml")
    assert "tpu-v9" in info.value.message
    assert "a100-80gb" in info.value.hint


def test_missing_links_file_is_a_user_error(tmp_path):
    _write_cluster(tmp_path / "c.yaml", {"links_file": "nowhere.json"})
    with pytest.raises(UserInputError, match="nowhere.json"):
        load_cluster(tmp_path / "c.yaml")


def test_unknown_cluster_name_lists_shipped_ones():
    with pytest.raises(UserInputError) as info:
        load_cluster("a100-9x9")
    assert "a100-9x9" in info.value.message and "a100-8x8" in info.value.hint


def test_spot_pricing_needs_spot_prices(tmp_path):
    spec = {
        "name": "s",
        "pricing": "spot",
        "node_types": [{"name": "n", "device": "t4", "devices_per_node": 1, "nodes": 1,
                        "price_per_device_hour_on_demand": 0.5}],
    }
    (tmp_path / "s.yaml").write_text(json.dumps(spec))
    with pytest.raises(UserInputError, match="spot"):
        load_cluster(tmp_path / "s.yaml")


def test_price_follows_the_cluster_pricing():
    assert price_per_device_hour(load_cluster("v100-4vm"), "v100-vms") == 0.92  # spot cluster
    assert price_per_device_hour(load_cluster("a100-8x8"), "a100-nodes") == 5.12  # on demand


def test_link_between_node_groups_is_the_slower_side(tmp_path):
    spec = {
        "name": "two",
        "node_types": [
            {"name": "fast", "device": "a100-80gb", "devices_per_node": 8, "nodes": 1},
            {"name": "slow", "device": "t4", "devices_per_node": 4, "nodes": 1},
        ],
    }
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(spec))
    link = link_between_node_types(load_cluster(tmp_path / "two.yaml"), "fast", "slow")
    assert link.bandwidth_bytes_per_second == get_device("t4").inter_node_bandwidth_gbytes_per_second * 1e9
    assert link.latency_seconds == pytest.approx(get_device("t4").inter_node_latency_us * 1e-6)


def test_ring_allreduce_model():
    link = LinkCost(latency_seconds=5e-6, bandwidth_bytes_per_second=25e9)
    assert link.ring_allreduce_seconds(1e9, 1) == 0.0
    assert link.ring_allreduce_seconds(1e9, 8) == pytest.approx(2 * 7 * (5e-6 + 1e9 / 8 / 25e9))
    # Bandwidth term tends to 2 * bytes / bw as the ring grows.
    assert link.ring_allreduce_seconds(1e9, 1024) < 2 * 1e9 / 25e9 + 2 * 1023 * 5e-6 + 1e-12


def test_docstring_examples():
    """cluster.py's worked examples hold (the local cluster, the note on a busier host)."""
    import doctest

    import pipectl.cluster
    import pipectl.paths

    assert doctest.testmod(pipectl.cluster).failed == 0 and doctest.testmod(pipectl.paths).failed == 0

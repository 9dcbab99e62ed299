"""Where a candidate's ranks sit, as the planner prices them and the launch numbers them.

Placement rule (Narayanan et al. 2021, §3.2: "put the heavy communication on the fast links"):
devices are numbered node by node, and a candidate's ranks take them in the order

    device = (replica * p + stage) * t + tensor_rank

so a tensor-parallel group whose t divides the devices per node n sits inside one node, and one
whose t is a multiple of n spans t/n whole nodes (its collectives then go over the inter-node
link, `tensor_parallel_link`; the planner searches both and lets the costs decide, a t that is
neither is refused: `tensor_parallel_placeable`). Consecutive pipeline stages are neighbours
(inside a node while the pipeline fits in one; with t >= n every stage starts a node of its own,
so every cut crosses nodes), and data-parallel replicas of a stage are p*t devices apart (the
all-reduce crosses nodes first). Which link a p2p message or a data-parallel ring takes is read
from the device numbers above (`ranks_share_node`, `replicas_share_node`), whatever t is.
"""

from __future__ import annotations


from pipectl.cluster import LinkCost, ResolvedLinks


# --- placement ---------------------------------------------------------------------------------


def tensor_parallel_placeable(tensor_parallel: int, devices_per_node: int) -> bool:
    """Whether a tensor group of t devices has a place under the placement rule: t divides the
    node's devices (the group sits inside one node) or is a multiple of them (it spans t/n whole
    nodes). Any other t would put a group partly on one node and partly on another, different for
    every group, which neither the cost model nor the launch numbering describes.

        >>> [t for t in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if tensor_parallel_placeable(t, 8)]
        [1, 2, 4, 8, 16, 24, 32]
    """
    return devices_per_node % tensor_parallel == 0 or tensor_parallel % devices_per_node == 0


def tensor_group_spans_nodes(tensor_parallel: int, devices_per_node: int) -> bool:
    """Whether a tensor group leaves its node: t > n (then t is a multiple of n, whole nodes)."""
    return tensor_parallel > devices_per_node


def tensor_parallel_link(links: ResolvedLinks, tensor_parallel: int, devices_per_node: int) -> LinkCost:
    """The link a tensor group's ring all-reduces run on: the node's all-reduce link while the group
    sits inside one node; for a group spanning k = t/n whole nodes, the inter-node link of all n
    devices of each of its nodes at once.

    NCCL runs an all-reduce over several nodes as rings (channels) over all t devices, each ring
    leaving a node through a different NIC, with the data split between them; every device sends
    2(t - 1)/t of the bytes in all (Patarasuk & Yuan 2009; nccl-tests' PERFORMANCE.md: bus
    bandwidth = algorithm bandwidth x 2(t - 1)/t, set by the slowest link of the ring). The slowest
    link of a spanning ring is the node's way out, n NICs of the per-device inter-node bandwidth
    B_inter, unless NVLink, which carries all of each device's bytes, is slower still. Each of the
    2(t - 1) steps waits for an inter-node hop, so the latency is the inter-node one a_inter:

        all-reduce(M bytes, t) = 2(t - 1) (a_inter + M / t / min(n B_inter, B_intra))

    (`LinkCost.ring_allreduce_seconds` with that latency and bus bandwidth). A whole node belongs to
    one tensor group (t is a multiple of n), so no other tensor group shares its NICs. The
    hierarchical all-reduce (reduce-scatter in the node, all-reduce of each device's 1/n over the
    k nodes on its own NIC, all-gather in the node) sends 2(k - 1)/k M/n per NIC: the same order.

    On the shipped A100 clusters (NVLink 3 µs, its collectives at NCCL's 230 GB/s; InfiniBand 5 µs,
    25 GB/s a GPU, 8 a node) one block all-reduce of 50 MB takes 14 (3e-6 + 50e6 / 8 / 230e9) =
    0.422 ms at t = 8 and 30 (5e-6 + 50e6 / 16 / 200e9) = 0.619 ms at t = 16, half as long again for
    half the work per device:

        >>> from pipectl.cluster import load_cluster, resolve_links
        >>> links = resolve_links(load_cluster("a100-8x8"), "a100-nodes")
        >>> [round(tensor_parallel_link(links, t, 8).ring_allreduce_seconds(50e6, t) * 1e3, 3) for t in (8, 16)]
        [0.422, 0.619]
    """
    if not tensor_group_spans_nodes(tensor_parallel, devices_per_node):
        return links.allreduce_intra
    node_exit = devices_per_node * links.allreduce_inter_bandwidth_bytes_per_second
    return LinkCost(
        links.allreduce_inter_latency_seconds,
        min(node_exit, links.allreduce_intra_bandwidth_bytes_per_second),
    )


def node_of(device: int, devices_per_node: int) -> int:
    return device // devices_per_node


def ranks_share_node(rank_a: int, rank_b: int, p: int, t: int, d: int, devices_per_node: int) -> bool:
    """Whether pipeline ranks a and b sit in one node in every replica (placement rule above)."""
    for replica in range(min(d, devices_per_node)):  # the pattern repeats with the node size
        first = (replica * p + rank_a) * t
        second = (replica * p + rank_b) * t
        if node_of(first, devices_per_node) != node_of(second, devices_per_node):
            return False
    return True


def replicas_share_node(rank: int, p: int, t: int, d: int, devices_per_node: int) -> bool:
    """Whether all d replicas of pipeline rank `rank` sit in one node (their ring stays inside)."""
    first = rank * t
    last = ((d - 1) * p + rank) * t
    return node_of(first, devices_per_node) == node_of(last, devices_per_node)

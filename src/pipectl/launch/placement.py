"""Where a plan's ranks run: the accelerator of its device kinds, and for a plan split over kinds
the nodes of each kind in rank order.

Every launcher numbers ranks node by node (torchrun by node rank, DeepSpeed's launcher by the
hostfile's order, Slurm by the order of a heterogeneous job's components), and the runtime lays
ranks out replica by replica (`runtime.engines.pipeline.planned_topology`: rank = (replica * p + stage) *
t + tensor rank). A split's replicas are grouped by kind (`plan.hetero`), so listing each kind's
nodes in replica order puts every replica on nodes of its own kind:

    replicas   0 (p100, 8 ranks)     1 (v100-16gb, 8 ranks)
    ranks      0 .. 7                8 .. 15
    nodes      p100-vms x 2          v100-vms x 2           (4 ranks per node)
"""

from __future__ import annotations

from pipectl.artifacts.cluster import ClusterSpec
from pipectl.artifacts.plan import Plan
from pipectl.artifacts.run import Engine, NodeGroup
from pipectl.catalog import get_device
from pipectl.errors import UserInputError
from pipectl.words import count


def plan_kinds(plan: Plan) -> list[str]:
    """The device kinds the chosen candidate's ranks run on, in replica order, each once."""
    return list(dict.fromkeys(plan.chosen.replica_kinds))


def plan_accelerator(plan: Plan, cluster: ClusterSpec | None = None) -> str:
    """'cpu' when the plan's devices are CPU ranks, else 'cuda'. A kind is looked up through the
    cluster's node types (an emulated kind runs on its node's device), else in the catalog; one
    the catalog lacks is a GPU. Kinds that run on both are refused: one job has one backend."""
    found = set()
    for kind in plan_kinds(plan):
        nodes = cluster.nodes_of_kind(kind) if cluster is not None else []
        device = nodes[0].device if nodes else kind
        try:
            found.add(get_device(device).accelerator)
        except UserInputError:  # a device of a catalog this host does not have
            found.add("cpu" if device == "cpu" else "cuda")
    if len(found) > 1:
        raise UserInputError(
            f"the plan puts ranks on CPU and GPU kinds ({', '.join(plan_kinds(plan))}), which one job cannot mix",
            hint="plan on a cluster of GPU kinds only, or of CPU ranks only",
        )
    return found.pop()


def compute_slowdowns(plan: Plan, cluster: ClusterSpec | None) -> dict[str, float]:
    """The emulated slower kinds the plan's ranks run on (`NodeType.compute_slowdown`), by kind."""
    if cluster is None:
        return {}
    kinds = set(plan_kinds(plan))
    return {n.kind: n.compute_slowdown for n in cluster.node_types if n.compute_slowdown != 1.0 and n.kind in kinds}


def node_groups(plan: Plan, cluster: ClusterSpec | None, engine: Engine, *, elastic: bool = False) -> list[NodeGroup]:
    """The nodes of each device kind of a split plan, in replica order; [] for a plan of one kind and
    for the local engine (one machine: kinds there are emulated, `compute_slowdowns`).

    Each kind's ranks go to as few nodes of its node type as hold them, evenly; every node runs the
    same number of ranks (one `ranks_per_node` for the job).
    """
    kinds = plan_kinds(plan)
    if len(kinds) < 2 or engine is Engine.LOCAL:
        return []
    if cluster is not None and cluster.one_host:
        raise UserInputError(
            f"cluster '{cluster.name}' is one machine (one_host: its kinds are emulated there), not nodes the "
            f"{engine.value} engine can place replicas on",
            hint="launch it with --engine local",
        )
    if engine is Engine.TORCHRUN:
        raise UserInputError(
            f"the plan splits its replicas over {', '.join(kinds)}: torchrun's rendezvous numbers the nodes by "
            "host name, not by device kind",
            hint="use --engine slurm (a heterogeneous job, one component per kind) or --engine deepspeed "
            "(--hosts listed kind by kind)",
        )
    if elastic:
        raise UserInputError(
            f"the plan splits its replicas over {', '.join(kinds)}: an elastic job cannot keep each replica on "
            "nodes of its kind", hint="launch it without --elastic; resize it with pipectl resize",
        )
    if cluster is None:
        raise UserInputError(
            f"the plan splits its replicas over {', '.join(kinds)} and its cluster file is not readable here, so "
            "the nodes of each kind are unknown",
            hint="pass --cluster PATH (the cluster file the plan was made for)",
        )
    chosen = plan.chosen
    ranks_per_replica = chosen.tensor_parallel * chosen.pipeline_parallel
    groups: list[NodeGroup] = []
    per_node: dict[str, int] = {}
    for kind in kinds:
        replicas = [r for r, k in enumerate(chosen.replica_kinds) if k == kind]
        if replicas != list(range(replicas[0], replicas[0] + len(replicas))):
            raise UserInputError(
                f"the plan's {kind} replicas {replicas} are not consecutive: their ranks cannot fill nodes of their own",
                hint="re-plan: pipectl plan groups each kind's replicas together",
            )
        node_types = cluster.nodes_of_kind(kind)
        if not node_types:
            raise UserInputError(f"cluster '{cluster.name}' has no {kind} nodes for the plan's {kind} replicas")
        node_type = node_types[0]
        ranks = len(replicas) * ranks_per_replica
        nodes = -(-ranks // node_type.devices_per_node)
        if ranks % nodes:
            raise UserInputError(
                f"the plan's {count(ranks, kind + ' rank')} cannot be spread evenly over "
                f"{count(nodes, node_type.name + ' node')} of {node_type.devices_per_node} devices"
            )
        if nodes > node_type.nodes:
            raise UserInputError(
                f"the plan's {count(ranks, kind + ' rank')} need {count(nodes, 'node')} of type {node_type.name}; "
                f"cluster '{cluster.name}' has {node_type.nodes}"
            )
        per_node[node_type.name] = ranks // nodes
        groups.append(NodeGroup(node_type=node_type.name, device=kind, nodes=nodes, first_replica=replicas[0],
                                replicas=len(replicas)))  # fmt: skip
    if len(set(per_node.values())) > 1:
        raise UserInputError(
            "the plan's node groups would run different numbers of ranks per node ("
            + ", ".join(f"{name}: {n}" for name, n in per_node.items()) + "); a job starts the same number on every node",
            hint="plan for node types with the same devices per node, or give each type that many devices per node",
        )
    return groups


def placement_note(groups: list[NodeGroup], hosts: list[str] | None = None) -> str:
    """The node groups in rank order, with the hosts each must be when they are named.

        >>> g = [NodeGroup(node_type="p100-vms", device="p100", nodes=1, first_replica=0, replicas=1),
        ...      NodeGroup(node_type="v100-vms", device="v100-16gb", nodes=2, first_replica=1, replicas=3)]
        >>> placement_note(g)
        'nodes in rank order: 1 p100-vms node (p100, replica 0); 2 v100-vms nodes (v100-16gb, replicas 1-3)'
        >>> placement_note(g, ["a", "b", "c"])
        'nodes in rank order: p100-vms (p100, replica 0): a; v100-vms (v100-16gb, replicas 1-3): b, c'
    """
    parts, start = [], 0
    for group in groups:
        if hosts:
            mine = hosts[start : start + group.nodes]
            parts.append(f"{group.node_type} ({group.device}, {group.replica_words()}): {', '.join(mine)}")
        else:
            parts.append(f"{count(group.nodes, group.node_type + ' node')} ({group.device}, {group.replica_words()})")
        start += group.nodes
    return "nodes in rank order: " + "; ".join(parts)


def check_cluster_runs(plan: Plan, cluster: ClusterSpec, asked: str) -> None:
    """`launch --cluster` names a cluster that can run the plan: one with its device kinds and, but
    for one host (whose ranks are processes), as many of them as the plan uses (a split plan's, per
    kind, in `node_groups`). Else the job would be written, and recorded, for nodes it does not have."""
    kinds = set(plan.chosen.replica_kinds)
    missing = sorted(kinds - set(cluster.device_kinds))
    way_out = f"leave --cluster out to run on the plan's cluster, or re-plan for this one: pipectl plan --cluster {asked} ..."
    if missing:
        raise UserInputError(
            f"--cluster {asked}: cluster '{cluster.name}' has no {' or '.join(missing)} devices, which the plan runs on "
            f"(it was made for '{plan.cluster}')",
            hint=way_out,
        )
    if cluster.local or cluster.one_host or len(kinds) > 1:  # a split plan's nodes: per kind (`node_groups`)
        return
    (kind,) = kinds
    have = sum(node.devices for node in cluster.nodes_of_kind(kind))
    if have < plan.chosen.devices:
        raise UserInputError(
            f"--cluster {asked}: cluster '{cluster.name}' has {count(have, kind + ' device')}, and the plan runs on "
            f"{plan.chosen.devices} (it was made for '{plan.cluster}')",
            hint=way_out,
        )

"""Which nodes a job runs on and how many: named (`--hosts`, `--hostfile`), counted (`--nodes`,
the elastic minimum, the plan's devices over a node's), or the Slurm allocation's; and where its
ranks meet."""

from __future__ import annotations

from pipectl.artifacts.cluster import ClusterSpec
from pipectl.artifacts.plan import Plan
from pipectl.artifacts.run import Engine, NodeGroup
from pipectl.config import given
from pipectl.errors import UserInputError
from pipectl.launch.engines import allocation_hosts
from pipectl.launch.options import LaunchOptions, read_hostfile
from pipectl.launch.placement import plan_accelerator
from pipectl.words import count


def job_nodes(plan: Plan, options: LaunchOptions, cluster: ClusterSpec | None, groups: list[NodeGroup] = ()) -> int:
    """Nodes the job spans: the node groups' of a split plan (`placement.node_groups`); 1 for
    `local`; else `--hosts`, `--nodes` or the elastic minimum if given, else the plan's devices over
    the devices per node of the cluster's node type for the plan's device (3,072 A100s on 8-GPU
    nodes: 384 nodes)."""
    devices = plan.chosen.devices
    # The devices a node of the plan's kind holds (none: the cluster is not readable here).
    per_node = [n.devices_per_node for n in (cluster.nodes_of_kind(plan.chosen.device) if cluster else [])]
    if groups:
        nodes = sum(group.nodes for group in groups)
        asked = len(options.hosts) if options.hosts else options.nodes
        if asked and asked != nodes:
            raise UserInputError(
                f"{count(asked, 'node')} given for a plan split over {count(len(groups), 'node type')} that runs on "
                + ", ".join(f"{count(g.nodes, g.node_type + ' node')}" for g in groups),
                hint="give one host per node, each kind's hosts together in this order",
            )
        return nodes
    if options.engine is Engine.LOCAL:
        nodes = options.nodes or 1
    elif options.hosts:
        nodes = len(options.hosts)
    elif options.elastic:
        nodes = options.elastic.min_nodes
    elif options.nodes:
        nodes = options.nodes
    else:
        if not per_node:
            raise UserInputError(
                f"cannot tell how many nodes the plan's {devices} x {plan.chosen.device} span: cluster "
                f"'{options.cluster or plan.cluster}' " + ("is not readable here" if cluster is None else f"has no {plan.chosen.device} nodes"),
                hint="pass --cluster NAME|PATH (the cluster file the plan was made for) or --nodes N",
            )
        nodes = -(-devices // max(per_node))
    if devices % nodes:
        raise UserInputError(f"the plan's {count(devices, 'rank')} cannot be split evenly over {count(nodes, 'node')}")
    # Local CPU ranks are as many as asked, GPUs as a node holds (a hostfile's slots too: they are
    # checked against the ranks per node apart, `check_hostfile_slots`).
    fewer = options.engine is not Engine.LOCAL or plan_accelerator(plan, cluster) == "cuda"
    if fewer and per_node and devices // nodes > max(per_node):
        # More ranks than a node has devices: every node would start that many processes on its
        # GPUs (a hostfile of 'slots=1512', torchrun's --nproc_per_node 1512).
        held = f"but each {plan.chosen.device} node of cluster '{cluster.name}' holds {max(per_node)}"
        needed = -(-devices // max(per_node))
        if options.engine is Engine.LOCAL:  # one machine, whatever --nodes says (`build_job` refuses more)
            raise UserInputError(
                f"engine local starts the plan's {count(devices, 'rank')} on this one node, {held}",
                hint=f"launch on {needed} nodes with --engine slurm or torchrun (--dry-run shows their files)",
            )
        name = "hostfile" if options.hostfile else "hosts" if options.hosts else "elastic" if options.elastic else "nodes"
        raise UserInputError(
            f"{given(options, name)}: {devices // nodes} of the plan's {count(devices, 'rank')} on each node, {held}",
            hint=f"give {needed} {'hosts' if options.hosts else 'nodes'}"
            + (", or leave the nodes out to have them counted" if name == "nodes" else ""),
        )
    return nodes


def master_address(options: LaunchOptions, nodes: int) -> str:
    """Where the ranks meet: `--master-addr`; else loopback on one node, the allocation's first
    node for slurm ('': the script asks `scontrol`), and the first of the nodes (`node_hosts`) for
    torchrun and DeepSpeed's launcher over several nodes. With several nodes and none of these,
    the launch is refused: this host's own name would let every node rendezvous with itself."""
    if options.master_addr:
        return options.master_addr
    if options.engine is Engine.SLURM or (options.engine is Engine.DEEPSPEED and not options.hosts and nodes > 1):
        return ""  # the script asks scontrol; DeepSpeed's launcher refuses without its hosts (`deepspeed_command`)
    if options.hosts:
        return options.hosts[0] if nodes > 1 or options.elastic or options.engine is Engine.DEEPSPEED else "127.0.0.1"
    if nodes > 1 or options.elastic:
        job = (f"an elastic {options.engine.value} job ({options.elastic.min_nodes}:{options.elastic.max_nodes} nodes)"
               if options.elastic else f"a {options.engine.value} job on {count(nodes, 'node')}")
        raise UserInputError(
            f"{job} needs its rendezvous head: no --master-addr, "
            "--hosts or --hostfile was given and launch does not run inside a Slurm allocation",
            hint="pass --master-addr NODE (the first node, where the rendezvous runs), --hosts n1,n2,... or "
            "--hostfile FILE; or use --engine slurm",
        )
    return "127.0.0.1"


def node_hosts(options: LaunchOptions) -> list[str] | None:
    """The job's nodes, in order: `--hosts`, else `--hostfile`'s, else the nodes of the Slurm
    allocation launch runs in (`scontrol show hostnames $SLURM_JOB_NODELIST`), else None."""
    if options.hosts:
        return options.hosts
    if options.hostfile:
        return [host for host, _ in read_hostfile(options.hostfile)]
    return allocation_hosts() or None


def check_named_nodes(options: LaunchOptions) -> None:
    """Nodes named twice (--hosts and --hostfile), or for a Slurm job (whose nodes Slurm gives it),
    are refused: one of them was dropped without a word."""
    if options.hosts and options.hostfile:
        raise UserInputError(f"{given(options, 'hosts')} and {given(options, 'hostfile')} both name the nodes",
                             hint="give one of them")
    if options.engine is Engine.SLURM and (options.hosts or options.hostfile):
        raise UserInputError(f"{given(options, 'hosts' if options.hosts else 'hostfile')}: a Slurm job runs on the "
                             "nodes Slurm allocates it, not on named ones",
                             hint="leave it out (--nodes N sets how many), or launch with --engine torchrun or deepspeed")


def check_hostfile_slots(options: LaunchOptions, ranks_per_node: int) -> None:
    """Every node of `--hostfile` has the job's ranks per node as its slots."""
    if not options.hostfile:
        return
    wrong = [(host, slots) for host, slots in read_hostfile(options.hostfile) if slots != ranks_per_node]
    if wrong:
        host, slots = wrong[0]
        raise UserInputError(
            f"{given(options, 'hostfile')} gives {host} slots={slots}; the plan runs {count(ranks_per_node, 'rank')} on "
            "each node",
            hint=f"give every node slots={ranks_per_node}",
        )

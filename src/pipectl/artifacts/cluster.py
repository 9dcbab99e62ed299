"""Cluster descriptions (configs/clusters/*.yaml): node types, counts, prices, link figures."""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from pipectl.artifacts.base import Artifact, Strict

# Bounds of a figure in a cluster file: far beyond real hardware, close enough that the planner's
# sums stay finite (the catalog, pipectl.catalog, holds its own figures to the same bounds).
MIN_GBYTES_PER_SECOND, MAX_GBYTES_PER_SECOND = 1e-6, 1e6  # 1 kB/s .. 1 PB/s
MAX_LATENCY_US = 1e9  # 1000 s
MAX_PRICE_PER_DEVICE_HOUR = 1e6  # USD
# Devices the planner searches over (it plans every count up to the total): 2**17 = 131,072, more
# accelerators than the largest published training clusters hold.
MAX_DEVICES = 2**17
MAX_DEVICES_PER_NODE = 4096
MAX_COMPUTE_SLOWDOWN = 1000.0
SLURM_VALUE = r"^[A-Za-z0-9_.:,@%+=/-]*$"  # what an #SBATCH value may hold here: no spaces, quotes or '$'
# sbatch --time's formats (sbatch(1)): minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds; or no limit.
VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SLURM_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|unlimited|infinite", re.IGNORECASE)


def slurm_time_seconds(value: str) -> int | None:
    """The time limit an sbatch `--time` value gives, in seconds; None for no limit. Slurm counts
    whole minutes, rounding seconds up, and takes 0 for no limit (sbatch(1), "--time").

        >>> [slurm_time_seconds(v) for v in ("1", "1:30", "1:00:00", "2-0", "2-03:04", "1-0:0:1", "0", "UNLIMITED")]
        [60, 120, 3600, 172800, 183840, 86460, None, None]
    """
    if not SLURM_TIME.fullmatch(value):
        raise ValueError(f"{value!r} is not a Slurm time")
    if value.isalpha():  # unlimited, infinite
        return None
    days, _, clock = value.rpartition("-")
    parts = [int(part) for part in clock.split(":")]
    if days:  # days-hours[:minutes[:seconds]]
        hours, minutes, seconds = (parts + [0, 0])[:3]
    elif len(parts) == 3:  # hours:minutes:seconds
        hours, minutes, seconds = parts
    else:  # minutes[:seconds]
        hours, (minutes, seconds) = 0, (parts + [0])[:2]
    total_minutes = (int(days or 0) * 24 + hours) * 60 + minutes + (1 if seconds else 0)
    return total_minutes * 60 or None


class LinkSpec(Strict):
    """Link figures that override the device catalog, or a links.json to read them from."""

    intra_node_bandwidth_gbytes_per_second: float | None = Field(
        default=None, ge=MIN_GBYTES_PER_SECOND, le=MAX_GBYTES_PER_SECOND
    )
    intra_node_allreduce_bandwidth_gbytes_per_second: float | None = Field(
        default=None, ge=MIN_GBYTES_PER_SECOND, le=MAX_GBYTES_PER_SECOND,
        description="NCCL's bus bandwidth of a collective inside a node, GB/s, where it is not the link's figure "
        "above (which then prices transfers only); default: that figure where it is set, else a links_file's "
        "all-reduce fit, else the catalog's.",
    )
    intra_node_latency_us: float | None = Field(default=None, ge=0, le=MAX_LATENCY_US)
    inter_node_bandwidth_gbytes_per_second: float | None = Field(
        default=None, ge=MIN_GBYTES_PER_SECOND, le=MAX_GBYTES_PER_SECOND
    )
    inter_node_allreduce_bandwidth_gbytes_per_second: float | None = Field(
        default=None, ge=MIN_GBYTES_PER_SECOND, le=MAX_GBYTES_PER_SECOND,
        description="NCCL's bus bandwidth of a collective across nodes, GB/s per device, while every device of "
        "the node takes part in one: a measured all-reduce over whole nodes (nccl-tests' or all_reduce_bench's "
        "busbw) divided by the devices per node. Default: the link's figure above (which then prices transfers "
        "only), else a links_file's all-reduce fit, else the catalog's.",
    )
    inter_node_latency_us: float | None = Field(default=None, ge=0, le=MAX_LATENCY_US)
    links_file: str | None = Field(
        default=None, description="Path to a links.json from `pipectl profile links` (relative to the YAML)."
    )


class NodeSlurm(Strict):
    """Which of a Slurm cluster's nodes are this node type: the component of a heterogeneous job
    that `launch --engine slurm` writes for a plan split over device kinds."""

    partition: str | None = Field(default=None, pattern=SLURM_VALUE, description="#SBATCH --partition of this type's nodes.")
    constraint: str | None = Field(default=None, pattern=SLURM_VALUE, description="#SBATCH --constraint selecting them, e.g. 'v100'.")


class NodeType(Strict):
    """A group of identical nodes."""

    name: str = Field(description="Name of this node group, e.g. 'a100-nodes'.")
    device: str = Field(description="Device kind, a key of the device catalog (configs/devices.yaml).")
    devices_per_node: int = Field(gt=0, le=MAX_DEVICES_PER_NODE, description="Accelerators (or CPU ranks) per node.")
    nodes: int = Field(gt=0, le=MAX_DEVICES, description="Nodes of this type available.")
    price_per_device_hour_on_demand: float = Field(default=0.0, ge=0, le=MAX_PRICE_PER_DEVICE_HOUR, description="USD per device-hour.")
    price_per_device_hour_spot: float | None = Field(default=None, ge=0, le=MAX_PRICE_PER_DEVICE_HOUR, description="USD, spot/pre-emptible.")
    links: LinkSpec = Field(default_factory=LinkSpec, description="Overrides of the catalog's link figures.")
    compute_slowdown: float = Field(
        default=1.0, ge=1.0, le=MAX_COMPUTE_SLOWDOWN,
        description="Emulate a slower device kind on these nodes: every layer's forward and backward takes this "
        "many times its time (the worker waits out the difference), and the planner prices it so, as the kind "
        "'<device>-slowed-<k>x'. For rehearsing a heterogeneous plan on one kind of hardware; 1: the device itself.",
    )
    slurm: NodeSlurm = Field(
        default_factory=NodeSlurm,
        description="Partition and constraint of these nodes in Slurm (over the cluster's slurm section).",
    )

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def kind(self) -> str:
        """The device kind the planner groups nodes by: the catalog device, or its emulated slower kind.

        >>> NodeType(name="slow", device="cpu", devices_per_node=1, nodes=1, compute_slowdown=2.5).kind
        'cpu-slowed-2.5x'
        """
        return self.device if self.compute_slowdown == 1.0 else emulated_kind(self.device, self.compute_slowdown)


def emulated_kind(device: str, slowdown: float) -> str:
    """The name of `device` slowed `slowdown` times (`NodeType.compute_slowdown`)."""
    return f"{device}-slowed-{slowdown:g}x"



class SlurmSpec(Strict):
    """What `launch --engine slurm` writes into the sbatch script that the plan cannot know.

    Every field is unset (None) unless given, so that a config file's `[slurm]` table and
    `launch --partition/--account/--time-limit` win over the cluster file's values key by key.
    """

    DEFAULT_SIGNAL_SECONDS: ClassVar[int] = 120
    DEFAULT_REQUEUE_LIMIT: ClassVar[int] = 3

    partition: str | None = Field(default=None, pattern=SLURM_VALUE, description="#SBATCH --partition.")
    account: str | None = Field(default=None, pattern=SLURM_VALUE, description="#SBATCH --account.")
    time: str | None = Field(
        default=None, description="#SBATCH --time: minutes, [days-]hours:minutes:seconds, e.g. '2-00:00:00'."
    )
    qos: str | None = Field(default=None, pattern=SLURM_VALUE, description="#SBATCH --qos.")
    constraint: str | None = Field(default=None, pattern=SLURM_VALUE, description="#SBATCH --constraint.")
    cpus_per_rank: int | None = Field(
        default=None, gt=0, le=1024, description="CPU cores per rank (--cpus-per-task = ranks per node x this; default 8 on GPUs, 1 on CPU)."
    )
    container_image: str | None = Field(
        default=None, pattern=SLURM_VALUE, description="srun --container-image (pyxis/enroot), when the job runs in a container."
    )
    network_interface: str | None = Field(
        default=None, pattern=SLURM_VALUE, description="NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME for the ranks, e.g. 'ib0'."
    )
    python: str | None = Field(
        default=None,
        pattern=SLURM_VALUE,
        description="The Python on the compute nodes with pipectl installed (default: 'python' from the set-up "
        "lines or in the container, or without either the one running launch).",
    )
    setup: list[str] | None = Field(
        default=None,
        max_length=256,
        description="Shell lines run before the ranks start, in order, as written: module loads, "
        "'source VENV/bin/activate', 'conda activate ENV'.",
    )
    env: dict[str, str] | None = Field(
        default=None,
        max_length=256,
        description="Variables exported for the ranks (NCCL_*, UCX_*, ...); values are quoted, not expanded.",
    )
    container_mounts: list[str] | None = Field(
        default=None,
        max_length=64,
        description="srun --container-mounts beside the run directory's, e.g. '/data:/data'.",
    )
    reservation: str | None = Field(default=None, pattern=SLURM_VALUE, description="#SBATCH --reservation.")
    signal_seconds: int | None = Field(
        default=None,
        ge=10,
        le=24 * 3600,
        description="Seconds before the time limit the job is told to checkpoint and requeue itself: at least a "
        "step and a checkpoint write (default 120).",
    )
    requeue_limit: int | None = Field(
        default=None,
        ge=0,
        le=10_000,
        description="Requeues in a row without a newer checkpoint before the job stops requeueing (default 3; 0: "
        "never requeue itself).",
    )

    @field_validator("setup")
    @classmethod
    def _one_line_each(cls, value: list[str] | None) -> list[str] | None:
        for line in value or []:
            if not line.strip() or "\n" in line or "\r" in line or "\0" in line:
                raise ValueError(f"{line!r} is not one non-empty shell line")
        return value

    @field_validator("env")
    @classmethod
    def _variable_names(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for name, text in (value or {}).items():
            if not VARIABLE_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not an environment variable name (letters, digits, '_')")
            if "\0" in text or "\n" in text:
                raise ValueError(f"the value of {name} holds a line break or a NUL")
        return value

    @field_validator("container_mounts")
    @classmethod
    def _mounts(cls, value: list[str] | None) -> list[str] | None:
        for mount in value or []:
            if not re.fullmatch(SLURM_VALUE, mount) or not mount or "," in mount:
                raise ValueError(f"{mount!r} is not one mount SRC:DST[:FLAGS] without blanks, quotes, '$' or ','")
        return value

    @field_validator("time")
    @classmethod
    def _slurm_time(cls, value: str | None) -> str | None:
        if value is not None and not SLURM_TIME.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a Slurm time: minutes, minutes:seconds, hours:minutes:seconds or "
                "days-hours[:minutes[:seconds]], e.g. 2-00:00:00"
            )
        return value


class ClusterSpec(Artifact):
    """A cluster: one or more node types. Several device kinds make it heterogeneous."""

    schema_version: Literal[1] = 1
    name: str = Field(description="Cluster name.")
    description: str = Field(default="", description="Free text.")
    node_types: list[NodeType] = Field(min_length=1, description="The node groups.")
    pricing: Literal["on_demand", "spot"] = Field(default="on_demand", description="Which price to plan with.")
    local: bool = Field(
        default=False,
        description="Local CPU ranks on this machine: `--devices N` sets how many (devices_per_node is the default).",
    )
    inter_node_links: LinkSpec = Field(default_factory=LinkSpec, description="Links between node groups.")
    # The links files this cluster names, read when it was loaded (`cluster.load_cluster`): path ->
    # LinksProfile. Not part of the file: pricing a layout then reads nothing from disk.
    _links_read: dict[str, Any] = PrivateAttr(default_factory=dict)
    one_host: bool = Field(
        default=False,
        description="Every node type is one node of ranks on one and the same machine (a heterogeneous cluster "
        "emulated with compute_slowdown): their ranks talk as inside a node and share its cores.",
    )
    slurm: SlurmSpec = Field(default_factory=SlurmSpec, description="Batch-system facts for `launch --engine slurm`.")

    @model_validator(mode="after")
    def _unique_names(self) -> "ClusterSpec":
        names = [n.name for n in self.node_types]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"node type names must be unique, repeated: {', '.join(dupes)}")
        if self.one_host and any(n.nodes != 1 for n in self.node_types):
            raise ValueError("a one_host cluster is one machine: every node type has nodes: 1")
        if self.total_devices > MAX_DEVICES:
            raise ValueError(f"the cluster has {self.total_devices} devices, more than the {MAX_DEVICES} pipectl plans for")
        return self

    @property
    def total_devices(self) -> int:
        return sum(n.devices for n in self.node_types)

    @property
    def device_kinds(self) -> list[str]:
        """The kinds the planner tells apart (`NodeType.kind`): catalog devices, and emulated slower ones."""
        return sorted({n.kind for n in self.node_types})

    def nodes_of_kind(self, kind: str) -> list[NodeType]:
        return [n for n in self.node_types if n.kind == kind]

    @property
    def heterogeneous(self) -> bool:
        return len(self.device_kinds) > 1

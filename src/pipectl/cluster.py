"""Clusters: load a cluster description and resolve the link figures the planner uses.

A link figure comes from the first of these that has it (most specific first):

1. the cluster YAML: the node type's `links`, then (inter-node only) the cluster's `inter_node_links`;
2. a links.json measured by `pipectl profile links` (`links_file` of the node type, then of the
   cluster's `inter_node_links`), which also supplies the all-reduce fit and the p2p jitter;
3. the device catalog (configs/devices.yaml).

All figures are per device and per direction (see configs/devices.yaml), converted here to SI units
(seconds, bytes per second) so that no caller converts µs or GB/s again.

    >>> cluster = load_cluster("a100-8x8")
    >>> links = resolve_links(cluster, "a100-nodes")
    >>> links.inter_bandwidth_bytes_per_second
    25000000000.0
    >>> round(links.inter.seconds(100e6) * 1e3, 3)   # 100 MB across nodes: 5 µs + 100e6 / 25e9 s
    4.005
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from pipectl.artifacts.calibration import RunsCalibration
from pipectl.artifacts.cluster import MAX_DEVICES_PER_NODE, ClusterSpec, LinkSpec, NodeType
from pipectl.artifacts.plan import Plan
from pipectl.artifacts.profile import HostState, LinkClass, LinkClassFit, LinksProfile, ModelProfile, ProfileSource
from pipectl.catalog import DeviceSpec, get_device, load_catalog
from pipectl.errors import PipectlError, UserInputError
from pipectl.io import load_model, sha256_file
from pipectl.paths import resolve_config
from pipectl.words import count



def _microseconds_to_seconds(value: float) -> float:
    return value / 1e6  # division keeps 90 µs -> 9e-05 exact (90 * 1e-6 is not)


def _gigabytes_to_bytes(value: float) -> float:
    return value * 1e9

# Where a resolved figure came from, for explanations ("inter bandwidth 25 GB/s from the cluster YAML").
FROM_CLUSTER = "cluster"
FROM_LINKS_FILE = "links.json"
FROM_CATALOG = "catalog"


@dataclass(frozen=True)
class LinkCost:
    """One link class: time(bytes) = latency + bytes / bandwidth (+ jitter as a spread)."""

    latency_seconds: float
    bandwidth_bytes_per_second: float
    jitter_seconds: float = 0.0

    def seconds(self, message_bytes: float) -> float:
        """Point-to-point time of one message (the alpha-beta model; Hockney 1994)."""
        return self.latency_seconds + message_bytes / self.bandwidth_bytes_per_second

    def ring_allreduce_seconds(self, message_bytes: float, ring_size: int) -> float:
        """Ring all-reduce of `message_bytes` over `ring_size` ranks: 2(D-1) steps of bytes/D each.

        Patarasuk & Yuan 2009 ("Bandwidth optimal all-reduce algorithms"); the same model as
        `LinkClassFit`. One rank needs no communication:

            latency 5 µs, 25 GB/s, 1 GB over 8 ranks: 2*7*(5e-6 + 1e9/8/25e9) = 0.070 s
        """
        if ring_size <= 1:
            return 0.0
        steps = 2 * (ring_size - 1)
        return steps * (self.latency_seconds + message_bytes / ring_size / self.bandwidth_bytes_per_second)


@dataclass(frozen=True)
class ResolvedLinks:
    """Link costs of one node type, in seconds and bytes per second, after the precedence above.

    `intra_*` is between devices of one node, `inter_*` between nodes; `allreduce_*` are the
    ring all-reduce per-hop latency and bus bandwidth (equal to the p2p figures unless a
    links.json measured them separately). `sources` names where each figure came from.
    """

    node_type: str
    device: str
    intra_latency_seconds: float
    intra_bandwidth_bytes_per_second: float
    inter_latency_seconds: float
    inter_bandwidth_bytes_per_second: float
    allreduce_intra_latency_seconds: float
    allreduce_intra_bandwidth_bytes_per_second: float
    allreduce_inter_latency_seconds: float
    allreduce_inter_bandwidth_bytes_per_second: float
    intra_jitter_seconds: float = 0.0
    inter_jitter_seconds: float = 0.0
    sources: Mapping[str, str] = field(default_factory=dict)

    @property
    def intra(self) -> LinkCost:
        return LinkCost(self.intra_latency_seconds, self.intra_bandwidth_bytes_per_second, self.intra_jitter_seconds)

    @property
    def inter(self) -> LinkCost:
        return LinkCost(self.inter_latency_seconds, self.inter_bandwidth_bytes_per_second, self.inter_jitter_seconds)

    @property
    def allreduce_intra(self) -> LinkCost:
        return LinkCost(self.allreduce_intra_latency_seconds, self.allreduce_intra_bandwidth_bytes_per_second)

    @property
    def allreduce_inter(self) -> LinkCost:
        return LinkCost(self.allreduce_inter_latency_seconds, self.allreduce_inter_bandwidth_bytes_per_second)


# --- loading -----------------------------------------------------------------------------------


def load_cluster(
    name_or_path: str | os.PathLike[str], *, links_copies: Mapping[str, LinksProfile] | None = None
) -> ClusterSpec:
    """A shipped cluster name (`local`, `a100-8x8`) or a YAML path -> validated `ClusterSpec`.

    Checks what the schema alone cannot: every device kind is in the catalog, every `links_file`
    exists (a relative one is taken relative to the YAML's folder and returned absolute), and a
    spot-priced cluster has spot prices. `links_copies`: links files as a plan read them
    (`Plan.links_copies`), which stand in for those no longer readable.
    """
    copies = links_copies or {}
    path = resolve_config(name_or_path, "clusters")
    cluster = _checked(_with_absolute_links_files(load_model(ClusterSpec, path), path.resolve().parent),
                       source=str(path), kept=copies)  # fmt: skip
    return _with_links_copies(with_links_read(cluster), copies)


def with_links_read(cluster: ClusterSpec) -> ClusterSpec:
    """`cluster` holding the links files it names, read now: a cluster is read once, when it is
    loaded, so the planner prices thousands of layouts without touching a file (`resolve_links`)."""
    read: dict[str, LinksProfile] = {}
    for links in [node_type.links for node_type in cluster.node_types] + [cluster.inter_node_links]:
        if links.links_file is not None and links.links_file not in read:
            try:
                read[links.links_file] = _read_links_file(links.links_file)
            except PipectlError:  # not readable: refused where its figures are needed, naming it
                continue
    loaded = cluster.model_copy()
    loaded._links_read = read
    return loaded


def links_read(cluster: ClusterSpec) -> dict[str, LinksProfile]:
    """The links files `cluster` held when it was loaded, by absolute path (`with_links_read`)."""
    return dict(cluster._links_read)


def _with_links_copies(cluster: ClusterSpec, copies: Mapping[str, LinksProfile]) -> ClusterSpec:
    """`cluster` with the plan's copy of each links file it names that is no longer readable."""
    named = {links.links_file for links in [n.links for n in cluster.node_types] + [cluster.inter_node_links]}
    missing = {path: copies[path] for path in named if path in copies and path not in cluster._links_read}
    if not missing:
        return cluster
    loaded = cluster.model_copy()
    loaded._links_read = {**cluster._links_read, **missing}
    return loaded


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask; all of them off Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def host_state(timing_spread: float | None = None) -> HostState | None:
    """This host's cores and 1-minute load average now; None where the system has no load average."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # pragma: no cover - not Unix
        return None
    return HostState(cores=usable_cores(), load_average=round(load, 2), timing_spread=timing_spread)


# A host this many times as contended as when the profile was measured is worth a word: below it,
# the noise of one machine's timings (benchmarks/machine_noise.py) hides the difference.
BUSIER = 1.5


def busier_note(profiled: HostState | None, now: HostState | None) -> str | None:
    """A line for the user when the host is much busier (or much quieter) than when its profile was
    measured: the predictions scale with how much of each core a rank gets.

        >>> quiet, busy = HostState(cores=2, load_average=0.2), HostState(cores=2, load_average=4.6)
        >>> busier_note(quiet, busy)
        'the host is 2.3x busier than when profiled: 2.3 runnable tasks a core now (load 4.6 on 2 cores), 1 then (load 0.2); predictions assume the profiled host; re-profile, or fit the profile to runs with pipectl calibrate'
        >>> busier_note(quiet, quiet) is None
        True
    """
    if profiled is None or now is None:
        return None
    ratio = now.contention / profiled.contention
    if 1 / BUSIER < ratio < BUSIER:
        return None
    words = f"{ratio:.1f}x busier" if ratio > 1 else f"{1 / ratio:.1f}x quieter"
    return (
        # The ratio is of tasks per core (at least one: a task alone has its core), shown beside each load.
        f"the host is {words} than when profiled: {now.contention:.2g} runnable tasks a core now (load "
        f"{now.load_average:g} on {count(now.cores, 'core')}), {profiled.contention:.2g} then (load "
        f"{profiled.load_average:g}); predictions assume the profiled host; re-profile, or fit the profile to runs "
        "with pipectl calibrate"
    )


def local_cluster(devices: int, base: ClusterSpec | None = None) -> ClusterSpec:
    """The local cluster (`configs/clusters/local.yaml`, or `base`) with `devices` CPU ranks.

        >>> local_cluster(4).total_devices
        4
    """
    cluster = base if base is not None else load_cluster("local")
    if not cluster.local:
        raise UserInputError(f"cluster '{cluster.name}' is not local: its device count is fixed by its nodes")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise UserInputError(f"a local cluster needs at least 1 device, got {devices!r}")
    if devices > MAX_DEVICES_PER_NODE:
        raise UserInputError(f"a local cluster is one machine: {devices} devices is more than {MAX_DEVICES_PER_NODE}")
    node_type = cluster.node_types[0].model_copy(update={"devices_per_node": devices, "nodes": 1})
    return cluster.model_copy(update={"node_types": [node_type]})


def plan_cluster_source(plan: Plan) -> str:
    """What a plan's cluster is read from: its YAML file by absolute path, else its shipped name."""
    return plan.cluster_file or plan.cluster


def calibrated_cluster(cluster: ClusterSpec, calibration: RunsCalibration) -> ClusterSpec:
    """`cluster` with the calibration's links on its node types of the calibration's device,
    as a cluster YAML's `links:` would set them (the others as they are)."""
    node_types = [
        node_type.model_copy(update={"links": node_type.links.model_copy(update=calibration.terms.links())})
        if node_type.device == calibration.device else node_type
        for node_type in cluster.node_types
    ]  # fmt: skip
    return cluster.model_copy(update={"node_types": node_types})


def load_calibration_for(
    path: str | os.PathLike[str], profiles: list[tuple[str, ModelProfile]], cluster: ClusterSpec,
    *, said: str | None = None,
) -> RunsCalibration:
    """The calibration `plan` or `simulate --calibration` names, refused where a profile derived
    for its device was derived with the catalog's figures (or another calibration's): its links
    would then price one plan with two views of one GPU. Refused too on a cluster without its
    device, where it would change nothing, without a word. `said`: how the user gave it (a config
    file's key, the plan's own), for the messages; `--calibration PATH` by default."""
    said = said or f"--calibration {path}"
    calibration = load_model(RunsCalibration, path)
    if calibration.device not in cluster.device_kinds:
        raise UserInputError(
            f"{said} was fitted to {calibration.device} runs, and cluster '{cluster.name}' has no "
            f"{calibration.device} (it has {', '.join(cluster.device_kinds)}): it would change nothing",
            hint="leave the calibration out, or plan on a cluster of that device",
        )
    sha = sha256_file(path)
    for name, profile in profiles:
        derived_for_it = profile.source is ProfileSource.DERIVED and profile.device == calibration.device
        if derived_for_it and profile.calibration_sha256 != sha:
            raise UserInputError(
                f"{name} was derived for {profile.device} with "
                + ("another calibration" if profile.calibration_sha256 else "the catalog's figures")
                + f", not with {said}",
                hint=f"derive it with them: pipectl profile MODEL --derive --device {profile.device} --calibration {path}",
            )
    return calibration


def check_profiles_calibrated_alike(profiles: list[tuple[str, ModelProfile]]) -> None:
    """Without `--calibration`, a profile derived with one prices the GPU with fitted figures and
    the links with the catalog's: refused, as the opposite mix is (`load_calibration_for`)."""
    for name, profile in profiles:
        if profile.source is ProfileSource.DERIVED and profile.calibration_sha256:
            raise UserInputError(
                f"{name} was derived for {profile.device} with a calibration (sha256 {profile.calibration_sha256[:12]}), "
                "and no --calibration is given: its links would be the catalog's",
                hint="plan with the same --calibration FILE, or derive the profile without one",
            )


def plan_cluster_file(plan: Plan) -> ClusterSpec:
    """The cluster a plan names, with the calibration it was planned with (`plan --calibration`):
    its file where it still is (edited or not: the cluster as it stands), else the copy the plan
    keeps of it."""
    if plan.cluster_file is not None and plan.cluster_copy is not None and not Path(plan.cluster_file).is_file():
        cluster = _with_links_copies(with_links_read(plan.cluster_copy), plan.links_copies)  # links files as they stand
    else:
        cluster = load_cluster(plan_cluster_source(plan), links_copies=plan.links_copies)
    calibration = plan_calibration(plan)
    return cluster if calibration is None else calibrated_cluster(cluster, calibration)


def plan_calibration(plan: Plan) -> RunsCalibration | None:
    """The calibration a plan was planned with (`plan --calibration`): its file where it still is,
    else the copy the plan keeps of it; None without one."""
    if plan.calibration_file is None:
        return None
    gone = plan.calibration_copy is not None and not Path(plan.calibration_file).is_file()
    return plan.calibration_copy if gone else load_model(RunsCalibration, plan.calibration_file)


def plan_files_changed(plan: Plan) -> list[str]:
    """The plan's cluster and calibration files that now differ from the copies it kept: re-pricing
    reads them as they stand (an edit is meant to count), and says so, since the figures then differ
    from the plan's for a reason no flag of the command shows."""
    changed = []
    for path, copy, read in (
        (plan.cluster_file, plan.cluster_copy, load_cluster),
        *((links, copy, _read_links_file) for links, copy in plan.links_copies.items()),
        (plan.calibration_file, plan.calibration_copy, lambda file: load_model(RunsCalibration, file)),
    ):
        if path is None or copy is None or not Path(path).is_file():
            continue
        try:
            now = read(path)
        except UserInputError:
            continue  # unreadable: re-pricing names why
        if now.model_dump() != copy.model_dump():  # the fields: a loaded cluster also holds its links files
            changed.append(path)
    return changed


def plan_cluster_spec(plan: Plan) -> ClusterSpec:
    """The cluster a plan was made for: its cluster file (with its calibration), and for the local
    cluster as many CPU ranks as the plan was made for (`plan --devices`) or its layout uses,
    whichever is more (a plan resized onto more ranks than it was made for). Re-pricing a local
    plan of four ranks on the file's default of two would put two of them on another node."""
    cluster = plan_cluster_file(plan)
    if not cluster.local:
        return cluster
    devices = max(plan.request.devices or cluster.total_devices, plan.chosen.devices)
    return cluster if devices == cluster.total_devices else local_cluster(devices, base=cluster)


def _with_absolute_links_files(cluster: ClusterSpec, folder: Path) -> ClusterSpec:
    def absolute(links: LinkSpec) -> LinkSpec:
        if links.links_file is None or Path(links.links_file).is_absolute():
            return links
        return links.model_copy(update={"links_file": str(folder / links.links_file)})

    node_types = [n.model_copy(update={"links": absolute(n.links)}) for n in cluster.node_types]
    return cluster.model_copy(update={"node_types": node_types, "inter_node_links": absolute(cluster.inter_node_links)})


def _checked(cluster: ClusterSpec, *, source: str, kept: Mapping[str, LinksProfile] | None = None) -> ClusterSpec:
    catalog = load_catalog()
    for node_type in cluster.node_types:
        if node_type.device not in catalog:
            raise UserInputError(
                f"{source}: node type '{node_type.name}' uses unknown device kind '{node_type.device}'",
                hint=f"known device kinds: {', '.join(sorted(catalog))}",
            )
        if cluster.pricing == "spot" and node_type.price_per_device_hour_spot is None:
            raise UserInputError(
                f"{source}: cluster pricing is 'spot' but node type '{node_type.name}' has no "
                "price_per_device_hour_spot"
            )
    if cluster.local and (len(cluster.node_types) != 1 or cluster.node_types[0].nodes != 1):
        raise UserInputError(f"{source}: a local cluster is one machine: one node type with nodes: 1")
    for links in [cluster.inter_node_links, *(n.links for n in cluster.node_types)]:
        if links.links_file is not None and not Path(links.links_file).is_file() and links.links_file not in (kept or {}):
            raise UserInputError(f"{source}: links_file not found: {links.links_file}")
    return cluster


# --- look-ups ----------------------------------------------------------------------------------


def node_type_named(cluster: ClusterSpec, name: str) -> NodeType:
    for node_type in cluster.node_types:
        if node_type.name == name:
            return node_type
    known = ", ".join(n.name for n in cluster.node_types)
    raise UserInputError(f"cluster '{cluster.name}' has no node type '{name}'", hint=f"node types: {known}")


def device_of(node_type: NodeType) -> DeviceSpec:
    """The catalog entry of a node type's device."""
    return get_device(node_type.device)


def price_per_device_hour(cluster: ClusterSpec, node_type: NodeType | str) -> float:
    """USD per device-hour at the cluster's pricing (spot or on-demand)."""
    if isinstance(node_type, str):
        node_type = node_type_named(cluster, node_type)
    if cluster.pricing == "spot" and node_type.price_per_device_hour_spot is not None:
        return node_type.price_per_device_hour_spot
    return node_type.price_per_device_hour_on_demand


def _links_of(cluster: ClusterSpec, path: str | None) -> LinksProfile | None:
    """A links file the cluster names: as read when it was loaded; read now only for a cluster
    built in code (`local_cluster`, tests) rather than loaded."""
    if path is not None and path in cluster._links_read:
        return cluster._links_read[path]
    return _read_links_file(path)


def _read_links_file(path: str | None) -> LinksProfile | None:
    if path is None:
        return None
    if not Path(path).is_file():
        raise UserInputError(f"links_file not found: {path}")
    return _read_links_file_cached(str(Path(path).resolve()), Path(path).stat().st_mtime_ns)


@lru_cache(maxsize=16)
def _read_links_file_cached(path: str, modified_ns: int) -> LinksProfile:
    # Cached by path and modification time: the planner resolves links for many candidates.
    return load_model(LinksProfile, path)


def _fit(links_files: list[LinksProfile | None], link_class: LinkClass) -> LinkClassFit | None:
    for links in links_files:
        if links is not None and (fit := links.fit(link_class)) is not None:
            return fit
    return None


def _first(values: list[float | None]) -> float | None:
    return next((value for value in values if value is not None), None)


def _pick(
    name: str,
    overrides: list[float | None],
    fit_p2p: float | None,
    fit_allreduce: float | None,
    catalog_value: float,
    to_si: Callable[[float], float],
    sources: dict[str, str],
    catalog_allreduce: float | None = None,
    allreduce_override: float | None = None,
) -> tuple[float, float]:
    """(p2p value, all-reduce value) in SI units from the first source that has the figure; the
    catalog's all-reduce figure is `catalog_allreduce` where it has one (a measured bus bandwidth),
    else its p2p figure. `allreduce_override` (a cluster's own all-reduce figure) replaces the
    all-reduce value whatever the p2p value's source."""
    p2p = allreduce = None
    for value in overrides:
        if value is not None:
            sources[name] = FROM_CLUSTER
            p2p, allreduce = to_si(value), to_si(value)
            break
    else:
        if fit_p2p is not None and fit_allreduce is not None:
            sources[name] = FROM_LINKS_FILE
            p2p, allreduce = fit_p2p, fit_allreduce
        else:
            sources[name] = FROM_CATALOG
            p2p = to_si(catalog_value)
            allreduce = to_si(catalog_value if catalog_allreduce is None else catalog_allreduce)
    if allreduce_override is not None:
        sources[f"allreduce_{name}"] = FROM_CLUSTER
        allreduce = to_si(allreduce_override)
    return p2p, allreduce


def resolve_links(cluster: ClusterSpec, node_type: NodeType | str) -> ResolvedLinks:
    """The link costs of one node type: cluster YAML override > links.json > catalog.

    A figure set in the YAML replaces both the p2p and the all-reduce figure of that link class,
    except that `intra_node_allreduce_bandwidth_gbytes_per_second` and
    `inter_node_allreduce_bandwidth_gbytes_per_second` replace the all-reduce figure of their class
    whatever the rest; a links.json supplies its p2p fit, its all-reduce fit and its
    measured jitter.
    """
    if isinstance(node_type, str):
        node_type = node_type_named(cluster, node_type)
    device = device_of(node_type)
    own, shared = node_type.links, cluster.inter_node_links
    intra_fit = _fit([_links_of(cluster, own.links_file)], LinkClass.INTRA_NODE)
    inter_fit = _fit([_links_of(cluster, own.links_file), _links_of(cluster, shared.links_file)], LinkClass.INTER_NODE)
    sources: dict[str, str] = {}

    intra_latency, allreduce_intra_latency = _pick(
        "intra_latency",
        [own.intra_node_latency_us],
        intra_fit.p2p_latency_seconds if intra_fit else None,
        intra_fit.allreduce_latency_seconds if intra_fit else None,
        device.intra_node_latency_us,
        _microseconds_to_seconds,
        sources,
    )
    intra_bandwidth, allreduce_intra_bandwidth = _pick(
        "intra_bandwidth",
        [own.intra_node_bandwidth_gbytes_per_second],
        intra_fit.p2p_bandwidth_bytes_per_second if intra_fit else None,
        intra_fit.allreduce_bandwidth_bytes_per_second if intra_fit else None,
        device.intra_node_bandwidth_gbytes_per_second,
        _gigabytes_to_bytes,
        sources,
        catalog_allreduce=device.intra_node_allreduce_bandwidth_gbytes_per_second,
        allreduce_override=own.intra_node_allreduce_bandwidth_gbytes_per_second,
    )
    inter_latency, allreduce_inter_latency = _pick(
        "inter_latency",
        [own.inter_node_latency_us, shared.inter_node_latency_us],
        inter_fit.p2p_latency_seconds if inter_fit else None,
        inter_fit.allreduce_latency_seconds if inter_fit else None,
        device.inter_node_latency_us,
        _microseconds_to_seconds,
        sources,
    )
    inter_bandwidth, allreduce_inter_bandwidth = _pick(
        "inter_bandwidth",
        [own.inter_node_bandwidth_gbytes_per_second, shared.inter_node_bandwidth_gbytes_per_second],
        inter_fit.p2p_bandwidth_bytes_per_second if inter_fit else None,
        inter_fit.allreduce_bandwidth_bytes_per_second if inter_fit else None,
        device.inter_node_bandwidth_gbytes_per_second,
        _gigabytes_to_bytes,
        sources,
        catalog_allreduce=device.inter_node_allreduce_bandwidth_gbytes_per_second,
        allreduce_override=_first(
            [own.inter_node_allreduce_bandwidth_gbytes_per_second, shared.inter_node_allreduce_bandwidth_gbytes_per_second]
        ),
    )
    return ResolvedLinks(
        node_type=node_type.name,
        device=device.name,
        intra_latency_seconds=intra_latency,
        intra_bandwidth_bytes_per_second=intra_bandwidth,
        inter_latency_seconds=inter_latency,
        inter_bandwidth_bytes_per_second=inter_bandwidth,
        allreduce_intra_latency_seconds=allreduce_intra_latency,
        allreduce_intra_bandwidth_bytes_per_second=allreduce_intra_bandwidth,
        allreduce_inter_latency_seconds=allreduce_inter_latency,
        allreduce_inter_bandwidth_bytes_per_second=allreduce_inter_bandwidth,
        intra_jitter_seconds=intra_fit.p2p_jitter_seconds if intra_fit else 0.0,
        inter_jitter_seconds=inter_fit.p2p_jitter_seconds if inter_fit else 0.0,
        sources=sources,
    )


def link_between_node_types(cluster: ClusterSpec, first: NodeType | str, second: NodeType | str) -> LinkCost:
    """The p2p link between a device of `first` and one of `second` (different nodes).

    Both sides' inter-node figures resolve as above; the transfer goes no faster than the slower
    side, so this is the larger latency and the smaller bandwidth (heterogeneous clusters).
    """
    a, b = resolve_links(cluster, first), resolve_links(cluster, second)
    return LinkCost(
        latency_seconds=max(a.inter_latency_seconds, b.inter_latency_seconds),
        bandwidth_bytes_per_second=min(a.inter_bandwidth_bytes_per_second, b.inter_bandwidth_bytes_per_second),
        jitter_seconds=max(a.inter_jitter_seconds, b.inter_jitter_seconds),
    )

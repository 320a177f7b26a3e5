"""ClusterSpec: the GPUs a job may use, as node groups of one device profile each."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from profiles.datafile import SpecError, from_mapping, require
from profiles.device import DeviceProfile, Link, load_profile


@dataclass(kw_only=True, slots=True, frozen=True)
class Network:
    """How a node reaches the other nodes: its NICs for inter-node traffic, shared by the
    node's GPUs. Collectives are priced from it by where their ranks sit
    (``simulator/costs/primitives.py``)."""

    nics_per_node: int
    """Network interfaces per node used for GPU traffic (e.g. 8 on a DGX, 1 on many clusters)."""
    nic_bandwidth_gbps: float
    """Bandwidth of one NIC per direction, in Gbit/s (e.g. 200 for HDR InfiniBand)."""

    def __post_init__(self) -> None:
        require(self.nics_per_node >= 1, f"must be a positive integer, got {self.nics_per_node}",
                "nics_per_node")
        require(self.nic_bandwidth_gbps > 0, "must be > 0", "nic_bandwidth_gbps")

    @property
    def nic_bandwidth_bytes_per_s(self) -> float:
        return self.nic_bandwidth_gbps * 1e9 / 8


MAX_GPUS_PER_NODE = 72
"""Most GPUs one node (one NVLink domain, where a tensor-parallel group lives) may have:
NVIDIA's GB200 NVL72 joins 72 GPUs in one NVLink domain (nvidia.com, GB200 NVL72 product
page). Planning a 8 x 72-GPU cluster takes about 5 s on a 2-core machine."""

MAX_CLUSTER_GPUS = 8192
"""Most GPUs a cluster may have. Planning time grows faster than linearly with the GPUs (the
search prices every split of them among the colocated sets): a GRPO job on 8,192 GPUs takes
about 70 s on a 2-core machine, 2,048 GPUs about 9 s."""


@dataclass(kw_only=True, slots=True, frozen=True)
class NodeGroup:
    """Identical nodes: ``nodes`` x ``gpus_per_node`` devices of one profile."""

    nodes: int
    """Number of nodes."""
    gpus_per_node: int = 8
    """Devices per node (a tensor-parallel group never spans nodes)."""
    device: str = "a100-80gb"
    """Device profile name (``profiles/devices/NAME.yaml``) or path to a profile YAML."""
    network: Network | None = None
    """The nodes' NICs (default: the device profile's, e.g. a DGX's eight)."""
    inter_node_bandwidth_gbps: float | None = None
    """Shorthand for one NIC per GPU of this many Gbit/s (``network`` says more; give one)."""
    price_per_gpu_hour: float | None = None
    """US dollars per GPU per hour on this group (default: the device profile's
    ``price_per_gpu_hour``); what the cost objectives of ``plan`` and ``compare`` charge."""

    def __post_init__(self) -> None:
        if self.price_per_gpu_hour is not None:
            require(self.price_per_gpu_hour > 0, f"must be > 0 (US dollars per GPU per hour), "
                    f"got {self.price_per_gpu_hour}", "price_per_gpu_hour")
        require(self.nodes > 0, f"must be a positive integer, got {self.nodes}", "nodes")
        require(self.gpus_per_node > 0, f"must be a positive integer, got {self.gpus_per_node}",
                "gpus_per_node")
        require(self.gpus_per_node <= MAX_GPUS_PER_NODE,
                f"{self.gpus_per_node} GPUs per node is above the planner's limit of "
                f"{MAX_GPUS_PER_NODE} (one NVLink domain, as GB200 NVL72)", "gpus_per_node")
        require(self.nodes * self.gpus_per_node <= MAX_CLUSTER_GPUS,
                f"{self.nodes} nodes x {self.gpus_per_node} GPUs = "
                f"{self.nodes * self.gpus_per_node} GPUs is above the planner's limit of "
                f"{MAX_CLUSTER_GPUS}", "nodes")
        if self.inter_node_bandwidth_gbps is not None:
            require(self.inter_node_bandwidth_gbps > 0, "must be > 0",
                    "inter_node_bandwidth_gbps")
            require(self.network is None, "give network or inter_node_bandwidth_gbps, not both",
                    "inter_node_bandwidth_gbps")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def effective_network(self) -> Network | None:
        """The network the job gives (``network``, or the per-GPU shorthand), or None to keep
        the device profile's."""
        if self.network is not None:
            return self.network
        if self.inter_node_bandwidth_gbps is not None:
            return Network(nics_per_node=self.gpus_per_node,
                           nic_bandwidth_gbps=self.inter_node_bandwidth_gbps)
        return None

    def pool_key(self) -> tuple:
        """What makes two groups interchangeable: same device, node size, network and price."""
        return (self.device, self.gpus_per_node, self.effective_network(),
                self.price_per_gpu_hour)

    def profile(self) -> DeviceProfile:
        """The device profile, with the cluster's network applied (one object per device and
        network: the cost models ask for it tens of thousands of times per search)."""
        key = (self.device, self.network, self.inter_node_bandwidth_gbps, self.gpus_per_node)
        found = _GROUP_PROFILES.get(key)
        if found is None:
            found = _GROUP_PROFILES[key] = self._load_profile()
        return found

    def _load_profile(self) -> DeviceProfile:
        try:
            base = load_profile(self.device)
        except SpecError as exc:
            # An error inside the profile's file names that file and its key; others are
            # about this key.
            raise exc if exc.source or exc.key == "device" else exc.within("device") from None
        network = self.effective_network()
        if network is None:
            return base
        return _with_network(base, network)


_GROUP_PROFILES: dict[tuple, DeviceProfile] = {}
"""NodeGroup.profile() per (device, network, shorthand bandwidth, GPUs per node): device
profiles are read once per process (``load_profile``), so their wired copies are too."""

_OVERRIDDEN: dict[tuple[int, Network], DeviceProfile] = {}


def _with_network(base: DeviceProfile, network: Network) -> DeviceProfile:
    # The cluster's wiring is applied to a copy of the device profile, one object per
    # (profile, network), so that cost-model caches keyed on the profile still hit.
    key = (id(base), network)
    if key not in _OVERRIDDEN:
        link = Link(bandwidth_bytes_per_s=network.nic_bandwidth_bytes_per_s,
                    latency_seconds=base.inter_node.latency_seconds)
        _OVERRIDDEN[key] = replace(base, inter_node=link, nics_per_node=network.nics_per_node)
    return _OVERRIDDEN[key]


@dataclass(frozen=True, slots=True)
class Pool:
    """GPUs a colocated set may be placed on: one node group, or several identical ones (same
    device, node size, network and price) when nothing slower joins them, since nodes of
    identical groups then reach each other as they reach their own group's nodes."""

    index: int
    """Index in the job of the pool's first node group (what a plan's ``node_group`` says)."""
    members: tuple[int, ...]
    """Indices in the job of every node group in the pool."""
    group: NodeGroup
    """The pool as one group (the members' nodes added up)."""

    @property
    def gpus(self) -> int:
        return self.group.gpus


@dataclass(kw_only=True, slots=True, frozen=True)
class ClusterSpec:
    """The cluster: one or more node groups, each with its own device and network.

    In YAML either the short form ``{nodes, gpus_per_node, device, network}``
    for one group, or ``{node_groups: [...], inter_group_network: {...}}``. Each colocated
    set lives inside one pool (``pools``): one group, or identical groups joined.
    """

    node_groups: tuple[NodeGroup, ...] = field(default_factory=tuple)
    inter_group_network: Network | None = None
    """How a node of one group reaches a node of another (default: the slower of the two
    groups' own inter-node networks). Batches between sets on different groups cross it."""

    def __post_init__(self) -> None:
        require(len(self.node_groups) > 0, "at least one node group is required", "node_groups")
        total = sum(g.gpus for g in self.node_groups)
        require(total <= MAX_CLUSTER_GPUS, f"{total} GPUs in all is above the planner's limit "
                f"of {MAX_CLUSTER_GPUS}", "node_groups")

    def pools(self) -> tuple[Pool, ...]:
        """The pools sets are placed on: identical groups joined into one, unless the job gives
        an ``inter_group_network`` (then every group is its own pool)."""
        if self.is_homogeneous:
            return (Pool(index=0, members=(0,), group=self.node_groups[0]),)
        members: dict[tuple, list[int]] = {}
        for i, g in enumerate(self.node_groups):
            key = g.pool_key() if self.inter_group_network is None else (i,)
            members.setdefault(key, []).append(i)
        pools = []
        for indices in members.values():
            first = self.node_groups[indices[0]]
            nodes = sum(self.node_groups[i].nodes for i in indices)
            pools.append(Pool(index=indices[0], members=tuple(indices),
                              group=replace(first, nodes=nodes)))
        return tuple(pools)

    def pool_of(self, node_group: int) -> Pool:
        """The pool holding the job's node group ``node_group``."""
        for pool in self.pools():
            if node_group in pool.members:
                return pool
        raise SpecError(f"node group {node_group} does not exist (the cluster has "
                        f"{len(self.node_groups)})", key="node_group")

    def device_of(self, node_group: int) -> str:
        """The device profile's name of node group ``node_group``."""
        return self.pool_of(node_group).group.profile().name

    def pool_cluster(self, pool: Pool) -> ClusterSpec:
        """The cluster as seen from a set on ``pool``: that pool alone."""
        if self.is_homogeneous:
            return self
        return ClusterSpec(node_groups=(pool.group,))

    def link_between(self, a: Pool, b: Pool) -> DeviceProfile:
        """The device profile whose inter-node link prices a batch between a node of ``a`` and
        one of ``b``: the inter-group network when the job gives one, else the slower side."""
        pa, pb = a.group.profile(), b.group.profile()
        if a.index == b.index:
            return pa
        if self.inter_group_network is not None:
            return _with_network(pa, self.inter_group_network)
        return pa if pa.inter_node.bandwidth_bytes_per_s <= pb.inter_node.bandwidth_bytes_per_s \
            else pb

    @classmethod
    def homogeneous(cls, nodes: int, gpus_per_node: int = 8, device: str = "a100-80gb",
                    inter_node_bandwidth_gbps: float | None = None) -> ClusterSpec:
        group = NodeGroup(nodes=nodes, gpus_per_node=gpus_per_node, device=device,
                          inter_node_bandwidth_gbps=inter_node_bandwidth_gbps)
        return cls(node_groups=(group,))

    @classmethod
    def from_value(cls, value: Any, key: str = "cluster") -> ClusterSpec:
        """Parse the short or the long YAML form."""
        if not isinstance(value, dict):
            raise SpecError(f"expected a mapping, got {value!r}", key=key)
        if "node_groups" in value:
            return from_mapping(cls, value, key_prefix=key)
        group = from_mapping(NodeGroup, value, key_prefix=key)
        return cls(node_groups=(group,))

    @property
    def is_homogeneous(self) -> bool:
        return len(self.node_groups) == 1

    def only_group(self) -> NodeGroup:
        """The single node group of a homogeneous cluster (error otherwise)."""
        if not self.is_homogeneous:
            raise SpecError(f"this needs a cluster of one node group, and it has "
                            f"{len(self.node_groups)} (plan, compare and simulate handle mixed "
                            "clusters; execute, profile and calibrate run on one group)",
                            key="cluster.node_groups")
        return self.node_groups[0]

    @property
    def total_gpus(self) -> int:
        return sum(g.gpus for g in self.node_groups)

    @property
    def device_label(self) -> str:
        """The device profile's name, or the groups' names joined by '+' on a mixed cluster."""
        names = list(dict.fromkeys(g.profile().name for g in self.node_groups))
        return "+".join(names)

    def describe(self) -> str:
        """'2 nodes x 8 a100-80gb = 16 GPUs', or the groups joined by ' + ' on a mixed cluster."""
        parts = [f"{g.nodes} node{'s' if g.nodes > 1 else ''} x {g.gpus_per_node} "
                 f"{g.profile().name}" for g in self.node_groups]
        return " + ".join(parts) + f" = {self.total_gpus} GPUs"

    def profiles(self) -> tuple[DeviceProfile, ...]:
        """Each node group's device profile (with its network), in the job's order."""
        return tuple(g.profile() for g in self.node_groups)

    @property
    def gpus_per_node(self) -> int:
        return self.only_group().gpus_per_node

    @property
    def nodes(self) -> int:
        return sum(g.nodes for g in self.node_groups)

    def profile(self) -> DeviceProfile:
        return self.only_group().profile()

    def to_value(self) -> dict[str, Any]:
        """The short YAML form for one group, the long form otherwise."""
        def group_dict(g: NodeGroup) -> dict[str, Any]:
            out: dict[str, Any] = {"nodes": g.nodes, "gpus_per_node": g.gpus_per_node,
                                   "device": g.device}
            if g.network is not None:
                out["network"] = {"nics_per_node": g.network.nics_per_node,
                                  "nic_bandwidth_gbps": g.network.nic_bandwidth_gbps}
            if g.inter_node_bandwidth_gbps is not None:
                out["inter_node_bandwidth_gbps"] = g.inter_node_bandwidth_gbps
            if g.price_per_gpu_hour is not None:
                out["price_per_gpu_hour"] = g.price_per_gpu_hour
            return out
        if self.is_homogeneous:
            return group_dict(self.node_groups[0])
        out: dict[str, Any] = {"node_groups": [group_dict(g) for g in self.node_groups]}
        if self.inter_group_network is not None:
            out["inter_group_network"] = {
                "nics_per_node": self.inter_group_network.nics_per_node,
                "nic_bandwidth_gbps": self.inter_group_network.nic_bandwidth_gbps}
        return out

    def with_total_gpus(self, gpus: int) -> ClusterSpec:
        """The same cluster resized to ``gpus``: one group to whole nodes (or one partial
        node); a mixed cluster by scaling every group's nodes alike, so its mix is kept."""
        if gpus <= 0:
            raise SpecError(f"must be a positive integer, got {gpus}", key="gpus")
        if not self.is_homogeneous:
            return self._scaled(gpus)
        group = self.node_groups[0]
        if gpus < group.gpus_per_node:
            return ClusterSpec(node_groups=(replace(group, nodes=1, gpus_per_node=gpus),))
        if gpus % group.gpus_per_node:
            raise SpecError(f"{gpus} GPUs is not a whole number of {group.gpus_per_node}-GPU "
                            "nodes", key="gpus")
        return ClusterSpec(node_groups=(replace(group, nodes=gpus // group.gpus_per_node),))

    def _scaled(self, gpus: int) -> ClusterSpec:
        total = self.total_gpus
        groups = []
        for i, g in enumerate(self.node_groups):
            nodes = g.nodes * gpus / total
            if nodes != int(nodes) or nodes < 1:
                raise SpecError(f"a mixed cluster is resized by scaling every node group alike: "
                                f"{gpus} GPUs is {gpus / total:g} x this cluster's {total}, which "
                                f"gives node group {i} {nodes:g} nodes (it needs a whole "
                                "number, at least 1)", key="gpus")
            groups.append(replace(g, nodes=int(nodes)))
        return replace(self, node_groups=tuple(groups))

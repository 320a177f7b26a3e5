"""Seconds of the primitive operations every cost model is built from: a GEMM, an attention
call, a memory-bound kernel, a collective, a point-to-point message.

Each is one formula: work / (peak x achieved fraction at that size), floored by the kernel
launch cost (a GPU cannot finish kernels faster than the host issues them).
"""

from __future__ import annotations

from dataclasses import dataclass

from profiles.device import DeviceProfile


def gemm_seconds(profile: DeviceProfile, m: float, n: float, k: float, dtype: str,
                 count: float = 1.0) -> float:
    """``count`` GEMMs of (m x k) @ (k x n) each."""
    flops = 2.0 * m * n * k
    if flops <= 0:
        return 0.0
    seconds = flops / (profile.peak_flops(dtype) * profile.efficiency.matmul.at(flops))
    return count * max(seconds, profile.overheads.kernel_launch_seconds)


def flops_seconds(profile: DeviceProfile, flops: float, dtype: str, gemm_flops: float) -> float:
    """``flops`` of matrix multiplication done in GEMMs of ``gemm_flops`` each."""
    if flops <= 0:
        return 0.0
    size = max(gemm_flops, 1.0)
    return flops / (profile.peak_flops(dtype) * profile.efficiency.matmul.at(size))


def attention_kernel_seconds(profile: DeviceProfile, flops: float, dtype: str) -> float:
    """One fused (flash) attention call of ``flops`` FLOPs."""
    if flops <= 0:
        return 0.0
    seconds = flops / (profile.peak_flops(dtype) * profile.efficiency.attention.at(flops))
    return max(seconds, profile.overheads.kernel_launch_seconds)


def memory_seconds(profile: DeviceProfile, bytes_moved: float, kernels: float = 1.0) -> float:
    """Memory-bound work moving ``bytes_moved`` bytes in ``kernels`` kernels."""
    if bytes_moved <= 0:
        return 0.0
    per_kernel = bytes_moved / max(kernels, 1.0)
    eff = profile.efficiency.memory.at(per_kernel)
    seconds = bytes_moved / (profile.memory_bandwidth_bytes_per_s * eff)
    return max(seconds, kernels * profile.overheads.kernel_launch_seconds)


@dataclass(frozen=True, slots=True)
class Span:
    """Where the ranks of one collective group sit, and who shares their node's NICs.

    Collectives that cross nodes run hierarchically (as NCCL's do): inside each node over
    NVLink among the group's ``ranks_per_node`` ranks, and between nodes on shards of
    1 / ranks_per_node of the message. During the inter-node phase the node's NICs are
    shared by ``busy_ranks_per_node`` ranks: every rank of the node that runs a collective of
    the same kind at that moment (e.g. the eight data-parallel groups of a node under tp=8
    all reduce their gradients at once).
    """

    ranks_per_node: int = 1
    """Ranks of one group on one node."""
    nodes: int = 1
    """Nodes one group spans."""
    busy_ranks_per_node: int = 1
    """Ranks of a node sending across nodes at the same time (all groups), >= ranks_per_node."""
    gpus_per_node: int = 8

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


WITHIN_NODE = Span()
"""A group inside one node."""


def group_span(group: int, stride: int, gpus_per_node: int,
               busy_ranks_per_node: int | None = None) -> Span:
    """The span of a group of ``group`` ranks spaced ``stride`` apart (consecutive = 1) in a
    set that starts on a node boundary. ``busy_ranks_per_node``: ranks of a node running the
    same collective at once (default: only this group's)."""
    if group <= 1:
        return Span(gpus_per_node=gpus_per_node)
    per_node = 1 if stride >= gpus_per_node else max(1, min(group, gpus_per_node // stride))
    nodes = -(-group // per_node)
    busy = busy_ranks_per_node if busy_ranks_per_node is not None else per_node
    busy = max(per_node, min(busy, gpus_per_node))
    return Span(ranks_per_node=per_node, nodes=nodes, busy_ranks_per_node=busy,
                gpus_per_node=gpus_per_node)


def nic_bandwidth_per_rank(profile: DeviceProfile, span: Span) -> float:
    """Bytes/s one rank gets across nodes: its share of the node's NICs, at most one NIC
    (a GPU sends through the NIC beside it)."""
    nics = profile.nics_per_node or span.gpus_per_node  # None: one NIC per GPU
    return profile.inter_node.bandwidth_bytes_per_s * min(1.0, nics / span.busy_ranks_per_node)


def _intra_seconds(profile: DeviceProfile, wire_bytes: float, message_bytes: float) -> float:
    """Wire bytes of a collective inside one node. The intra-node curve is nccl-tests' bus
    bandwidth and includes NCCL's latency."""
    bandwidth = profile.intra_node.bandwidth_bytes_per_s
    curve = profile.efficiency.intra_node_collective
    smallest = curve.points[0][0]
    if message_bytes < smallest:
        # Below the smallest measured message a collective costs what that message costs:
        # latency, not bandwidth, dominates there.
        return wire_bytes / message_bytes * smallest / (bandwidth * curve.points[0][1])
    return wire_bytes / (bandwidth * curve.at(message_bytes))


def _inter_seconds(profile: DeviceProfile, wire_bytes: float, message_bytes: float,
                   ring_steps: int, span: Span) -> float:
    """Wire bytes per rank between nodes, at the rank's share of the NICs (the inter-node curve
    is a fraction of the NIC bound by message size), plus the link latency once per ring
    step."""
    curve = profile.efficiency.inter_node_collective
    bandwidth = nic_bandwidth_per_rank(profile, span) * curve.at(message_bytes)
    return wire_bytes / bandwidth + ring_steps * profile.inter_node.latency_seconds


def all_reduce_seconds(profile: DeviceProfile, message_bytes: float, group: int,
                       crosses_nodes: bool = False, *, span: Span | None = None,
                       correction: str = "collective") -> float:
    """All-reduce of a ``message_bytes`` tensor over ``group`` devices (``correction``: the
    profile's fitted factor for this kind of collective). Within a node a ring:
    each device sends and receives 2 (n-1)/n of it. Across nodes (``span``; or
    ``crosses_nodes`` for one rank per node) hierarchical: reduce-scatter and all-gather inside
    each node, and a ring all-reduce of each 1/k shard between the nodes."""
    if group <= 1 or message_bytes <= 0:
        return 0.0
    span = _resolve(span, crosses_nodes, group)
    if not span.crosses_nodes:
        wire = 2.0 * (group - 1) / group * message_bytes
        return _intra_seconds(profile, wire, message_bytes) * profile.correction(correction)
    k, n = span.ranks_per_node, span.nodes
    intra = _intra_seconds(profile, 2.0 * (k - 1) / k * message_bytes, message_bytes) \
        if k > 1 else 0.0
    shard = message_bytes / k
    inter = _inter_seconds(profile, 2.0 * (n - 1) / n * shard, shard, 2 * (n - 1), span)
    return (intra + inter) * profile.correction(correction)


def all_gather_seconds(profile: DeviceProfile, output_bytes: float, group: int,
                       crosses_nodes: bool = False, *, span: Span | None = None,
                       correction: str = "collective") -> float:
    """All-gather producing ``output_bytes`` on each device: each receives (n-1)/n of it.
    Across nodes: an all-gather between nodes of each local rank's 1/k share, then one
    inside each node."""
    if group <= 1 or output_bytes <= 0:
        return 0.0
    span = _resolve(span, crosses_nodes, group)
    if not span.crosses_nodes:
        wire = (group - 1) / group * output_bytes
        return _intra_seconds(profile, wire, output_bytes) * profile.correction(correction)
    k, n = span.ranks_per_node, span.nodes
    shard = output_bytes / k
    inter = _inter_seconds(profile, (n - 1) / n * shard, shard, n - 1, span)
    intra = _intra_seconds(profile, (k - 1) / k * output_bytes, output_bytes) if k > 1 else 0.0
    return (intra + inter) * profile.correction(correction)


def reduce_scatter_seconds(profile: DeviceProfile, input_bytes: float, group: int,
                           crosses_nodes: bool = False, *, span: Span | None = None,
                           correction: str = "collective") -> float:
    """Reduce-scatter of an ``input_bytes`` tensor: each device sends (n-1)/n of it (the mirror
    image of an all-gather, same wire bytes)."""
    return all_gather_seconds(profile, input_bytes, group, crosses_nodes, span=span,
                              correction=correction)


def broadcast_seconds(profile: DeviceProfile, message_bytes: float, group: int, *,
                      span: Span | None = None, correction: str = "collective") -> float:
    """Broadcast of a ``message_bytes`` tensor from one rank to the rest of ``group``. NCCL
    pipelines it along a ring, so every rank receives the whole tensor once (nccl-tests'
    bus bandwidth of a broadcast is its algorithm bandwidth): over NVLink inside a node, over
    the rank's share of the NICs when the group spans nodes, plus one link latency per hop."""
    if group <= 1 or message_bytes <= 0:
        return 0.0
    span = span or WITHIN_NODE
    if not span.crosses_nodes:
        seconds = _intra_seconds(profile, message_bytes, message_bytes)
    else:
        seconds = _inter_seconds(profile, message_bytes, message_bytes, group - 1, span)
    return seconds * profile.correction(correction)


def all_to_all_seconds(profile: DeviceProfile, send_bytes: float, group: int, *,
                       span: Span | None = None, correction: str = "collective") -> float:
    """All-to-all where each of ``group`` devices sends ``send_bytes`` split evenly over the
    group (its own share stays). The shares to ranks of the same node go over NVLink and those
    to other nodes over the node's NICs, at the same time (NCCL posts every peer's send at
    once): the slower of the two, with one link latency per peer node."""
    if group <= 1 or send_bytes <= 0:
        return 0.0
    span = span or WITHIN_NODE
    chunk = send_bytes / group
    if not span.crosses_nodes:
        wire = (group - 1) / group * send_bytes
        return _intra_seconds(profile, wire, chunk) * profile.correction(correction)
    k = span.ranks_per_node
    return exchange_seconds(profile, (k - 1) * chunk, (group - k) * chunk, chunk, chunk, span,
                            correction=correction)


def exchange_seconds(profile: DeviceProfile, intra_bytes: float, inter_bytes: float,
                     intra_message_bytes: float, inter_message_bytes: float, span: Span, *,
                     correction: str = "collective") -> float:
    """One rank's share of an exchange across ``span``'s nodes: ``intra_bytes`` to ranks of its
    own node over NVLink while ``inter_bytes`` leave through its share of the NICs, in
    messages of the given sizes (which set the achieved fraction of each link); the slower
    of the two, with one link latency per peer node."""
    intra = _intra_seconds(profile, intra_bytes, intra_message_bytes) if intra_bytes > 0 \
        else 0.0
    inter = _inter_seconds(profile, inter_bytes, inter_message_bytes, span.nodes - 1, span) \
        if inter_bytes > 0 else 0.0
    return max(intra, inter) * profile.correction(correction)


def _resolve(span: Span | None, crosses_nodes: bool, group: int) -> Span:
    if span is not None:
        return span
    if crosses_nodes:  # callers without placement: one rank per node, alone on its NICs
        return Span(ranks_per_node=1, nodes=group, busy_ranks_per_node=1, gpus_per_node=1)
    return WITHIN_NODE


def p2p_seconds(profile: DeviceProfile, message_bytes: float, crosses_nodes: bool,
                busy_ranks_per_node: int = 1, gpus_per_node: int = 8) -> float:
    """One point-to-point message (pipeline activations, transfers between sets). Across
    nodes the sender shares its node's NICs with ``busy_ranks_per_node`` ranks sending at the
    same time."""
    if message_bytes <= 0:
        return 0.0
    if not crosses_nodes:
        # A single stream reaches the large-message fraction of the link at best.
        efficiency = profile.efficiency.intra_node_collective.points[-1][1]
        return (profile.intra_node.latency_seconds
                + message_bytes / (profile.intra_node.bandwidth_bytes_per_s * efficiency))
    span = Span(ranks_per_node=1, nodes=2, gpus_per_node=gpus_per_node,
                busy_ranks_per_node=max(1, min(busy_ranks_per_node, gpus_per_node)))
    return _inter_seconds(profile, message_bytes, message_bytes, 1, span)


def first_straddling_group(first_gpu: int, gpus: int, group_size: int,
                           gpus_per_node: int) -> int | None:
    """First GPU of the first group of ``group_size`` consecutive GPUs (the groups tiling
    ``gpus`` GPUs from ``first_gpu``) that spans two nodes, or None if none does."""
    for start in range(first_gpu, first_gpu + gpus, group_size):
        if start // gpus_per_node != (start + group_size - 1) // gpus_per_node:
            return start
    return None


def group_crosses_nodes(group_size: int, stride: int, gpus_per_node: int) -> bool:
    """Whether a group of ``group_size`` ranks spaced ``stride`` apart (consecutive = 1) spans
    more than one node, for sets that start on a node boundary."""
    return group_size > 1 and group_size * stride > gpus_per_node

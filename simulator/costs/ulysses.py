"""DeepSpeed-Ulysses sequence parallelism (verl's ulysses_sequence_parallel_size): a sequence's
tokens are split over ``sp`` ranks; around the attention core an all-to-all gives each rank
every token of heads / sp heads (the queries, keys and values) and another gives the attention
output back by tokens (Jacobs et al. 2023, "DeepSpeed Ulysses", arXiv 2309.14509 §3; verl
0.9.1 verl/utils/ulysses.py gather_seq_scatter_heads / gather_heads_scatter_seq). The backward
pass runs the transposed pair. Everything else of the layer computes on the rank's own tokens,
so a rank's work is 1 / sp of a micro-batch's; the cost models price the layer at micro-batch
/ sp and add these exchanges."""

from __future__ import annotations

from profiles.device import DTYPE_BYTES, DeviceProfile
from simulator.costs.primitives import all_to_all_seconds, group_span
from simulator.specs.model import ModelSpec


def ulysses_forward_seconds(model: ModelSpec, profile: DeviceProfile, *, tokens: float,
                            tp: int, sp: int, dtype: str, gpus_per_node: int,
                            busy_ranks_per_node: int) -> float:
    """One layer's forward exchanges for a rank holding ``tokens`` tokens of its micro-batch
    (tp: the heads this rank's tensor-parallel shard holds): the q, k, v all-to-all and the
    output's (0 without sequence parallelism). The sp ranks are consecutive (inside a node
    up to its size), every rank of the node exchanging at once."""
    if sp <= 1:
        return 0.0
    b = DTYPE_BYTES[dtype]
    qkv = tokens * (model.q_size + 2 * model.kv_size) / tp * b
    output = tokens * model.v_size / tp * b
    span = group_span(sp, 1, gpus_per_node, busy_ranks_per_node=busy_ranks_per_node)
    return (all_to_all_seconds(profile, qkv, sp, span=span, correction="train_collective")
            + all_to_all_seconds(profile, output, sp, span=span,
                                 correction="train_collective"))

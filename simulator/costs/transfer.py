"""Moving a batch from the node that produced it to the node that consumes it.

With a single controller (HybridFlow, verl, this project's executor) every call returns its
output to the controller and the controller sends the next call its input: a batch crosses
the controller's network link once on the way in and once on the way out, whichever sets the
two nodes live on. Work done on the controller itself (advantages, rule rewards) needs only
the leg that reaches or leaves it."""

from __future__ import annotations

from profiles.device import DeviceProfile
from simulator.costs.primitives import p2p_seconds

BYTES_PER_TOKEN = {
    "generate": 4 + 1 + 4,
    "infer": 4,
    "compute": 4 * 3,
}
"""Bytes per token a node of each operation produces for its consumers: generate: token id
(int32), attention mask (int8), sampling log-prob (fp32); infer: one fp32 value per token
(value, log-prob, or reward spread over tokens); compute (advantages): fp32 advantages,
returns and old log-probs."""


def transfer_seconds(profile: DeviceProfile, *, sequences: float, tokens_per_sequence: float,
                     operation: str, legs: int) -> float:
    """Seconds to move the output of a node with ``operation`` through the controller:
    ``legs`` crossings (worker -> controller, controller -> worker) of its single link (one
    NIC; on one machine, its loopback)."""
    if legs <= 0:
        return 0.0
    total = sequences * tokens_per_sequence * BYTES_PER_TOKEN.get(operation, 4)
    seconds = legs * p2p_seconds(profile, total, crosses_nodes=True)
    return seconds * profile.correction("transfer")

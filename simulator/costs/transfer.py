"""Moving a batch from the node that produced it to the node that consumes it.

With a single controller (HybridFlow, verl, this project's executor) every call returns its
output to the controller and the controller sends the next call its input: a batch crosses
the controller's network link once on the way in and once on the way out, whichever sets the
two nodes live on. Work done on the controller itself (advantages, rule rewards) needs only
the leg that reaches or leaves it. Before the wire, the driver serializes what it sends
(``controller_dispatch_seconds``)."""

from __future__ import annotations

from profiles.device import DeviceProfile
from profiles.framework import ControllerSettings
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


def controller_dispatch_seconds(controller: ControllerSettings, *, operation: str,
                                sequences: float, padded_tokens: float, data_parallel: int,
                                workers_per_shard: int) -> float:
    """Seconds a model call spends having its batch serialized by the driver and its results
    taken back, beyond the wire (``transfer_seconds``): the driver pickles each copy it sends
    (one per shard, or one per worker of a shard's ``workers_per_shard`` tensor x pipeline
    group when the framework passes the batch by value to every worker), each worker unpickles
    its shard (in parallel with the others), and the driver unpickles every result it collects.
    ``padded_tokens`` is the batch's slot count per sequence (padded to its longest).
    Generation calls are not priced: they send prompts only and return one copy of the
    responses per engine (int64 ids and fp32 log-probs, about 12 bytes a token, once)."""
    serialize, deserialize = controller.serialize_bytes_per_s, controller.deserialize_bytes_per_s
    if not controller.priced or serialize is None or deserialize is None:
        return 0.0
    if operation == "train":
        in_bytes_per_token = controller.train_input_bytes_per_token
        out_bytes_per_token = 0.0
    elif operation == "infer":
        in_bytes_per_token = controller.infer_input_bytes_per_token
        out_bytes_per_token = controller.infer_output_bytes_per_token
    else:
        return 0.0
    slots = sequences * padded_tokens
    batch_in_bytes = slots * in_bytes_per_token
    batch_out_bytes = slots * out_bytes_per_token
    copies_sent = workers_per_shard if controller.dispatch == "per_worker" else 1
    copies_collected = workers_per_shard if controller.collect == "every_worker" else 1
    driver_seconds = (copies_sent * batch_in_bytes / serialize
                      + copies_collected * batch_out_bytes / deserialize)
    worker_seconds = (batch_in_bytes / data_parallel / deserialize
                      + batch_out_bytes / data_parallel / serialize)
    return driver_seconds + worker_seconds

"""How fast a single Ray driver hands torch batches to its workers (``make bench``): the
rates behind the framework profiles' ``controller.serialize_bytes_per_s`` and
``controller.deserialize_bytes_per_s``. Prints medians; never asserts.

A driver that passes a batch of CPU torch tensors to a remote call (by value, or with
``ray.put``) pickles it: Ray keeps numpy arrays zero-copy (pickle protocol 5 out-of-band
buffers), but a torch tensor goes through torch's own reducer, which copies its storage into
bytes. The payload is a data-parallel shard of an RLHF batch as NeMo-RL sends it (int64 token
ids and mask, fp32 advantages and log-probs, padded to 4096 tokens)."""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import ray
import torch

REPEATS = 15
SEQUENCES = 256
PADDED_TOKENS = 4096


def shard() -> dict[str, torch.Tensor]:
    """One shard: 256 sequences x 4096 slots, 24 bytes a slot (NeMo-RL v0.5.0's log-prob
    call: input_ids int64, advantages fp32, generation_logprobs fp32, token_mask int64)."""
    shape = (SEQUENCES, PADDED_TOKENS)
    return {"input_ids": torch.randint(0, 128_000, shape),
            "advantages": torch.randn(shape),
            "generation_logprobs": torch.randn(shape),
            "token_mask": torch.ones(shape, dtype=torch.long)}


def payload_bytes(batch: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in batch.values())


@ray.remote(num_cpus=0)
class Worker:
    def __init__(self) -> None:
        self.result = shard()

    def take(self, batch) -> int:
        return len(batch)

    def give(self) -> dict[str, torch.Tensor]:
        return self.result


def median_rate(nbytes: int, action) -> tuple[float, float]:
    """(median, worst) bytes per second of ``action`` over REPEATS runs after a warm-up."""
    action()
    seconds = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        action()
        seconds.append(time.perf_counter() - start)
    return nbytes / statistics.median(seconds), nbytes / max(seconds)


def main() -> None:
    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        batch = shard()
        nbytes = payload_bytes(batch)
        worker = Worker.remote()
        ray.get(worker.take.remote({}))
        stored = ray.put(batch)
        rows = {
            # controller.serialize_bytes_per_s: the driver's work per copy it sends
            "ray.put (the driver pickles a shard)": median_rate(nbytes, lambda: ray.put(batch)),
            # controller.deserialize_bytes_per_s
            "ray.get of a stored shard (unpickle)": median_rate(nbytes, lambda: ray.get(stored)),
            # End to end, for comparison: one by-value call (pickle, worker unpickle) and
            # fetching a worker's result (worker pickles, driver unpickles).
            "remote call with the shard by value": median_rate(
                nbytes, lambda: ray.get(worker.take.remote(batch))),
            "ray.get of a worker's returned shard": median_rate(
                nbytes, lambda: ray.get(worker.give.remote())),
        }
        print(f"payload {nbytes / 1e6:.1f} MB, {REPEATS} repeats, Ray {ray.__version__}, "
              f"torch {torch.__version__}")
        for name, (median, worst) in rows.items():
            print(f"  {name:50s} median {median / 1e9:6.3f} GB/s   worst {worst / 1e9:6.3f} GB/s")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()

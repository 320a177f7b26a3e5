"""Sequence packing: how a framework that packs sequences into token bins (NeMo-RL's
``sequence_packing``) cuts a batch into micro-batches, simulated on the batch's own lengths.

The batch is the job's deterministic stratified sample of prompt + response lengths. It is
packed first-fit-decreasing into bins of ``capacity_tokens`` (a bin is one micro-batch: a
packed sequence of several responses, attention kept within each; NeMo-RL's modified
first-fit-decreasing fills bins alike); the bins are dealt round-robin to the data-parallel
ranks; the step waits for the rank with the most work. With pipeline parallelism every bin of
a rank is padded to that rank's longest bin (the pipeline exchanges fixed-size activations).
Not modelled: NeMo-RL v0.5+ splitting bins until every rank has as many (min_bin_count,
bin_count_multiple), and the padding of each sequence to a multiple of tp under sequence
parallelism (a few tokens). The result is what the cost models need:
how many micro-batches the busiest rank runs, how many sequences each holds and how many tokens
each sequence then stands for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from simulator.specs.lengths import LengthDistribution


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """The busiest data-parallel rank's micro-batches under sequence packing."""

    micro_batches: int
    """Bins (micro-batches) the busiest rank runs."""
    sequences_per_micro_batch: float
    """Mean sequences in one of its bins."""
    tokens_per_sequence: float
    """Mean tokens of one of its sequences, the padding of its bins included."""
    capacity_tokens: int
    """Tokens a bin holds at most."""
    largest_bin_tokens: int
    """Tokens of the fullest bin of any rank (what a micro-batch's memory must hold)."""

    @property
    def tokens_per_micro_batch(self) -> float:
        return self.sequences_per_micro_batch * self.tokens_per_sequence


def first_fit_decreasing(lengths: tuple[int, ...], capacity_tokens: int) -> list[list[int]]:
    """Bins of at most ``capacity_tokens`` tokens, filled longest first into the first bin
    with room (a sequence longer than the capacity gets a bin of its own).

    The first bin with room is found in a tree of the bins' free room (each node the most room
    below it), so a batch of n sequences packs in O(n log n), not O(n x bins): a batch of
    32,768 sequences that each fill a bin took minutes bin by bin."""
    items = sorted(lengths, reverse=True)
    leaves = 1
    while leaves < len(items):
        leaves *= 2
    # Unopened bins hold -1: no sequence (>= 1 token) fits them; a full bin holds 0.
    most_room = [-1] * (2 * leaves)
    bins: list[list[int]] = []
    for length in items:
        if most_room[1] >= length:
            node = 1
            while node < leaves:  # the leftmost bin with room
                node = 2 * node if most_room[2 * node] >= length else 2 * node + 1
            bins[node - leaves].append(length)
            most_room[node] -= length
        else:
            node = leaves + len(bins)
            bins.append([length])
            most_room[node] = capacity_tokens - length
        node //= 2
        while node:
            most_room[node] = max(most_room[2 * node], most_room[2 * node + 1])
            node //= 2
    return bins


@lru_cache(maxsize=4096)
def pack_batch(lengths: tuple[int, ...], *, capacity_tokens: int, data_parallel: int,
               pad_to_longest_bin: bool) -> PackedBatch:
    """Pack ``lengths`` (one batch's sequences, in tokens) into bins of ``capacity_tokens``,
    deal the bins round-robin to ``data_parallel`` ranks and describe the busiest rank's
    micro-batches (``pad_to_longest_bin``: each of a rank's bins padded to its longest)."""
    if not lengths:
        return PackedBatch(micro_batches=1, sequences_per_micro_batch=0.0,
                           tokens_per_sequence=0.0, capacity_tokens=capacity_tokens,
                           largest_bin_tokens=0)
    bins = first_fit_decreasing(lengths, capacity_tokens)
    ranks: list[list[list[int]]] = [[] for _ in range(data_parallel)]
    for index, packed in enumerate(bins):
        ranks[index % data_parallel].append(packed)

    def work(rank_bins: list[list[int]]) -> float:
        if not rank_bins:
            return 0.0
        if pad_to_longest_bin:
            return len(rank_bins) * max(sum(b) for b in rank_bins)
        return float(sum(sum(b) for b in rank_bins))

    busiest = max(ranks, key=lambda rank_bins: (work(rank_bins), len(rank_bins)))
    sequences = sum(len(b) for b in busiest)
    tokens = work(busiest)
    return PackedBatch(micro_batches=max(1, len(busiest)),
                       sequences_per_micro_batch=sequences / max(1, len(busiest)),
                       tokens_per_sequence=tokens / max(1, sequences),
                       capacity_tokens=capacity_tokens,
                       largest_bin_tokens=max(sum(b) for b in bins))


def bin_capacity_tokens(max_sequence_tokens: int, micro_batch_size: int) -> int:
    """A bin's capacity: the longest sequence times the micro-batch size in sequences (NeMo-RL's
    ``train_mb_tokens`` and ``logprob_mb_tokens``)."""
    return max(1, max_sequence_tokens * max(1, micro_batch_size))


@lru_cache(maxsize=4096)
def pack_stratified_batch(response_length: LengthDistribution, sequences: int,
                          prompt_tokens: int, *, capacity_tokens: int, data_parallel: int,
                          pad_to_longest_bin: bool) -> PackedBatch:
    """``pack_batch`` of a batch of ``sequences`` whose prompt + response lengths are the
    stratified sample of ``response_length`` (cached: the search asks it for every config)."""
    lengths = tuple(prompt_tokens + r for r in response_length.sample(sequences))
    return pack_batch(lengths, capacity_tokens=capacity_tokens, data_parallel=data_parallel,
                      pad_to_longest_bin=pad_to_longest_bin)


def token_budget_batch(sequences: int, mean_tokens: float, longest_tokens: int, *,
                       budget_tokens: int, data_parallel: int) -> PackedBatch:
    """Micro-batches by a token budget per GPU, as verl forms them with use_dynamic_bsz: the
    batch's tokens are spread evenly over the data-parallel ranks (trainer.balance_batch), and
    each rank's sequences are split into min(sequences, ceil(tokens / budget)) micro-batches
    of balanced work (verl 0.9.1 verl/utils/seqlen_balancing.py:348-440,
    rearrange_micro_batches; the count is synced to the largest over the ranks, which are
    even here). Sequences are not padded (remove-padding packs them); the fullest micro-batch
    holds the longest sequence at least."""
    per_rank = max(1, -(-sequences // data_parallel))
    tokens = per_rank * mean_tokens
    count = max(1, min(per_rank, math.ceil(tokens / budget_tokens)))
    return PackedBatch(micro_batches=count, sequences_per_micro_batch=per_rank / count,
                       tokens_per_sequence=mean_tokens, capacity_tokens=budget_tokens,
                       largest_bin_tokens=max(longest_tokens, math.ceil(tokens / count)))

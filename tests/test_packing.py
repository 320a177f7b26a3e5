"""Sequence packing (NeMo-RL's ``sequence_packing``): bins filled first-fit-decreasing, dealt
round-robin to the data-parallel ranks, padded to the rank's longest bin under pipeline
parallelism; the busiest rank's bins become the micro-batches of training and of the log-prob
passes."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.planning import plan_job
from planner.search import SearchOptions
from planner.space import SpaceOptions
from simulator.packing import first_fit_decreasing, pack_batch
from simulator.predict import estimate_plan, packed_batch
from simulator.specs.job import job_from_mapping
from simulator.specs.lengths import parse_lengths
from simulator.specs.parallel import ParallelConfig


def test_first_fit_decreasing_fills_the_first_bin_with_room():
    bins = first_fit_decreasing((1, 5, 2, 4, 3, 3), capacity_tokens=6)
    assert bins == [[5, 1], [4, 2], [3, 3]]
    # A sequence longer than a bin gets a bin of its own.
    assert first_fit_decreasing((9, 2), capacity_tokens=6) == [[9], [2]]


def _first_fit_bin_by_bin(lengths: tuple[int, ...], capacity_tokens: int) -> list[list[int]]:
    """The definition, scanning the bins in order for each sequence."""
    bins: list[list[int]] = []
    for length in sorted(lengths, reverse=True):
        for packed in bins:
            if sum(packed) + length <= capacity_tokens:
                packed.append(length)
                break
        else:
            bins.append([length])
    return bins


@given(lengths=st.lists(st.integers(1, 120), max_size=300),
       capacity_tokens=st.integers(1, 200))
@settings(max_examples=200, deadline=None)
def test_first_fit_decreasing_is_the_bin_by_bin_definition(lengths, capacity_tokens):
    assert first_fit_decreasing(tuple(lengths), capacity_tokens) == \
        _first_fit_bin_by_bin(tuple(lengths), capacity_tokens)


def test_a_batch_of_32k_sequences_that_each_fill_a_bin_packs():
    """The case that made a random job's search run for minutes: 32,768 sequences of
    2,999-3,045 tokens in bins of 3,045, one sequence a bin."""
    lengths = tuple(2999 + i % 47 for i in range(32768))
    bins = first_fit_decreasing(lengths, capacity_tokens=3045)
    assert len(bins) == 32768 and all(len(b) == 1 for b in bins)


def test_round_robin_bins_make_one_rank_the_busiest():
    # Five full bins over two ranks: one rank runs three.
    packed = pack_batch((4,) * 5, capacity_tokens=4, data_parallel=2, pad_to_longest_bin=False)
    assert packed.micro_batches == 3
    assert packed.tokens_per_micro_batch == 4


def test_pipeline_padding_pads_every_bin_to_the_rank_longest():
    # One rank gets bins of 10 and 2 tokens (capacity 10): padded, both cost 10.
    lengths = (10, 2)
    plain = pack_batch(lengths, capacity_tokens=10, data_parallel=1, pad_to_longest_bin=False)
    padded = pack_batch(lengths, capacity_tokens=10, data_parallel=1, pad_to_longest_bin=True)
    assert plain.micro_batches == padded.micro_batches == 2
    assert plain.tokens_per_sequence * 2 == 12 and padded.tokens_per_sequence * 2 == 20


def test_long_responses_near_the_cap_pad_to_a_bin_each():
    # Qwen3-32B in NeMo-RL's v0.3 blog: mean 3283 of at most 3992 generated tokens, prompts of
    # 104, bins of 4096: about one sequence per bin, each padded to the rank's longest under
    # pipeline parallelism (NVIDIA-NeMo/RL issue #2438), some 10-15% more tokens.
    dist = parse_lengths({"distribution": "max_entropy", "mean": 3283, "max": 3992}, "x")
    lengths = tuple(104 + r for r in dist.sample(512))
    mean = sum(lengths) / len(lengths)
    padded = pack_batch(lengths, capacity_tokens=4096, data_parallel=8, pad_to_longest_bin=True)
    plain = pack_batch(lengths, capacity_tokens=4096, data_parallel=8, pad_to_longest_bin=False)
    assert padded.sequences_per_micro_batch == pytest.approx(1.0, abs=0.15)
    assert 1.08 < padded.tokens_per_sequence / mean < 1.2
    assert plain.tokens_per_sequence / mean < 1.05


def _job(framework: str, pp: int = 1) -> object:
    return job_from_mapping({
        "algorithm": "grpo", "framework": framework,
        "models": {"actor": "llama3.1-8b", "ref": "llama3.1-8b", "reward": "rule"},
        "cluster": {"nodes": 1, "gpus_per_node": 8, "device": "h100-80gb"},
        "workload": {"prompts_per_iteration": 64, "samples_per_prompt": 32,
                     "prompt_length": 127,
                     "response_length": {"distribution": "max_entropy", "mean": 795,
                                         "max": 3969},
                     "mini_batches_per_epoch": 4, "train_micro_batch_size": 1,
                     "infer_micro_batch_size": 4},
        "parallel": {"actor": {"tp": 1, "pp": pp, "sharding": "optimizer",
                               "micro_batch_size": 1, "generation_tp": 1},
                     "ref": {"tp": 1, "pp": pp, "sharding": "none", "micro_batch_size": 4}}})


def test_only_a_packing_framework_packs():
    par = ParallelConfig(tp=1, pp=1, dp=8, sharding="optimizer", micro_batch_size=1)
    assert packed_batch(_job("verl"), par, sequences=512, micro_batch_size=1) is None
    packed = packed_batch(_job("nemo-rl"), par, sequences=512, micro_batch_size=1)
    # 512 sequences of ~922 tokens on 8 ranks: bins of 4096 tokens, about 15 per rank, several
    # sequences each.
    assert 13 <= packed.micro_batches <= 17
    assert packed.sequences_per_micro_batch > 3


def test_packing_changes_the_micro_batches_of_training_and_log_probs(tmp_path):
    # The same framework without packing: micro-batches of whole sequences, one per training
    # micro-batch and four per log-prob micro-batch.
    # Both with a fused log-softmax and one loss call per micro-batch, so that only the
    # packing differs.
    fused = ("logprob_forward_bytes_per_vocab_entry: 12, logprob_backward_bytes_per_vocab_entry"
             ": 24, loss_per_packed_sequence: false")
    (tmp_path / "packing.yaml").write_text(
        f"base: nemo-rl\nname: packing\ntraining: {{{fused}}}\n")
    (tmp_path / "no-packing.yaml").write_text(
        f"base: nemo-rl\nname: no-packing\ntraining: {{sequence_packing: false, {fused}}}\n")
    packing = dataclasses.replace(_job("nemo-rl"), framework=str(tmp_path / "packing.yaml"))
    plain = dataclasses.replace(packing, framework=str(tmp_path / "no-packing.yaml"))
    assert packing.framework_profile.training.sequence_packing
    assert not plain.framework_profile.training.sequence_packing

    # Simulated layouts: the search does not depend on which executor engines are installed.
    plan = plan_job(packing, SearchOptions(space=SpaceOptions(backend="simulated"))).best.plan
    packed = estimate_plan(packing, plan).nodes
    unpacked = estimate_plan(plain, plan).nodes
    # Log-probs: 256 sequences per rank in micro-batches of 4 (64) become ~15 bins of 16384
    # tokens; training: 64 one-sequence micro-batches per mini-batch become ~15 bins of 4096.
    assert unpacked["actor.old_log_prob"].detail["micro_batches"] == 64
    assert 13 <= packed["actor.old_log_prob"].detail["micro_batches"] <= 17
    # Training runs the same tokens in fewer, larger micro-batches (bins of 4096 tokens instead
    # of single ~922-token sequences): its GEMMs run at larger, more efficient shapes, which
    # outweighs the busiest rank's extra tokens here (one stage: no pipeline bubble).
    assert packed["actor.train"].seconds < unpacked["actor.train"].seconds
    # Memory: the fullest bin holds as many tokens as micro_batch_size longest sequences, so
    # the activations to plan for are the same.
    assert packed["actor.train"].transient.activations == pytest.approx(
        unpacked["actor.train"].transient.activations, rel=0.01)


def test_a_packed_micro_batch_holds_at_most_the_fullest_bin():
    from simulator.predict import full_bin

    # Two 1000-token sequences in bins of 16384 tokens: memory for 2000 tokens, not 16384.
    packed = pack_batch((1000, 1000), capacity_tokens=16384, data_parallel=1,
                        pad_to_longest_bin=False)
    assert packed.largest_bin_tokens == 2000
    assert full_bin(packed).tokens_per_micro_batch == 2000


def test_nemo_rl_log_probs_cost_their_unfused_fp32_passes():
    from simulator.predict import loss_bytes_per_vocab_entry

    packed = pack_batch((1000,) * 8, capacity_tokens=4096, data_parallel=1,
                        pad_to_longest_bin=False)
    assert packed.sequences_per_micro_batch == 4
    # verl: a fused fp32 log-softmax (3 x 4 bytes forward, twice that backward), no slices.
    verl = _job("verl").framework_profile.training
    assert loss_bytes_per_vocab_entry(verl, packed) == (12.0, 24.0)
    # NeMo-RL: 46 bytes forward, 22 backward, and each of the bin's 4 sequences' logit slices
    # costs a zero-filled bin-sized gradient and its sum: 16 x 4 - 4 more.
    nemo = _job("nemo-rl").framework_profile.training
    assert loss_bytes_per_vocab_entry(nemo, packed) == (46.0, 22.0 + 60.0)
    assert loss_bytes_per_vocab_entry(nemo, None) == (46.0, 22.0)

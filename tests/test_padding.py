"""Prompts of different lengths, left-padded into one batch: every model pass and the native
generator compute for each sequence what they compute for it alone (CPU only)."""

from __future__ import annotations

import torch

from executor.generation import GenerationEngine, SamplingParams
from executor.model import CausalLM, padded_causal_mask, padded_positions
from simulator.specs.presets import MODEL_PRESETS

SPEC = MODEL_PRESETS["tiny-4l"]
GPT = MODEL_PRESETS["tiny-gpt-2l"]


def left_pad(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def test_positions_and_mask_of_left_padded_rows() -> None:
    _, mask = left_pad([[5, 6, 7], [8]])
    assert padded_positions(mask).tolist() == [[0, 1, 2], [0, 0, 0]]
    allowed = padded_causal_mask(mask)
    assert allowed.shape == (2, 1, 3, 3)
    # The short row's real token sees only itself; its pads see only themselves.
    assert allowed[1, 0].tolist() == [[True, False, False], [False, True, False],
                                      [False, False, True]]
    assert allowed[0, 0].tolist() == [[True, False, False], [True, True, False],
                                      [True, True, True]]


def test_a_left_padded_sequence_computes_what_it_computes_alone() -> None:
    for spec in (SPEC, GPT):
        torch.manual_seed(0)
        model = CausalLM(spec).eval()
        values = CausalLM(spec, value_head=True).eval()
        rows = [[5, 9, 11, 7, 3], [4, 6], [8, 8, 8, 1]]
        ids, mask = left_pad(rows)
        with torch.no_grad():
            logits = model(ids, mask)
            scores = values(ids, mask)
            for i, row in enumerate(rows):
                alone = model(torch.tensor([row]))[0]
                torch.testing.assert_close(logits[i, -len(row):], alone, rtol=1e-5,
                                           atol=1e-5)
                torch.testing.assert_close(scores[i, -len(row):],
                                           values(torch.tensor([row]))[0], rtol=1e-5,
                                           atol=1e-5)
            # No padding at all: the plain causal path, bit for bit.
            full = torch.tensor([rows[0]])
            assert torch.equal(model(full, torch.ones_like(full)), model(full))


def test_native_generation_of_padded_prompts_equals_generation_alone() -> None:
    torch.manual_seed(1)
    model = CausalLM(SPEC).eval()
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    engine = GenerationEngine(SPEC)
    engine.load(weights)
    params = SamplingParams(max_new_tokens=6, eos_token_id=2, greedy=True)
    rows = [[5, 9, 11, 7, 3], [4, 6], [8, 8, 8, 1]]
    ids, mask = left_pad(rows)
    together = engine.generate(ids, params, torch.Generator(), prompt_mask=mask)
    for i, row in enumerate(rows):
        alone = engine.generate(torch.tensor([row]), params, torch.Generator())
        assert together.responses[i].tolist() == alone.responses[0].tolist()
        assert together.lengths[i] == alone.lengths[0]
        torch.testing.assert_close(together.log_probs[i], alone.log_probs[0], rtol=1e-4,
                                   atol=1e-5)
    # The generator's log-probs are the model's own (teacher forcing on the padded batch).
    sequences = torch.cat([ids, together.responses], dim=1)
    attention = torch.cat([mask, torch.ones_like(together.responses)], dim=1)
    with torch.no_grad():
        log_probs = torch.log_softmax(model(sequences, attention)[:, :-1].float(), -1)
    picked = log_probs.gather(-1, sequences[:, 1:, None]).squeeze(-1)[:, ids.shape[1] - 1:]
    for i in range(len(rows)):
        n = int(together.lengths[i])
        torch.testing.assert_close(picked[i, :n], together.log_probs[i, :n], rtol=1e-4,
                                   atol=1e-5)


def test_padded_prompts_in_waves_match_one_wave() -> None:
    torch.manual_seed(2)
    model = CausalLM(SPEC).eval()
    engine = GenerationEngine(SPEC)
    engine.load({k: v.detach() for k, v in model.state_dict().items()})
    params = SamplingParams(max_new_tokens=4, eos_token_id=2, greedy=True)
    ids, mask = left_pad([[5, 9, 11], [4], [8, 8], [7, 6, 5]])
    whole = engine.generate(ids, params, torch.Generator(), prompt_mask=mask)
    engine.kv_cache_budget_bytes = engine.sequence_kv_cache_bytes(3 + 4) * 2
    waves = engine.generate(ids, params, torch.Generator(), prompt_mask=mask)
    assert waves.responses.tolist() == whole.responses.tolist()

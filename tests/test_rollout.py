"""Sampling: left padding, EOS, masks, and agreement between sampler log-probs and the training forward."""

import pytest
import torch

from lopd.prompts import encode_prompt
from lopd.rollout import sample
from lopd.tokens import score_completions


@pytest.fixture(scope="module")
def prompts(tiny, toolworld):
    _, tok = tiny
    tasks = list(toolworld.tasks("test")[:6])
    return [encode_prompt(tok, t.messages) for t in tasks]


def test_left_padding_does_not_change_greedy_output(tiny, prompts):
    model, tok = tiny
    assert len({len(p) for p in prompts}) > 1  # the batch really is ragged
    batched = sample(model, tok, prompts, temperature=0, max_new_tokens=40)
    for i, p in enumerate(prompts):
        alone = sample(model, tok, [p], temperature=0, max_new_tokens=40)
        assert alone.texts[0] == batched.texts[i]
        n = int(alone.completion_mask.sum())
        torch.testing.assert_close(alone.sampler_logprobs[0, :n], batched.sampler_logprobs[i, :n], atol=2e-4, rtol=0)


def test_completion_mask_ends_at_first_eos(tiny, prompts):
    model, tok = tiny
    torch.manual_seed(0)
    s = sample(model, tok, prompts * 4, temperature=1.0, max_new_tokens=24)
    eos = tok.eos_token_id
    for row, mask, truncated in zip(s.completion_ids, s.completion_mask, s.truncated):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()
        hits = (row == eos).nonzero()
        if truncated:
            assert n == 24 and (len(hits) == 0 or hits[0] >= n)
        else:
            assert int(hits[0]) == n - 1  # the EOS itself is trained on: the policy must learn to stop
    assert (s.sampler_logprobs[s.completion_mask == 0] == 0).all()
    assert (s.sampler_logprobs[s.completion_mask == 1] <= 0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_equal_training_forward(tiny, prompts, temperature):
    """Before any update the importance ratio must be 1: same positions, masks and temperature."""
    model, tok = tiny
    torch.manual_seed(1)
    s = sample(model, tok, prompts * 2, temperature=temperature, max_new_tokens=32)
    with torch.no_grad():
        stats = score_completions(model, s.prompt_ids, s.prompt_mask, s.completion_ids, s.completion_mask,
                                  temperature=temperature)
    lp = stats.logprobs()
    m = s.completion_mask.bool()
    assert (lp - s.sampler_logprobs)[m].abs().max() < 1e-4

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
        assert alone.completions[0] == batched.completions[i]
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


def test_chunks_split_only_where_the_attention_bound_is_passed():
    from lopd.rollout import decode_chunks as chunks

    # bound 100 elements, extra 0: rows x longest^2 <= 100
    assert chunks([3, 3, 3], batch_size=8, max_elements=100) == [range(0, 3)]  # 3 x 9 = 27
    assert chunks([3, 3, 3, 3, 3], batch_size=2, max_elements=100) == [range(0, 2), range(2, 4), range(4, 5)]
    assert chunks([3, 6, 3], batch_size=8, max_elements=100) == [range(0, 2), range(2, 3)]  # 2 x 36 = 72; 3 x 36 > 100
    assert chunks([2, 20, 2, 2], batch_size=8, max_elements=100) == [range(0, 1), range(1, 2), range(2, 4)]  # 400 alone
    assert chunks([4, 4], batch_size=8, extra=1, max_elements=50) == [range(0, 2)]  # 2 x 25 = 50
    assert chunks([4, 4], batch_size=8, extra=2, max_elements=50) == [range(0, 1), range(1, 2)]  # 2 x 36 > 50
    assert chunks([], batch_size=4) == []


@pytest.mark.parametrize("seed", range(20))
def test_chunks_cover_every_prompt_in_order_within_the_bounds(seed):
    from lopd.rollout import decode_chunks as chunks

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 60, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
    size, bound = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 20_000, (1,), generator=g))
    parts = chunks(lengths, size, extra=5, max_elements=bound)
    assert [i for r in parts for i in r] == list(range(len(lengths)))
    for r in parts:
        assert 1 <= len(r) <= size
        assert len(r) == 1 or len(r) * (max(lengths[i] for i in r) + 5) ** 2 <= bound
    for a, b in zip(parts, parts[1:]):  # each chunk is as long as the bounds allow: one more row would pass one
        grown = range(a.start, b.start + 1)
        assert len(grown) > size or len(grown) * (max(lengths[i] for i in grown) + 5) ** 2 > bound


def test_long_prompts_decode_in_smaller_batches_with_the_same_result(tiny, prompts):
    model, tok = tiny
    bounded = sample(model, tok, prompts, temperature=0, max_new_tokens=16, max_attention_elements=1)  # one per batch
    alone = [sample(model, tok, [p], temperature=0, max_new_tokens=16) for p in prompts]
    assert bounded.completions == [a.completions[0] for a in alone]
    for i, a in enumerate(alone):
        n = int(a.completion_mask.sum())
        assert torch.equal(bounded.sampler_logprobs[i, :n], a.sampler_logprobs[0, :n])


def test_a_groups_prompt_is_read_once_and_decodes_as_if_read_per_row(tiny, prompts):
    """`train.share_prompts`: the rows of a group (one prompt, G samples) share the prompt's prefill; under the
    same seed they draw the same completions as with a prefill per row, with the same log-probs (to float
    rounding), and ragged groups (different prompt lengths) keep their own padding."""
    from lopd.rollout import shared_prefill
    from lopd.tokens import set_prompt_sharing

    model, tok = tiny
    rows = [p for p in prompts[:4] for _ in range(4)]  # 4 groups of 4, prompts of different lengths
    out = []
    for share in (False, True):
        set_prompt_sharing(share)
        try:
            torch.manual_seed(7)
            out.append(sample(model, tok, rows, temperature=1.0, max_new_tokens=32))
        finally:
            set_prompt_sharing(True)
    plain, shared = out
    assert shared.completions == plain.completions
    torch.testing.assert_close(shared.sampler_logprobs, plain.sampler_logprobs, atol=1e-4, rtol=0)
    from lopd.rollout import left_pad

    ids, mask = left_pad(rows, tok.pad_token_id)
    assert shared_prefill(model, ids, mask)  # it did share
    ids, mask = left_pad(prompts[:4], tok.pad_token_id)
    assert shared_prefill(model, ids, mask) == {}  # nothing to share

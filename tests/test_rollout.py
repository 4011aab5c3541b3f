"""Sampling: left padding, EOS, masks, and agreement between sampler log-probs and the training forward."""

import pytest
import torch

from lopd.prompts import encode_prompt
from lopd.rollout import left_pad, sample
from lopd.tokens import Latents, TokenStats, full_reverse_kl, score_completions


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


@pytest.mark.parametrize("where", ["front", "middle"])
def test_spliced_latents_equal_the_same_tokens_in_the_prompt(tiny, prompts, where):
    """Slots spliced into the prompt (in front of it, or before its column `at`) are read exactly as the
    same token embeddings written into the prompt; absent slots are invisible (no attention, no position)."""
    model, tok = tiny
    s = sample(model, tok, prompts[:3], temperature=0, max_new_tokens=20)
    context = tok("Reference answer: something", add_special_tokens=False)["input_ids"]
    K = len(context) + 3  # three absent slots after the context
    real = [p[m.bool()].tolist() for p, m in zip(s.prompt_ids, s.prompt_mask)]
    cut = [0 if where == "front" else len(r) // 2 for r in real]  # where the slots go in each prompt
    with torch.no_grad():
        embeds = model.get_input_embeddings()(torch.tensor(context))  # [C, H]
        values = torch.cat([embeds, torch.randn(3, embeds.shape[1])]).unsqueeze(0).expand(3, -1, -1)  # [3, K, H]
        present = (torch.arange(K) < len(context)).unsqueeze(0).expand(3, -1)
        pad = (s.prompt_mask == 0).sum(-1)
        latents = Latents(values, present, pad + torch.tensor(cut))
        spliced = score_completions(model, s.prompt_ids, s.prompt_mask, s.completion_ids, s.completion_mask,
                                    latents=latents).logprobs()
        joined = [r[:c] + context + r[c:] for r, c in zip(real, cut)]  # the same tokens in the prompt, re-padded
        ids, mask = left_pad(joined, tok.pad_token_id)
        via_ids = score_completions(model, ids, mask, s.completion_ids, s.completion_mask).logprobs()
    torch.testing.assert_close(spliced, via_ids, atol=1e-5, rtol=0)


def _stats(hidden, head, targets, mask, chunk):
    return TokenStats(hidden, head, targets, mask, temperature=0.9, chunk=chunk)


def test_chunked_logprobs_and_gradients_match_the_direct_computation():
    torch.manual_seed(0)
    B, T, H, V = 3, 11, 8, 50
    head = torch.nn.Linear(H, V, bias=False).double()
    hidden = torch.randn(B, T, H, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (B, T))
    mask = (torch.rand(B, T) > 0.2).double()
    chunked = _stats(hidden, head, targets, mask, chunk=4).logprobs()
    (g_chunked,) = torch.autograd.grad(chunked.sum(), hidden)
    direct = torch.log_softmax(head(hidden) / 0.9, -1).gather(-1, targets[..., None]).squeeze(-1) * mask
    (g_direct,) = torch.autograd.grad(direct.sum(), hidden)
    torch.testing.assert_close(chunked, direct)
    torch.testing.assert_close(g_chunked, g_direct)


def test_full_reverse_kl_matches_float64_reference():
    torch.manual_seed(0)
    B, T, H, V = 2, 9, 6, 40
    s_head = torch.nn.Linear(H, V, bias=False).double()
    t_head = torch.nn.Linear(H, V, bias=False).double()
    s_hidden = torch.randn(B, T, H, dtype=torch.float64, requires_grad=True)
    t_hidden = torch.randn(B, T, H, dtype=torch.float64)
    targets = torch.randint(0, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.float64)
    kl = full_reverse_kl(_stats(s_hidden, s_head, targets, mask, 4), _stats(t_hidden, t_head, targets, mask, 4))
    (g,) = torch.autograd.grad(kl.sum(), s_hidden)
    # reference: explicit probabilities, sum over the vocabulary written out another way
    p = torch.softmax(s_head(s_hidden) / 0.9, -1)
    q = torch.softmax(t_head(t_hidden) / 0.9, -1)
    ref = (p * torch.log(p / q)).sum(-1)
    (g_ref,) = torch.autograd.grad(ref.sum(), s_hidden)
    torch.testing.assert_close(kl, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(g, g_ref, atol=1e-10, rtol=1e-10)
    assert (kl >= 0).all()

"""tokens.py: per-token statistics without a [B, T, V] tensor. Every estimator against an exact float64
reference over the full vocabulary and against hand-computed values, both gradient paths against autograd,
and latent slots spliced into prompts read exactly as the same tokens."""

import math

import pytest
import torch

from lopd.rollout import left_pad, sample
from lopd.prompts import encode_prompt
from lopd.losses import divergence_chunk, full_reverse_kl, token_divergence
from lopd.tokens import Latents, TokenStats, score_completions

V, H = 30, 6


@pytest.fixture(scope="module")
def prompts(tiny, toolworld):
    _, tok = tiny
    return [encode_prompt(tok, t.messages) for t in toolworld.tasks("test")[:6]]


def _pair(B=2, T=5, seed=0, grad_teacher=False):
    g = torch.Generator().manual_seed(seed)
    s_head = torch.nn.Linear(H, V, bias=False).double()
    t_head = torch.nn.Linear(H, V, bias=False).double()
    s_h = torch.randn(B, T, H, generator=g, dtype=torch.float64, requires_grad=True)
    t_h = torch.randn(B, T, H, generator=g, dtype=torch.float64, requires_grad=grad_teacher)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.float64)
    return (TokenStats(s_h, s_head, targets, mask, 1.0, chunk=2), TokenStats(t_h, t_head, targets, mask, 1.0, chunk=2))


def _probs(stats):
    return torch.softmax(stats.head(stats.hidden), -1)  # [B, T, V], explicit


def test_full_is_exact_reverse_kl_values_and_gradients():
    s, t = _pair(grad_teacher=True)
    got = token_divergence(s, t, "full")
    p, q = _probs(s), _probs(t)
    ref = (p * (p.log() - q.log())).sum(-1)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
    gs, gt = torch.autograd.grad(got.sum(), [s.hidden, t.hidden])
    rs, rt = torch.autograd.grad(ref.sum(), [s.hidden, t.hidden])
    torch.testing.assert_close(gs, rs, atol=1e-6, rtol=0)
    torch.testing.assert_close(gt, rt, atol=1e-6, rtol=0)


def test_full_hand_computed_two_token_vocabulary():
    head = torch.nn.Linear(1, 2, bias=False).double()
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[0.0], [1.0]]))
    # student logits (0, log 3) -> p = (1/4, 3/4); teacher logits (0, 0) -> q = (1/2, 1/2)
    s = TokenStats(torch.tensor([[[math.log(3.0)]]], dtype=torch.float64), head,
                   torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1))
    t = TokenStats(torch.zeros(1, 1, 1, dtype=torch.float64), head, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1))
    expected = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert token_divergence(s, t, "full").item() == pytest.approx(expected, abs=1e-12)


def test_topk_equals_full_when_k_is_the_vocabulary_and_matches_a_manual_tail_bucket():
    s, t = _pair(grad_teacher=True)
    full = token_divergence(s, t, "full")
    torch.testing.assert_close(token_divergence(s, t, "topk", topk=V), full, atol=1e-10, rtol=0)
    k = 4
    got = token_divergence(s, t, "topk", topk=k)
    p, q = _probs(s), _probs(t)
    idx = p.topk(k, -1).indices
    pk, qk = p.gather(-1, idx), q.gather(-1, idx)
    ref = (pk * (pk / qk).log()).sum(-1) + (1 - pk.sum(-1)) * ((1 - pk.sum(-1)) / (1 - qk.sum(-1))).log()
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)
    gs = torch.autograd.grad(got.sum(), s.hidden)[0]
    rs = torch.autograd.grad(ref.sum(), s.hidden)[0]
    torch.testing.assert_close(gs, rs, atol=1e-8, rtol=0)
    assert (got <= full + 1e-12).all()  # bucketing can only merge, never add, divergence


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 1.0])
def test_jsd_family_against_explicit_formulas(alpha):
    s, t = _pair(grad_teacher=True)
    got = token_divergence(s, t, "jsd", alpha=alpha)
    p, q = _probs(s), _probs(t)
    kl = lambda a, b: (a * (a.log() - b.log())).sum(-1)  # noqa: E731
    if alpha == 0:
        ref = kl(q, p)
    elif alpha == 1:
        ref = kl(p, q)
    else:
        m = alpha * q + (1 - alpha) * p
        ref = alpha * kl(q, m) + (1 - alpha) * kl(p, m)
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), s.hidden)[0], torch.autograd.grad(ref.sum(), s.hidden)[0],
                               atol=1e-8, rtol=0)
    if alpha == 0.5:  # the classic symmetric JSD
        m = 0.5 * (p + q)
        torch.testing.assert_close(got, 0.5 * kl(p, m) + 0.5 * kl(q, m), atol=1e-10, rtol=0)


def test_sampled_estimator_gradient_matches_the_exact_gradient_in_expectation():
    """Monte Carlo over real samples y ~ p at one position; the tolerance is ~5 standard errors."""
    g = torch.Generator().manual_seed(3)
    s_head = torch.nn.Linear(H, V, bias=False).double()
    t_head = torch.nn.Linear(H, V, bias=False).double()
    s_vec = torch.randn(H, generator=g, dtype=torch.float64, requires_grad=True)
    t_vec = torch.randn(H, generator=g, dtype=torch.float64, requires_grad=True)
    N = 100_000
    p = torch.softmax(s_head(s_vec), -1).detach()
    y = torch.multinomial(p, N, replacement=True, generator=g)[:, None]  # [N, 1]
    s = TokenStats(s_vec.expand(N, 1, H), s_head, y, torch.ones(N, 1, dtype=torch.float64))
    t = TokenStats(t_vec.expand(N, 1, H), t_head, y, torch.ones(N, 1, dtype=torch.float64))
    mc = token_divergence(s, t, "sampled").mean()
    g_s, g_t = torch.autograd.grad(mc, [s_vec, t_vec])
    ps, pt = torch.softmax(s_head(s_vec), -1), torch.softmax(t_head(t_vec), -1)
    exact = (ps * (ps.log() - pt.log())).sum()
    e_s, e_t = torch.autograd.grad(exact, [s_vec, t_vec])
    assert mc.item() == pytest.approx(exact.item(), abs=0.03)  # its value estimates the KL too
    torch.testing.assert_close(g_s, e_s, atol=0.03, rtol=0)
    torch.testing.assert_close(g_t, e_t, atol=0.03, rtol=0)


def _graph_names(t: torch.Tensor) -> set[str]:
    seen, stack = set(), [t.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn.name() in seen:
            continue
        seen.add(fn.name())
        stack.extend(f for f, _ in fn.next_functions)
    return seen


@pytest.mark.parametrize("heads", ["frozen", "trained"])
@pytest.mark.parametrize("quantity", ["full", "topk", "jsd", "logprobs"])
def test_both_gradient_paths_match_autograd_over_materialised_logits(heads, quantity):
    """Frozen heads (LoRA): per-token gradients taken in the forward pass; trained heads: checkpointed
    recompute. Either way, values and gradients of a randomly weighted sum equal plain autograd over the
    full [B, T, V] float64 logits, including the heads' weight gradients when they are trained."""
    s, t = _pair(B=3, T=5, grad_teacher=True)
    for head in (s.head, t.head):
        head.requires_grad_(heads == "trained")
    w = torch.rand(3, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def compute(stats_s, stats_t):
        if quantity == "logprobs":
            return stats_s.logprobs() + stats_t.logprobs()
        return token_divergence(stats_s, stats_t, quantity, topk=4, alpha=0.3)

    got = compute(s, t)
    assert ("_PerTokenGradBackward" in _graph_names(got)) == (heads == "frozen")
    if quantity == "logprobs":  # the reference: plain autograd over the whole [B, T, V] at once
        ref = s._chunk_logprobs(s.hidden, s.targets) + t._chunk_logprobs(t.hidden, t.targets)
    else:
        ref = divergence_chunk(s.head, t.head, 1.0, 1.0, quantity, 4, 0.3, torch.float32, s.hidden, t.hidden)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
    inputs = [s.hidden, t.hidden] + ([s.head.weight, t.head.weight] if heads == "trained" else [])
    for a, b in zip(torch.autograd.grad((w * got).sum(), inputs), torch.autograd.grad((w * ref).sum(), inputs)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_teacher_gradient_flows_only_where_asked():
    s, t = _pair(grad_teacher=True)
    loss = token_divergence(s, t.detached(), "full").sum()
    loss.backward()
    assert s.hidden.grad is not None and t.hidden.grad is None
    assert all(p.grad is None for p in t.head.parameters())


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


# ----------------------------------------------------------------------------- hostile inputs


def _reference(s_logits, t_logits, estimator, alpha=1.0, topk=4):
    """The divergence computed another way: float64 over the vocabulary with the tokens that are impossible
    for both models (-inf logits) dropped from it, terms with p = 0 dropped explicitly (0 log 0 = 0)."""
    possible = ~((s_logits == -math.inf) & (t_logits == -math.inf)).flatten(0, -2).all(0)  # [V]
    s_logits, t_logits = s_logits[..., possible], t_logits[..., possible]
    ls, lt = torch.log_softmax(s_logits, -1), torch.log_softmax(t_logits, -1)
    def kl(la, lb):
        terms = torch.zeros_like(la)
        keep = la > -math.inf
        terms[keep] = la[keep].exp() * (la[keep] - lb[keep])
        return terms.sum(-1)
    if estimator == "full":
        return kl(ls, lt)
    if estimator == "jsd":  # the family's ends are the two KLs (as the estimator defines them)
        if alpha == 0:
            return kl(lt, ls)
        lm = torch.log(alpha * lt.exp() + (1 - alpha) * ls.exp())
        return alpha * kl(lt, lm) + (1 - alpha) * kl(ls, lm)
    idx = ls.topk(topk, -1).indices
    out = kl(ls.gather(-1, idx), lt.gather(-1, idx))
    rest = torch.ones_like(ls, dtype=torch.bool).scatter(-1, idx, False)
    return out + kl(ls.masked_fill(~rest, -math.inf).logsumexp(-1, keepdim=True),
                    lt.masked_fill(~rest, -math.inf).logsumexp(-1, keepdim=True))


def _biased_pair(bias_value=-math.inf, B=2, T=3, seed=4):
    """Student and teacher heads with a -inf bias on a third of the vocabulary (a masked vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    heads = []
    for _ in range(2):
        head = torch.nn.Linear(H, V, bias=True).double()
        with torch.no_grad():
            head.weight.copy_(torch.randn(V, H, generator=g, dtype=torch.float64))
            head.bias.zero_()
            head.bias[::3] = bias_value
        heads.append(head)
    s_h = torch.randn(B, T, H, generator=g, dtype=torch.float64, requires_grad=True)
    t_h = torch.randn(B, T, H, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.ones(B, T, dtype=torch.long)  # token 1 is never masked
    mask = torch.ones(B, T, dtype=torch.float64)
    return (TokenStats(s_h, heads[0], targets, mask, 1.0, chunk=2), TokenStats(t_h, heads[1], targets, mask, 1.0, chunk=2))


@pytest.mark.parametrize("estimator, alpha", [("full", 1.0), ("jsd", 0.0), ("jsd", 0.4), ("topk", 1.0)])
def test_minus_inf_logits_give_the_exact_finite_value_and_gradient(estimator, alpha):
    s, t = _biased_pair()
    got = token_divergence(s, t, estimator, alpha=alpha, topk=4)
    ref = _reference(s.head(s.hidden), t.head(t.hidden), estimator, alpha)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)
    gs, gt = torch.autograd.grad(got.sum(), [s.hidden, t.hidden])
    rs, rt = torch.autograd.grad(ref.sum(), [s.hidden, t.hidden])
    assert torch.isfinite(gs).all() and torch.isfinite(gt).all()
    torch.testing.assert_close(gs, rs, atol=1e-10, rtol=0)
    torch.testing.assert_close(gt, rt, atol=1e-10, rtol=0)


def test_a_non_finite_value_at_a_masked_position_does_not_reach_the_loss():
    from lopd.losses import aggregate

    s, t = _biased_pair(bias_value=0.0)
    with torch.no_grad():
        s.hidden[0, 2] = math.inf  # garbage where nothing is trained (a padded position)
    s.mask[0, 2] = 0
    for estimator in ("full", "sampled"):
        per = token_divergence(s, t.detached(), estimator)
        loss = aggregate(per, s.mask)
        (grad,) = torch.autograd.grad(loss, s.hidden)
        assert torch.isfinite(loss) and torch.isfinite(grad).all() and grad[0, 2].abs().max() == 0
        clean = _reference(s.head(s.hidden), t.head(t.hidden), "full")[s.mask.bool()].mean()
        if estimator == "full":
            assert loss.item() == pytest.approx(clean.item(), abs=1e-12)


def test_each_side_reads_its_own_temperature():
    s, t = _biased_pair(bias_value=0.0)
    s.temperature, t.temperature = 0.7, 1.3
    got = token_divergence(s, t, "full")
    ref = _reference(s.head(s.hidden) / 0.7, t.head(t.hidden) / 1.3, "full")
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("alpha", [-0.1, 1.5])
def test_alpha_outside_zero_one_is_an_error(alpha):
    s, t = _biased_pair(bias_value=0.0)
    with pytest.raises(ValueError, match="alpha"):
        token_divergence(s, t, "jsd", alpha=alpha)
    from lopd.config import load_config
    from lopd.errors import ConfigError

    with pytest.raises(ConfigError, match="algorithm.distill.alpha"):
        load_config(None, [f"algorithm.distill.alpha={alpha}"])


def test_a_bf16_head_keeps_the_gradient_direction_when_its_product_is_taken_in_float32():
    """Logit scale 50, V = 49,152 (SmolLM2's vocabulary), bf16 weights: rounding the logits to bf16 before the
    upcast loses the gradient's direction; the same bf16 weights multiplied in float32 keep it."""
    g = torch.Generator().manual_seed(0)
    Vb, Hb = 49_152, 64
    w_s = (torch.randn(Vb, Hb, generator=g) * 50 / math.sqrt(Hb)).bfloat16()
    w_t = (w_s.float() + 0.05 * torch.randn(Vb, Hb, generator=g)).bfloat16()
    s_h = torch.randn(1, 4, Hb, generator=g).bfloat16().requires_grad_(True)
    t_h = torch.randn(1, 4, Hb, generator=g).bfloat16()
    heads = [torch.nn.Linear(Hb, Vb, bias=False) for _ in range(2)]
    for head, w in zip(heads, (w_s, w_t)):
        head.to(torch.bfloat16).weight.data.copy_(w)
        head.requires_grad_(False)
    targets, mask = torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4)
    ref_h = s_h.detach().double().requires_grad_(True)
    ref = _reference(ref_h @ w_s.double().T, t_h.double() @ w_t.double().T, "full").sum()
    (want,) = torch.autograd.grad(ref, ref_h)
    errors = {}
    for name, dtype in (("float32", torch.float32), ("model", None)):
        s = TokenStats(s_h, heads[0], targets, mask, 1.0, chunk=4, head_dtype=dtype)
        t = TokenStats(t_h, heads[1], targets, mask, 1.0, chunk=4, head_dtype=dtype)
        (got,) = torch.autograd.grad(token_divergence(s, t, "full").sum(), s_h)
        errors[name] = float((got.double() - want).norm() / want.norm())
    # measured: 1.5e-3 in float32 against 0.14 with bf16 logits
    assert errors["float32"] < 1e-2 and errors["model"] > 20 * errors["float32"], errors


def _groups(model, tok, prompts, G=3, max_new_tokens=16):
    """G sampled completions of each prompt, grouped as a rollout batch is ([P0 x G, P1 x G, ...])."""
    torch.manual_seed(0)
    return sample(model, tok, [p for p in prompts for _ in range(G)], temperature=1.0, max_new_tokens=max_new_tokens)


@pytest.mark.parametrize("with_latents", [False, True])
def test_rows_that_share_a_prompt_share_its_forward_with_the_same_values_and_gradients(tiny, prompts, with_latents):
    """`train.share_prompts`: each distinct prompt runs once, its keys and values read by every row's
    completion. The log-probs, the parameters' gradients and the latent slots' gradients equal one forward
    per row (float32, to 1e-5); it shares only rows whose prompt (and slots) are the same, and runs each row
    on its own under activation checkpointing in training."""
    from lopd.tokens import set_prompt_sharing, shared_prompts

    model, tok = tiny
    s = _groups(model, tok, prompts[:3])  # 9 rows, 3 distinct prompts
    first, inverse = shared_prompts(s.prompt_ids, s.prompt_mask, None)
    assert sorted(first.tolist()) == [0, 3, 6]  # the first row of each group
    assert len(set(inverse.tolist())) == 3
    K, H = 4, model.config.hidden_size
    torch.manual_seed(1)
    unique = torch.randn(3, K, H) * 0.1
    latents = None
    results = []
    for share in (False, True):
        set_prompt_sharing(share)
        try:
            model.zero_grad()
            values = unique.clone().requires_grad_()
            if with_latents:  # one slot set per group, indexed per row (as a composer's output is)
                rows = values[torch.arange(9) // 3]  # [9, K, H]
                latents = Latents(rows, torch.ones(9, K, dtype=torch.bool), (s.prompt_mask == 0).sum(-1) + 2)
            stats = score_completions(model, s.prompt_ids, s.prompt_mask, s.completion_ids, s.completion_mask,
                                      latents=latents)
            lp = stats.logprobs()
            (lp.sum() / s.completion_mask.sum()).backward()
            results.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                            values.grad.clone() if with_latents else None))
        finally:
            set_prompt_sharing(True)
    (a, ga, va), (b, gb, vb) = results
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert ga.keys() == gb.keys() and ga
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], atol=1e-5, rtol=1e-4, msg=name)
    if with_latents:
        torch.testing.assert_close(va, vb, atol=1e-6, rtol=1e-4)
        other = Latents(latents.values.detach().clone(), latents.present, latents.at)
        other.values[1] += 1.0  # one row of the first group reads other slots: that group is not shared
        assert shared_prompts(s.prompt_ids, s.prompt_mask, other) is None
    model.zero_grad()


def test_prompt_sharing_steps_aside_where_it_cannot_apply(tiny, prompts):
    """Every prompt distinct: nothing to share. Activation checkpointing in training (HF turns the cache off):
    one forward per row, the same values."""
    from lopd.tokens import cache_usable, shared_prompts

    model, tok = tiny
    s = _groups(model, tok, prompts[:2], G=1)
    assert shared_prompts(s.prompt_ids, s.prompt_mask, None) is None
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        model.train()
        assert not cache_usable(model)
        with torch.no_grad():
            assert cache_usable(model)  # no backward: the cache is fine
    finally:
        model.gradient_checkpointing_disable()
    assert cache_usable(model)

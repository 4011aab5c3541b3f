"""Self-distillation core: estimators against exact float64 references, teacher alignment, teacher
weights, and each baseline's privileged context on hand-made batches."""

import copy
import math

import pytest
import torch

from lopd.algorithms import build_algorithm
from lopd.config import load_config
from lopd.envs.base import Task
from lopd.models import load_policy
from lopd.prompts import encode_prompt, with_context
from lopd.rollout import RolloutBatch, sample
from lopd.teacher import EMATeacher, FrozenTeacher, LiveTeacher
from lopd.tokens import TokenStats, _divergence_chunk, token_divergence

V, H = 30, 6


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
        ref = _divergence_chunk(s.head, t.head, 1.0, quantity, 4, 0.3, s.hidden, t.hidden)
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


# ----------------------------------------------------------------------------- teacher alignment


def test_teacher_logprobs_equal_a_separate_forward_over_context_prompt_completion(tiny, toolworld):
    model, tok = tiny
    tasks = list(toolworld.tasks("test")[:3])
    prompts = [encode_prompt(tok, t.messages) for t in tasks]
    s = sample(model, tok, prompts, temperature=0.0, max_new_tokens=24)
    batch = RolloutBatch(**vars(s), tasks=tasks, group=torch.arange(3), rewards=torch.zeros(3),
                         success=torch.zeros(3, dtype=torch.bool), feedback=[""] * 3)
    contexts = [f"Reference answer: {toolworld.reference(t)}" for t in tasks]
    with torch.no_grad():
        got = FrozenTeacher(model, tok).score(batch, contexts).logprobs()
        for i, (task, ctx) in enumerate(zip(tasks, contexts)):
            text = tok.apply_chat_template(with_context(task.messages, ctx), tokenize=False, add_generation_prompt=True)
            prompt = tok(text, add_special_tokens=False)["input_ids"]
            n = int(s.completion_mask[i].sum())
            full = torch.tensor([prompt + s.completion_ids[i, :n].tolist()])
            logits = model(input_ids=full).logits[0]  # [L, V] a plain forward, no padding at all
            ref = torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + n], -1)
            ref = ref.gather(-1, s.completion_ids[i, :n, None]).squeeze(-1)
            torch.testing.assert_close(got[i, :n], ref, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- teacher weights


def _student_step(model):
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.01)


def test_frozen_teacher_never_changes_and_ema_moves_at_its_rate():
    cfg = load_config(None, [])
    model, _ = load_policy(cfg.model)
    frozen = FrozenTeacher(model)
    ema = EMATeacher(model, rate=0.25)
    before = copy.deepcopy(frozen.model.state_dict())
    ema_before = {k: v.clone() for k, v in ema.model.state_dict().items()}
    _student_step(model)
    ema.after_step()
    for k, v in frozen.model.state_dict().items():
        assert torch.equal(v, before[k])
    student = model.state_dict()
    for k, v in ema.model.state_dict().items():
        torch.testing.assert_close(v, 0.75 * ema_before[k] + 0.25 * student[k])


def test_lora_ema_teacher_is_a_second_adapter_moving_at_its_rate():
    cfg = load_config(None, ["model.lora.enabled=true", "model.lora.r=2"])
    model, _ = load_policy(cfg.model)
    ema = EMATeacher(model, rate=0.5)
    pairs = ema._pairs()
    assert pairs and all(not e.requires_grad for e, _ in pairs) and all(s.requires_grad for _, s in pairs)
    old = [e.detach().clone() for e, _ in pairs]
    _student_step(model)
    ema.after_step()
    for (e, s), o in zip(ema._pairs(), old):
        torch.testing.assert_close(e, 0.5 * o + 0.5 * s.detach())
    with ema.active():
        assert all(not e.requires_grad for e, _ in ema._pairs())
    assert model.active_adapter == "default"


def test_live_teacher_passes_no_gradient_to_the_weights(tiny):
    model, _ = tiny
    live = LiveTeacher(model)
    x = torch.randint(0, 100, (1, 5))
    with live.active() as m:
        out = m(input_ids=x).logits.sum()
    assert all(p.requires_grad for p in model.parameters())  # restored after the forward
    assert not out.requires_grad


# ----------------------------------------------------------------------------- contexts


def _hand_batch(toolworld):
    """Two groups of three: group 0 has one success (index 1), group 1 none."""
    tasks = [toolworld.tasks("train")[0]] * 3 + [toolworld.tasks("train")[1]] * 3
    texts = ["bad0", toolworld.reference(tasks[0]), "bad2", "bad3", "bad4", "bad5"]
    feedback = ["Parameter 'date' has the wrong value.", "Correct call.", "Missing parameter 'city'.", "f3", "f4", "f5"]
    z = torch.zeros(6, 1, dtype=torch.long)
    return RolloutBatch(prompt_ids=z, prompt_mask=z, completion_ids=z, completion_mask=z, sampler_logprobs=z.float(),
                        texts=texts, truncated=torch.zeros(6, dtype=torch.bool), tasks=tasks,
                        group=torch.tensor([0, 0, 0, 1, 1, 1]), rewards=torch.tensor([0, 1, 0, 0, 0, 0.0]),
                        success=torch.tensor([0, 1, 0, 0, 0, 0], dtype=torch.bool), feedback=feedback)


def _algorithm(name, tiny, toolworld, overrides=(), run=None):
    model, tok = tiny
    algo = build_algorithm(load_config(None, [f"algorithm.name={name}", *overrides]))
    algo.setup(policy=model, tokenizer=tok, env=toolworld, run=run)
    return algo


def test_opsd_context_is_the_reference_answer(toolworld, tiny):
    algo = _algorithm("opsd", tiny, toolworld)
    batch = _hand_batch(toolworld)
    ctx = algo.build_context(batch, 1)
    assert ctx.texts == [f"Reference answer: {toolworld.reference(t)}" for t in batch.tasks]


def test_sdpo_context_feedback_sibling_and_mask(toolworld, tiny):
    algo = _algorithm("sdpo", tiny, toolworld)
    batch = _hand_batch(toolworld)
    texts = algo.build_context(batch, 1).texts
    success_call = batch.texts[1]
    assert "Parameter 'date' has the wrong value." in texts[0] and success_call in texts[0] and "bad0" in texts[0]
    assert "Missing parameter 'city'." in texts[2] and success_call in texts[2]
    assert texts[1] is None  # the lone success is not reprompted with itself by default
    assert texts[3:] == [None, None, None]  # a group without success: masked out of distillation
    algo = _algorithm("sdpo", tiny, toolworld, ["algorithm.sdpo.reprompt_lone_success=true"])
    texts = algo.build_context(batch, 1).texts
    assert texts[1] is not None and success_call in texts[1]


def test_skill_sd_learns_skills_from_successes_and_retrieves_them(toolworld, tiny, tmp_path):
    from lopd.runs import RunDir

    algo = _algorithm("skill_sd", tiny, toolworld, run=RunDir(tmp_path))
    batch = _hand_batch(toolworld)
    ctx = algo.build_context(batch, 1)
    assert ctx.texts == [None] * 6  # an empty library gives no context
    metrics = algo.remember(batch, ctx, 1)
    assert metrics["context/skills"] == 1  # one success -> one skill; failures teach nothing
    texts = algo.build_context(batch, 2).texts
    assert all(t is not None and batch.texts[1] in t for t in texts[:3])
    algo.remember(batch, ctx, 2)
    assert algo.library.size == 1  # deduplicated
    # the library persists in the run directory and a resume forgets skills from redone steps
    again = _algorithm("skill_sd", tiny, toolworld, run=RunDir(tmp_path))
    assert again.library.size == 1
    again.load_state_dict({}, 0)
    assert again.library.size == 0


def test_self_distillation_masks_trajectories_without_context(toolworld, tiny):
    algo = _algorithm("sdpo", tiny, toolworld)
    s, t = _pair(B=6, T=3)
    batch = _hand_batch(toolworld)
    ctx = algo.build_context(batch, 1)
    loss, metrics = algo.distill_loss(batch, ctx, s, t)
    per = token_divergence(s, t, "full")
    keep = torch.tensor([c is not None for c in ctx.texts], dtype=torch.float64)[:, None]
    assert loss.item() == pytest.approx(((per * keep).sum() / (keep.sum() * 3)).item())
    assert metrics["context/coverage"] == pytest.approx(2 / 6)


def test_task_type_is_frozen_dataclass():
    t = Task("x", ({"role": "user", "content": "hi"},), None)
    with pytest.raises(Exception):
        t.id = "y"


def test_the_hybrid_policy_gradient_reaches_the_student(toolworld):
    """distill.coef = 0, pg_weight = 1: a self-distillation method's update is exactly GRPO's (a no-grad
    log-prob cached for a metric once hid the policy gradient from the student)."""
    from conftest import rollouts, session_for
    from lopd.models import trainable_parameters
    from lopd.loop import update

    common = ["rollout.tasks_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=32"]
    grpo = session_for(["algorithm.name=grpo", *common], env=toolworld)
    hybrid = session_for(["algorithm.name=opsd", "algorithm.distill.coef=0.0", "algorithm.distill.pg_weight=1.0",
                          *common], env=toolworld)
    batch = rollouts(grpo, list(toolworld.tasks("train")[:2]), [1.0, 0.0, 0.0, 1.0] * 2)
    after = []
    for s in (grpo, hybrid):
        s.optimizer = torch.optim.SGD(trainable_parameters(s.model), lr=1.0)
        s.scheduler = torch.optim.lr_scheduler.LambdaLR(s.optimizer, lambda step: 1.0)
        before = [p.detach().clone() for p in s.model.parameters()]
        update(s.model, s.algorithm, s.optimizer, s.scheduler, batch, s.algorithm.build_context(batch, 1), s.cfg)
        after.append([p.detach() - b for p, b in zip(s.model.parameters(), before)])
    assert any(d.abs().max() > 0 for d in after[1])
    for a, b in zip(*after):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0)

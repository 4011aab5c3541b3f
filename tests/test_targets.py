"""Distillation targets that do not pull the student home (`algorithm.distill.target`): the residual target
(the student shifted by the context's clipped log-ratio) on hand-computed values, against a float64
full-vocabulary reference, and bounded where the context lifts a token from near zero; the gated target
distils only where the context moves the teacher."""

import math

import pytest
import torch

from lopd import losses
from lopd.tokens import TokenStats


def _stats(logits: list[list[float]], requires_grad: bool = False) -> TokenStats:
    """One position per row; an identity head, so the hidden state is the logit vector.   [B, V]"""
    V = len(logits[0])
    head = torch.nn.Linear(V, V, bias=False).double()
    with torch.no_grad():
        head.weight.copy_(torch.eye(V, dtype=torch.float64))
    head.requires_grad_(False)
    h = torch.tensor(logits, dtype=torch.float64)[:, None, :].requires_grad_(requires_grad)  # [B, 1, V]
    n = len(logits)
    return TokenStats(h, head, torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.float64))


def _log(ps):
    return [math.log(p) for p in ps]


def test_residual_target_by_hand():
    """p = (.5, .3, .2), pi_T(.|c) = (.2, .6, .2), pi_T(.|none) = (.4, .3, .3): r = log(1/2, 2, 2/3);
    q* = p e^r / Z; the value is KL(p || q*), the gradient p_j (mean_p r - r_j) (a policy gradient on r)."""
    p, tc, tb = [0.5, 0.3, 0.2], [0.2, 0.6, 0.2], [0.4, 0.3, 0.3]
    student = _stats([_log(p)], requires_grad=True)
    got = losses.residual_divergence(student, _stats([_log(tc)]), _stats([_log(tb)]), beta=1.0, clip=10.0, topk=0)
    r = [math.log(a / b) for a, b in zip(tc, tb)]
    z = sum(pi * math.exp(ri) for pi, ri in zip(p, r))
    q = [pi * math.exp(ri) / z for pi, ri in zip(p, r)]
    assert got.item() == pytest.approx(sum(pi * math.log(pi / qi) for pi, qi in zip(p, q)), abs=1e-12)
    (grad,) = torch.autograd.grad(got.sum(), student.hidden)
    mean_r = sum(pi * ri for pi, ri in zip(p, r))
    for j in range(3):
        assert grad[0, 0, j].item() == pytest.approx(p[j] * (mean_r - r[j]), abs=1e-12)
    # where the context changes nothing the target is the student itself: no pull at all
    same = losses.residual_divergence(student, _stats([_log(tb)]), _stats([_log(tb)]), beta=1.0, clip=10.0, topk=0)
    assert same.item() == pytest.approx(0.0, abs=1e-15)


def test_residual_target_matches_a_float64_full_vocabulary_reference():
    g = torch.Generator().manual_seed(0)
    B, T, H, V = 3, 5, 6, 11
    heads = [torch.nn.Linear(H, V).double() for _ in range(3)]
    for head in heads:
        head.requires_grad_(False)
    hs = [torch.randn(B, T, H, generator=g, dtype=torch.float64) for _ in range(3)]
    student = TokenStats(hs[0].clone().requires_grad_(True), heads[0], torch.zeros(B, T, dtype=torch.long),
                         torch.ones(B, T, dtype=torch.float64), chunk=2)
    teacher = TokenStats(hs[1], heads[1], student.targets, student.mask, chunk=2)
    base = TokenStats(hs[2], heads[2], student.targets, student.mask, chunk=2)
    beta, clip, k = 1.5, 0.7, 4
    got = losses.residual_divergence(student, teacher, base, beta=beta, clip=clip, topk=k)
    ls = torch.log_softmax(heads[0](student.hidden), -1)  # [B, T, V], one tensor, no chunks
    lt, lb = torch.log_softmax(heads[1](hs[1]), -1), torch.log_softmax(heads[2](hs[2]), -1)
    r = (lt - lb).clamp(-clip, clip)
    top = torch.zeros_like(r, dtype=torch.bool).scatter_(-1, lt.topk(k, -1).indices, True)
    lq = torch.log_softmax(ls.detach() + beta * torch.where(top, r, torch.zeros_like(r)), -1)
    want = (ls.exp() * (ls - lq)).sum(-1)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    w = torch.rand(B, T, generator=g, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad((w * got).sum(), student.hidden)[0],
                               torch.autograd.grad((w * want).sum(), student.hidden)[0], atol=1e-12, rtol=0)


def _train_toy_student(clip: float, topk: int, steps: int = 100) -> float:
    """A student (free logits over 5 tokens) trained by plain gradient descent on KL(p || q*), q* rebuilt from
    the current p every step as in training, against a teacher whose context lifts token 4 from 1e-8 to 1e-3
    (a value copied from a retrieved example, still unlikely to the teacher itself). Returns the student's
    final probability of token 4 (it starts at 0.01)."""
    teacher_c = torch.log(torch.tensor([[0.45, 0.3, 0.15, 0.099, 1e-3]], dtype=torch.float64))
    teacher_0 = torch.log(torch.tensor([[0.45, 0.3, 0.15, 0.1 - 1e-8, 1e-8]], dtype=torch.float64))
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.09, 0.01]], dtype=torch.float64)).requires_grad_(True)
    for _ in range(steps):
        student = _stats(logits.tolist(), requires_grad=True)
        loss = losses.residual_divergence(student, _stats(teacher_c.tolist()), _stats(teacher_0.tolist()),
                                          beta=1.0, clip=clip, topk=topk).sum()
        (grad,) = torch.autograd.grad(loss, student.hidden)
        with torch.no_grad():
            logits -= 5.0 * grad[:, 0]
    return float(torch.softmax(logits.detach(), -1)[0, 4])


def test_the_bound_keeps_the_residual_target_from_running_to_a_token_lifted_from_near_zero():
    """Unbounded, the log-ratio log(1e-3 / 1e-8) = 11.5 is a dense reward that makes the student run to a token
    the teacher itself gives 1e-3. Restricted to the teacher's top-k tokens, the ratio never lifts it (the
    stationary point is then a token the teacher ranks high); the clip alone only slows the run (it bounds
    each step's lift by e^(beta clip), not where repeated steps end)."""
    unbounded = _train_toy_student(clip=math.inf, topk=0)
    assert unbounded > 0.9
    assert _train_toy_student(clip=1.0, topk=3) < 0.0101  # token 4 is outside the teacher's top-3: never lifted
    # the clip alone bounds each step's lift, not where the steps end: it is the top-k that bounds the target
    assert _train_toy_student(clip=1.0, topk=0, steps=3) < _train_toy_student(clip=math.inf, topk=0, steps=3) / 5
    assert _train_toy_student(clip=1.0, topk=0) > 0.9


def test_context_shift_and_the_gated_target(toolworld, tiny):
    """The gate passes the positions where KL(pi_T(.|c) || pi_T(.|none)) exceeds the threshold; elsewhere the
    distillation term is exactly 0, and the mean still counts every distilled token."""
    from lopd.algorithms import build_algorithm
    from lopd.algorithms.base import Context
    from lopd.config import load_config
    from lopd.rollout import RolloutBatch
    from lopd.update import whole_batch

    cfg = load_config("sdpo", ["algorithm.distill.target=gated", "algorithm.distill.gate_threshold=0.1",
                               "algorithm.distill.pg_weight=0"])
    algo = build_algorithm(cfg)
    algo.setup(policy=tiny[0], tokenizer=tiny[1], env=toolworld)
    # rows 0-1: the context moves the teacher (shift ln 2 - ...), rows 2-3: it changes nothing (shift 0)
    student = _stats([[0.0, 0.0, 0.0]] * 4, requires_grad=True)
    teacher = _stats([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    base = _stats([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    z = torch.zeros(4, 1, dtype=torch.long)
    tasks = [toolworld.tasks("train")[0]] * 4
    batch = RolloutBatch(prompt_ids=z, prompt_mask=z, completion_ids=z, completion_mask=torch.ones(4, 1),
                         sampler_logprobs=z.double(), completions=[""] * 4, truncated=torch.zeros(4, dtype=torch.bool),
                         tasks=tasks, group=torch.zeros(4, dtype=torch.long), rewards=torch.zeros(4),
                         success=torch.zeros(4, dtype=torch.bool), feedback=[""] * 4)
    ctx = Context(step=1, advantages=torch.zeros(4), privileged=["c"] * 4, has_context=torch.ones(4, dtype=torch.bool))
    terms = algo.distill_terms(batch, ctx, student, teacher, base)
    shift = losses.context_shift(teacher, base)[:, 0]
    assert shift[0] > 0.1 and shift[1] > 0.1 and shift[2] == pytest.approx(0.0, abs=1e-15) and shift[3] == 0
    full = losses.token_divergence(student, teacher.detached(), "full")[:, 0]
    values = terms["loss/distill"].values[:, 0]
    assert values[:2].tolist() == pytest.approx(full[:2].tolist(), abs=1e-12) and values[2:].tolist() == [0.0, 0.0]
    _, measured = whole_batch(terms)
    assert measured["loss/distill"] == pytest.approx(float(full[:2].sum()) / 4, abs=1e-12)
    assert measured["context/gated_share"] == pytest.approx(0.5)

"""Loss functions: small, pure, shape-commented. Every one is tested against hand-computed values.

Shapes: B trajectories, T completion positions, V the vocabulary. `mask` is 1 on tokens the loss trains on.

    advantages        group_advantages
    reductions        aggregate / aggregate_count (token or sequence), per_unit, sequence_mean
    policy gradient   clipped_policy_gradient, kl_sampled (k1/k2/k3), policy_kl
    divergences       token_divergence (full / topk / sampled / jsd over the vocabulary, in chunks), full_reverse_kl
    targets           context_shift (gated: where the context moves the teacher), residual_divergence (the
                      student shifted by the context's log-ratio)
    LOPD              privileged_margin, privilege, constrained
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor, nn

from lopd.schema import Aggregation, DistillEstimator, KLEstimator
from lopd.tokens import TokenStats, head_logits, masked, per_token, trained_positions

__all__ = ["masked"]  # re-exported: the one masking rule (a masked inf stays out of values and gradients)


def group_advantages(rewards: Tensor, group: Tensor, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """A_i = (r_i - mean of its group) [/ (std of its group + eps)].   rewards, group: [B] -> [B]

    std is the unbiased sample std (torch's default), as in the GRPO reference implementations.
    A group whose rewards are all equal gets advantage 0 everywhere.
    """
    rewards = rewards.float()
    ids, inverse = torch.unique(group, return_inverse=True)
    n = torch.zeros(len(ids), dtype=rewards.dtype).index_add_(0, inverse, torch.ones_like(rewards))  # [G]
    mean = torch.zeros(len(ids), dtype=rewards.dtype).index_add_(0, inverse, rewards) / n  # [G]
    centered = rewards - mean[inverse]  # [B]
    if not normalize_std:
        return centered
    var = torch.zeros(len(ids), dtype=rewards.dtype).index_add_(0, inverse, centered**2) / (n - 1).clamp(min=1)
    return centered / (var.sqrt()[inverse] + eps)


# ------------------------------------------------------------------------------------------- reductions


def per_unit(per_token: Tensor, mask: Tensor, mode: Aggregation = Aggregation.token) -> tuple[Tensor, Tensor]:
    """The units a per-token loss is averaged over, and their mask.   [B, T], [B, T] -> ([B, T], [B, T]) or ([B], [B])

    token:    every masked token is a unit (each token weighs the same)
    sequence: each sequence with a masked token is a unit, valued at its tokens' mean (each sequence weighs
              the same)
    The loss is then sum(masked(values, units)) / count(units), the count taken over the whole minibatch.
    """
    mask = mask.to(per_token.dtype)
    if mode == Aggregation.token:
        return per_token, mask
    if mode == Aggregation.sequence:
        per_seq = masked(per_token, mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
        return per_seq, (mask.sum(-1) > 0).to(per_token.dtype)
    raise ValueError(f"aggregation '{mode}' is not one of {', '.join(Aggregation)}")


def aggregate(per_token: Tensor, mask: Tensor, mode: Aggregation = Aggregation.token, total: float | None = None) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar: sum over its units (`per_unit`) / their count.

    total: the denominator, counted by `aggregate_count` over the whole minibatch (every micro-batch, every
    rank); the result is then this micro-batch's share of the minibatch's value, and the shares add up to
    it exactly however the minibatch is split. None: this call's own count (the mean over these rows).
    """
    values, units = per_unit(per_token, mask, mode)
    return masked(values, units).sum() / _denominator(units.sum(), total)


def aggregate_count(mask: Tensor, mode: Aggregation = Aggregation.token) -> float:
    """What `aggregate` divides by over these rows: masked tokens (token) or sequences with any (sequence).
    [B, T] -> float"""
    return float(per_unit(mask.double(), mask, mode)[1].sum())


def _denominator(local: Tensor, total: float | None) -> Tensor | float:
    return local.clamp(min=1) if total is None else max(float(total), 1.0)


def sequence_mean(per_token: Tensor, mask: Tensor) -> Tensor:
    """Mean over each sequence's masked tokens.   [B, T] -> [B]"""
    mask = mask.to(per_token.dtype)
    return masked(per_token, mask).sum(-1) / mask.sum(-1).clamp(min=1)


# ------------------------------------------------------------------------------------- policy gradient


def clipped_policy_gradient(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, clip_low: float = 0.2,
                            clip_high: float = 0.2) -> tuple[Tensor, Tensor]:
    """PPO/GRPO per-token objective, as a loss to minimise.

    logprobs, old_logprobs: [B, T]; advantages: [B].  Returns (loss [B, T], clipped [B, T] bool):
        ratio = exp(logprobs - old_logprobs)
        loss  = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
    """
    ratio = torch.exp(logprobs - old_logprobs)  # [B, T]
    adv = advantages.unsqueeze(-1)  # [B, 1]
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def kl_sampled(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = KLEstimator.k2) -> Tensor:
    """Per-token estimate of KL(pi || ref) from the sampled tokens y_t ~ pi.   [B, T] -> [B, T]

    With d = log pi(y_t) - log ref(y_t):
      k1 = d                      unbiased value; as a loss its expected gradient is 0 (useless)
      k2 = d^2 / 2                biased value; gradient d * grad log pi = the exact reverse-KL gradient
      k3 = exp(-d) - 1 + d        unbiased, non-negative value; gradient (1 - exp(-d)) grad log pi, whose
                                  expectation is the gradient of the *forward* KL(ref || pi)
    Use k2 to optimise reverse KL, k3 to report it (`algorithm.pg.kl_estimator` offers those two; k1 is here
    for the record and its test).
    """
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d**2
    if estimator == "k3":
        return torch.exp(-d) - 1 + d
    raise ValueError(f"sampled KL estimator '{estimator}' is not one of k1, k2, k3")


def policy_kl(student: TokenStats, reference: TokenStats, estimator: KLEstimator) -> Tensor:
    """Per-token KL(student || reference), sampled (k1/k2/k3) or over the full vocabulary.   -> [B, T]"""
    if estimator == KLEstimator.full:
        return full_reverse_kl(student, reference)
    return kl_sampled(student.logprobs(), reference.logprobs().detach(), estimator)


# ------------------------------------------------------------------------------------------ divergences

LOG_FLOOR = math.log(torch.finfo(torch.float32).tiny)  # -87.34: float32's smallest normal probability, 1.2e-38


def floor_impossible(log_b: Tensor, log_a: Tensor) -> Tensor:
    """log_b, raised to LOG_FLOOR where b gives probability 0 to a token a gives mass to (elsewhere unchanged,
    bit for bit). KL(a || b) is then finite with a finite gradient that moves a's mass off those tokens,
    instead of +inf with a NaN gradient: a teacher that calls a sampled token impossible (a -inf logit the
    student does not share) is one defined, counted case (`impossible`), not a poisoned update."""
    return torch.where((log_b == -math.inf) & (log_a > -math.inf), torch.full((), LOG_FLOOR, dtype=log_b.dtype,
                                                                               device=log_b.device), log_b)


def impossible(teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """[B, T] float: 1 on trained tokens the teacher gives probability 0 (floored by `floor_impossible`)."""
    return ((teacher_logprobs == -math.inf) & (mask > 0)).to(mask.dtype)


def xlogy_divergence(log_a: Tensor, log_b: Tensor) -> Tensor:
    """sum_v a_v (log a_v - log b_v), with 0 log 0 = 0 exactly in value and gradient (-inf logits: a masked
    vocabulary, a -inf bias).   [..., V] -> [...]"""
    present = log_a > -math.inf
    log_b = floor_impossible(log_b, log_a)
    return (log_a.exp() * torch.where(present, log_a - log_b, torch.zeros((), dtype=log_a.dtype,
                                                                          device=log_a.device))).sum(-1)


def safe_logsumexp(x: Tensor, dim: int, keepdim: bool = False) -> Tensor:
    """logsumexp whose gradient stays finite where every entry is -inf (the result there is -inf and its
    gradient 0, instead of exp(-inf - -inf) = nan)."""
    empty = (x == -math.inf).all(dim=dim, keepdim=True)
    out = torch.where(empty, torch.zeros((), dtype=x.dtype, device=x.device), x).logsumexp(dim, keepdim=True)
    out = torch.where(empty, torch.full((), -math.inf, dtype=x.dtype, device=x.device), out)
    return out if keepdim else out.squeeze(dim)


def divergence_chunk(s_head: nn.Module, t_head: nn.Module, s_temperature: float, t_temperature: float,
                     estimator: DistillEstimator, topk: int, alpha: float, head_dtype, s_hidden: Tensor,
                     t_hidden: Tensor) -> Tensor:
    """Divergence between the student's and the teacher's next-token distributions, each at its own
    temperature, exact for -inf logits (0 log 0 = 0).   [B, c, H], [B, c, H] -> [B, c]"""
    ls = torch.log_softmax(head_logits(s_head, s_hidden, head_dtype) / s_temperature, dim=-1)  # [B, c, V] student log p
    lt = torch.log_softmax(head_logits(t_head, t_hidden, head_dtype) / t_temperature, dim=-1)  # [B, c, V] teacher log q
    if estimator == DistillEstimator.full or (estimator == DistillEstimator.jsd and alpha >= 1):  # reverse KL(p || q)
        return xlogy_divergence(ls, lt)
    if estimator == DistillEstimator.jsd and alpha <= 0:  # forward KL(q || p)
        return xlogy_divergence(lt, ls)
    if estimator == DistillEstimator.jsd:  # m = alpha q + (1 - alpha) p;  alpha KL(q || m) + (1 - alpha) KL(p || m)
        lm = safe_logsumexp(torch.stack([lt + math.log(alpha), ls + math.log(1 - alpha)]), dim=0)  # [B, c, V]
        return alpha * xlogy_divergence(lt, lm) + (1 - alpha) * xlogy_divergence(ls, lm)
    if estimator == DistillEstimator.topk:  # the student's top-k tokens plus one bucket holding the rest of the mass
        k = min(topk, ls.shape[-1])
        idx = ls.detach().topk(k, dim=-1).indices  # [B, c, k]
        out = xlogy_divergence(ls.gather(-1, idx), lt.gather(-1, idx))
        if k < ls.shape[-1]:
            in_top = torch.zeros_like(ls, dtype=torch.bool).scatter_(-1, idx, True)
            ls_tail = safe_logsumexp(ls.masked_fill(in_top, -math.inf), dim=-1, keepdim=True)  # [B, c, 1] log tail mass
            lt_tail = safe_logsumexp(lt.masked_fill(in_top, -math.inf), dim=-1, keepdim=True)
            out = out + xlogy_divergence(ls_tail, lt_tail)
        return out
    raise ValueError(f"distillation estimator '{estimator}' is not one of {', '.join(DistillEstimator)}")


def token_divergence(student: TokenStats, teacher: TokenStats, estimator: DistillEstimator = DistillEstimator.full, *,
                     topk: int = 20, alpha: float = 1.0) -> Tensor:
    """Per-token divergence of the student from the teacher at every completion position.   -> [B, T]

    estimator:
      full     exact KL(student || teacher) over the vocabulary
      topk     the student's top-k tokens plus one tail bucket, for both models (= full when k = V)
      sampled  on the sampled token y_t only: value log p(y_t) - log q(y_t); gradient for the student
               -(log q - log p) grad log p (the reverse-KL score-function estimator), for the teacher
               -grad log q(y_t) (the gradient of KL(p || q) in q, with y_t ~ p)
      jsd      generalised Jensen-Shannon with weight alpha: 1 = reverse KL, 0 = forward KL(teacher || student)

    A teacher probability of exactly 0 where the student has mass is floored at exp(LOG_FLOOR)
    (`floor_impossible`): the value stays finite, as does its gradient. Gradients flow into whichever side's
    hidden states require them (detach a side to stop them). Full-vocabulary estimators run chunk by chunk
    (`tokens.per_token`), so peak memory holds one [B, chunk, V] block per model, never [B, T, V].
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"algorithm.distill.alpha: {alpha} is not between 0 (forward KL) and 1 (reverse KL)")
    if estimator == DistillEstimator.sampled:
        lp, lq = student.logprobs(), teacher.logprobs()  # [B, T]
        lq = floor_impossible(lq, lp)
        gap = (lp - lq).detach()
        return masked(gap + gap * (lp - lp.detach()) - (lq - lq.detach()), student.mask)
    if estimator not in tuple(DistillEstimator):
        raise ValueError(f"distillation estimator '{estimator}' is not one of {', '.join(DistillEstimator)}")
    parts = []
    fn = functools.partial(divergence_chunk, student.head, teacher.head, student.temperature, teacher.temperature,
                           estimator, topk, alpha, student.head_dtype)
    s_hidden, t_hidden = trained_positions(student.hidden, student.mask), trained_positions(teacher.hidden, student.mask)
    for sl in student.chunks():
        parts.append(per_token(fn, (student.head, teacher.head), s_hidden[:, sl], t_hidden[:, sl]))
    return masked(torch.cat(parts, dim=1), student.mask)


def full_reverse_kl(student: TokenStats, teacher: TokenStats) -> Tensor:
    """Exact KL(student || teacher) over the vocabulary at every position.   -> [B, T]"""
    return token_divergence(student, teacher, DistillEstimator.full)


# -------------------------------------------------------------------- targets that do not pull the student home


def context_shift(teacher: TokenStats, base: TokenStats) -> Tensor:
    """KL(pi_T(.|c) || pi_T(.|no context)) per position: how much the privileged context moves the teacher's
    prediction (0 where it changes nothing). The `gated` target distils only where it exceeds a threshold.
    [B, T], no gradient."""
    with torch.no_grad():
        return token_divergence(teacher.detached(), base.detached(), DistillEstimator.full)


def residual_log_target(log_p: Tensor, log_teacher: Tensor, log_base: Tensor, beta: float, clip: float,
                        topk: int) -> Tensor:
    """log q*, the student's own distribution shifted by what the context does to the teacher:

        r_v    = log pi_T(v | c) - log pi_T(v | no context), clipped to [-clip, clip], and 0 outside the
                 teacher's (with context) top-k tokens (topk 0: every token)
        log q* = log_softmax(sg(log p) + beta * r)

    Where the context changes nothing (r = 0) q* = p, so KL(p || q*) pulls nowhere. Its gradient in the
    student is -beta E_p[r grad log p]: a policy gradient with r as a dense per-token reward over the
    vocabulary. Unbounded, r favours tokens the context lifts from near zero (a value copied from a
    retrieved example): the clip and the top-k bound how far q* can lift any token (by at most e^(beta
    clip) times its student probability).   [..., V] x 3 -> [..., V]"""
    both = (log_teacher > -math.inf) & (log_base > -math.inf)
    r = torch.where(both, log_teacher - log_base, torch.zeros((), dtype=log_p.dtype, device=log_p.device))
    r = r.clamp(-clip, clip)
    if 0 < topk < log_teacher.shape[-1]:
        top = log_teacher.topk(topk, dim=-1).indices
        r = torch.zeros_like(r).scatter_(-1, top, r.gather(-1, top))
    return torch.log_softmax(log_p.detach() + beta * r, dim=-1)


def _residual_chunk(s_head, t_head, b_head, s_temperature, t_temperature, beta, clip, topk, head_dtype,
                    s_hidden, t_hidden, b_hidden) -> Tensor:
    """KL(p || q*) with q* = `residual_log_target`, for one chunk.   [B, c, H] x 3 -> [B, c]"""
    ls = torch.log_softmax(head_logits(s_head, s_hidden, head_dtype) / s_temperature, dim=-1)  # [B, c, V]
    lt = torch.log_softmax(head_logits(t_head, t_hidden, head_dtype) / t_temperature, dim=-1)  # teacher with c
    lb = torch.log_softmax(head_logits(b_head, b_hidden, head_dtype) / t_temperature, dim=-1)  # teacher without
    return xlogy_divergence(ls, residual_log_target(ls, lt.detach(), lb.detach(), beta, clip, topk))


def residual_divergence(student: TokenStats, teacher: TokenStats, base: TokenStats, *, beta: float = 1.0,
                        clip: float = 1.0, topk: int = 0) -> Tensor:
    """KL(student || q*) per position, q* the student shifted by the context's clipped log-ratio
    (`residual_log_target`); the teachers get no gradient. Exact over the vocabulary, in chunks.   -> [B, T]"""
    parts = []
    teacher, base = teacher.detached(), base.detached()
    fn = functools.partial(_residual_chunk, student.head, teacher.head, base.head, student.temperature,
                           teacher.temperature, beta, clip, topk, student.head_dtype)
    hiddens = [trained_positions(x.hidden, student.mask) for x in (student, teacher, base)]
    for sl in student.chunks():
        parts.append(per_token(fn, (student.head, teacher.head, base.head), *(h[:, sl] for h in hiddens)))
    return masked(torch.cat(parts, dim=1), student.mask)


# ----------------------------------------------------------------------------------------------- LOPD


def privileged_margin(delta: Tensor, advantages: Tensor, margin: float, active: Tensor | None = None,
                      total: float | None = None) -> tuple[Tensor, Tensor]:
    """LOPD's hinge on the teacher's privilege, averaged over the trajectories it constrains.

    delta: [B] Delta(y) = mean_t [log pi_T(y_t | z, x, y<t) - log pi_0(y_t | x, y<t)]; advantages: [B];
    active: [B] bool, optional (LOPD: the trajectories whose teacher got a context).
        loss  = mean_{y: A != 0, active} max(0, m - A(y) * Delta(y))
    Returns (loss, slack [B] = m - A * Delta). A group whose rewards are all equal (A = 0) says nothing
    about better or worse and is left out. total: the number of constrained trajectories in the whole
    minibatch (as in `aggregate`); None: these rows' own.
    """
    slack = margin - advantages * delta  # [B]
    use = constrained(advantages, active).to(delta.dtype)
    return masked(torch.relu(slack), use).sum() / _denominator(use.sum(), total), slack


def privilege(delta: Tensor, advantages: Tensor, active: Tensor | None = None, total: float | None = None) -> Tensor:
    """mean_{y: A != 0, active} A(y) * Delta(y): how much the context raises better-than-average trajectories
    and lowers worse ones (nats per token). LOPD's `privilege` objective maximises it.   [B], [B] -> []
    total: as in `privileged_margin`."""
    use = constrained(advantages, active).to(delta.dtype)
    return masked(advantages * delta, use).sum() / _denominator(use.sum(), total)


def constrained(advantages: Tensor, active: Tensor | None = None) -> Tensor:
    """[B] bool: trajectories with a non-zero advantage (and `active`, if given)."""
    use = advantages != 0
    return use if active is None else use & active.to(torch.bool)

"""Loss functions: small, pure, shape-commented. Every one is tested against hand-computed values.

Shapes: B trajectories, T completion positions. `mask` is 1 on tokens the loss trains on.
"""

from __future__ import annotations

import enum

import torch
from torch import Tensor


def masked(x: Tensor, mask: Tensor) -> Tensor:
    """x where mask is set, exactly 0 elsewhere (x * mask would turn a masked inf into nan)."""
    return torch.where(mask > 0, x * mask, torch.zeros((), dtype=x.dtype, device=x.device))


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


def aggregate(per_token: Tensor, mask: Tensor, mode: str = "token", total: float | None = None) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar.

    token:    sum over every masked token / number of masked tokens (each token weighs the same)
    sequence: mean over each sequence's tokens, then mean over sequences (each sequence weighs the same)

    total: the denominator, counted by `aggregate_count` over the whole minibatch (every micro-batch, every
    rank); the result is then this micro-batch's share of the minibatch's value, and the shares add up to
    it exactly however the minibatch is split. None: this call's own count (the mean over these rows).
    """
    mask = mask.to(per_token.dtype)
    mode = mode.value if isinstance(mode, enum.Enum) else mode
    if mode == "token":
        return masked(per_token, mask).sum() / _denominator(mask.sum(), total)
    if mode == "sequence":
        per_seq = masked(per_token, mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
        has_tokens = (mask.sum(-1) > 0).to(per_token.dtype)
        return (per_seq * has_tokens).sum() / _denominator(has_tokens.sum(), total)
    raise ValueError(f"aggregation '{mode}' is not one of token, sequence")


def aggregate_count(mask: Tensor, mode: str = "token") -> float:
    """What `aggregate` divides by over these rows: masked tokens (token) or sequences with any (sequence).
    [B, T] -> float"""
    mode = mode.value if isinstance(mode, enum.Enum) else mode
    if mode == "token":
        return float(mask.double().sum())
    if mode == "sequence":
        return float((mask.double().sum(-1) > 0).sum())
    raise ValueError(f"aggregation '{mode}' is not one of token, sequence")


def _denominator(local: Tensor, total: float | None) -> Tensor | float:
    return local.clamp(min=1) if total is None else max(float(total), 1.0)


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


def kl_sampled(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k2") -> Tensor:
    """Per-token estimate of KL(pi || ref) from the sampled tokens y_t ~ pi.   [B, T] -> [B, T]

    With d = log pi(y_t) - log ref(y_t):
      k1 = d                      unbiased value; as a loss its expected gradient is 0 (useless)
      k2 = d^2 / 2                biased value; gradient d * grad log pi = the exact reverse-KL gradient
      k3 = exp(-d) - 1 + d        unbiased, non-negative value; gradient (1 - exp(-d)) grad log pi, whose
                                  expectation is the gradient of the *forward* KL(ref || pi)
    Use k2 to optimise reverse KL, k3 to report it.
    """
    d = logprobs - ref_logprobs
    estimator = estimator.value if isinstance(estimator, enum.Enum) else estimator
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d**2
    if estimator == "k3":
        return torch.exp(-d) - 1 + d
    raise ValueError(f"sampled KL estimator '{estimator}' is not one of k1, k2, k3")


def sequence_mean(per_token: Tensor, mask: Tensor) -> Tensor:
    """Mean over each sequence's masked tokens.   [B, T] -> [B]"""
    mask = mask.to(per_token.dtype)
    return masked(per_token, mask).sum(-1) / mask.sum(-1).clamp(min=1)


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

"""GRPO (RLVR): no privileged context; group-normalised reward advantages and a clipped policy gradient.

    A_i  = (r_i - mean_group r) / (std_group r + eps)           (normalize_std=false: Dr. GRPO)
    loss = aggregate(-min(rho_t A_i, clip(rho_t) A_i)) + kl_coef * aggregate(KL_t(pi || pi_ref))
with rho_t = pi(y_t) / pi_sampler(y_t). The reference KL is optional; `k2` on sampled tokens gives the
exact reverse-KL gradient in expectation, `full` sums over the vocabulary.

    lopd train --config configs/grpo.yaml
"""

from __future__ import annotations

import torch

from lopd import losses
from lopd.algorithms.base import Algorithm, Context, mean_of
from lopd.config import KLEstimator, head_dtype_of
from lopd.teacher import FrozenTeacher


class GRPO(Algorithm):
    name = "grpo"

    def setup(self, *, policy=None, tokenizer=None, **runtime) -> None:
        super().setup(policy=policy, tokenizer=tokenizer, **runtime)
        self.reference = reference_for(self.cfg, policy, tokenizer) if self.cfg.algorithm.pg.kl_coef > 0 else None

    def build_context(self, batch, step):
        pg = self.cfg.algorithm.pg
        return Context(step=step, advantages=losses.group_advantages(batch.rewards, batch.group, pg.normalize_std))

    def loss_totals(self, batch, ctx):
        return {"policy": policy_total(self.cfg, batch)}

    def live_rows(self, batch, ctx):
        return policy_live(self.cfg, ctx.advantages)

    def loss(self, batch, ctx: Context, student):
        return grpo_loss(self.cfg, batch, ctx.advantages, student, self.reference, total=ctx.totals.get("policy"))


def reference_for(cfg, policy, tokenizer) -> FrozenTeacher:
    """The frozen initial model, scoring at the sampling temperature."""
    return FrozenTeacher(policy, tokenizer, cfg.rollout.temperature, head_dtype_of(cfg))


def policy_total(cfg, batch) -> float:
    """The policy-gradient terms' denominator over these rows: their trained tokens (or sequences)."""
    return losses.aggregate_count(batch.completion_mask, cfg.algorithm.aggregation)


def policy_live(cfg, advantages) -> torch.Tensor:
    """[B] bool: rows where the policy-gradient terms can be non-zero: A != 0, or every row under a
    reference KL."""
    return advantages != 0 if cfg.algorithm.pg.kl_coef == 0 else torch.ones(len(advantages), dtype=torch.bool)


def grpo_loss(cfg, batch, advantages, student, reference: FrozenTeacher | None = None, total: float | None = None):
    """Clipped policy gradient (+ kl_coef * reference KL), aggregated as configured; `total` is their
    denominator over the whole minibatch (`policy_total`; None: these rows'). The `loss/*` metrics are
    means over these rows."""
    pg, agg = cfg.algorithm.pg, cfg.algorithm.aggregation
    ref_stats = None
    if pg.kl_coef > 0:
        with torch.no_grad():
            ref_stats = reference.score(batch)
    mask = student.mask
    logprobs = student.logprobs()  # [B, T]
    per_token, clipped = losses.clipped_policy_gradient(logprobs, batch.sampler_logprobs, advantages,
                                                        pg.clip_low, pg.clip_high)
    if batch.is_weights is not None:  # another engine sampled: truncated importance weights pi_trainer / pi_sampler
        per_token = per_token * batch.is_weights
    loss = losses.aggregate(per_token, mask, agg, total)
    metrics = {"loss/pg": losses.aggregate(per_token.detach(), mask, agg).item(), "loss/clip_frac": mean_of(clipped.float(), mask),
               "loss/ratio": mean_of((logprobs - batch.sampler_logprobs).exp().detach(), mask)}
    if pg.kl_coef > 0:
        kl = policy_kl(student, ref_stats, pg.kl_estimator)  # [B, T]
        loss = loss + pg.kl_coef * losses.aggregate(kl, mask, agg, total)
        metrics["loss/kl_ref"] = losses.aggregate(kl.detach(), mask, agg).item()
    return loss, metrics


def policy_kl(student, reference, estimator: KLEstimator | str):
    """Per-token KL(student || reference), sampled (k2/k3) or over the full vocabulary."""
    if KLEstimator(estimator) is KLEstimator.full:
        from lopd.tokens import full_reverse_kl

        return full_reverse_kl(student, reference)
    return losses.kl_sampled(student.logprobs(), reference.logprobs().detach(), KLEstimator(estimator).value)

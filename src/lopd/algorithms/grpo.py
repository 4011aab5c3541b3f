"""GRPO (RLVR): no privileged context; group-normalised reward advantages and a clipped policy gradient.

    A_i  = (r_i - mean_group r) / (std_group r + eps)           (normalize_std=false: Dr. GRPO)
    loss = aggregate(-min(rho_t A_i, clip(rho_t) A_i)) + kl_coef * aggregate(KL_t(pi || pi_0))
with rho_t = pi(y_t) / pi_sampler(y_t) and pi_0 the initial policy. The reference KL is optional; `k2` on
sampled tokens gives the exact reverse-KL gradient in expectation, `full` sums over the vocabulary.

    lopd train --config configs/grpo.yaml
"""

from __future__ import annotations

import torch

from lopd import losses
from lopd.algorithms.base import Algorithm, Context, Term, measured
from lopd.schema import head_dtype_of
from lopd.teacher import FrozenTeacher


class GRPO(Algorithm):
    name = "grpo"

    def setup(self, *, policy=None, tokenizer=None, **runtime) -> None:
        super().setup(policy=policy, tokenizer=tokenizer, **runtime)
        self.initial_policy = initial_policy(self.cfg, policy, tokenizer) if self.cfg.algorithm.pg.kl_coef > 0 else None

    def build_context(self, batch, step):
        return self.new_context(batch, step)

    def units(self, batch, ctx):
        return {"policy": policy_units(self.cfg, batch.completion_mask)}

    def live_rows(self, batch, ctx):
        return policy_live(self.cfg, ctx.advantages)

    def loss(self, batch, ctx: Context, student):
        return policy_terms(self.cfg, batch, ctx.advantages, student, self.initial_policy)


def initial_policy(cfg, policy, tokenizer) -> FrozenTeacher:
    """pi_0, the frozen initial model (the reference KL's, LOPD's Delta's), scoring at the sampling temperature."""
    return FrozenTeacher(policy, tokenizer, cfg.rollout.temperature, head_dtype_of(cfg))


def policy_units(cfg, mask: torch.Tensor) -> torch.Tensor:
    """The policy-gradient terms' units: the trained tokens, or the sequences, by `algorithm.aggregation`.
    [B, T] -> [B, T] or [B]"""
    return losses.per_unit(mask, mask, cfg.algorithm.aggregation)[1]


def policy_live(cfg, advantages) -> torch.Tensor:
    """[B] bool: rows where the policy-gradient terms can be non-zero: A != 0, or every row under a
    reference KL."""
    return advantages != 0 if cfg.algorithm.pg.kl_coef == 0 else torch.ones(len(advantages), dtype=torch.bool)


def policy_terms(cfg, batch, advantages, student, initial: FrozenTeacher | None = None,
                 weight: float = 1.0) -> dict[str, Term]:
    """The clipped policy gradient and, with kl_coef > 0, the reference KL to pi_0, as terms over the
    "policy" units (each weighted by `weight`: the hybrid's pg_weight), and the ratio's diagnostics."""
    pg, agg = cfg.algorithm.pg, cfg.algorithm.aggregation
    mask = student.mask
    logprobs = student.logprobs()  # [B, T]
    per_token, clipped = losses.clipped_policy_gradient(logprobs, batch.sampler_logprobs, advantages,
                                                        pg.clip_low, pg.clip_high)
    if batch.is_weights is not None:  # another engine sampled: truncated importance weights pi_trainer / pi_sampler
        per_token = per_token * batch.is_weights
    terms = {"loss/pg": Term(*losses.per_unit(per_token, mask, agg), coef=weight, units="policy"),
             "loss/clip_frac": measured(clipped.float(), mask),
             "loss/ratio": measured((logprobs - batch.sampler_logprobs).exp(), mask)}
    if pg.kl_coef > 0:
        with torch.no_grad():
            reference = initial.score(batch)
        kl = losses.policy_kl(student, reference, pg.kl_estimator)  # [B, T]
        terms["loss/kl_ref"] = Term(*losses.per_unit(kl, mask, agg), coef=weight * pg.kl_coef, units="policy")
    return terms

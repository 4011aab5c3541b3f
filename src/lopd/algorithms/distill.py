"""On-policy self-distillation, the part OPSD, SDPO and Skill-SD share.

The student samples; the frozen self-teacher (same backbone) re-scores every visited prefix with a
privileged text context in its prompt; the student is pulled toward it token by token:
    loss = coef * aggregate_t D(pi_student(.|x, y<t) || sg pi_teacher(.|c, x, y<t))  [+ pg_weight * GRPO]
with D one of the estimators of `tokens.token_divergence`. A subclass only says what the context c is.
Trajectories whose teacher got no context are left out of the distillation term (`mask_without_context`).
"""

from __future__ import annotations

import torch

from lopd import losses
from lopd.algorithms.base import Algorithm, Context, mean_of
from lopd.algorithms.grpo import grpo_loss
from lopd.tokens import token_divergence


class SelfDistillation(Algorithm):
    uses_teacher = True

    @property
    def uses_reference(self) -> bool:  # type: ignore[override]
        d = self.cfg.algorithm.distill
        return d.pg_weight > 0 and self.cfg.algorithm.pg.kl_coef > 0

    def contexts(self, batch) -> list[str | None]:
        """The teacher's privileged context for every trajectory (None: no context)."""
        raise NotImplementedError

    def build_context(self, batch) -> Context:
        d, pg = self.cfg.algorithm.distill, self.cfg.algorithm.pg
        advantages = losses.group_advantages(batch.rewards, batch.group, pg.normalize_std)
        return Context(advantages=advantages, texts=self.contexts(batch))

    def loss(self, batch, ctx: Context, student, teacher, reference=None):
        d, agg = self.cfg.algorithm.distill, self.cfg.algorithm.aggregation
        has_context = torch.tensor([c is not None for c in ctx.texts], dtype=student.mask.dtype,
                                   device=student.mask.device)  # [B]
        mask = student.mask * has_context[:, None] if d.mask_without_context else student.mask  # [B, T]
        per_token = token_divergence(student, teacher.detached(), d.estimator, topk=d.topk, alpha=d.alpha)  # [B, T]
        distill = losses.aggregate(per_token, mask, agg)
        loss = d.coef * distill
        with torch.no_grad():  # how much the context raises the likelihood of what the student sampled
            gain = teacher.logprobs() - student.logprobs()  # [B, T]
        success = batch.success.to(mask.device, mask.dtype)[:, None]
        metrics = {"loss/distill": distill.item(), "context/coverage": float(has_context.mean()),
                   "context/teacher_gain_success": mean_of(gain, student.mask * success),
                   "context/teacher_gain_failure": mean_of(gain, student.mask * (1 - success))}
        if d.pg_weight > 0:
            pg, pg_metrics = grpo_loss(self.cfg, batch, ctx.advantages, student, reference)
            loss = loss + d.pg_weight * pg
            metrics.update(pg_metrics)
        return loss, metrics

"""On-policy self-distillation, the part OPSD, SDPO, Skill-SD and LOPD share.

The student samples; the self-teacher (same backbone; frozen, EMA or live weights) re-scores every
visited prefix with a privileged context in its prompt; the student is pulled toward it token by token:
    loss = coef * aggregate_t D(pi_student(.|x, y<t) || sg pi_teacher(.|c, x, y<t))  [+ pg_weight * GRPO]
with D one of the estimators of `tokens.token_divergence`. A text method only says what the context c
is (`contexts`). Trajectories whose teacher got no context are left out of the distillation term
(`mask_without_context`).
"""

from __future__ import annotations

import torch

from lopd import losses
from lopd.algorithms.base import Algorithm, Context, mean_of
from lopd.algorithms.grpo import grpo_loss, policy_live, policy_total, reference_for
from lopd.config import head_dtype_of
from lopd.teacher import build_teacher
from lopd.tokens import TokenStats, token_divergence


class SelfDistillation(Algorithm):
    def setup(self, *, policy=None, tokenizer=None, **runtime) -> None:
        super().setup(policy=policy, tokenizer=tokenizer, **runtime)
        d = self.cfg.algorithm.distill
        self.tokenizer = tokenizer
        self.teacher = build_teacher(d.teacher, policy, ema_rate=d.ema_rate, tokenizer=tokenizer,
                                     temperature=self.cfg.rollout.temperature, head_dtype=head_dtype_of(self.cfg))
        self.reference = reference_for(self.cfg, policy, tokenizer) if self.needs_reference() else None

    def needs_reference(self) -> bool:
        """The frozen initial model is scored too (the hybrid's reference KL; LOPD's Delta)."""
        return self.cfg.algorithm.distill.pg_weight > 0 and self.cfg.algorithm.pg.kl_coef > 0

    def contexts(self, batch, step: int) -> list[str | None]:
        """The teacher's privileged context for every trajectory (None: no context)."""
        raise NotImplementedError

    def build_context(self, batch, step) -> Context:
        pg = self.cfg.algorithm.pg
        texts = self.contexts(batch, step)
        return Context(step=step, advantages=losses.group_advantages(batch.rewards, batch.group, pg.normalize_std),
                       texts=texts, has_context=torch.tensor([c is not None for c in texts]))

    def distilled(self, mask: torch.Tensor, has_context: torch.Tensor) -> torch.Tensor:
        """The distillation term's mask: the trained tokens, of trajectories whose teacher got a context
        (with `mask_without_context`).   [B, T], [B] -> [B, T]"""
        has_context = has_context.to(mask.device, mask.dtype)
        return mask * has_context[:, None] if self.cfg.algorithm.distill.mask_without_context else mask

    def loss_totals(self, batch, ctx):
        totals = {"distill": losses.aggregate_count(self.distilled(batch.completion_mask, ctx.has_context),
                                                    self.cfg.algorithm.aggregation)}
        if self.cfg.algorithm.distill.pg_weight > 0:
            totals["policy"] = policy_total(self.cfg, batch)
        return totals

    def live_rows(self, batch, ctx):
        live = self.distilled(batch.completion_mask, ctx.has_context).sum(-1) > 0  # [B]
        return live | policy_live(self.cfg, ctx.advantages) if self.cfg.algorithm.distill.pg_weight > 0 else live

    def teacher_stats(self, batch, ctx: Context) -> TokenStats:
        """The teacher's view of the batch under its context (no gradient for text contexts)."""
        with torch.no_grad():
            return self.teacher.score(batch, ctx.texts)

    def loss(self, batch, ctx: Context, student):
        return self.distill_loss(batch, ctx, student, self.teacher_stats(batch, ctx))

    def trains_student(self, ctx: Context) -> bool:
        """Whether this pass moves the student (LOPD's composer-only passes do not)."""
        return True

    def teacher_side(self, teacher: TokenStats) -> TokenStats:
        """The teacher as the divergence sees it: detached (LOPD lets a scaled gradient reach its composer)."""
        return teacher.detached()

    def distill_loss(self, batch, ctx: Context, student: TokenStats, teacher: TokenStats):
        d, agg = self.cfg.algorithm.distill, self.cfg.algorithm.aggregation
        has_context = ctx.has_context.to(student.mask.device, student.mask.dtype)  # [B]
        mask = self.distilled(student.mask, has_context)  # [B, T]
        trained = self.trains_student(ctx)
        per_token = token_divergence(student if trained else student.detached(), self.teacher_side(teacher),
                                     d.estimator, topk=d.topk, alpha=d.alpha)  # [B, T]
        loss = d.coef * losses.aggregate(per_token, mask, agg, ctx.totals.get("distill"))
        with torch.no_grad():  # how much the context raises the likelihood of what the student sampled
            gain = teacher.logprobs() - student.logprobs()  # [B, T]
        success = batch.success.to(mask.device, mask.dtype)[:, None]
        metrics = {"loss/distill": losses.aggregate(per_token.detach(), mask, agg).item(), "context/coverage": float(has_context.mean()),
                   "context/teacher_gain_success": mean_of(gain, student.mask * success),
                   "context/teacher_gain_failure": mean_of(gain, student.mask * (1 - success))}
        if d.pg_weight > 0 and trained:
            pg, pg_metrics = grpo_loss(self.cfg, batch, ctx.advantages, student, self.reference,
                                       total=ctx.totals.get("policy"))
            loss = loss + d.pg_weight * pg
            metrics.update(pg_metrics)
        return loss, metrics

    def after_step(self) -> None:
        self.teacher.after_step()

    def state_dict(self) -> dict:
        return {"teacher": self.teacher.state_dict()} if self.teacher.trained else {}

    def load_state_dict(self, state: dict, step: int) -> None:
        self.teacher.load_state_dict(state.get("teacher", {}))

"""On-policy self-distillation, the part OPSD, SDPO, Skill-SD and LOPD share.

The student samples; the self-teacher (same backbone; frozen, EMA or live weights) re-scores every
visited prefix with a privileged context in its prompt; the student is pulled toward it token by token:
    loss = coef * aggregate_t D(pi_student(.|x, y<t) || target_t)  [+ pg_weight * GRPO]
with D one of the estimators of `losses.token_divergence` and the target (`algorithm.distill.target`):
    teacher   sg pi_teacher(.|c, x, y<t) at every token (the default)
    gated     the same, only where the context moves the teacher: KL(pi_T(.|c) || pi_T(.|none)) > threshold
              (0 elsewhere: the tokens the context says nothing about keep their RL gradient alone)
    residual  the student's own distribution shifted by beta * clip(log pi_T(.|c) - log pi_T(.|none)), exact
              KL over the vocabulary: a dense policy gradient on the context's log-ratio, 0 where it changes
              nothing, so the student is never pulled back toward the teacher's (initial) weights
A text method only says what the context c is (`privileged_contexts`). Trajectories whose teacher got no
context are left out of the distillation term (`mask_without_context`); with `skip_successes`, so are the
student's successes (they keep the policy gradient alone: a teacher worse than the student where it is already
right does not pull it back there). With `rows_per_group` k, only k rows of each group keep their context (drawn
at random each batch): the distillation's mean is estimated on them, and the teacher (and, with pg_weight, the
student on groups without reward variance) runs on k/G of the rows.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from lopd import losses
from lopd.algorithms.base import Algorithm, Context, Term, measured, rows
from lopd.algorithms.grpo import initial_policy, policy_live, policy_terms, policy_units
from lopd.errors import ConfigError
from lopd.schema import DistillTarget, TeacherWeights, head_dtype_of
from lopd.teacher import build_teacher
from lopd.tokens import TokenStats


class SelfDistillation(Algorithm):
    def setup(self, *, policy=None, tokenizer=None, **runtime) -> None:
        super().setup(policy=policy, tokenizer=tokenizer, **runtime)
        d = self.cfg.algorithm.distill
        self.tokenizer = tokenizer
        self.teacher = build_teacher(d.teacher, policy, ema_rate=d.ema_rate, tokenizer=tokenizer,
                                     temperature=self.cfg.rollout.temperature, head_dtype=head_dtype_of(self.cfg))
        self.initial_policy = initial_policy(self.cfg, policy, tokenizer) if self.needs_initial_policy() else None
        if d.rows_per_group and not d.mask_without_context:
            raise ConfigError("algorithm.distill.rows_per_group: the rows left out would be distilled toward a teacher "
                              "without context; it needs algorithm.distill.mask_without_context true")

    def new_context(self, batch, step, kind=Context, **values) -> Context:
        """The base's context, with only `rows_per_group` rows of each group keeping their privileged context."""
        ctx = super().new_context(batch, step, kind, **values)
        k = self.cfg.algorithm.distill.rows_per_group
        if k and ctx.has_context is not None:
            generator = torch.Generator().manual_seed(self.cfg.train.seed * 1_000_003 + step)  # the same on a resume
            keep = rows_per_group(batch.group, ctx.has_context, k, generator)
            ctx.has_context = ctx.has_context & keep
            ctx.privileged = [c if kept else None for c, kept in zip(ctx.privileged, keep.tolist())]
        return ctx

    def needs_initial_policy(self) -> bool:
        """pi_0, the frozen initial model, is scored too (the hybrid's reference KL; LOPD's Delta)."""
        return self.cfg.algorithm.distill.pg_weight > 0 and self.cfg.algorithm.pg.kl_coef > 0

    def privileged_contexts(self, batch, step: int) -> list[str | None]:
        """The teacher's privileged context for every trajectory (None: no context)."""
        raise NotImplementedError

    def build_context(self, batch, step) -> Context:
        texts = self.privileged_contexts(batch, step)
        return self.new_context(batch, step, privileged=texts, has_context=torch.tensor([c is not None for c in texts]))

    def distilled(self, mask: torch.Tensor, has_context: torch.Tensor, success: torch.Tensor) -> torch.Tensor:
        """The distillation term's mask: the trained tokens, of trajectories whose teacher got a context
        (with `mask_without_context`) and that failed (with `skip_successes`).   [B, T], [B], [B] -> [B, T]"""
        d = self.cfg.algorithm.distill
        if d.mask_without_context:
            mask = mask * has_context.to(mask.device, mask.dtype)[:, None]
        if d.skip_successes:
            mask = mask * (~success.to(mask.device, torch.bool)).to(mask.dtype)[:, None]
        return mask

    def units(self, batch, ctx):
        distilled = self.distilled(batch.completion_mask, ctx.has_context, batch.success)  # [B, T]
        units = {"distill": losses.per_unit(batch.completion_mask, distilled, self.cfg.algorithm.aggregation)[1]}
        if self.cfg.algorithm.distill.pg_weight > 0:
            units["policy"] = policy_units(self.cfg, batch.completion_mask)
        return units

    def live_rows(self, batch, ctx):
        live = self.distilled(batch.completion_mask, ctx.has_context, batch.success).sum(-1) > 0  # [B]
        return live | policy_live(self.cfg, ctx.advantages) if self.cfg.algorithm.distill.pg_weight > 0 else live

    def teacher_stats(self, batch, ctx: Context, student: TokenStats | None = None) -> TokenStats:
        """The teacher's view of the batch under its context (no gradient for text contexts). With
        `train.skip_zero_loss_rows` it is scored only on the rows with a context, when the others are left out
        of the distillation (their teacher reaches nothing; the same update up to float rounding; `student`
        gives the full micro-batch's shape)."""
        rows = torch.nonzero(ctx.has_context).flatten()
        skip = self.cfg.train.skip_zero_loss_rows and self.cfg.algorithm.distill.mask_without_context
        with torch.no_grad():
            if student is None or len(rows) == len(batch) or not skip:
                return self.teacher.score(batch, ctx.privileged)
            if not len(rows):  # no row to distil: nothing the teacher says reaches the loss
                return replace(student.detached(), hidden=torch.zeros_like(student.hidden), _logprobs=None)
            part = self.teacher.score(batch.select(rows), [ctx.privileged[i] for i in rows.tolist()])
            return part.placed(rows, student)

    def needs_base(self) -> bool:
        """The gated and residual targets read the teacher without its context too."""
        return self.cfg.algorithm.distill.target != DistillTarget.teacher

    def base_stats(self, batch, initial: TokenStats | None = None) -> TokenStats | None:
        """The teacher without context (no gradient), when the target needs it: a frozen teacher's is pi_0's,
        so an `initial` already scored is reused."""
        if not self.needs_base():
            return None
        if initial is not None and self.cfg.algorithm.distill.teacher == TeacherWeights.frozen:
            return initial
        with torch.no_grad():
            return self.teacher.score(batch)

    def loss(self, batch, ctx: Context, student):
        return self.distill_terms(batch, ctx, student, self.teacher_stats(batch, ctx, student), self.base_stats(batch))

    def trains_student(self, ctx: Context) -> bool:
        """Whether this pass moves the student (LOPD's composer-only passes do not)."""
        return True

    def teacher_side(self, teacher: TokenStats) -> TokenStats:
        """The teacher as the divergence sees it: detached (LOPD lets a scaled gradient reach its composer)."""
        return teacher.detached()

    def distill_terms(self, batch, ctx: Context, student: TokenStats, teacher: TokenStats,
                      base: TokenStats | None = None) -> dict[str, Term]:
        """coef * D(student || target) over the distilled tokens (+ pg_weight * GRPO), and what the context
        does to the likelihood of the student's own tokens (the teacher's gain, on successes and failures).
        `base`: the teacher without context (the gated and residual targets)."""
        d = self.cfg.algorithm.distill
        has_context = ctx.has_context.to(student.mask.device, student.mask.dtype)  # [B]
        mask = self.distilled(student.mask, has_context, batch.success)  # [B, T]
        trained = self.trains_student(ctx)
        shown = student if trained else student.detached()
        extra: dict[str, Term] = {}
        if d.target == DistillTarget.residual:
            per_token = losses.residual_divergence(shown, teacher, base, beta=d.residual_beta, clip=d.residual_clip,
                                                   topk=d.residual_topk)  # [B, T]
        else:
            per_token = losses.token_divergence(shown, self.teacher_side(teacher), d.estimator, topk=d.topk,
                                                alpha=d.alpha)  # [B, T]
        if base is not None:
            shift = losses.context_shift(teacher, base)  # [B, T]
            extra["context/shift"] = measured(shift, mask)
            if d.target == DistillTarget.gated:
                gate = shift > d.gate_threshold
                per_token = torch.where(gate, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
                extra["context/gated_share"] = measured(gate.to(mask.dtype), mask)  # (ungated tokens count as 0)

        with torch.no_grad():  # how much the context raises the likelihood of what the student sampled
            teacher_lp = teacher.logprobs()  # [B, T]
            gain = losses.floor_impossible(teacher_lp, student.logprobs()) - student.logprobs()
        success = batch.success.to(mask.device, mask.dtype)[:, None]
        read = student.mask * has_context[:, None]  # the tokens of rows whose teacher read a context
        terms = {"loss/distill": Term(*losses.per_unit(per_token, mask, self.cfg.algorithm.aggregation),
                                      coef=d.coef, units="distill"),
                 "context/coverage": rows(has_context, has_context),
                 "context/teacher_gain_success": measured(gain, read * success),
                 "context/teacher_gain_failure": measured(gain, read * (1 - success)),
                 "health/teacher_impossible": measured(losses.impossible(teacher_lp, mask), mask), **extra}
        if d.pg_weight > 0 and trained:
            terms.update(policy_terms(self.cfg, batch, ctx.advantages, student, self.initial_policy, weight=d.pg_weight))
        return terms

    def after_step(self) -> None:
        self.teacher.after_step()

    def state_dict(self) -> dict:
        return {"teacher": self.teacher.state_dict()} if self.teacher.trained else {}

    def load_state_dict(self, state: dict, step: int) -> None:
        self.teacher.load_state_dict(state.get("teacher", {}))


def rows_per_group(group: torch.Tensor, eligible: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """[B] bool: k rows of each group drawn uniformly without replacement among its `eligible` ones (all of
    them where it has k or fewer).   group [B] ids, eligible [B] bool"""
    keep = torch.zeros(len(group), dtype=torch.bool)
    for g in group.unique(sorted=True):
        members = torch.nonzero((group == g) & eligible.cpu()).flatten()
        keep[members[torch.randperm(len(members), generator=generator)[:k]]] = True
    return keep

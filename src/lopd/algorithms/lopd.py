"""LOPD: Latent On-Policy Self-Distillation.

Per batch:
    retrieve   top-k successful experiences of earlier steps per task (never the trajectory's own group), by
               `algorithm.retrieval.key`: the most similar requests, or those that called one of the task's tools
    compose    the composer writes K latent slots z from them (`algorithm.lopd.composer`):
                 compressor  a trainable copy of the backbone reads [the experiences' text ; K memory tokens];
                             the K last hidden states, at the embeddings' scale, are z (K = 16 for ~90 tokens)
                 resampler   a Perceiver-style resampler over frozen features adds tanh(g) n_k to the embedding of
                             each context token it lies over (`copy_experience_tokens`: no compression)
    teach      the frozen teacher reads its prompt with z where the text context would stand (the end of the
               system message, `position: in_context`; or before the chat template, `prefix`) and scores every
               visited prefix of the student's completion
    distil     student:  coef * D(pi_theta || target) per token (`algorithm.distill.target`: the teacher, the
                         teacher where the context moves it, or the student shifted by the context's log-ratio)
                         [+ pg_weight * GRPO]
               composer: compressor  cd_weight * KL(pi_T(.|c) || pi_T(.|z)) on `cd_rows` rows per group (context
                                     distillation toward the text teacher: no reward needed) + lambda * hinge
                         resampler   objective `kl`: beta * KL(sg pi_theta || pi_T) + lambda * hinge;
                                     `privilege`: -w * mean A * Delta + beta * KL + lambda * hinge
               hinge = mean_y max(0, m - A(y) * Delta(y)),
               Delta(y) = mean_t [log pi_T(y_t | z, x, y<t) - log pi_0(y_t | x, y<t)]   (pi_0: no context)
    step       one optimizer step on student and composer (separate learning rates)
    remember   the batch's trajectories go into the experience bank (key: the task's embedding; its tools)
lambda is fixed, or follows dual ascent lambda <- max(0, lambda + dual_lr * mean(m - A * Delta)).

The compressor warms up first: until its slots carry enough of the text's effect (KL(text || z) / KL(text ||
none) below `latent_from_kl_ratio` over the whole minibatch) the student follows the text teacher, as
`lopd_text` does, whose scores the compressor's context distillation reads on every row at no extra forward,
and the margin waits; then the student follows the cheaper latent teacher, and the text teacher is scored on
`cd_rows` rows per group only. The resampler starts at gate 0 as exactly its text ablation
`lopd_text` (a test checks it to 1e-5). Trajectories whose retrieval found nothing get no context and, with
`mask_without_context`, no distillation and no composer loss. `composer_warmup_steps` trains only the composer on
the first batches, `composer_passes` adds composer-only passes over every batch. At evaluation the student runs
alone.

Ablations (configs/lopd_*.yaml): no margin (lambda = 0), a frozen random composer, no retrieval (a
learned task-independent context), and `lopd_text`: the same retrieved experiences as plain text.

    lopd train --config configs/lopd.yaml
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lopd import losses
from lopd.algorithms.base import Context, Term, measured, rows
from lopd.algorithms.distill import SelfDistillation
from lopd.latent.composer import Composer, Compressor, slot_cosine
from lopd.latent.pretrain import compress_texts, load_compressor, new_compressor
from lopd.latent.memory import ExperienceEncoder, ExperienceMemory
from lopd.errors import ConfigError
from lopd.prompts import PLACEHOLDER, context_examples, context_span
from lopd.schema import ComposerKind, ComposerObjective, DistillEstimator
from lopd.teacher import LatentSlots
from lopd.tokens import TokenStats


@dataclass
class RetrievalContext(Context):
    retrieved: list[list[int]] | None = None  # [B][<=k] bank ids, best first
    similarity: list[list[float]] | None = None
    cd_rows: torch.Tensor | None = None  # [B] bool: the compressor's context-distillation rows (text teacher scored)
    latent: bool = True  # the student follows the latent teacher (the compressor's warm-up: the text teacher)


def experiences_as_text(bank, ids: list[int]) -> str | None:
    """The retrieved experiences as the text context `lopd_text` gives its teacher (None: nothing found)."""
    return context_examples([(bank.entries[i].task_text, bank.entries[i].trajectory) for i in ids]) if ids else None


class RetrievalMixin:
    """Retrieval from the experience bank before the update, remembering after it (LOPD and lopd_text)."""

    def setup_memory(self, run) -> None:
        self.memory = ExperienceMemory(self.cfg, run, self.initial_policy or self.teacher, self.tokenizer)

    def retrieve(self, batch, step: int) -> RetrievalContext:
        found = self.memory.retrieve(batch, step)
        texts = [experiences_as_text(self.memory.bank, ids) for ids in found.index]
        return self.new_context(batch, step, RetrievalContext, privileged=texts,
                                has_context=torch.tensor([t is not None for t in texts]),
                                metrics=self.memory.metrics(batch, found), retrieved=found.index,
                                similarity=found.similarity)

    def remember(self, batch, step):
        self.memory.remember(batch, step)
        return {}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "bank_written": self.memory.bank.written}

    def load_state_dict(self, state, step):
        super().load_state_dict(state, step)
        self.memory.bank.truncate_after(step)


class LOPD(RetrievalMixin, SelfDistillation):
    name = "lopd"

    def needs_initial_policy(self) -> bool:
        return True  # pi_0, the context-free frozen model, for Delta

    def setup(self, **runtime) -> None:
        super().setup(**runtime)
        c = self.cfg.algorithm.lopd
        self.setup_memory(runtime.get("run"))
        self.encoder = ExperienceEncoder(self.initial_policy, self.tokenizer, c.max_experience_tokens, c.cache_entries)
        with self.initial_policy.active() as model:
            emb = model.get_input_embeddings().weight.detach()
            hidden = model.config.hidden_size
        self.lam = c.margin_coef
        # the compressor warms up on the text teacher first (latent_from_kl_ratio inf: the latent one from the start)
        self.latent = c.composer != ComposerKind.compressor or c.latent_from_kl_ratio == float("inf")
        if c.composer == ComposerKind.compressor:
            self.composer = self.build_compressor(runtime.get("device", "cpu"))
            self.composer.requires_grad_(c.train_composer)
            return
        filler_id = self.tokenizer("\n", add_special_tokens=False)["input_ids"][0]
        copy = c.copy_experience_tokens and c.retrieve
        if c.token_queries and not copy:
            raise ConfigError("algorithm.lopd.token_queries: the slots must lie over the context's tokens "
                              "(copy_experience_tokens and retrieve true)")
        self.composer = Composer(hidden, float(emb.float().norm(dim=-1).mean()), emb[filler_id], memory_dim=2 * hidden,
                                 latent_tokens=c.latent_tokens, layers=c.layers, heads=c.heads, width=c.width,
                                 gate_init=c.gate_init, copy_tokens=copy,
                                 token_queries=c.token_queries).to(runtime.get("device", "cpu"))
        self.composer.requires_grad_(c.train_composer)

    def build_compressor(self, device) -> Compressor:
        """A trainable copy of the initial backbone's decoder with K memory embeddings (`new_compressor`), or
        the pretrained one `compressor_init` names."""
        c = self.cfg.algorithm.lopd
        compressor = new_compressor(self.cfg, c.latent_tokens, device)
        if c.compressor_init:
            load_compressor(compressor, c.compressor_init, self.cfg.model.name)
        return compressor

    @property
    def compresses(self) -> bool:
        return self.cfg.algorithm.lopd.composer == ComposerKind.compressor

    def kept_prompt_lengths(self, batch, ctx: RetrievalContext) -> torch.Tensor:
        """The student's prompts and the latent teacher's (its gradient reaches the composer): the prompt
        and its K slot columns (absent slots are masked, but their columns are computed).   [2, B]"""
        prompt = batch.prompt_mask.sum(-1)  # [B]
        if not self.cfg.algorithm.lopd.train_composer:
            return prompt[None]
        slots = prompt + self.cfg.algorithm.lopd.latent_tokens
        return torch.stack([prompt, slots, prompt] if self.compresses else [prompt, slots])  # (+ the compressor's pass)

    def units(self, batch, ctx: RetrievalContext) -> dict[str, torch.Tensor]:
        """The distillation's and policy gradient's units, the composer's privilege terms' (the trajectories
        they constrain: A != 0, with a context), and the compressor's context distillation's (the tokens of
        its rows)."""
        units = {**super().units(batch, ctx), "privilege": losses.constrained(ctx.advantages, ctx.has_context).float()}
        if self.compresses:
            units["cd"] = batch.completion_mask * (ctx.cd_rows & ctx.has_context).to(batch.completion_mask.dtype)[:, None]
        return units

    def param_groups(self) -> list[dict]:
        params = [p for p in self.composer.parameters() if p.requires_grad]
        return [{"params": params, "lr": self.cfg.algorithm.lopd.composer_lr}] if params else []

    # ------------------------------------------------------------------ context

    def build_context(self, batch, step) -> RetrievalContext:
        c = self.cfg.algorithm.lopd
        if c.retrieve:
            ctx = self.retrieve(batch, step)
        else:  # a learned task-independent context for every trajectory, where a text context would stand
            ctx = self.new_context(batch, step, RetrievalContext, privileged=[PLACEHOLDER] * len(batch),
                                   has_context=torch.ones(len(batch), dtype=torch.bool))
        ctx.extra_passes = c.composer_passes
        ctx.latent = self.latent
        rank = torch.zeros(len(batch), dtype=torch.long)  # each row's place among its group's rows with a context
        for g in batch.group.unique():
            members = torch.nonzero((batch.group == g) & ctx.has_context).flatten()
            rank[members] = torch.arange(len(members))
        # warming up, the text teacher is scored on every row anyway (the student's target): all rows distil
        every = not self.latent or c.cd_rows <= 0
        ctx.cd_rows = torch.ones(len(batch), dtype=torch.bool) if every else rank < c.cd_rows
        return ctx

    def remember(self, batch, step):
        return super().remember(batch, step) if self.cfg.algorithm.lopd.retrieve else {}

    def tokens_under_slots(self, tasks, texts: list[str | None]) -> torch.Tensor:
        """[b, K, H] the teacher's input embeddings of the first K tokens of each row's text context, where
        the slots lie (as `Teacher.score_latent` places them); zeros past the context or without one."""
        K = self.cfg.algorithm.lopd.latent_tokens
        ids = torch.zeros(len(texts), K, dtype=torch.long)
        present = torch.zeros(len(texts), K, dtype=torch.bool)
        for b, (task, text) in enumerate(zip(tasks, texts)):
            if text is not None:
                prompt, start, end = context_span(self.tokenizer, task.messages, text)
                span = prompt[start:end][:K]
                ids[b, :len(span)], present[b, :len(span)] = torch.tensor(span, dtype=torch.long), True
        with self.initial_policy.active() as model:
            table = model.get_input_embeddings()
            return table(ids.to(table.weight.device)).detach() * present.to(table.weight.device)[..., None]

    def compose(self, ctx: RetrievalContext, attention: list | None = None,
                under: torch.Tensor | None = None) -> torch.Tensor:
        """The slots' values for a micro-batch: [b, K, H] (see `Composer`); `under` [b, K, H]: the tokens
        under the slots (`tokens_under_slots`), read by a composer with token queries."""
        if self.compresses:
            return self.compress(ctx.privileged)
        device = self.composer.queries.device
        if not self.cfg.algorithm.lopd.retrieve:
            return self.composer(batch=len(ctx.privileged))
        rows = self.encoder.encode(self.memory.bank, ctx.retrieved)  # [b][k] of [L, 2H]
        width = max([sum(len(h) for h in r) for r in rows] + [1])
        memory = torch.zeros(len(rows), width, self.composer.inp.in_features, device=device)  # [b, M, 2H]
        pad = torch.ones(len(rows), width, dtype=torch.bool, device=device)  # [b, M]
        success = torch.zeros(len(rows), width, dtype=torch.long, device=device)  # [b, M]
        for b, (r, ids) in enumerate(zip(rows, ctx.retrieved)):
            at = 0
            for h, i in zip(r, ids):
                memory[b, at:at + len(h)] = h
                pad[b, at:at + len(h)] = False
                success[b, at:at + len(h)] = int(self.memory.bank.entries[i].success)
                at += len(h)
        return self.composer(memory, pad, success, attention=attention, under=under)

    @property
    def compressor_token_limit(self) -> int:
        """The most context tokens the compressor reads (room for several experiences of max_experience_tokens)."""
        return self.cfg.algorithm.lopd.max_experience_tokens * 8

    def compress(self, texts: list[str | None]) -> torch.Tensor:
        """The compressor's slots for each row's context: [b, K, H], zeros for a row without context."""
        return compress_texts(self.composer, self.tokenizer, texts, self.compressor_token_limit)

    def latent_teacher(self, batch, ctx: RetrievalContext) -> tuple[TokenStats, dict[str, Term]]:
        """The teacher reading the composer's slots (gradient open back to the composer), and the slots'
        measurements."""
        c = self.cfg.algorithm.lopd
        under = self.tokens_under_slots(batch.tasks, ctx.privileged) \
            if getattr(self.composer, "token_in", None) is not None else None
        values = self.compose(ctx, under=under)  # [b, K, H]
        over = not self.compresses and self.composer.copy_tokens
        slots = LatentSlots(values, over_context=over, position=c.position)
        with torch.set_grad_enabled(values.requires_grad):
            teacher, length = self.teacher.score_latent(batch, ctx.privileged, slots,
                                                        checkpoint_layers=c.checkpoint_teacher and values.requires_grad)
        used = ctx.has_context.to(length.device).double()
        if not over:  # K slots of their own stand for the whole context: the teacher reads K, the text had more
            length = torch.full_like(length, values.shape[1])
        metrics = {"context/latent_norm": rows(values.detach().norm(dim=-1).mean(-1), values),
                   "context/context_tokens": measured(length.double(), used),
                   "context/context_truncated": measured((length >= c.latent_tokens).double(), used)}
        K = values.shape[1]
        present = (torch.arange(K)[None] < length[:, None] if over
                   else torch.ones(len(length), K, dtype=torch.bool)) & ctx.has_context.cpu()[:, None]  # [b, K]
        added = values if over or self.compresses else values - self.composer.filler
        alike = slot_cosine(added, present.to(values.device))  # [b], NaN where no direction to compare (gate 0)
        if not alike.isnan().all():
            metrics["context/slot_cosine"] = measured(alike, (~alike.isnan()).double())
        return teacher, metrics

    # ------------------------------------------------------------------ losses

    def trains_student(self, ctx: Context) -> bool:
        c = self.cfg.algorithm.lopd
        return ctx.step > c.composer_warmup_steps and ctx.pass_index >= ctx.extra_passes

    def live_rows(self, batch, ctx):
        """The distilled rows (and the policy gradient's), and while the composer trains every row with a context:
        its terms read the student's successes too, which `distill.skip_successes` leaves out of the distillation."""
        live = super().live_rows(batch, ctx)  # [B]
        return live | ctx.has_context.to(live.device) if self.cfg.algorithm.lopd.train_composer else live

    def teacher_side(self, teacher: TokenStats) -> TokenStats:
        """One divergence, both partial gradients: the student's coef * KL(p || sg q) and the composer's
        beta * KL(sg p || q): the teacher's hidden states pass beta / coef of the gradient to z."""
        d, c = self.cfg.algorithm.distill, self.cfg.algorithm.lopd
        w = c.beta / d.coef if d.coef > 0 else 0.0
        h = teacher.hidden
        return replace(teacher, hidden=w * h + (1 - w) * h.detach(), _logprobs=None)

    def measures(self, ctx: RetrievalContext) -> bool:
        """Whether this step runs the forwards that only measure when the composer is frozen: pi_0 for Delta
        (the margin, the privilege) and the compressor's text teacher for its context-distillation KL. A
        training composer's gradient reads them, and the compressor's warm-up ends on their KL ratio, so both
        run them on every step; otherwise step 1 and every `measure_every`-th step after."""
        c = self.cfg.algorithm.lopd
        return c.train_composer or not ctx.latent or (ctx.step - 1) % c.measure_every == 0

    def loss(self, batch, ctx: RetrievalContext, student):
        # pi_0 and the teachers are scored on the rows with a context only, where the others are not distilled
        # (policy-gradient rows of `distill.rows_per_group`): nothing they would say reaches a loss
        measure = self.measures(ctx)
        part = torch.nonzero(ctx.has_context).flatten()
        whole = not self.cfg.train.skip_zero_loss_rows or len(part) == len(batch)
        on, on_ctx = (batch, ctx) if whole else (batch.select(part.cpu()), ctx.select(part.cpu()))
        placed = (lambda stats: stats) if whole else (lambda stats: stats.placed(part, student))
        empty = not len(part) and not whole
        if empty:  # no row to distil here: zero stand-ins, every context term masked out
            initial = latent = replace(student.detached(), hidden=torch.zeros_like(student.hidden), _logprobs=None)
            slot_terms = {}
        else:
            initial = None  # pi_0, the context-free frozen model: for the measurements and the targets that read it
            if measure or self.needs_base():
                with torch.no_grad():
                    initial = placed(self.initial_policy.score(on))
            latent, slot_terms = self.latent_teacher(on, on_ctx)
            latent = placed(latent)
        text = None
        if self.compresses and not ctx.latent and not empty:  # the warm-up: the student follows the text teacher
            with torch.no_grad():
                text = placed(self.teacher.score(on, on_ctx.privileged))
        terms = self.distill_terms(batch, ctx, student, latent if text is None else text, self.base_stats(batch, initial))
        if not measure:  # a frozen composer's terms move nothing: measured on other steps
            return {**terms, **slot_terms}
        composer = self.composer_terms(batch, ctx, student, latent, initial)
        if self.compresses:
            terms.update(self.context_distillation(batch, ctx, latent, initial, text))
            if not ctx.latent:  # the margin is about the latent teacher's privilege: it waits too
                for name in ("loss/margin", "context/privilege"):
                    composer[name] = replace(composer[name], coef=0.0, units=None)
        return {**terms, **composer, **slot_terms}

    def context_distillation(self, batch, ctx: RetrievalContext, latent: TokenStats, initial: TokenStats,
                             text: TokenStats | None = None) -> dict[str, Term]:
        """The compressor's loss: KL(pi_T(.|c) || pi_T(.|slots)) over the tokens of the distillation rows (the
        text teacher `text` if already scored on the whole micro-batch, else scored on those rows only, no
        gradient), and the same KL to the context-free model, their ratio being how much of the text's effect
        the slots carry (read by `after_update`)."""
        rows = torch.nonzero((ctx.cd_rows & ctx.has_context).to(latent.mask.device)).flatten()
        if not len(rows):
            empty = latent.mask[:0]
            return {"loss/cd": Term(empty, empty, coef=self.cfg.algorithm.lopd.cd_weight, units="cd"),
                    "context/cd_kl_none": measured(empty, empty)}
        if text is not None:
            text = text.select(rows)
        else:
            with torch.no_grad():
                text = self.teacher.score(batch.select(rows.cpu()), [ctx.privileged[i] for i in rows.tolist()])
        mask = latent.mask[rows]
        forward_kl = DistillEstimator.jsd  # alpha 0: KL(text || the other), gradient into the other's hidden states
        cd = losses.token_divergence(latent.select(rows), text, forward_kl, alpha=0.0)  # [n, T]
        with torch.no_grad():
            none = losses.token_divergence(initial.select(rows), text, forward_kl, alpha=0.0)  # [n, T]
        return {"loss/cd": Term(cd, mask, coef=self.cfg.algorithm.lopd.cd_weight, units="cd"),
                "context/cd_kl_none": measured(none, mask)}

    def composer_terms(self, batch, ctx: RetrievalContext, student: TokenStats, teacher: TokenStats,
                       initial: TokenStats) -> dict[str, Term]:
        """The composer's privilege terms on Delta (its KL term rides on `teacher_side`), over the
        trajectories whose teacher got a context and whose advantage is not 0 (the "privilege" units)."""
        c = self.cfg.algorithm.lopd
        delta = losses.sequence_mean(teacher.logprobs() - initial.logprobs().detach(), student.mask)  # [B]
        adv = ctx.advantages.to(delta.device)
        active = ctx.has_context.to(delta.device)
        use = losses.constrained(adv, active).to(delta.dtype)  # [B]
        slack = c.margin - adv * delta  # [B] the hinge's argument: m - A * Delta
        priv_coef = -c.privilege_weight if c.objective is ComposerObjective.privilege else 0.0
        success = (batch.success.to(delta.device) & active).to(delta.dtype)
        failure = (~batch.success.to(delta.device) & active).to(delta.dtype)
        return {"loss/margin": Term(torch.relu(slack), use, coef=self.lam, units="privilege"),
                "context/privilege": Term(adv * delta, use, coef=priv_coef, units="privilege"),
                "context/constraint": measured(slack, use),
                "context/delta_success": measured(delta, success),
                "context/delta_failure": measured(delta, failure),
                "context/margin_violation": measured((slack > 0).float(), use),
                **({} if self.compresses else {"context/gate": rows(torch.tanh(self.composer.gate.detach()), delta)})}

    def after_update(self, values):
        """Dual ascent on lambda, on the constraint's mean over the whole minibatch (every micro-batch, every
        rank); the compressor's warm-up ends when its slots carry enough of the text's effect."""
        c = self.cfg.algorithm.lopd
        if c.dual_lr > 0 and "context/constraint" in values and self.latent:
            self.lam = max(0.0, self.lam + c.dual_lr * values["context/constraint"])
        out = {"context/lambda": self.lam}
        if self.compresses:
            if values.get("context/cd_kl_none", 0.0) > 0:
                ratio = values["loss/cd"] / values["context/cd_kl_none"]
                out["context/cd_kl_ratio"] = ratio
                self.latent = self.latent or ratio < c.latent_from_kl_ratio
            out["context/latent_teacher"] = float(self.latent)
        return out

    def state_dict(self) -> dict:
        return {**super().state_dict(), "composer": self.composer.state_dict(), "lambda": self.lam,
                "latent": self.latent}

    def load_state_dict(self, state: dict, step: int) -> None:
        super().load_state_dict(state, step)
        if state:
            self.composer.load_state_dict(state["composer"])
            self.lam = state["lambda"]
            self.latent = state.get("latent", True)


class LOPDText(RetrievalMixin, SelfDistillation):
    """Ablation: the same retrieved experiences, given to the teacher as plain text (no latents)."""

    name = "lopd_text"

    def setup(self, **runtime) -> None:
        super().setup(**runtime)
        self.setup_memory(runtime.get("run"))

    def build_context(self, batch, step):
        return self.retrieve(batch, step)

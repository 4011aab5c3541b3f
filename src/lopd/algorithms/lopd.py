"""LOPD: Latent On-Policy Self-Distillation.

Per batch:
    remember   every scored trajectory goes into the experience bank (key: its task's embedding)
    retrieve   top-k similar experiences per task: never the trajectory itself, never its own group
    compose    the composer turns their frozen-backbone encodings into K latent tokens z
    teach      the frozen teacher reads [z ; prompt ; completion] and scores every visited prefix
    distil     student:  KL(pi_theta || sg pi_T)                       per token, any estimator
               composer: beta * KL(sg pi_theta || pi_T) + lambda * mean_y max(0, m - A(y) * Delta(y))
               Delta(y) = mean_t [log pi_T(y_t | z, x, y<t) - log pi_0(y_t | x, y<t)]   (pi_0: no context)
    step       one optimizer step on student and composer (separate learning rates)
lambda is fixed, or follows dual ascent lambda <- max(0, lambda + dual_lr * mean(m - A * Delta)).
Without the margin the composer's cheapest way to lower the KL is to make the teacher copy the student
(Delta -> 0, collapse); the margin makes the latent context keep raising the likelihood of better-than-
average trajectories and lowering that of worse ones. At evaluation the student runs alone.

Ablations (configs/lopd_*.yaml): no margin (lambda = 0), a frozen random composer, no retrieval (a
learned task-independent prefix), and `lopd_text`: the same retrieved experiences as plain text.

    lopd train --config configs/lopd.yaml
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from lopd import losses
from lopd.algorithms.base import Algorithm, Context, mean_of
from lopd.algorithms.distill import SelfDistillation
from lopd.algorithms.grpo import grpo_loss
from lopd.latent.composer import Composer
from lopd.latent.embedder import build_embedder
from lopd.latent.experience_bank import Experience, ExperienceBank, Retrieved
from lopd.prompts import context_examples, task_text
from lopd.tokens import TokenStats, decoder_and_head, token_divergence


@dataclass
class RetrievalContext(Context):
    retrieved: list[list[int]] | None = None  # [B][<=k] bank ids, best first
    similarity: list[list[float]] | None = None


class ExperienceMemory:
    """Remember and retrieve: the bank, its embedder, and the exclusion rules (shared by LOPD and lopd_text)."""

    def __init__(self, cfg, run, reference, tokenizer):
        r, c = cfg.algorithm.retrieval, cfg.algorithm.lopd
        self.cfg = c
        self.embedder = build_embedder(r.embedder, r.embedder_path, reference, tokenizer)
        folder = run.path / "bank" if run is not None else None
        self.bank = ExperienceBank(self.embedder.dim, folder, capacity=c.bank_capacity, eviction=c.eviction)

    def remember(self, batch, step: int) -> list[int]:
        """Store the batch's trajectories; returns their bank ids (-1 for the ones not kept)."""
        keep = [i for i in range(len(batch)) if self.cfg.remember == "all" or bool(batch.success[i])]
        texts = [task_text(batch.tasks[i]) for i in keep]
        entries = [Experience(batch.tasks[i].id, texts[j], batch.texts[i], float(batch.rewards[i]),
                              bool(batch.success[i]), batch.feedback[i], step, f"{step}:{int(batch.group[i])}",
                              category=batch.tasks[i].category,
                              tokens=batch.completion_ids[i][batch.completion_mask[i].bool()].tolist())
                   for j, i in enumerate(keep)]
        ids = self.bank.add(entries, self._encode_unique(texts)) if entries else []
        out = [-1] * len(batch)
        for i, bank_id in zip(keep, ids):
            out[i] = bank_id
        return out

    def _encode_unique(self, texts: list[str]):
        unique = list(dict.fromkeys(texts))
        keys = self.embedder.encode(unique)
        row = {t: i for i, t in enumerate(unique)}
        return keys[[row[t] for t in texts]]

    def retrieve(self, batch, step: int, own_ids: list[int]) -> Retrieved:
        """Top-k per trajectory, searched once per sampling group: every trajectory of a group shares its
        task, and excluding the group excludes each of them (their own entries included)."""
        groups = [f"{step}:{int(g)}" for g in batch.group]
        first = {g: i for i, g in reversed(list(enumerate(groups)))}  # group -> its first trajectory
        order = list(first)
        texts = [task_text(batch.tasks[first[g]]) for g in order]
        found = self.bank.search(self._encode_unique(texts), self.cfg.retrieve_k, exclude_groups=order,
                                 exclude_ids=[[i for i, gg in zip(own_ids, groups) if gg == g and i >= 0] for g in order],
                                 successes_only=not self.cfg.retrieve_failures, min_similarity=self.cfg.min_similarity)
        row = {g: j for j, g in enumerate(order)}
        return Retrieved([found.index[row[g]] for g in groups], [found.similarity[row[g]] for g in groups])

    def metrics(self, batch, found) -> dict[str, float]:
        """Bank size, similarity of what was retrieved, and the hit rate: the fraction of tasks for which
        at least one retrieved experience is of the task's own category (ToolWorld: the same tool)."""
        sims = [s for row in found.similarity for s in row]
        hits = [any(self.bank.entries[i].category == t.category for i in row) for t, row in zip(batch.tasks, found.index)]
        return {**self.bank.stats(),
                "context/retrieved_per_task": sum(map(len, found.index)) / max(len(found.index), 1),
                "context/retrieval_similarity": sum(sims) / len(sims) if sims else 0.0,
                "context/retrieval_hit": sum(hits) / max(len(hits), 1)}


class ExperienceEncoder:
    """Features of bank entries ("request -> answer" tokens) from the frozen backbone, cached (LRU):
    per token, [last hidden state ; input embedding] ([L, 2H]): what the token means in context, and
    which token it is (so the composer can carry exact values, e.g. a date's format, into z)."""

    def __init__(self, reference, tokenizer, max_tokens: int, cache_entries: int):
        self.reference, self.tokenizer, self.max_tokens, self.cache_entries = reference, tokenizer, max_tokens, cache_entries
        self.cache: OrderedDict[int, torch.Tensor] = OrderedDict()

    @torch.no_grad()
    def encode(self, bank: ExperienceBank, ids: list[int]) -> list[torch.Tensor]:
        missing = [i for i in dict.fromkeys(ids) if i not in self.cache]
        if missing:
            seqs = [self.tokenizer(f"{bank.entries[i].task_text} -> {bank.entries[i].trajectory}",
                                   add_special_tokens=False)["input_ids"][: self.max_tokens] or [0] for i in missing]
            with self.reference.active() as model:
                decoder, _ = decoder_and_head(model)
                device = next(model.parameters()).device
                # one entry at a time: an entry's features never depend on what it was batched with, so a
                # resumed run (empty cache) composes exactly what the uninterrupted run did
                for i, seq in zip(missing, seqs):
                    x = torch.tensor([seq], device=device)  # [1, L]
                    h = decoder(input_ids=x).last_hidden_state
                    e = decoder.get_input_embeddings()(x)
                    self.cache[i] = torch.cat([h, e], dim=-1).float()[0]  # [L, 2H]
        out = []
        for i in ids:
            self.cache.move_to_end(i)
            out.append(self.cache[i])
        while len(self.cache) > self.cache_entries:
            self.cache.popitem(last=False)
        return out


class LOPD(Algorithm):
    name = "lopd"
    uses_teacher = True
    uses_reference = True  # pi_0, the context-free frozen model, for Delta

    def setup(self, **runtime) -> None:
        super().setup(**runtime)
        c = self.cfg.algorithm.lopd
        tok, device = runtime["tokenizer"], runtime.get("device", "cpu")
        self.memory = ExperienceMemory(self.cfg, runtime.get("run"), self.reference, tok)
        self.encoder = ExperienceEncoder(self.reference, tok, c.max_experience_tokens, c.cache_entries)
        with self.reference.active() as model:
            emb = model.get_input_embeddings().weight.detach()
            hidden = model.config.hidden_size
        filler_id = tok("\n", add_special_tokens=False)["input_ids"][0]
        self.composer = Composer(hidden, float(emb.float().norm(dim=-1).mean()), emb[filler_id], memory_dim=2 * hidden,
                                 latent_tokens=c.latent_tokens, layers=c.layers, heads=c.heads, width=c.width,
                                 gate_init=c.gate_init, copy_tokens=c.copy_experience_tokens).to(device)
        self.composer.requires_grad_(c.train_composer)
        self.lam = c.margin_coef
        self.step = 0
        self._constraint: list[float] = []

    def param_groups(self) -> list[dict]:
        params = [p for p in self.composer.parameters() if p.requires_grad]
        return [{"params": params, "lr": self.cfg.algorithm.lopd.composer_lr}] if params else []

    def build_context(self, batch) -> RetrievalContext:
        self.step += 1
        own = self.memory.remember(batch, self.step)
        found = self.memory.retrieve(batch, self.step, own)
        self._retrieval_metrics = self.memory.metrics(batch, found)
        pg = self.cfg.algorithm.pg
        return RetrievalContext(advantages=losses.group_advantages(batch.rewards, batch.group, pg.normalize_std),
                                retrieved=found.index, similarity=found.similarity)

    def teacher_prefix(self, batch, ctx: RetrievalContext) -> torch.Tensor:
        device = self.composer.queries.device
        if not self.cfg.algorithm.lopd.retrieve:
            z = self.composer(batch=len(batch))
            self._last_norm = float(z.detach().norm(dim=-1).mean())
            return z
        rows = [self.encoder.encode(self.memory.bank, ids) for ids in ctx.retrieved]  # [b][k] of [L, H]
        width = max([sum(len(h) for h in r) for r in rows] + [1])
        memory = torch.zeros(len(rows), width, self.composer.inp.in_features, device=device)
        pad = torch.ones(len(rows), width, dtype=torch.bool, device=device)
        success = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        for b, (r, ids) in enumerate(zip(rows, ctx.retrieved)):
            at = 0
            for h, i in zip(r, ids):
                memory[b, at:at + len(h)] = h
                pad[b, at:at + len(h)] = False
                success[b, at:at + len(h)] = int(self.memory.bank.entries[i].success)
                at += len(h)
        z = self.composer(memory, pad, success)  # [b, K, H]
        self._last_norm = float(z.detach().norm(dim=-1).mean())
        return z

    def loss(self, batch, ctx: RetrievalContext, student: TokenStats, teacher: TokenStats, reference: TokenStats):
        c, d, agg = self.cfg.algorithm.lopd, self.cfg.algorithm.distill, self.cfg.algorithm.aggregation
        mask = student.mask  # [B, T]
        # one divergence, both partial gradients: the student's KL(p || sg q) and the composer's
        # beta * KL(sg p || q) (the teacher's hidden states carry the gradient to z, scaled by beta)
        h = teacher.hidden
        scaled = TokenStats(c.beta * h + (1 - c.beta) * h.detach(), teacher.head, teacher.targets, teacher.mask,
                            teacher.temperature, teacher.chunk)
        kl = losses.aggregate(token_divergence(student, scaled, d.estimator, topk=d.topk, alpha=d.alpha), mask, agg)
        # the privileged margin on Delta(y), per trajectory
        delta = losses.sequence_mean(teacher.logprobs() - reference.logprobs().detach(), mask)  # [B]
        adv = ctx.advantages.to(delta.device)
        margin, slack = losses.privileged_margin(delta, adv, c.margin)
        active = (adv != 0).to(delta.dtype)
        loss = d.coef * kl + self.lam * margin
        self._constraint.append(float((slack.detach() * active).sum() / active.sum().clamp(min=1)))
        success = batch.success.to(delta.device)
        metrics = {"loss/distill": kl.item(), "loss/margin": margin.item(),
                   "context/delta_success": float(delta[success].mean().detach()) if success.any() else 0.0,
                   "context/delta_failure": float(delta[~success].mean().detach()) if (~success).any() else 0.0,
                   "context/margin_violation": mean_of((slack.detach() > 0).float(), active),
                   "context/privilege": mean_of((adv * delta).detach(), active),
                   "context/lambda": self.lam, "context/gate": float(torch.tanh(self.composer.gate.detach())),
                   "context/latent_norm": self._last_norm, **self._retrieval_metrics}
        if d.pg_weight > 0:
            pg, pg_metrics = grpo_loss(self.cfg, batch, ctx.advantages, student, reference)
            loss = loss + d.pg_weight * pg
            metrics.update(pg_metrics)
        return loss, metrics

    def after_update(self, batch) -> dict[str, float]:
        c = self.cfg.algorithm.lopd
        if c.dual_lr > 0 and self._constraint:
            self.lam = max(0.0, self.lam + c.dual_lr * sum(self._constraint) / len(self._constraint))
        self._constraint = []
        return {"context/lambda": self.lam}

    def state_dict(self) -> dict:
        return {"composer": self.composer.state_dict(), "lambda": self.lam, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.composer.load_state_dict(state["composer"])
            self.lam, self.step = state["lambda"], state["step"]
            self.memory.bank.truncate_after(self.step)


class LOPDText(SelfDistillation):
    """Ablation: the same retrieved experiences, given to the teacher as plain text (no latents)."""

    name = "lopd_text"

    def setup(self, **runtime) -> None:
        super().setup(**runtime)
        self.memory = ExperienceMemory(self.cfg, runtime.get("run"), self.reference or self.teacher, runtime["tokenizer"])
        self.step = 0

    def contexts(self, batch):
        self.step += 1
        own = self.memory.remember(batch, self.step)
        found = self.memory.retrieve(batch, self.step, own)
        self._retrieval_metrics = self.memory.metrics(batch, found)
        bank = self.memory.bank.entries
        return [context_examples([(bank[i].task_text, bank[i].trajectory) for i in ids]) if ids else None
                for ids in found.index]

    def loss(self, batch, ctx, student, teacher, reference=None):
        loss, metrics = super().loss(batch, ctx, student, teacher, reference)
        return loss, {**metrics, **self._retrieval_metrics}

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state.get("step", 0)
        self.memory.bank.truncate_after(self.step)

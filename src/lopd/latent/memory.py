"""Remember and retrieve experiences, and encode them for the composer (shared by LOPD and lopd_text).

    ExperienceMemory   the bank, its embedder and the exclusion rules: remember a batch's trajectories,
                       retrieve the top-k successful experiences of other sampling groups for each task
    ExperienceEncoder  per token of an entry ("request -> answer"), the frozen backbone's
                       [last hidden ; input embedding], cached (LRU): the composer's memory
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from lopd.latent.embedder import build_embedder
from lopd.latent.experience_bank import Experience, ExperienceBank, Retrieved
from lopd.prompts import called_tools, offered_tools, task_text
from lopd.fsdp import is_sharded, union
from lopd.schema import RememberWhat, RetrievalKey
from lopd.tokens import decoder_and_head


class ExperienceMemory:
    """Remember and retrieve: the bank, its embedder, and the exclusion rules (shared by LOPD and lopd_text)."""

    def __init__(self, cfg, run, frozen, tokenizer):
        r, c = cfg.algorithm.retrieval, cfg.algorithm.lopd
        self.cfg, self.key = c, r.key
        self.embedder = build_embedder(r.embedder, r.embedder_path, frozen, tokenizer)
        folder = run.bank_dir if run is not None else None
        self.bank = ExperienceBank(self.embedder.dim, folder, capacity=c.bank_capacity, eviction=c.eviction,
                                   readonly=run is not None and not run.writer,
                                   checkpointed=checkpointed_count(run, "bank_written"))

    def remember(self, batch, step: int) -> list[int]:
        """Store the batch's trajectories; returns their bank ids (-1 for the ones not kept)."""
        keep = [i for i in range(len(batch)) if self.cfg.remember is RememberWhat.all or bool(batch.success[i])]
        texts = [task_text(batch.tasks[i]) for i in keep]
        entries = [Experience(batch.tasks[i].id, texts[j], batch.completions[i], float(batch.rewards[i]),
                              bool(batch.success[i]), batch.feedback[i], step, f"{step}:{int(batch.group[i])}",
                              category=batch.tasks[i].category, tools=called_tools(batch.completions[i]))
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

    def search(self, tasks, **exclusions) -> Retrieved:
        """The configured retrieval (key, k, successes only, minimum similarity, distinct experiences) for
        tasks; training, `lopd inspect` and the privilege probe all go through it."""
        return self.bank.search(self._encode_unique([task_text(t) for t in tasks]), self.cfg.retrieve_k,
                                successes_only=not self.cfg.retrieve_failures, min_similarity=self.cfg.min_similarity,
                                distinct=self.cfg.distinct_experiences, only=allowed(self.bank, tasks, self.key),
                                **exclusions)

    def retrieve(self, batch, step: int, own_ids: list[int] | None = None) -> Retrieved:
        """Top-k per trajectory, searched once per sampling group: every trajectory of a group shares its
        task, and excluding the group excludes each of them (their own entries included, if the batch was
        already remembered)."""
        own_ids = own_ids if own_ids is not None else [-1] * len(batch)
        groups = [f"{step}:{int(g)}" for g in batch.group]
        first = {g: i for i, g in reversed(list(enumerate(groups)))}  # group -> its first trajectory
        order = list(first)
        found = self.search([batch.tasks[first[g]] for g in order], exclude_groups=order,
                            exclude_ids=[[i for i, gg in zip(own_ids, groups) if gg == g and i >= 0] for g in order])
        row = {g: j for j, g in enumerate(order)}
        return Retrieved([found.index[row[g]] for g in groups], [found.similarity[row[g]] for g in groups])

    def metrics(self, batch, found) -> dict[str, float]:
        """Bank size, similarity of what was retrieved, and two hit rates: the fraction of tasks for which at
        least one retrieved experience is of the task's own category (ToolWorld: the same tool; an env with
        one category, e.g. HumanEval, hits whenever anything is retrieved) and of the task itself (an
        earlier visit's experience: a task revisited in a later epoch)."""
        sims = [s for row in found.similarity for s in row]
        pairs = list(zip(batch.tasks, found.index))
        hits = [any(self.bank.entries[i].category == t.category for i in row) for t, row in pairs]
        same = [any(self.bank.entries[i].task_id == t.id for i in row) for t, row in pairs]
        return {**self.bank.stats(),
                "context/retrieved_per_task": sum(map(len, found.index)) / max(len(found.index), 1),
                "context/retrieval_similarity": sum(sims) / len(sims) if sims else 0.0,
                "context/retrieval_hit": sum(hits) / max(len(hits), 1),
                "context/retrieval_same_task": sum(same) / max(len(same), 1)}


def allowed(bank: ExperienceBank, tasks, key: RetrievalKey) -> list[list[int] | None] | None:
    """Per task, the bank entries retrieval may find under `key` (`algorithm.retrieval.key`; None: any):
    task_tools, the entries whose trajectory called a tool the task offers (a task that offers none may find
    any); category, the entries of the task's category."""
    if key == RetrievalKey.request:
        return None
    if key == RetrievalKey.task_tools:
        return [bank.calling(tools) if (tools := offered_tools(t)) else None for t in tasks]
    if key == RetrievalKey.category:
        return [bank.by_category.get(t.category, []) for t in tasks]
    raise ValueError(f"retrieval key '{key}' is not one of {', '.join(RetrievalKey)}")


def checkpointed_count(run, key: str) -> int | None:
    """How many entries the run's newest checkpoint covers (its algorithm state's `key`): a repair of the
    bank's files never goes below it. 0 without a checkpoint (a fresh start drops everything anyway); None
    for a checkpoint older than the count (never below the complete entries)."""
    if run is None:
        return None
    state = run.checkpointed_algorithm_state()
    return 0 if state is None else state.get(key)


class ExperienceEncoder:
    """Features of bank entries ("request -> answer" tokens) from the frozen backbone, cached (LRU):
    per token, [last hidden state ; input embedding] ([L, 2H]): what the token means in context, and
    which token it is (so the composer can carry exact values, e.g. a date's format, into z)."""

    def __init__(self, frozen, tokenizer, max_tokens: int, cache_entries: int):
        self.frozen, self.tokenizer, self.max_tokens, self.cache_entries = frozen, tokenizer, max_tokens, cache_entries
        self.cache: OrderedDict[int, torch.Tensor] = OrderedDict()

    @torch.no_grad()
    def encode(self, bank: ExperienceBank, rows: list[list[int]]) -> list[list[torch.Tensor]]:
        """Each row's entries' features ([L, 2H] each), for one micro-batch in one call. Sharded (FSDP),
        every forward is collective: every rank encodes the union of what any rank's call misses."""
        wanted = list(dict.fromkeys(i for row in rows for i in row))
        missing = [i for i in wanted if i not in self.cache]
        with self.frozen.active() as model:
            if is_sharded(model):
                missing = union(missing)  # an entry this rank has cached is recomputed: the same values
            fresh: dict[int, torch.Tensor] = {}
            if missing:
                decoder, _ = decoder_and_head(model)
                device = next(model.parameters()).device
                # one entry at a time: an entry's features never depend on what it was batched with, so a
                # resumed run (empty cache) composes exactly what the uninterrupted run did
                for i in missing:
                    entry = bank.entries[i]
                    seq = self.tokenizer(f"{entry.task_text} -> {entry.trajectory}",
                                         add_special_tokens=False)["input_ids"][: self.max_tokens] or [0]
                    x = torch.tensor([seq], device=device)  # [1, L]
                    h = decoder(input_ids=x).last_hidden_state
                    e = decoder.get_input_embeddings()(x)
                    fresh[i] = torch.cat([h, e], dim=-1).float()[0]  # [L, 2H]
        self.cache.update(fresh)
        out = [[self.cache[i] for i in row] for row in rows]
        for i in wanted:
            self.cache.move_to_end(i)
        while len(self.cache) > self.cache_entries:
            self.cache.popitem(last=False)
        return out

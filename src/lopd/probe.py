"""`lopd probe`: how much privilege a teacher's context gives, measured before any grid.

A self-teacher helps only where its context gives it an edge over the student. On a fixed bank (the untrained
policy's rollouts on `train`) and a fixed batch of the student's own trajectories on `val` (G per task at the
training temperature), for each context source:

    none                        the teacher reads nothing extra (every figure is 0 by construction)
    reference                   the task's reference answer (OPSD's context)
    <key>:k<k>[:early]          k successful experiences from the bank (`algorithm.retrieval.key`: request,
                                task_tools, category); `early`: the bank's first rollouts only (LOPD's state
                                after a step or two)
    latent:K<K>[:<key>:k<k>]    the compressor's K slots for the same experiences, after `latent_steps` steps
                                of context distillation toward the text teacher on the bank's trajectories
    latent:pretrained[:<key>:k<k>]   the slots of the compressor `--compressor` names (`lopd pretrain-compressor`:
                                trained before any RL, on no env reward), as it is

it reports, with Delta(y) = mean_t [log pi_T(y_t | c, ...) - log pi_0(y_t | ...)] (the student is pi_0 here,
so this is also the teacher's gain over the student):

    gain_success, gain_failure  the token-mean gain on the student's successes and failures (nats/token)
    auc                         P(Delta(success) > Delta(failure)) over the pairs of one mixed group: does the
                                context raise what worked above what did not
    a_delta                     mean over A != 0 of A(y) * Delta(y) (what LOPD's margin asks to be positive)
    shift                       mean KL(pi_T(.|c) || pi_T(.|none)) per token (the gated target's quantity)
    kl_ratio                    latent only: KL(text || slots) / KL(text || none) on the val trajectories
    coverage, tokens            the share of trajectories with a context, its mean length in tokens
    greedy                      greedy success on the val tasks with the context in the prompt (%)

    lopd probe --out runs/probe [key=value ...]                   (config keys: the model, env, decoding)
    lopd probe --out runs/probe --sources none reference task_tools:k2 latent:K16:task_tools:k2
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import torch

from lopd import losses
from lopd.envs import build_env
from lopd.latent.memory import ExperienceMemory
from lopd.latent.pretrain import compress_texts, new_compressor, pretrained_compressor
from lopd.errors import ConfigError
from lopd.models import load_policy
from lopd.prompts import context_reference, encode_prompt
from lopd.rollout import RolloutBatch, sample, sample_and_score
from lopd.schema import Config, DistillEstimator, RetrievalKey
from lopd.session import env_tasks, tasks_for_step
from lopd.teacher import FrozenTeacher, LatentSlots
from lopd.tokens import set_prompt_sharing

ROWS = 96  # trajectories scored per teacher forward


@dataclass
class ProbeSettings:
    bank_rollouts: int = 2048  # the untrained policy's rollouts on `train` that fill the bank
    early_rollouts: int = 176  # the "early" bank: its first rollouts only
    val_tasks: int = 100  # the first val tasks the student's trajectories and the greedy success come from
    group: int = 8  # trajectories per val task
    split: str = "val"
    sources: list[str] = field(default_factory=lambda: [
        "none", "reference", *[f"{key}:k{k}{bank}" for key in RetrievalKey for k in (1, 2, 4) for bank in ("", ":early")],
        "latent:K16:task_tools:k2"])
    latent_steps: int = 200  # context-distillation steps of the compressor on the bank's trajectories
    latent_rows: int = 32  # trajectories per step
    latent_lr: float = 1e-3
    compressor: str | None = None  # the compressor.pt that `latent:pretrained` reads


def auc_within_groups(delta: Sequence[float], success: Sequence[bool], group: Sequence[int], tie: float = 1e-6) -> float:
    """P(Delta(s) > Delta(f)) + P(=)/2 over the (success s, failure f) pairs of one group, all groups pooled;
    NaN without a mixed group. Deltas within `tie` nats/token are equal (float rounding of two forwards that
    batch the same rows differently, e.g. the `none` source's exact zeros)."""
    wins, pairs = 0.0, 0
    by_group: dict[int, list[int]] = {}
    for i, g in enumerate(group):
        by_group.setdefault(int(g), []).append(i)
    for members in by_group.values():
        good = [delta[i] for i in members if success[i]]
        bad = [delta[i] for i in members if not success[i]]
        for a in good:
            for b in bad:
                wins += 0.5 if abs(a - b) <= tie else 1.0 if a > b else 0.0
                pairs += 1
    return wins / pairs if pairs else math.nan


class Probe:
    def __init__(self, cfg: Config, settings: ProbeSettings, out: Path):
        self.cfg, self.s, self.out = cfg, settings, Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        set_prompt_sharing(cfg.train.share_prompts)
        torch.manual_seed(cfg.train.seed)
        self.env = build_env(cfg.env)
        self.model, self.tokenizer = load_policy(cfg.model)
        self.teacher = FrozenTeacher(self.model, self.tokenizer, cfg.rollout.temperature)
        self.banks: dict[bool, ExperienceMemory] = {}  # early? -> the bank
        self.bank_batches = self.bank_rollouts()
        self.val = self.student_trajectories()
        self.val_tasks = list({t.id: t for t in self.val.tasks}.values())
        self.initial = self.score(None)  # [B, T] log pi_0 of the student's tokens

    # --------------------------------------------------------------------------------- data

    def bank_rollouts(self) -> list[RolloutBatch]:
        """The untrained policy's rollouts on `train`, step by step as training draws them (cached)."""
        path = self.out / "bank_rollouts.pt"
        if path.is_file():
            return torch.load(path, weights_only=False)
        r, tasks = self.cfg.rollout, env_tasks(self.env, self.cfg.env.train_split, "env.train_split")
        batches = []
        for step in range(self.s.bank_rollouts // (r.tasks_per_step * r.group_size)):
            chosen = tasks_for_step(tasks, step, r.tasks_per_step, self.cfg.train.seed)
            batches.append(sample_and_score(self.model, self.tokenizer, self.env, chosen, group_size=r.group_size,
                                            temperature=r.temperature, max_new_tokens=r.max_new_tokens))
        torch.save(batches, path)
        return batches

    def student_trajectories(self) -> RolloutBatch:
        tasks = list(env_tasks(self.env, self.s.split, "split"))[: self.s.val_tasks]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.train.seed + 1)
            return sample_and_score(self.model, self.tokenizer, self.env, tasks, group_size=self.s.group,
                                    temperature=self.cfg.rollout.temperature, max_new_tokens=self.cfg.rollout.max_new_tokens)

    def memory(self, key: RetrievalKey, k: int, early: bool) -> ExperienceMemory:
        """A bank of the first `early_rollouts` (or all) bank rollouts, retrieving by `key`, k per task (the
        bank and its keys are built once per size; a source only changes how it is searched)."""
        if early not in self.banks:
            memory = ExperienceMemory(self.cfg, None, self.teacher, self.tokenizer)
            left = self.s.early_rollouts if early else self.s.bank_rollouts
            for step, batch in enumerate(self.bank_batches, 1):
                if left <= 0:
                    break
                part = batch if left >= len(batch) else batch.select(torch.arange(left))
                memory.remember(part, step)
                left -= len(part)
            self.banks[early] = memory
        view = copy.copy(self.banks[early])
        view.key, view.cfg = key, replace(view.cfg, retrieve_k=k)
        return view

    # --------------------------------------------------------------------------------- measurements

    def score(self, contexts: list[str | None] | None, slots: torch.Tensor | None = None) -> torch.Tensor:
        """log pi_T(y_t | context) of the student's tokens, [B, T] (text contexts, or latent slots [B, K, H])."""
        parts = []
        with torch.no_grad():
            for start in range(0, len(self.val), ROWS):
                idx = torch.arange(start, min(start + ROWS, len(self.val)))
                mb = self.val.select(idx)
                if slots is None:
                    stats = self.teacher.score(mb, None if contexts is None else contexts[start:start + len(idx)])
                else:
                    stats, _ = self.teacher.score_latent(mb, contexts[start:start + len(idx)],
                                                         LatentSlots(slots[idx], over_context=False))
                parts.append(stats.logprobs())
        width = self.val.completion_ids.shape[1]
        return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])

    def figures(self, contexts: list[str | None], lp: torch.Tensor) -> dict[str, float]:
        mask = self.val.completion_mask.float()
        gain = lp - self.initial  # [B, T]
        delta = losses.sequence_mean(gain, mask)  # [B]
        success = self.val.success
        adv = losses.group_advantages(self.val.rewards, self.val.group)
        use = adv != 0

        def token_mean(rows):
            m = mask * rows.float()[:, None]
            return float((gain * m).sum() / m.sum().clamp(min=1))

        tokens = [len(self.tokenizer(c, add_special_tokens=False)["input_ids"]) for c in contexts if c is not None]
        return {"gain_success": token_mean(success), "gain_failure": token_mean(~success),
                "auc": auc_within_groups(delta.tolist(), success.tolist(), self.val.group.tolist()),
                "a_delta": float((adv * delta)[use].mean()) if use.any() else 0.0,
                "coverage": sum(c is not None for c in contexts) / len(contexts),
                "tokens": sum(tokens) / len(tokens) if tokens else 0.0}

    def greedy(self, per_task: dict[str, str | None]) -> float:
        prompts = [encode_prompt(self.tokenizer, t.messages, per_task[t.id]) for t in self.val_tasks]
        out = sample(self.model, self.tokenizer, prompts, temperature=0.0, max_new_tokens=self.cfg.rollout.max_new_tokens)
        return 100 * sum(self.env.score(t, c).success for t, c in zip(self.val_tasks, out.completions)) / len(self.val_tasks)

    # --------------------------------------------------------------------------------- sources

    def contexts(self, source: str) -> tuple[list[str | None], dict[str, str | None]]:
        """Per trajectory and per task, the context a source gives."""
        from lopd.algorithms.lopd import experiences_as_text

        if source == "none":
            per_task = {t.id: None for t in self.val_tasks}
        elif source == "reference":
            per_task = {t.id: context_reference(self.env.reference(t)) for t in self.val_tasks}
        else:
            key, k, *rest = source.split(":")
            memory = self.memory(RetrievalKey(key), int(k.removeprefix("k")), rest == ["early"])
            found = memory.search(self.val_tasks)
            per_task = {t.id: experiences_as_text(memory.bank, ids) for t, ids in zip(self.val_tasks, found.index)}
        return [per_task[t.id] for t in self.val.tasks], per_task

    def measure(self, source: str) -> dict[str, float]:
        start = time.perf_counter()
        if source.startswith("latent:"):
            return self.measure_latent(source)
        contexts, per_task = self.contexts(source)
        lp = self.score(contexts)
        row = {"source": source, **self.figures(contexts, lp), "shift": self.shift(contexts), "greedy": self.greedy(per_task)}
        return {**row, "seconds": time.perf_counter() - start}

    def shift(self, contexts: list[str | None]) -> float:
        """Mean KL(pi_T(.|c) || pi_T(.|none)) per trained token."""
        total, count = 0.0, 0.0
        with torch.no_grad():
            for start in range(0, len(self.val), ROWS):
                idx = torch.arange(start, min(start + ROWS, len(self.val)))
                mb = self.val.select(idx)
                kl = losses.context_shift(self.teacher.score(mb, contexts[start:start + len(idx)]), self.teacher.score(mb))
                total += float(kl.sum())
                count += float(mb.completion_mask.sum())
        return total / max(count, 1.0)

    def measure_latent(self, source: str) -> dict[str, float]:
        """Train a compressor by context distillation on the bank's trajectories, then measure its slots."""
        start = time.perf_counter()
        _, K, *text = source.split(":")
        text_source = ":".join(text) or "task_tools:k2"
        key, k = text_source.split(":")[:2]
        memory = self.memory(RetrievalKey(key), int(k.removeprefix("k")), False)
        if K == "pretrained":
            if not self.s.compressor:
                raise ConfigError("probe source latent:pretrained needs --compressor PATH (a compressor.pt)")
            compressor = pretrained_compressor(self.cfg, self.s.compressor)
        else:
            compressor = self.train_compressor(memory, int(K.removeprefix("K")))
        contexts, per_task = self.contexts(text_source)
        with torch.no_grad():
            slots = self.compress(compressor, contexts)
        lp = self.score(contexts, slots)
        text_lp = self.score(contexts)
        row = {"source": source, **self.figures(contexts, lp), "kl_ratio": self.kl_ratio(contexts, slots),
               "text_gain_success": self.figures(contexts, text_lp)["gain_success"]}
        tasks = self.val_tasks
        answers = self.teacher.generate_latent(tasks, [per_task[t.id] for t in tasks],
                                               LatentSlots(self.compress(compressor, [per_task[t.id] for t in tasks]),
                                                           over_context=False),
                                               max_new_tokens=self.cfg.rollout.max_new_tokens)
        row["greedy"] = 100 * sum(self.env.score(t, a).success for t, a in zip(tasks, answers)) / len(tasks)
        row["tokens"] = float(compressor.latent_tokens)
        return {**row, "seconds": time.perf_counter() - start}

    def compress(self, compressor, contexts: list[str | None]) -> torch.Tensor:
        with torch.no_grad():
            return compress_texts(compressor, self.tokenizer, contexts).cpu()

    def kl_ratio(self, contexts: list[str | None], slots: torch.Tensor) -> float:
        """KL(text || slots) / KL(text || none) over the trained tokens of the rows with a context."""
        num, den = 0.0, 0.0
        jsd0 = DistillEstimator.jsd
        with torch.no_grad():
            for start in range(0, len(self.val), ROWS):
                idx = [i for i in range(start, min(start + ROWS, len(self.val))) if contexts[i] is not None]
                if not idx:
                    continue
                mb = self.val.select(torch.tensor(idx))
                text = self.teacher.score(mb, [contexts[i] for i in idx])
                latent, _ = self.teacher.score_latent(mb, [contexts[i] for i in idx],
                                                      LatentSlots(slots[idx], over_context=False))
                num += float(losses.token_divergence(latent, text, jsd0, alpha=0.0).sum())
                den += float(losses.token_divergence(self.teacher.score(mb), text, jsd0, alpha=0.0).sum())
        return num / den if den else math.nan

    def train_compressor(self, memory: ExperienceMemory, K: int):
        """`latent_steps` steps of KL(pi_T(.|c) || pi_T(.|slots)) on the bank's own trajectories, each with the
        experiences retrieved for it (never its own group's), AdamW at `latent_lr`."""
        from lopd.algorithms.lopd import experiences_as_text
        torch.manual_seed(self.cfg.train.seed)
        compressor = new_compressor(self.cfg, K)
        optimizer = torch.optim.AdamW(compressor.parameters(), lr=self.s.latent_lr)
        pool = [(step, batch) for step, batch in enumerate(self.bank_batches, 1)]
        rng = random.Random(self.cfg.train.seed)
        jsd0 = DistillEstimator.jsd
        for _ in range(self.s.latent_steps):
            step, batch = rng.choice(pool)
            rows = torch.tensor(sorted(rng.sample(range(len(batch)), min(self.s.latent_rows, len(batch)))))
            mb = batch.select(rows)
            found = memory.retrieve(mb, step)
            contexts = [experiences_as_text(memory.bank, ids) for ids in found.index]
            keep = torch.tensor([i for i, c in enumerate(contexts) if c is not None], dtype=torch.long)
            if not len(keep):
                continue
            mb, contexts = mb.select(keep), [contexts[i] for i in keep.tolist()]
            with torch.no_grad():
                text = self.teacher.score(mb, contexts)
            slots = compress_texts(compressor, self.tokenizer, contexts)
            latent, _ = self.teacher.score_latent(mb, contexts, LatentSlots(slots, over_context=False))
            kl = losses.token_divergence(latent, text, jsd0, alpha=0.0)  # [b, T]
            loss = (kl * mb.completion_mask).sum() / mb.completion_mask.sum().clamp(min=1)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(compressor.parameters(), 1.0)
            optimizer.step()
        return compressor


COLUMNS = [("source", "{}"), ("gain_success", "{:+.3f}"), ("gain_failure", "{:+.3f}"), ("auc", "{:.3f}"),
           ("a_delta", "{:+.4f}"), ("shift", "{:.3f}"), ("kl_ratio", "{:.2f}"), ("coverage", "{:.2f}"),
           ("tokens", "{:.0f}"), ("greedy", "{:.1f}")]


def markdown(rows: list[dict], settings: ProbeSettings, cfg: Config) -> str:
    head = "| " + " | ".join(c for c, _ in COLUMNS) + " |"
    lines = [f"# Privilege probe: {cfg.model.name} on {cfg.env.name} `{settings.split}`", "",
             f"Bank: {settings.bank_rollouts} rollouts of the untrained policy on `{cfg.env.train_split}` (early: the first "
             f"{settings.early_rollouts}); student trajectories: {settings.group} per task on the first "
             f"{settings.val_tasks} `{settings.split}` tasks at temperature {cfg.rollout.temperature}; greedy: the same "
             f"tasks, greedy, with the context in the prompt. Columns: `lopd.probe`'s docstring.", "",
             head, "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [fmt.format(r[c]) if c in r and not (isinstance(r[c], float) and math.isnan(r[c])) else "-"
                 for c, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run_probe(cfg: Config, settings: ProbeSettings, out: str | Path, progress=print) -> list[dict]:
    """Measure every source (resumable: a source already in probe.json under these settings is kept)."""
    out = Path(out)
    probe = Probe(cfg, settings, out)
    record = out / "probe.json"
    header = {"settings": vars(settings), "model": cfg.model.name, "env": cfg.env.name}
    done = {}
    if record.is_file():
        saved = json.loads(record.read_text())
        if {k: saved.get(k) for k in header} == json.loads(json.dumps(header)):
            done = {r["source"]: r for r in saved["rows"]}
    rows = []
    for source in settings.sources:
        row = done.get(source) or probe.measure(source)
        rows.append(row)
        progress(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        record.write_text(json.dumps({**header, "rows": rows + [r for s, r in done.items() if s not in
                                                               {x["source"] for x in rows}]}, indent=1))
    (out / "probe.md").write_text(markdown(rows, settings, cfg))
    return rows

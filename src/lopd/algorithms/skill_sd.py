"""Skill-SD: self-distillation with short textual skills distilled from earlier successes.

After every update, each successful trajectory is turned into a skill and stored in a skill library
keyed by its task's embedding; for every new task the top-k most similar skills are retrieved and
given to the teacher as context. Extractors:
    rule   deterministic, for models too small to summarise: the successful answer with its task
           stripped away (for tool calls, the call itself: "book_flight(date="02/18/2025", ...)")
    model  the backbone summarises the success in one sentence under a fixed prompt (greedy)
Skills are deduplicated by text; the library keeps `skill.capacity` skills (oldest evicted) and lives in
the run directory (`skills/`), so a resumed run finds it again.

    lopd train --config configs/skill_sd.yaml
"""

from __future__ import annotations

from lopd.algorithms.distill import SelfDistillation
from lopd.envs.calls import ParseFailure, parse_calls, render_calls
from lopd.latent.embedder import build_embedder
from lopd.latent.experience_bank import Experience, ExperienceBank
from lopd.latent.memory import allowed, checkpointed_count
from lopd.prompts import called_tools, context_skills, encode_prompt, task_text
from lopd.schema import SkillExtractor

SUMMARY_PROMPT = ("Here is a request and a correct answer to it. In one short sentence, state the lesson "
                  "that would help answer similar requests.\nRequest: {request}\nAnswer: {answer}")


def rule_skill(completion: str) -> str:
    """The success without its task: a tool call re-rendered canonically, or the first line of text."""
    calls = parse_calls(completion)
    if not isinstance(calls, ParseFailure):
        return render_calls(calls)
    return completion.strip().splitlines()[0][:200] if completion.strip() else ""


class SkillSD(SelfDistillation):
    name = "skill_sd"

    def setup(self, **runtime) -> None:
        super().setup(**runtime)
        r = self.cfg.algorithm.retrieval
        self.embedder = build_embedder(r.embedder, r.embedder_path, self.initial_policy or self.teacher, self.tokenizer)
        run = runtime.get("run")
        folder = run.skills_dir if run is not None else None
        self.library = ExperienceBank(self.embedder.dim, folder, capacity=self.cfg.algorithm.skill.capacity,
                                      readonly=run is not None and not run.writer,
                                      checkpointed=checkpointed_count(run, "library_written"))

    def privileged_contexts(self, batch, step):
        """The top-k skills per task under the configured retrieval key (`algorithm.retrieval.key`, the same
        retrieval LOPD and lopd_text use), searched once per distinct task."""
        k = self.cfg.algorithm.skill
        first = {t.id: t for t in batch.tasks}  # one search per task
        unique = list(first.values())
        found = self.library.search(self.embedder.encode([task_text(t) for t in unique]), k.top_k,
                                    min_similarity=k.min_similarity,
                                    only=allowed(self.library, unique, self.cfg.algorithm.retrieval.key))
        by_id = {t.id: [self.library.entries[i].trajectory for i in idx] for t, idx in zip(unique, found.index)}
        return [context_skills(by_id[t.id]) if by_id[t.id] else None for t in batch.tasks]

    def remember(self, batch, step):
        known = {e.trajectory for e in self.library.entries}
        new: list[Experience] = []
        wins = [i for i, ok in enumerate(batch.success.tolist()) if ok]
        skills = self._extract([batch.tasks[i] for i in wins], [batch.completions[i] for i in wins])
        for i, skill in zip(wins, skills):
            if skill and skill not in known:
                known.add(skill)
                task = batch.tasks[i]
                new.append(Experience(task.id, task_text(task), skill, float(batch.rewards[i]), True,
                                      step=step, source="skill", category=task.category,
                                      tools=called_tools(batch.completions[i])))
        if new:
            self.library.add(new, self.embedder.encode([e.task_text for e in new]))
        return {"context/skills": float(self.library.size), "context/new_skills": float(len(new))}

    def _extract(self, tasks, completions) -> list[str]:
        if self.cfg.algorithm.skill.extractor is SkillExtractor.rule:
            return [rule_skill(c) for c in completions]
        from lopd.rollout import sample

        tok = self.tokenizer
        prompts = [encode_prompt(tok, [{"role": "user", "content": SUMMARY_PROMPT.format(request=task_text(t), answer=c)}])
                   for t, c in zip(tasks, completions)]
        if not prompts:
            return []
        with self.teacher.active() as model:
            out = sample(model, tok, prompts, temperature=0.0, max_new_tokens=48)
        return [t.strip().splitlines()[0] if t.strip() else "" for t in out.completions]

    def state_dict(self) -> dict:
        return {**super().state_dict(), "library_written": self.library.written}

    def load_state_dict(self, state, step):
        super().load_state_dict(state, step)
        self.library.truncate_after(step)

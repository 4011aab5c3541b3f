"""SDPO: self-distillation with the checker's feedback on the attempt and a successful sibling.

For trajectory i of a group, the teacher sees
    - the feedback on i's own attempt (the env's sentence, e.g. "Parameter 'date' has the wrong value ..."),
    - a successful trajectory of the same group as a demonstration (the first success other than i; a
      group's lone success is reprompted with itself only if `sdpo.reprompt_lone_success`).
A group with no success gives its trajectories no context: they are masked out of the distillation
(the per-sample mask), since feedback without any solution is not what SDPO distils from.

    lopd train --config configs/sdpo.yaml
"""

from __future__ import annotations

from lopd.algorithms.distill import SelfDistillation
from lopd.prompts import context_examples, context_feedback, join_contexts


class SDPO(SelfDistillation):
    name = "sdpo"

    def privileged_contexts(self, batch, step):
        s = self.cfg.algorithm.sdpo
        success = batch.success.tolist()
        group = batch.group.tolist()
        members: dict[int, list[int]] = {}
        for i, g in enumerate(group):
            members.setdefault(g, []).append(i)
        out: list[str | None] = []
        for i, g in enumerate(group):
            wins = [j for j in members[g] if success[j]]
            if not wins:
                out.append(None)
                continue
            others = [j for j in wins if j != i]
            demo = others[0] if others else (i if s.reprompt_lone_success else None)
            request = batch.tasks[i].meta.get("request") or batch.tasks[i].messages[-1]["content"]
            feedback = context_feedback(batch.feedback[i], batch.completions[i]) if s.feedback else None
            example = context_examples([(request, batch.completions[demo])]) if s.demonstration and demo is not None else None
            out.append(join_contexts(feedback, example) if example is not None or not s.demonstration else None)
        return out

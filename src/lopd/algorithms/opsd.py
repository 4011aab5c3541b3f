"""OPSD: on-policy self-distillation with the task's reference answer as the teacher's privileged context.

    teacher prompt = [system + "Reference answer: <reference>" ; user request]   (same chat template)
    loss           = D(student || sg teacher) per token, on the student's own samples

    lopd train --config configs/opsd.yaml
"""

from __future__ import annotations

from lopd.algorithms.distill import SelfDistillation
from lopd.prompts import context_reference


class OPSD(SelfDistillation):
    name = "opsd"
    env_methods = {"reference": "its teacher reads each task's reference answer"}

    def privileged_contexts(self, batch, step):
        return [context_reference(self.env.reference(task)) for task in batch.tasks]

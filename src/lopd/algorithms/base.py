"""What an algorithm is: how it builds the teacher's privileged context and which loss terms it uses.

The training loop calls, for every rollout batch:
    ctx  = algorithm.build_context(batch)              once, before the update (advantages, contexts)
    loss = algorithm.loss(mb, ctx_mb, student, ...)    per minibatch, with the student's TokenStats
and never branches on which algorithm it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lopd.config import LopdConfig
    from lopd.rollout import RolloutBatch
    from lopd.tokens import TokenStats


@dataclass
class Context:
    """Per-trajectory quantities an algorithm computes once per batch; sliced per minibatch."""

    advantages: Tensor | None = None  # [B]
    texts: list[str | None] | None = None  # privileged context for the teacher, one per trajectory

    def select(self, index: Tensor) -> "Context":
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                value = value[index]
            elif isinstance(value, list):
                value = [value[i] for i in index.tolist()]
            out[f.name] = value
        return type(self)(**out)

    def to(self, device: torch.device | str) -> "Context":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return type(self)(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in values.items()})


class Algorithm:
    """Base class; subclasses set `name` and implement `build_context` and `loss`."""

    name: str = ""
    uses_reference: bool = False  # the loop provides TokenStats of the frozen initial model
    uses_teacher: bool = False  # the loop builds a frozen self-teacher (FrozenView) for the algorithm

    def __init__(self, cfg: "LopdConfig"):
        self.cfg = cfg
        self.reference = None  # FrozenView of the initial weights, when uses_reference
        self.teacher = None  # the self-teacher's weights (frozen / EMA / live), when uses_teacher
        self.runtime: dict[str, Any] = {}

    def setup(self, *, reference=None, teacher=None, **runtime: Any) -> None:
        """Called once by the loop with the models and the env (LOPD builds its composer and bank here)."""
        self.reference, self.teacher, self.runtime = reference, teacher, runtime

    def teacher_prefix(self, batch: "RolloutBatch", ctx: Context) -> Tensor | None:
        """Continuous tokens put in front of the teacher's prompt ([b, K, H], may carry gradient)."""
        return None

    def build_context(self, batch: "RolloutBatch") -> Context:
        raise NotImplementedError

    def loss(self, batch: "RolloutBatch", ctx: Context, student: "TokenStats", teacher: "TokenStats | None" = None,
             reference: "TokenStats | None" = None) -> tuple[Tensor, dict[str, float]]:
        raise NotImplementedError

    def param_groups(self) -> list[dict]:
        """Optimizer parameter groups besides the policy's (LOPD's composer, with its own lr)."""
        return []

    def after_update(self, batch: "RolloutBatch") -> dict[str, float]:
        """Called after each optimizer step on a batch (remember experiences, dual ascent, ...)."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def mean_of(x: Tensor, mask: Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp(min=1)) if x.numel() else 0.0

"""What an algorithm is: how it builds the teacher's privileged context and which loss terms it uses.

The training loop calls, for every rollout batch of step `step` (1-based):

    ctx = algorithm.build_context(batch, step)        once (advantages, privileged contexts, retrieval)
    for each pass over the batch, each minibatch:
        totals = algorithm.loss_totals(minibatch, ...)    each loss term's denominator (summed over ranks)
        for each micro-batch (of algorithm.live_rows only, with train.skip_zero_loss_rows):
            loss, metrics = algorithm.loss(mb, ctx_mb, student)   the student's TokenStats; the algorithm
                                  scores its own teacher / reference, and divides each term by ctx_mb.totals:
                                  the micro-batches' losses add up to the minibatch's, however it is split
            ... backward
        optimizer step; algorithm.after_step()
    metrics |= algorithm.after_update(update_metrics)  once the batch's optimizer steps are done
    metrics |= algorithm.remember(batch, step)         store what later batches retrieve

and never branches on which algorithm it runs. Everything a batch needs travels in its `Context`
(or in return values); an algorithm's own state across batches (a bank, a composer, lambda) is in
`state_dict`, restored with the step it was saved at.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lopd.config import Config
    from lopd.rollout import RolloutBatch
    from lopd.tokens import TokenStats


@dataclass
class Context:
    """Per-trajectory quantities an algorithm computes once per batch; sliced per micro-batch.

    Tensors and lists of length B are sliced by `select`; everything else (step, metrics) is shared.
    """

    step: int = 0  # the optimizer step this batch is for (1-based)
    advantages: Tensor | None = None  # [B]
    texts: list[str | None] | None = None  # privileged text context for the teacher, one per trajectory
    has_context: Tensor | None = None  # [B] bool: the teacher got a context (others leave the distillation)
    extra_passes: int = 0  # passes over the batch before the configured epochs (LOPD's composer-only passes)
    pass_index: int = 0  # which pass over the batch a micro-batch belongs to (set by the loop)
    totals: dict[str, float] = field(default_factory=dict)  # each loss term's denominator over the whole
    # minibatch (every micro-batch, every rank): set by the loop from `Algorithm.loss_totals`
    metrics: dict[str, float] = field(default_factory=dict)  # batch-level metrics (retrieval), logged once

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

    def for_pass(self, index: int) -> "Context":
        return replace(self, pass_index=index)


class Algorithm:
    """Base class; subclasses set `name` and implement `build_context` and `loss`."""

    name: str = ""

    def __init__(self, cfg: "Config"):
        self.cfg = cfg
        self.env = None

    def setup(self, *, policy=None, tokenizer=None, env=None, run=None, device: Any = "cpu") -> None:
        """Called once by the loop with the policy, its tokenizer, the env and the run directory; an
        algorithm builds what it needs here (teachers, LOPD's composer and bank, Skill-SD's library)."""
        self.env = env

    def build_context(self, batch: "RolloutBatch", step: int) -> Context:
        raise NotImplementedError

    def loss(self, batch: "RolloutBatch", ctx: Context, student: "TokenStats") -> tuple[Tensor, dict[str, float]]:
        raise NotImplementedError

    def loss_totals(self, batch: "RolloutBatch", ctx: Context) -> dict[str, float]:
        """Each loss term's denominator counted over `batch`, this rank's rows of one minibatch
        (`losses.aggregate_count`). The loop sums it over the ranks and hands it to every micro-batch as
        `ctx.totals`; `loss` divides each term by it, so the micro-batches' losses add up to the
        minibatch's exactly, however it is split into micro-batches and ranks."""
        return {}

    def live_rows(self, batch: "RolloutBatch", ctx: Context) -> Tensor:
        """[B] bool: the rows on which some loss term can be non-zero. With `train.skip_zero_loss_rows` the
        others are not forwarded (their terms are exactly 0; `loss_totals` still counts them). Default:
        every row."""
        return torch.ones(len(batch), dtype=torch.bool)

    def kept_prompt_lengths(self, batch: "RolloutBatch", ctx: Context) -> Tensor:
        """Prompt lengths of each forward per micro-batch whose activations wait for the backward, for the
        memory planner: the student's alone by default.   [F, B]"""
        return batch.prompt_mask.sum(-1)[None]

    def param_groups(self) -> list[dict]:
        """Optimizer parameter groups besides the policy's (LOPD's composer, with its own lr)."""
        return []

    def after_step(self) -> None:
        """Called after every optimizer step (an EMA teacher moves here)."""

    def after_update(self, metrics: dict[str, float]) -> dict[str, float]:
        """Called once per batch after its optimizer steps, with the update's averaged metrics (LOPD's dual
        ascent on lambda reads its constraint from them). Returns metrics to log."""
        return {}

    def remember(self, batch: "RolloutBatch", step: int) -> dict[str, float]:
        """Store what later batches may retrieve (LOPD's experiences, Skill-SD's skills). `batch` is the
        whole step's (gathered from every rank in data-parallel runs). Returns metrics."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict, step: int) -> None:
        """Restore the state saved at `step` (anything written after it is about to be redone)."""


def mean_of(x: Tensor, mask: Tensor) -> float:
    """The mean of x over the set entries of mask (a metric)."""
    from lopd.losses import masked

    return float(masked(x, mask).sum() / mask.sum().clamp(min=1)) if x.numel() else 0.0

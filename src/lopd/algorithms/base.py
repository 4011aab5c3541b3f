"""What an algorithm is: how it builds the teacher's privileged context and which loss terms it uses.

The training loop calls, for every rollout batch of step `step` (1-based):

    ctx = algorithm.build_context(batch, step)            once (advantages, privileged contexts, retrieval)
    for each pass over the batch, each minibatch:
        units = algorithm.units(minibatch, ctx)           each loss term's denominator (a mask), counted over
                                                          the whole minibatch and every rank before any forward
        for each micro-batch (of algorithm.live_rows only, with train.skip_zero_loss_rows):
            terms = algorithm.loss(mb, ctx_mb, student)   named `Term`s: per-unit values and their mask; the
                                                          algorithm scores its own teachers here
            the update: loss = sum of coef * sum(values over the mask) / count of the term's units; backward
        optimizer step; algorithm.after_step()
    metrics |= algorithm.after_update(values)   once per batch, with every term's mean over the whole minibatch
    metrics |= algorithm.remember(batch, step)   store what later batches retrieve

and never branches on which algorithm it runs. Everything a batch needs travels in its `Context` (or in
return values); an algorithm's own state across batches (a bank, a composer, lambda) is in `state_dict`,
restored with the step it was saved at.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lopd import losses

if TYPE_CHECKING:
    from lopd.rollout import RolloutBatch
    from lopd.schema import Config
    from lopd.tokens import TokenStats


@dataclass
class Term:
    """One named quantity of a micro-batch: the mean of `values` over the units `mask` selects, taken by the
    update over the whole minibatch (every micro-batch, every rank), so it never depends on how the minibatch
    is split.

    values: [B, T] per token, or [B] per trajectory (`losses.per_unit` turns a per-token loss into either,
    by the configured aggregation); mask: the same shape, 1 on the units averaged over.
    coef: the term's weight in the loss; 0 makes it a measurement (logged, and read by `after_update`).
    units: for a loss term, the name of its denominator in `Algorithm.units` (counted before the forward, as
    gradient accumulation needs it); the update checks that the term's masks add up to that count.
    """

    values: Tensor
    mask: Tensor
    coef: float = 0.0
    units: str | None = None

    def numerator(self) -> Tensor:
        """sum of the values over the mask (differentiable; a masked inf or nan stays out)."""
        return losses.masked(self.values, self.mask.to(self.values.dtype)).sum()

    def count(self) -> float:
        return float(self.mask.double().sum())


@dataclass
class Context:
    """Per-trajectory quantities an algorithm computes once per batch; sliced per micro-batch.

    Tensors and lists of length B are sliced by `select`; everything else (step, metrics) is shared.
    """

    step: int = 0  # the optimizer step this batch is for (1-based)
    advantages: Tensor | None = None  # [B] group-normalised (`Algorithm.new_context`, the one place they are made)
    privileged: list[str | None] | None = None  # the teacher's privileged context per trajectory (None: none)
    has_context: Tensor | None = None  # [B] bool: the teacher got a context (others leave the distillation)
    extra_passes: int = 0  # passes over the batch before the configured epochs (LOPD's composer-only passes)
    pass_index: int = 0  # which pass over the batch a micro-batch belongs to (set by the loop)
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
    """Base class; subclasses set `name` and implement `build_context`, `units` and `loss`."""

    name: str = ""
    env_methods: dict[str, str] = {}  # env methods beyond tasks/score it needs -> why (checked before the first step)

    def __init__(self, cfg: "Config"):
        self.cfg = cfg
        self.env = None

    def setup(self, *, policy=None, tokenizer=None, env=None, run=None, device: Any = "cpu") -> None:
        """Called once by the loop with the policy, its tokenizer, the env and the run directory; an
        algorithm builds what it needs here (teachers, LOPD's composer and bank, Skill-SD's library)."""
        self.env = env

    def new_context(self, batch: "RolloutBatch", step: int, kind: type[Context] = Context, **values) -> Context:
        """A batch's context with its group-normalised advantages: every algorithm's contexts start here."""
        pg = self.cfg.algorithm.pg
        advantages = losses.group_advantages(batch.rewards, batch.group, pg.normalize_std)
        return kind(step=step, advantages=advantages, **values)

    def build_context(self, batch: "RolloutBatch", step: int) -> Context:
        raise NotImplementedError

    def units(self, batch: "RolloutBatch", ctx: Context) -> dict[str, Tensor]:
        """Each loss term's units over `batch` (this rank's rows of one minibatch), by name: the masks whose
        counts the update divides the terms by (`Term.units`), computed without a forward. The update sums
        their counts over the ranks before the first micro-batch, so the micro-batches' losses add up to the
        minibatch's exactly, however it is split."""
        return {}

    def loss(self, batch: "RolloutBatch", ctx: Context, student: "TokenStats") -> dict[str, Term]:
        """This micro-batch's terms by metric name ("loss/pg", "context/teacher_gain_success", ...)."""
        raise NotImplementedError

    def live_rows(self, batch: "RolloutBatch", ctx: Context) -> Tensor:
        """[B] bool: the rows on which some loss term can be non-zero. With `train.skip_zero_loss_rows` the
        others are not forwarded (their terms are exactly 0; `units` still counts them). Default: every row."""
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

    def after_update(self, values: dict[str, float]) -> dict[str, float]:
        """Called once per batch after its optimizer steps, with every term's mean over the whole minibatch
        (averaged over the passes): LOPD's dual ascent reads its constraint here. Returns metrics to log."""
        return {}

    def remember(self, batch: "RolloutBatch", step: int) -> dict[str, float]:
        """Store what later batches may retrieve (LOPD's experiences, Skill-SD's skills). `batch` is the
        whole step's (gathered from every rank in data-parallel runs). Returns metrics."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict, step: int) -> None:
        """Restore the state saved at `step` (anything written after it is about to be redone)."""


def measured(values: Tensor, mask: Tensor) -> Term:
    """A measurement: the mean of `values` over `mask`, logged, not trained."""
    return Term(values.detach(), mask)


def rows(values: Tensor | float, like: Tensor) -> Term:
    """A per-trajectory measurement over every row of the micro-batch (`like`: any [B, ...] tensor)."""
    values = torch.as_tensor(values, dtype=torch.float64, device=like.device)
    return measured(values.expand(len(like)) if values.ndim == 0 else values.double(),
                    torch.ones(len(like), dtype=torch.float64, device=like.device))

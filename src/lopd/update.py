"""The update phase: one rollout batch becomes (extra + epochs) x minibatches optimizer steps.

    for each pass, each minibatch (drawn from the global batch: every rank takes the step one process would):
        units  = algorithm.units(rows)                      counted over the minibatch, summed over the ranks
        for each micro-batch (planned under the memory budget; `train.skip_zero_loss_rows`: live rows only):
            student = score_completions(policy, mb)         the student's TokenStats
            terms   = algorithm.loss(mb, ctx, student)      named `Term`s
            loss    = sum_k coef_k * sum(values_k over mask_k) / count(units_k)   -> backward
        gradients summed over the ranks, clipped; optimizer step, scheduler step, algorithm.after_step()
    every term's value: its numerators and counts summed over the minibatch's micro-batches and the ranks,
    divided, averaged over the passes -> the metrics row and `algorithm.after_update`; `update/rows_forwarded`:
    the share of rows whose forward ran (what the update's time scales with)

Each loss term is divided by its own count over the whole minibatch, so micro-batch size and rank count
change memory and speed, never the result; every logged value is computed the same way, so it does not
depend on the split either. The micro-batch plan is a function of the config and the model alone
(`train.memory_budget_gib`, never the memory free at run time).
"""

from __future__ import annotations

import torch

from lopd import dist, failpoints, fsdp, host_memory, microbatch
from lopd.algorithms import Algorithm, Context
from lopd.algorithms.base import Term
from lopd.dist import World
from lopd.errors import LopdError
from lopd.rollout import RolloutBatch
from lopd.schema import Config, head_dtype_of
from lopd.tokens import score_completions


def update(model, algorithm: Algorithm, optimizer, scheduler, batch: RolloutBatch, ctx: Context,
           cfg: Config, world: World = World()) -> dict[str, float]:
    """(extra + epochs) x minibatches optimizer steps over one rollout batch, with gradient accumulation.

    Data-parallel (`world`): `batch` is this rank's share of the step; minibatches are drawn from the global
    batch, and gradients are summed across ranks before clipping. Numerical guard: a micro-batch whose loss
    is not finite is not backpropagated, and an optimizer step whose loss or gradient norm is not finite (on
    any rank) is skipped (gradients dropped, no step, no scheduler step); `health/skipped_steps` and
    `health/nonfinite_losses` count them."""
    t = cfg.train
    params = [p for group in optimizer.param_groups for p in group["params"]]
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
    epochs = ctx.extra_passes + t.epochs_per_batch
    passes = epochs * t.minibatches
    device = params[0].device
    sharded = fsdp.is_sharded(model)
    first, local_n = world.rank * len(batch), len(batch)  # this rank's rows in the global batch
    kept_prompts = algorithm.kept_prompt_lengths(batch, ctx)  # [F, B] the forwards whose activations are kept
    used = batch.attention
    completion_len = torch.where(used.any(-1), used.shape[1] - used.flip(-1).float().argmax(-1), 0)  # [B] last attended + 1
    max_tokens = t.micro_batch_tokens or microbatch.token_budget(
        model, device, t.memory_budget_gib, int((kept_prompts + completion_len).max()), 1, measure=not sharded)
    sums: dict[str, float] = {}  # "step\0term\0num" and "...\0count": this rank's sums, per optimizer step
    shared = {"health/skipped_steps": 0.0, "optim/grad_norm": 0.0}  # identical on every rank
    bad_losses = 0.0
    rows_seen = {"forwarded": 0.0, "all": 0.0}  # this rank's rows over every pass: those whose forward ran
    steps = 0
    return_memory = t.return_host_memory and device.type == "cpu" and microbatch.largest_kept_bytes(
        model, kept_prompts, completion_len, max_tokens, measure=not sharded) >= t.return_host_memory_from_gib * 2**30
    with host_memory.activations_returned(return_memory):  # freed buffers go back to the OS where it pays
        for epoch in range(epochs):
            global_n = local_n * world.size
            order = torch.randperm(global_n) if t.minibatches > 1 else torch.arange(global_n)
            for mb_global in order.chunk(t.minibatches):
                mb_index = mb_global[(mb_global >= first) & (mb_global < first + local_n)] - first
                optimizer.zero_grad(set_to_none=True)
                rows, rows_ctx = batch.select(mb_index), ctx.select(mb_index)
                counts = dist.all_sum(world, unit_counts(algorithm.units(rows, rows_ctx)))  # each term's denominator
                live = algorithm.live_rows(rows, rows_ctx) if t.skip_zero_loss_rows else torch.ones(len(rows), dtype=torch.bool)
                finite = True
                micros = microbatch.plan(kept_prompts, completion_len, mb_index[live], t.micro_batch_size, max_tokens)
                rows_seen["forwarded"] += float(live.sum())
                rows_seen["all"] += float(len(mb_index))
                if not micros and len(mb_index):  # no row left to learn from: one row's exactly-zero gradient, so
                    micros = [None]  # every parameter the loss reaches gets its 0, as if all rows had run
                if sharded:  # every rank runs as many forwards/backwards: the extra ones weigh nothing
                    micros += [None] * (int(dist.all_max(world, len(micros))) - len(micros))
                covered = Coverage()
                for micro in micros:
                    zero = micro is None
                    if zero:
                        micro = mb_index[:1] if len(mb_index) else torch.zeros(1, dtype=torch.long)  # its loss x 0
                    mb = batch.select(micro).trimmed().to(device)
                    mctx = ctx.select(micro).to(device).for_pass(epoch)
                    student = score_completions(model, mb.prompt_ids, mb.prompt_mask, mb.completion_ids,
                                                mb.completion_mask, completion_attention=mb.completion_attention,
                                                temperature=cfg.rollout.temperature, head_dtype=head_dtype_of(cfg))
                    terms = algorithm.loss(mb, mctx, student)
                    loss = loss_of(terms, counts)  # this micro-batch's share of the minibatch's loss
                    good = bool(torch.isfinite(loss.detach()))
                    if not good:
                        finite = False
                        bad_losses += 0 if zero else 1  # a zero-weight stand-in repeats a row counted already
                        if not sharded:  # sharded: the backward still runs (its collectives); the step is skipped
                            continue
                    if loss.requires_grad:  # a pass may train nothing (a frozen composer's composer-only pass)
                        (loss * 0.0 if zero else loss).backward()
                    failpoints.reached("update")
                    if good and not zero:
                        covered.add(terms)
                if finite:
                    covered.check(algorithm, rows, rows_ctx, live)
                sums.update({f"{steps}\0{k}": v for k, v in covered.sums.items()})
                steps += 1
                finite = not dist.any_true(world, not finite)
                if sharded:  # FSDP has summed the layers' gradients; the replicated ones are summed here
                    dist.sum_gradients(world, fsdp.replicated(params))
                    norm = fsdp.clip_grad_norm_(params, max_norm)
                else:
                    dist.sum_gradients(world, params)
                    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
                if not finite or not bool(torch.isfinite(norm)):
                    optimizer.zero_grad(set_to_none=True)
                    shared["health/skipped_steps"] += 1
                    continue
                shared["optim/grad_norm"] += float(norm) / passes
                optimizer.step()
                scheduler.step()
                algorithm.after_step()
    values = term_values(dist.sum_union(world, sums), passes)
    seen = dist.all_sum(world, {"n": bad_losses, **rows_seen})
    metrics = {**values, "health/nonfinite_losses": seen["n"], **shared,
               "update/rows_forwarded": seen["forwarded"] / max(seen["all"], 1.0),
               "optim/lr": scheduler.get_last_lr()[0], "memory/returned_to_os": float(return_memory)}
    metrics.update(algorithm.after_update(values))
    return metrics


def unit_counts(units: dict[str, torch.Tensor]) -> dict[str, float]:
    """name -> how many units the mask selects (tokens, or trajectories)."""
    return {name: float(mask.double().sum()) for name, mask in units.items()}


def loss_of(terms: dict[str, Term], counts: dict[str, float]) -> torch.Tensor:
    """sum_k coef_k * numerator_k / count_k over the loss terms (coef != 0), in the algorithm's order."""
    loss = None
    for name, term in terms.items():
        if term.coef == 0:
            continue
        if term.units not in counts:
            raise LopdError(f"loss term '{name}' has coefficient {term.coef} but its units '{term.units}' are not "
                            f"among the algorithm's units ({', '.join(counts) or 'none'})")
        part = term.coef * (term.numerator() / max(counts[term.units], 1.0))
        loss = part if loss is None else loss + part
    return loss if loss is not None else torch.zeros(())  # no loss term: nothing to train


def whole_batch(terms: dict[str, Term]) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss and every term's value when the terms' micro-batch is the whole minibatch (each term's units
    are then its own mask), as `update` computes them: for tools and tests that call an algorithm's hooks."""
    values = {name: float(t.numerator().detach()) / max(t.count(), 1.0) for name, t in terms.items()}
    counts = {t.units: t.count() for t in terms.values() if t.units is not None}
    return loss_of(terms, counts), values


class Coverage:
    """One optimizer step's terms, summed over its micro-batches: each term's numerator and count (float64),
    and which units each loss term claims."""

    def __init__(self):
        self.sums: dict[str, float] = {}  # "term\0num" / "term\0count"
        self.units: dict[str, str] = {}

    def add(self, terms: dict[str, Term]) -> None:
        for name, term in terms.items():
            self.sums[f"{name}\0num"] = self.sums.get(f"{name}\0num", 0.0) + float(term.numerator().detach().double())
            self.sums[f"{name}\0count"] = self.sums.get(f"{name}\0count", 0.0) + term.count()
            if term.units is not None:
                self.units[name] = term.units

    def check(self, algorithm: Algorithm, rows: RolloutBatch, ctx: Context, live: torch.Tensor) -> None:
        """Each term with units covered exactly what `algorithm.units` counts on the rows forwarded (this
        rank's share): the numerators and the denominators agree, or the algorithm has a bug."""
        if not self.units:
            return
        index = torch.nonzero(live).flatten()
        expected = unit_counts(algorithm.units(rows.select(index), ctx.select(index)))
        for name, units in self.units.items():
            got, want = self.sums[f"{name}\0count"], expected.get(units, 0.0)
            if abs(got - want) > 0.5:
                raise LopdError(f"algorithm '{algorithm.name}': term '{name}' covered {got:.0f} units but its "
                                f"units '{units}' count {want:.0f} on the same rows")


def term_values(sums: dict[str, float], passes: int) -> dict[str, float]:
    """Each term's value: per optimizer step, its numerators over its counts (summed over the ranks), then
    the mean over the passes (a step without the term adds 0)."""
    values: dict[str, float] = {}
    for key, num in sums.items():
        step_term, _, part = key.rpartition("\0")
        if part != "num":
            continue
        name = step_term.split("\0", 1)[1]
        values[name] = values.get(name, 0.0) + num / max(sums[f"{step_term}\0count"], 1.0) / passes
    return values

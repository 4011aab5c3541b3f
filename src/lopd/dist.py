"""Data parallelism: one code path for 1 and N processes (torchrun, or any launcher that sets RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT).

    torchrun --nproc-per-node 8 -m lopd.cli train --config configs/lopd.yaml     # NCCL on GPUs
    torchrun --nproc-per-node 2 -m lopd.cli train --config configs/grpo.yaml     # gloo on CPUs

What each rank does (docs/scaling.md):
    rollout   its contiguous share of the step's tasks; whole sampling groups stay on one rank, so group
              advantages need no communication. Every group is sampled under its own seed (train seed,
              step, task), so rollouts do not depend on how the tasks are split.
    update    its micro-batches, weighted by the GLOBAL token (or sequence) count; then the gradients of the
              policy and of the algorithm's own parameters (LOPD's composer) are summed across ranks, by
              hand, before clipping: every rank then takes the same optimizer step and holds the same
              weights. Not DDP: the student's forward and the teacher's (the same module with its LoRA
              adapter disabled, differentiated into LOPD's latent slots) run through one module several
              times per backward, which DDP's one-forward-per-backward hooks do not allow.
    remember  the step's trajectories are gathered (in rank order: the single-process order), so every rank's
              experience bank (and Skill-SD's library) is identical; only rank 0 writes them to disk.
    metrics   update metrics are summed (they are already weighted globally), batch metrics computed on the
              gathered batch, the budget and token counts are global.
    rank 0    evaluates, checkpoints, logs; the others wait. A checkpoint holds no per-rank state, so a run
              resumes on any number of ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as tdist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def init(device: str = "auto") -> World:
    """The process group from the launcher's environment (a no-op for one process). gloo on CPUs, nccl on
    CUDA devices; with CUDA each rank takes the device of its LOCAL_RANK."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    cuda = torch.cuda.is_available() and device != "cpu"
    if not tdist.is_initialized():
        if cuda:
            torch.cuda.set_device(local)
        tdist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=size)
    return World(rank, size, local)


def device_for(world: World, name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and world.distributed:
        return torch.device("cuda", world.local_rank)
    return torch.device(name)


def share(items: Sequence, world: World) -> list:
    """Rank r's contiguous block of `items` (their count must divide evenly)."""
    if len(items) % world.size:
        raise ValueError(f"{len(items)} tasks per step do not split evenly over {world.size} ranks")
    n = len(items) // world.size
    return list(items[world.rank * n:(world.rank + 1) * n])


def all_sum(world: World, values: dict[str, float]) -> dict[str, float]:
    """Per-key sums over ranks (every rank must pass the same keys)."""
    if not world.distributed or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    tdist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def sum_union(world: World, values: dict[str, float]) -> dict[str, float]:
    """Per-key sums over ranks of the union of their keys (a key a rank lacks counts 0 there)."""
    if not world.distributed:
        return values
    keys = sorted({k for d in gather(world, sorted(values)) for k in d})
    return all_sum(world, {k: values.get(k, 0.0) for k in keys})


def all_mean(world: World, values: dict[str, float]) -> dict[str, float]:
    """Per-key means over ranks (the union of keys; a missing key counts as absent, not 0)."""
    if not world.distributed:
        return values
    gathered = gather(world, values)
    keys = sorted({k for d in gathered for k in d})
    return {k: sum(d[k] for d in gathered if k in d) / sum(1 for d in gathered if k in d) for k in keys}


def all_max(world: World, value: float) -> float:
    if not world.distributed:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return float(t.item())


def any_true(world: World, flag: bool) -> bool:
    if not world.distributed:
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return bool(t.item() > 0)


def gather(world: World, obj: Any) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if not world.distributed:
        return [obj]
    out: list = [None] * world.size
    tdist.all_gather_object(out, obj)
    return out


def broadcast(world: World, obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not world.distributed:
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(world: World) -> None:
    if world.distributed:
        tdist.barrier()


def sum_gradients(world: World, params: Sequence[torch.nn.Parameter]) -> None:
    """Sum the gradients of `params` over ranks, in place, one flat buffer per dtype and device. A
    parameter with no gradient on any rank keeps None (so AdamW skips it, as in one process); one with a
    gradient on some ranks only gets zeros elsewhere first."""
    if not world.distributed:
        return
    has = torch.tensor([1.0 if p.grad is not None else 0.0 for p in params])
    tdist.all_reduce(has, op=tdist.ReduceOp.MAX)
    live = [p for p, h in zip(params, has.tolist()) if h > 0]
    for p in live:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: dict[tuple, list[torch.nn.Parameter]] = {}
    for p in live:
        buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p)
    for group in buckets.values():
        flat = torch.cat([p.grad.reshape(-1) for p in group])
        tdist.all_reduce(flat)
        at = 0
        for p in group:
            n = p.grad.numel()
            p.grad.copy_(flat[at:at + n].view_as(p.grad))
            at += n


def close(world: World) -> None:
    if world.distributed and tdist.is_initialized():
        tdist.destroy_process_group()

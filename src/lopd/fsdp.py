"""FSDP2 for full fine-tunes that do not fit one device (`train.fsdp`), on top of the data parallelism
of `lopd.dist`.

    torchrun --nproc-per-node 8 -m lopd.cli train --config configs/opsd.yaml train.fsdp=true

What is sharded: every decoder layer of the policy, and of each full-model copy a teacher keeps (the
frozen initial weights, an EMA), by `torch.distributed.fully_shard` over all ranks, with the decoder as
the root unit. Each layer's parameters, gradients and AdamW moments then live 1/N on each rank; a layer
is all-gathered for its forward (and again for its backward) and freed after it. What stays replicated:
the token embeddings, the final norm and the output head. lopd calls the embedding table and the head
outside the decoder's forward (latent slots are spliced between the two; the head runs in vocabulary
chunks), and a tied head is the embedding table; their gradients are summed by hand with the other
replicated ones (LOPD's composer) in `dist.sum_gradients`.

Gradients: FSDP reduce-scatters each layer's gradient as a SUM (divide factor 1), because every
micro-batch loss is already weighted by the global token count, exactly as in `dist`. The gradient norm
adds the ranks' local shards' squares (one all-reduce) to the replicated parameters' (identical on every
rank), so clipping is the single-process clipping.

Every forward of a sharded module is a collective: every rank must run the same number of them, in the
same order. The loop keeps that so: rollouts decode with `synced_gpus` (a rank that has finished keeps
stepping until all have), micro-batch counts are equalised across ranks (a rank with fewer runs a
zero-weight one), a rank with a non-finite loss still runs its backward (the step is skipped on every
rank anyway), evaluation runs on every rank (rank 0 records it), and LOPD's experience encoder encodes
the union of what the ranks need. Multi-turn envs (a data-dependent number of decoding calls) and the
vLLM engine are refused at start-up.

Checkpoints hold full (unsharded) tensors, written by rank 0 after a collective gather, so a sharded run
resumes on any number of ranks, sharded or not, and `lopd eval` reads it as it reads any run.

Checked against one process (tests/test_fsdp.py): GRPO, OPSD and LOPD with frozen teachers, bit for bit.
Not yet checked: SDPO's EMA copy (sharded, lerped shard by shard) and the live teacher.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
import torch.distributed as tdist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor


def is_sharded(model: nn.Module) -> bool:
    """Whether any part of `model` is an FSDP2 unit."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def shard(model: nn.Module, device: torch.device) -> None:
    """fully_shard every decoder layer of `model` (an HF causal LM) and then its decoder as the root unit,
    over all ranks of the default process group; the embeddings and the final norm stay replicated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    decoder = model.get_decoder()  # (full fine-tunes only: no peft wrapper in between)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"{type(decoder).__name__} has no `layers` to shard")
    mesh = init_device_mesh(device.type, (tdist.get_world_size(),))
    replicated = set(decoder.get_input_embeddings().parameters())
    norm = getattr(decoder, "norm", None)
    if norm is not None:
        replicated |= set(norm.parameters())
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(decoder, mesh=mesh, ignored_params=replicated)
    for m in decoder.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # a sum: the losses are weighted globally
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)


def replicated(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters FSDP does not manage (their gradients are summed by hand)."""
    return [p for p in params if not isinstance(p, DTensor)]


def clip_grad_norm_(params: Sequence[nn.Parameter], max_norm: float) -> Tensor:
    """torch.nn.utils.clip_grad_norm_ over sharded (DTensor) and replicated gradients together: the
    global L2 norm, and every gradient scaled by min(1, max_norm / (norm + 1e-6))."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g.to_local() for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    device = (sharded or plain)[0].device if grads else torch.device("cpu")
    local = torch.zeros((), dtype=torch.float64, device=device)
    for g in sharded:
        local += g.double().pow(2).sum()
    tdist.all_reduce(local)
    for g in plain:  # identical on every rank: counted once
        local += g.double().pow(2).sum()
    norm = local.sqrt().float()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in sharded + plain:
        g.mul_(coef.to(g.dtype))
    return norm


def full_tensor(t: Tensor) -> Tensor:
    """A DTensor's full value on every rank (collective), on the CPU; any other tensor as it is."""
    return t.full_tensor().cpu() if isinstance(t, DTensor) else t


def full_state(obj: Any) -> Any:
    """`obj` (a nested dict/list/tuple of tensors, as state_dict() returns) with every DTensor gathered to
    its full value. Collective: every rank calls it on structures of the same layout."""
    if isinstance(obj, Tensor):
        return full_tensor(obj)
    if isinstance(obj, dict):
        return {k: full_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(full_state(v) for v in obj)
    return obj


def model_state(model: nn.Module) -> dict[str, Tensor]:
    """The model's full state dict (every rank gets it; collective)."""
    return {k: full_tensor(v) for k, v in model.state_dict().items()}


def load_model_state(model: nn.Module, state: dict[str, Tensor]) -> tuple[list[str], list[str]]:
    """Copy full tensors into a (partly) sharded model: each rank keeps its own shard. Returns (missing,
    unexpected) as `load_state_dict(strict=False)` would."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    with torch.no_grad():
        for k, t in own.items():
            if k in state:
                copy_full_(t, state[k])
    return missing, unexpected


def copy_full_(target: Tensor, full: Tensor) -> None:
    """target <- full, where target may be a shard (DTensor) of a tensor whose full value is `full`."""
    if isinstance(target, DTensor):
        shard = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(shard.to_local())
    else:
        target.copy_(full)


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """optimizer.state_dict() with every sharded moment gathered to its full value (collective)."""
    return full_state(optimizer.state_dict())


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a full optimizer state (`optimizer_state`, or a single process's) into an optimizer over
    sharded parameters: each sharded parameter's moments become shards like the parameter."""
    optimizer.load_state_dict(state)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, Tensor) and not isinstance(v, DTensor) and v.shape == p.shape:
                    optimizer.state[p][k] = distribute_tensor(v.to(p.device), p.device_mesh, p.placements,
                                                              src_data_rank=None)


def union(items: Sequence) -> list:
    """The union of every rank's `items`, in first-seen rank order (the same list on every rank)."""
    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        return list(dict.fromkeys(items))
    out: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, list(items))
    return list(dict.fromkeys(x for part in out for x in part))


def checkpoint_state(model: nn.Module, optimizer: torch.optim.Optimizer, algorithm) -> dict:
    """What a checkpoint of a sharded run holds, gathered to full tensors (collective; rank 0 writes it):
    {"model": state dict, "optimizer": state dict, "algorithm": the algorithm's state}."""
    return {"model": model_state(model), "optimizer": optimizer_state(optimizer),
            "algorithm": full_state(algorithm.state_dict())}

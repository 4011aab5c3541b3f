"""Micro-batches by a memory budget: how many sequences go into one forward/backward.

    train.micro_batch_size = 0 (default)   as many as `train.memory_budget_gib` allows for this model
    train.micro_batch_size = N             at most N sequences (and never more tokens than the budget allows)

Padding-aware: a minibatch's sequences are packed longest first, so each micro-batch holds sequences of
similar lengths and is trimmed to its own longest prompt and completion; the cost of a micro-batch is its
padded size, rows x (longest prompt + longest completion). Within a micro-batch the sequences keep their
order in the minibatch, so when everything fits in one micro-batch nothing changes at all.

The activation estimate per padded token, for a forward whose activations are kept for the backward
(float32 unless the model is bf16/fp16), per decoder layer: about 12 hidden-size vectors (norm inputs and
outputs, q/k/v/o, residuals), 3 intermediate-size vectors (gate, up, their product), and an attention
row of the sequence's length per head (CPU attention materialises it). LOPD keeps a second such forward,
its teacher's, for the gradient into the composer. The budget also holds the weights, gradients and
AdamW's two moments of the trained parameters. Measured against real peaks in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import torch
from torch import Tensor


def available_memory_bytes(device: torch.device) -> int:
    """What this process may use: the free GPU memory, or MemAvailable from /proc/meminfo (CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def activation_bytes_per_token(model, sequence_length: int, forwards_kept: int = 1) -> int:
    """Bytes of kept activations per padded token of one micro-batch (see the module doc). On CUDA the
    attention kernels keep no row of attention weights; with activation checkpointing on, a layer keeps
    only its input (one hidden-size vector)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    hidden = config.hidden_size
    inter = getattr(config, "intermediate_size", 4 * hidden)
    heads = config.num_attention_heads
    layers = config.num_hidden_layers
    param = next(model.parameters())
    dtype_bytes = 4 if param.dtype == torch.float32 else 2
    attention_row = 0 if param.device.type == "cuda" else heads * sequence_length
    per_layer = 12 * hidden + 3 * inter + attention_row
    if checkpointing_on(base) and base.training:
        per_layer = hidden
    return int(layers * per_layer * dtype_bytes * forwards_kept)


def checkpointing_on(model) -> bool:
    """Whether Hugging Face activation checkpointing is enabled on `model` (either property name)."""
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def trained_state_bytes(model) -> int:
    """Weights + gradients + AdamW's two moments of the trained parameters, plus the frozen weights once."""
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    return 4 * trained + frozen


def token_budget(model, device: torch.device, budget_gib: float, sequence_length: int, forwards_kept: int) -> int:
    """Padded tokens per micro-batch whose activations fit in `budget_gib` of memory, the trained state
    counted first (0: half of what is available now)."""
    budget = budget_gib * 2**30 if budget_gib > 0 else available_memory_bytes(device) // 2
    per_token = activation_bytes_per_token(model, sequence_length, forwards_kept)
    return max(1, int((budget - trained_state_bytes(model)) // per_token))


def plan(prompt_lengths: Tensor, completion_lengths: Tensor, index: Tensor, max_rows: int, max_tokens: int) -> list[Tensor]:
    """Split the rows `index` into micro-batches of at most `max_rows` rows (0: no limit) whose padded size
    rows x (longest prompt + longest completion) stays within `max_tokens` (0: no limit); longest first.
    Each micro-batch keeps its rows in their order within `index`. A row longer than `max_tokens` on its
    own still gets a micro-batch of its own."""
    position = {int(i): p for p, i in enumerate(index.tolist())}
    by_length = sorted(index.tolist(), key=lambda i: (-int(prompt_lengths[i] + completion_lengths[i]), position[i]))
    groups: list[list[int]] = []
    current: list[int] = []
    longest_p = longest_c = 0
    for i in by_length:
        p, c = int(prompt_lengths[i]), int(completion_lengths[i])
        grown = (len(current) + 1) * (max(longest_p, p) + max(longest_c, c))
        if current and ((max_rows and len(current) >= max_rows) or (max_tokens and grown > max_tokens)):
            groups.append(current)
            current, longest_p, longest_c = [], 0, 0
        current.append(i)
        longest_p, longest_c = max(longest_p, p), max(longest_c, c)
    if current:
        groups.append(current)
    return [torch.tensor(sorted(g, key=position.__getitem__), dtype=torch.long) for g in groups]

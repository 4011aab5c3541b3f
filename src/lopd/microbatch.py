"""Micro-batches by a memory budget: how many sequences go into one forward/backward.

    train.micro_batch_size = 0 (default)   as many as `train.memory_budget_gib` (10 GiB) allows for this model
    train.micro_batch_size = N             at most N sequences (and never more tokens than the budget allows)

Padding-aware: a minibatch's sequences are packed longest first, so each micro-batch holds sequences of
similar lengths and is trimmed to its own longest prompt and completion; the cost of a micro-batch is its
padded size, rows x (longest prompt + longest completion). Within a micro-batch the sequences keep their
order in the minibatch, so when everything fits in one micro-batch nothing changes at all.

What a padded token costs is measured, not guessed: `kept_bytes_per_token` runs one forward of the
policy's decoder over two dummy rows of the step's longest length (one of them left-padded, so attention
takes the masked path real batches take) under `torch.autograd.graph.saved_tensors_hooks`, and counts
every storage autograd keeps for the backward once, parameters excluded. That is cached per model and
length bucket (a forward per 64 tokens of length, once per run), and draws no random numbers from the
training stream. LOPD keeps a second such forward, its latent teacher's, for the gradient into the
composer, over a longer prompt (the slots): `Algorithm.kept_prompt_lengths` names each kept forward's
prompt lengths, and a micro-batch's padded size sums over them. The budget also holds the weights,
gradients and AdamW's two moments of the trained parameters, and the teachers' weight copies. Under
`train.fsdp` (a forward there is a collective) the planner uses
`activation_bytes_per_token`, the count of vectors per layer that docs/scaling.md plans with, which is
low on CPU. Measured against real peaks in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from lopd.models import base_model, checkpointing_on, copies_of

LENGTH_BUCKET = 64  # kept bytes are measured at the step's longest length rounded up to this
_measured: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {(length, mode): bytes}


def activation_bytes_per_token(model, sequence_length: int, forwards_kept: int = 1) -> int:
    """Bytes of kept activations per padded token of one micro-batch (see the module doc). On CUDA the
    attention kernels keep no row of attention weights; with activation checkpointing on, a layer keeps
    only its input (one hidden-size vector)."""
    base = base_model(model)
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


def kept_bytes_per_token(model, sequence_length: int) -> int:
    """Bytes autograd keeps for the backward per padded token of one forward of `model`'s decoder at
    `sequence_length` (rounded up to LENGTH_BUCKET), measured on two dummy rows; cached per model."""
    from lopd.tokens import decoder_and_head, positions

    decoder, _ = decoder_and_head(model)
    length = max(2, -(-sequence_length // LENGTH_BUCKET) * LENGTH_BUCKET)
    key = (length, decoder.training, checkpointing_on(base_model(model)))
    cache = _measured.setdefault(model, {})
    if key not in cache:
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        kept: dict[int, int] = {}
        alive: list[Tensor] = []  # every saved tensor stays alive until the count is done (no address reused)

        def pack(t: Tensor) -> None:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                kept[storage.data_ptr()] = storage.nbytes()
            alive.append(t)
            # Nothing goes into the graph: a graph that saved `t` itself (an output of the node that saves it)
            # is a cycle through C++ that the garbage collector never frees, and each measured length leaked its
            # whole forward (1.3 GiB at SmolLM2's 512 tokens, step after step: benchmarks/RESULTS.md section 20).

        device = next(model.parameters()).device
        mask = torch.ones(2, length, dtype=torch.long, device=device)
        mask[1, 0] = 0  # a left-padded row: the attention mask is real, as in a training batch
        ids = torch.zeros(2, length, dtype=torch.long, device=device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(pack, _never_unpacked):
            decoder(input_ids=ids, attention_mask=mask, position_ids=positions(mask))
        alive.clear()
        cache[key] = sum(kept.values()) // (2 * length)
    return cache[key]


def _never_unpacked(packed: None) -> Tensor:
    raise RuntimeError("the planner's measuring forward has no backward pass")


def trained_state_bytes(model) -> int:
    """Weights + gradients + AdamW's two moments of the trained parameters, plus the frozen weights once,
    plus the teachers' full-model weight copies of `model` (a full fine-tune's frozen teacher, EMA)."""
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    copies = sum(p.numel() * p.element_size() for c in copies_of(model) for p in c.parameters())
    return 4 * trained + frozen + copies


def token_budget(model, device: torch.device, budget_gib: float, sequence_length: int, forwards_kept: int,
                 measure: bool = True) -> int:
    """Padded tokens per micro-batch whose activations fit in `budget_gib` of memory, the trained state
    counted first; kept bytes measured (`measure`) or estimated. A function of the budget and the model
    only, never of the memory free at the time: the same config gives the same plan, hence the same numbers,
    on a busy machine and an idle one."""
    budget = budget_gib * 2**30
    per_token = (kept_bytes_per_token(model, sequence_length) * forwards_kept if measure
                 else activation_bytes_per_token(model, sequence_length, forwards_kept))
    return max(1, int((budget - trained_state_bytes(model)) // per_token))


def largest_kept_bytes(model, prompt_lengths: Tensor, completion_lengths: Tensor, max_tokens: int,
                       measure: bool = True) -> int:
    """An upper bound on the activations one micro-batch of these rows keeps: all the rows padded into one
    micro-batch (prompt_lengths [F, B] as in `plan`, completion_lengths [B]), at most `max_tokens` (0: no
    limit), at the bytes per token `token_budget` plans with."""
    if completion_lengths.numel() == 0:
        return 0
    prompts = prompt_lengths.reshape(-1, prompt_lengths.shape[-1])  # [F, B]
    longest = int((prompts + completion_lengths).max())
    padded = completion_lengths.numel() * int((prompts.max(-1).values + completion_lengths.max()).sum())
    per_token = kept_bytes_per_token(model, longest) if measure else activation_bytes_per_token(model, longest)
    return per_token * (min(padded, max_tokens) if max_tokens else padded)


def plan(prompt_lengths: Tensor, completion_lengths: Tensor, index: Tensor, max_rows: int, max_tokens: int) -> list[Tensor]:
    """Split the rows `index` into micro-batches of at most `max_rows` rows (0: no limit) whose padded size
    stays within `max_tokens` (0: no limit); longest first. prompt_lengths: [B], or [F, B] for F forwards
    whose activations are all kept (LOPD: the student's prompt, and the latent teacher's prompt with its
    slots); the padded size is rows x sum over forwards of (longest prompt + longest completion).
    Each micro-batch keeps its rows in their order within `index`. A row longer than `max_tokens` on its
    own still gets a micro-batch of its own."""
    prompts = prompt_lengths.reshape(-1, prompt_lengths.shape[-1]).tolist()  # [F][B]
    forwards = len(prompts)
    position = {int(i): p for p, i in enumerate(index.tolist())}
    size = {i: sum(f[i] for f in prompts) + forwards * int(completion_lengths[i]) for i in position}
    by_length = sorted(position, key=lambda i: (-size[i], position[i]))
    groups: list[list[int]] = []
    current: list[int] = []
    longest_p, longest_c = [0] * forwards, 0
    for i in by_length:
        p, c = [f[i] for f in prompts], int(completion_lengths[i])
        grown = (len(current) + 1) * (sum(map(max, longest_p, p)) + forwards * max(longest_c, c))
        if current and ((max_rows and len(current) >= max_rows) or (max_tokens and grown > max_tokens)):
            groups.append(current)
            current, longest_p, longest_c = [], [0] * forwards, 0
        current.append(i)
        longest_p, longest_c = list(map(max, longest_p, p)), max(longest_c, c)
    if current:
        groups.append(current)
    return [torch.tensor(sorted(g, key=position.__getitem__), dtype=torch.long) for g in groups]

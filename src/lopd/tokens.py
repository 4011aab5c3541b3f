"""Per-token statistics of a model over completions, computed without a [B, T, V] float32 tensor.

`score_completions` runs the backbone once over [prefix ; prompt ; completion] and keeps only the
hidden states at the positions that predict completion tokens; rows that share a prompt (a sampling group)
share its forward: the prompt runs once, and its keys and values serve each row's completion
(`train.share_prompts`). `TokenStats` turns them into
log-probs chunk by chunk through the output head, so [B, chunk, V] logits are never held for the whole
sequence; the full-vocabulary divergences of `lopd.losses` run through the same chunks (`per_token`).

Every such quantity is per token: its value at position t depends on the hidden states at t alone.
When no output head has a trainable weight (LoRA, the usual case at scale), each chunk's gradient with
respect to its hidden states is therefore computed in the forward pass and kept ([B, chunk, H], small);
the backward pass only scales it by the incoming per-token gradient (`_PerTokenGrad`): no recompute,
fewer matrix products than autograd over materialised logits. When a head is trained (a full fine-tune
of a tied-embedding model), the chunk is instead recomputed in the backward pass (activation
checkpointing), since its weight gradient depends on the per-token weights that arrive only then.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lopd.models import base_model, checkpointing_on


DEFAULT_CHUNK = 128  # completion positions per output-head chunk, at most
CHUNK_ELEMENTS = 1 << 25  # and at most this many logits per [B, chunk, V] block (128 MiB in float32): at a large
# vocabulary and many rows the chunk shrinks (SmolLM2's 49,152 tokens x 16 rows: 42 positions), so the divergences'
# transient blocks stay bounded whatever the micro-batch; positions are independent, so the values are the same


def masked(x: Tensor, mask: Tensor) -> Tensor:
    """x where mask is set, exactly 0 elsewhere (x * mask would turn a masked inf into nan)."""
    return torch.where(mask > 0, x * mask, torch.zeros((), dtype=x.dtype, device=x.device))


def upcast(x: Tensor) -> Tensor:
    """At least float32 (bf16/fp16 logits are upcast; float64 stays float64 for exact references)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


VOCAB_BLOCK = 8192  # vocabulary rows per block when a low-precision head's product is taken in float32


def head_logits(head: nn.Module, hidden: Tensor, dtype: torch.dtype | None = torch.float32) -> Tensor:
    """The head's logits, at least float32.   [B, c, H] -> [B, c, V]

    With a bf16/fp16 head and `dtype` float32, the product itself is taken in float32 (hidden states and
    weight rows upcast, a vocabulary block at a time), so the logits are never rounded to bf16 (at logit
    scale 50, bf16 rounding costs the divergence's gradient its direction). `dtype` None: the head's own
    precision, then upcast (faster, and what a float32 model does anyway)."""
    inner = head.inner if isinstance(head, WeightsDetached) else head
    weight = getattr(inner, "weight", None)
    if dtype is None or weight is None or not isinstance(inner, nn.Linear) or weight.dtype.itemsize >= 4:
        return upcast(head(hidden))
    if isinstance(head, WeightsDetached):
        weight = weight.detach()
    bias = inner.bias.detach() if inner.bias is not None and isinstance(head, WeightsDetached) else inner.bias
    x = hidden.to(dtype)
    blocks = [nn.functional.linear(x, weight[v:v + VOCAB_BLOCK].to(dtype),
                                   None if bias is None else bias[v:v + VOCAB_BLOCK].to(dtype))
              for v in range(0, weight.shape[0], VOCAB_BLOCK)]
    return torch.cat(blocks, dim=-1)


def trained_positions(hidden: Tensor, mask: Tensor) -> Tensor:
    """Hidden states with the untrained positions (pads, observations) set to 0: whatever they hold (even
    inf or nan) never reaches a value or a gradient.   [B, T, H], [B, T] -> [B, T, H]"""
    return torch.where(mask.to(hidden.device)[..., None] > 0, hidden, torch.zeros((), dtype=hidden.dtype,
                                                                                    device=hidden.device))


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The transformer body (returns hidden states) and the output head, for HF and peft models."""
    base = base_model(model)
    return base.get_decoder(), base.get_output_embeddings()


def positions(mask: Tensor) -> Tensor:
    """Position ids for a left-padded batch: 0, 1, 2, ... from each row's first real token.   [B, L]"""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


class WeightsDetached(nn.Module):
    """A module evaluated with its parameters detached: inputs keep their gradient, weights get none."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.inner = module

    def forward(self, x: Tensor) -> Tensor:
        params = {k: v.detach() for k, v in self.inner.named_parameters()}
        return torch.func.functional_call(self.inner, params, (x,))


def _trains_weights(*heads: nn.Module) -> bool:
    return any(not isinstance(h, WeightsDetached) and any(p.requires_grad for p in h.parameters()) for h in heads)


class _PerTokenGrad(torch.autograd.Function):
    """out[b, t] = fn(*hiddens[:, t]) with each position independent and no trainable weights inside fn:
    d out[b, t] / d hidden[b, t] is taken in the forward pass; backward multiplies it by grad_out[b, t]."""

    @staticmethod
    def forward(ctx, fn, *hiddens: Tensor) -> Tensor:
        leaves = [h.detach().requires_grad_(h.requires_grad) for h in hiddens]
        with torch.enable_grad():
            out = fn(*leaves)  # [B, c]
            wanted = [x for x in leaves if x.requires_grad]
            grads = iter(torch.autograd.grad(out.sum(), wanted) if wanted else ())
        ctx.save_for_backward(*[next(grads) if x.requires_grad else None for x in leaves])
        return out.detach()

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        scale = grad_out.unsqueeze(-1)  # [B, c, 1]
        return (None, *[None if g is None else (g * scale).to(g.dtype) for g in ctx.saved_tensors])


def per_token(fn, heads: tuple[nn.Module, ...], *hiddens: Tensor) -> Tensor:
    """fn(*hiddens) -> [B, c] for one chunk, with the cheapest exact gradient path (see the module doc)."""
    if not (torch.is_grad_enabled() and any(h.requires_grad for h in hiddens)):
        return fn(*hiddens)
    if _trains_weights(*heads):
        return checkpoint(fn, *hiddens, use_reentrant=False)
    return _PerTokenGrad.apply(fn, *hiddens)


@dataclass
class TokenStats:
    """A model's view of B completions of length T: hidden states at the predicting positions."""

    hidden: Tensor  # [B, T, H] hidden state that predicts completion token t
    head: nn.Module  # output head H -> V
    targets: Tensor  # [B, T] the completion tokens
    mask: Tensor  # [B, T] 1 on trained tokens
    temperature: float = 1.0
    chunk: int = DEFAULT_CHUNK
    head_dtype: torch.dtype | None = torch.float32  # the head's product in float32 (see `head_logits`)
    _logprobs: Tensor | None = field(default=None, repr=False)

    def detached(self) -> "TokenStats":
        """The same view with no gradient path (a teacher the loss must not move)."""
        return replace(self, hidden=self.hidden.detach(), head=self.weights_detached().head,
                       _logprobs=None if self._logprobs is None else self._logprobs.detach())

    def placed(self, rows: Tensor, into: "TokenStats") -> "TokenStats":
        """These stats (of some rows) in a view the size of `into` (its targets and mask; hidden states 0 in
        the other rows): a teacher scored only where it is needed, read alongside the whole micro-batch."""
        hidden = torch.zeros(into.hidden.shape, dtype=self.hidden.dtype, device=self.hidden.device)
        hidden[rows.to(hidden.device)] = self.hidden
        return replace(self, hidden=hidden, targets=into.targets, mask=into.mask, _logprobs=None)

    def select(self, rows: Tensor) -> "TokenStats":
        """The same view of some rows only (gradients flow back to the selected rows' hidden states)."""
        return replace(self, hidden=self.hidden[rows], targets=self.targets[rows], mask=self.mask[rows],
                       _logprobs=None if self._logprobs is None else self._logprobs[rows])

    def weights_detached(self) -> "TokenStats":
        """The same view whose output head passes no gradient to its weights (every teacher's)."""
        return replace(self, head=self.head if isinstance(self.head, WeightsDetached) else WeightsDetached(self.head))

    def logprobs(self) -> Tensor:
        """log p(y_t | prefix) of the completion tokens.   [B, T], 0 where mask is 0."""
        # a value cached without a graph (under no_grad) must not stand in for one that needs a gradient
        stale = self._logprobs is not None and not self._logprobs.requires_grad and torch.is_grad_enabled() \
            and self.hidden.requires_grad
        if self._logprobs is None or stale:
            parts = []
            hidden = trained_positions(self.hidden, self.mask)
            for sl in self.chunks():
                targets = self.targets[:, sl]
                fn = functools.partial(self._chunk_logprobs, targets=targets)  # bound now, not at recompute
                parts.append(per_token(fn, (self.head,), hidden[:, sl]))
            self._logprobs = masked(torch.cat(parts, dim=1), self.mask)
        return self._logprobs

    def chunks(self) -> list[slice]:
        """The position slices the output head is evaluated over: `chunk` positions, fewer where B x chunk x V
        would pass CHUNK_ELEMENTS."""
        B, T = self.hidden.shape[:2]
        inner = self.head.inner if isinstance(self.head, WeightsDetached) else self.head
        weight = getattr(inner, "weight", None)
        V = weight.shape[0] if weight is not None else 1
        step = max(1, min(self.chunk, CHUNK_ELEMENTS // max(B * V, 1)))
        return [slice(start, min(T, start + step)) for start in range(0, T, step)]

    def _chunk_logprobs(self, hidden: Tensor, targets: Tensor) -> Tensor:
        logits = head_logits(self.head, hidden, self.head_dtype) / self.temperature  # [B, c, V]
        return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # [B, c]


@dataclass
class Latents:
    """Continuous tokens spliced into each row's prompt (LOPD's latent context).

    values: [B, K, H] the slots' input embeddings; present: [B, K] bool, an absent slot is masked out of
    attention and takes no position (so a row may use fewer than K); at: [B] long, the prompt column (in
    the left-padded prompt) before which row b's slots go: 0 puts them in front of everything.
    """

    values: Tensor
    present: Tensor
    at: Tensor


def splice(embeds: Tensor, mask: Tensor, latents: Latents) -> tuple[Tensor, Tensor]:
    """Insert each row's K slots before its column `at`.   [B, P, H], [B, P] -> [B, P+K, H], [B, P+K]"""
    B, P, H = embeds.shape
    K = latents.values.shape[1]
    j = torch.arange(P + K, device=embeds.device)[None]  # [1, P+K] output column
    at = latents.at.to(embeds.device)[:, None]  # [B, 1]
    source = torch.where(j < at, j, torch.where(j < at + K, P + j - at, j - K))  # [B, P+K] column in [prompt ; slots]
    values = torch.cat([embeds, latents.values.to(embeds.dtype)], dim=1)  # [B, P+K, H]
    present = torch.cat([mask, latents.present.to(mask.dtype)], dim=1)  # [B, P+K]
    return values.gather(1, source[..., None].expand(-1, -1, H)), present.gather(1, source)


def score_completions(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                      completion_mask: Tensor, *, completion_attention: Tensor | None = None, temperature: float = 1.0,
                      latents: Latents | None = None, chunk: int = DEFAULT_CHUNK,
                      head_dtype: torch.dtype | None = torch.float32) -> TokenStats:
    """One forward over [prompt (with latent slots spliced in) ; completion]; stats at the completion positions.

    prompt_ids/mask: [B, P] left-padded; completion_ids/mask: [B, T] right-padded;
    completion_attention: [B, T] tokens attended to (default completion_mask); in multi-turn episodes it
        also covers the observations, which completion_mask (the trained tokens) leaves out.
    latents: optional continuous tokens spliced into the prompt (see `Latents`).
    Teacher position t and student position t predict the same completion token whatever the prompt.
    """
    decoder, head = decoder_and_head(model)
    device = next(model.parameters()).device
    attend = completion_mask if completion_attention is None else completion_attention
    ids = torch.cat([prompt_ids, completion_ids], dim=1).to(device)  # [B, P+T]
    mask = torch.cat([prompt_mask, attend], dim=1).to(device)  # [B, P+T]
    embeds = decoder.get_input_embeddings()(ids)  # [B, P+T, H]
    P, T = prompt_ids.shape[1], completion_ids.shape[1]
    if latents is not None:
        prompt, pmask = splice(embeds[:, :P], mask[:, :P], latents)  # [B, P+K, H], [B, P+K]
        embeds, mask = torch.cat([prompt, embeds[:, P:]], dim=1), torch.cat([pmask, mask[:, P:]], dim=1)
        P = prompt.shape[1]
    shared = shared_prompts(prompt_ids, prompt_mask, latents) if prompt_sharing() and cache_usable(model) else None
    if shared is not None:
        predicting = _forward_shared(decoder, embeds, mask, P, T, *shared)
    else:
        # a pad inside the sequence (after EOS) must still see a position; masking keeps it out of attention
        hidden = decoder(inputs_embeds=embeds, attention_mask=mask, position_ids=positions(mask)).last_hidden_state
        predicting = hidden[:, P - 1:P + T - 1]  # [B, T, H]: position i predicts token i + 1
    return TokenStats(predicting, head, completion_ids.to(device), completion_mask.to(device).float(), temperature,
                      chunk, head_dtype)


# ------------------------------------------------------------------------------------------------ shared prompts

_SHARE_PROMPTS = [True]  # process-wide, set from `train.share_prompts` (like torch.set_num_threads from train.threads)


def set_prompt_sharing(on: bool) -> None:
    """Whether `score_completions` and rollout sampling run each distinct prompt of a batch once
    (`train.share_prompts`)."""
    _SHARE_PROMPTS[0] = bool(on)


def prompt_sharing() -> bool:
    return _SHARE_PROMPTS[0]


def shared_prompts(prompt_ids: Tensor, prompt_mask: Tensor, latents: Latents | None) -> tuple[Tensor, Tensor] | None:
    """(first, inverse): the first row of each distinct prompt [U] and each row's distinct prompt [B], when
    some rows share a prompt (a sampling group: one task, G completions; with latents, the same slots too);
    None when every prompt is distinct."""
    B = prompt_ids.shape[0]
    if B < 2:
        return None
    _, inverse = torch.unique(torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1), dim=0,
                              return_inverse=True)  # [B]
    U = int(inverse.max()) + 1
    if U == B:
        return None
    first = torch.full((U,), B, dtype=torch.long).scatter_reduce(0, inverse, torch.arange(B), "amin")  # [U]
    if latents is not None:  # the same ids, but the slots must be the same too
        again = inverse.to(latents.values.device)
        f = first.to(latents.values.device)
        if not (torch.equal(latents.values[f][again], latents.values) and torch.equal(latents.present[f][again],
                latents.present) and torch.equal(latents.at.to(f.device)[f][again], latents.at.to(f.device))):
            return None
    return first, inverse


def cache_usable(model: nn.Module) -> bool:
    """A key/value cache can carry a prompt's forward into its rows' completions: not when the layers are
    recomputed in the backward pass (HF turns the cache off under activation checkpointing in training)."""
    return not (checkpointing_on(model) and base_model(model).training and torch.is_grad_enabled())


def _forward_shared(decoder: nn.Module, embeds: Tensor, mask: Tensor, P: int, T: int, first: Tensor,
                    inverse: Tensor) -> Tensor:
    """The hidden states predicting each completion token, with each distinct prompt run once: its keys and
    values (a cache, index-selected per row: gradients from every row of a group add up in the one forward)
    then read by each row's completion. The same numbers as one forward over [prompt ; completion] per row,
    up to float rounding.   embeds [B, P+T, H], mask [B, P+T] -> [B, T, H]"""
    device = embeds.device
    first, inverse = first.to(device), inverse.to(device)
    prompt_mask = mask[first, :P]  # [U, P]
    key = "cache" if "cache" in forward_parameters(type(decoder)) else "past_key_values"
    out = decoder(inputs_embeds=embeds[first, :P], attention_mask=prompt_mask, position_ids=positions(prompt_mask),
                  use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    cache.reorder_cache(inverse)  # [U, heads, P, d] -> [B, heads, P, d] per layer
    last = out.last_hidden_state[inverse, P - 1:P]  # [B, 1, H]: the prompt's last position predicts token 0
    if T == 1:
        return last
    rest = decoder(inputs_embeds=embeds[:, P:P + T - 1], attention_mask=mask[:, :P + T - 1],
                   position_ids=positions(mask)[:, P:P + T - 1], use_cache=True, **{key: cache}).last_hidden_state
    return torch.cat([last, rest], dim=1)  # [B, T, H]


@functools.cache
def forward_parameters(cls: type) -> frozenset[str]:
    import inspect

    return frozenset(inspect.signature(cls.forward).parameters)

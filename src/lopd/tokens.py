"""Per-token statistics of a model over completions, computed without a [B, T, V] float32 tensor.

`score_completions` runs the backbone once over [prefix ; prompt ; completion] and keeps only the
hidden states at the positions that predict completion tokens. `TokenStats` turns them into
log-probs (and, for the distillation losses, full-vocabulary quantities) chunk by chunk through the
output head; each chunk is recomputed in the backward pass (activation checkpointing) so its
[B, chunk, V] logits are never held for the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK = 256  # completion positions per output-head chunk


def upcast(x: Tensor) -> Tensor:
    """At least float32 (bf16/fp16 logits are upcast; float64 stays float64 for exact references)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The transformer body (returns hidden states) and the output head, for HF and peft models."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


def positions(mask: Tensor) -> Tensor:
    """Position ids for a left-padded batch: 0, 1, 2, ... from each row's first real token.   [B, L]"""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


@dataclass
class TokenStats:
    """A model's view of B completions of length T: hidden states at the predicting positions."""

    hidden: Tensor  # [B, T, H] hidden state that predicts completion token t
    head: nn.Module  # output head H -> V
    targets: Tensor  # [B, T] the completion tokens
    mask: Tensor  # [B, T] 1 on trained tokens
    temperature: float = 1.0
    chunk: int = DEFAULT_CHUNK
    _logprobs: Tensor | None = field(default=None, repr=False)

    def logits_chunks(self):
        """Yield (slice, float32 logits [B, c, V] / temperature) chunk by chunk (no checkpointing)."""
        T = self.hidden.shape[1]
        for start in range(0, T, self.chunk):
            sl = slice(start, min(T, start + self.chunk))
            yield sl, upcast(self.head(self.hidden[:, sl])) / self.temperature

    def logprobs(self) -> Tensor:
        """log p(y_t | prefix) of the completion tokens.   [B, T], 0 where mask is 0."""
        if self._logprobs is None:
            parts = []
            T = self.hidden.shape[1]
            for start in range(0, T, self.chunk):
                sl = slice(start, min(T, start + self.chunk))
                args = (self.hidden[:, sl], self.targets[:, sl])
                if torch.is_grad_enabled() and self.hidden.requires_grad:
                    parts.append(checkpoint(self._chunk_logprobs, *args, use_reentrant=False))
                else:
                    parts.append(self._chunk_logprobs(*args))
            self._logprobs = torch.cat(parts, dim=1) * self.mask
        return self._logprobs

    def _chunk_logprobs(self, hidden: Tensor, targets: Tensor) -> Tensor:
        logits = upcast(self.head(hidden)) / self.temperature  # [B, c, V]
        return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # [B, c]


def score_completions(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                      completion_mask: Tensor, *, temperature: float = 1.0, prefix_embeds: Tensor | None = None,
                      chunk: int = DEFAULT_CHUNK) -> TokenStats:
    """One forward over [prefix ; prompt ; completion]; stats at the completion positions.

    prompt_ids/mask: [B, P] left-padded; completion_ids/mask: [B, T] right-padded;
    prefix_embeds: [B, K, H] optional continuous tokens placed before the prompt (LOPD's latents).
    Teacher position t and student position t predict the same completion token whatever the prefix.
    """
    decoder, head = decoder_and_head(model)
    device = next(model.parameters()).device
    ids = torch.cat([prompt_ids, completion_ids], dim=1).to(device)  # [B, P+T]
    mask = torch.cat([prompt_mask, completion_mask], dim=1).to(device)  # [B, P+T]
    embeds = decoder.get_input_embeddings()(ids)  # [B, P+T, H]
    K = 0
    if prefix_embeds is not None:
        K = prefix_embeds.shape[1]
        embeds = torch.cat([prefix_embeds.to(embeds.dtype), embeds], dim=1)  # [B, K+P+T, H]
        mask = torch.cat([torch.ones_like(mask[:, :K]), mask], dim=1)
    # a pad inside the sequence (after EOS) must still see a position; masking keeps it out of attention
    hidden = decoder(inputs_embeds=embeds, attention_mask=mask, position_ids=positions(mask)).last_hidden_state
    P, T = prompt_ids.shape[1], completion_ids.shape[1]
    predicting = hidden[:, K + P - 1:K + P + T - 1]  # [B, T, H]: position i predicts token i + 1
    return TokenStats(predicting, head, completion_ids.to(device), completion_mask.to(device).float(), temperature,
                      chunk)


def _chunk_reverse_kl(s_head: nn.Module, t_head: nn.Module, temperature: float, s_hidden: Tensor,
                      t_hidden: Tensor) -> Tensor:
    s = torch.log_softmax(upcast(s_head(s_hidden)) / temperature, dim=-1)  # [B, c, V]
    t = torch.log_softmax(upcast(t_head(t_hidden)) / temperature, dim=-1)  # [B, c, V]
    return (s.exp() * (s - t)).sum(-1)  # [B, c]


def full_reverse_kl(student: TokenStats, teacher: TokenStats) -> Tensor:
    """Exact KL(student || teacher) over the whole vocabulary at every position.   -> [B, T]

    Gradients flow into whichever side carries them (detach a side to stop them); each chunk is
    recomputed in the backward pass, so peak memory holds one [B, chunk, V] block per model.
    """
    parts = []
    T = student.hidden.shape[1]
    for start in range(0, T, student.chunk):
        sl = slice(start, min(T, start + student.chunk))
        args = (student.head, teacher.head, student.temperature, student.hidden[:, sl], teacher.hidden[:, sl])
        if torch.is_grad_enabled() and (student.hidden.requires_grad or teacher.hidden.requires_grad):
            parts.append(checkpoint(_chunk_reverse_kl, *args, use_reentrant=False))
        else:
            parts.append(_chunk_reverse_kl(*args))
    return torch.cat(parts, dim=1) * student.mask

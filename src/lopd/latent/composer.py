"""The latent composer C_phi: retrieved experiences -> what K latent slots add to the teacher's prompt.

    memory  = [null ; LN(W_in h) + outcome[success]]   h: per token of each retrieved experience ("request ->
                                                    answer"), the frozen backbone's [last hidden ; input
                                                    embedding], cached per bank entry; null: a learned
                                                    slot (what "no experience" reads)
    q       = K learned queries                     [K, D]
           (+ W_tok LN(e(c_k)))                     with `token_queries`: slot k's query also reads the
                                                    embedding of the context token c_k under it
    q      += CrossAttn(LN(q), memory); q += MLP(LN(q))     x layers (a Perceiver-style resampler)
    n       = normalize(W_out q) * mean token-embedding norm
    values  = tanh(gate) * n                         over the context's tokens (copy_tokens): the teacher
                                                    adds each to the embedding of the context token under it
            = filler + tanh(gate) * n                otherwise: K slots of their own, starting as a neutral token

The gate starts at 0 (`gate_init`), so at step 0 the slots are exactly the retrieved experiences as soft
text (the teacher reads them as it reads the text context: `lopd_text`) or K neutral filler tokens; the
composer starts from a teacher that works, and learns what to add. With no retrieval (`memory` is None)
the queries skip cross-attention: a learned, task-independent context. Everything is differentiable;
the backbone is not part of the composer and gets no gradient from it.

The learned queries alone see nothing of the token under their slot, and the cross-attention's output
outweighs them: their additions start almost parallel (mean pairwise cosine 0.97 on ToolWorld), and one
AdamW step at a composer lr of 1e-2 makes them one vector for every slot (`benchmarks/slot_collapse.py`,
`lopd inspect`). `token_queries` gives each query the token it will be added to (they start apart, 0.42,
but the same step still aligns them).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class ResamplerLayer(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm_q, self.norm_m, self.norm_ff = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, q: Tensor, memory: Tensor | None, memory_pad: Tensor | None,
                attention: list[Tensor] | None = None) -> Tensor:
        if memory is not None:  # q: [b, K, D]; memory: [b, M, D]; memory_pad: [b, M] True = padding
            m = self.norm_m(memory)
            out, weights = self.attn(self.norm_q(q), m, m, key_padding_mask=memory_pad,
                                     need_weights=attention is not None)
            if attention is not None:
                attention.append(weights.detach())  # [b, K, M] averaged over heads
            q = q + out
        return q + self.ff(self.norm_ff(q))


class Composer(nn.Module):
    def __init__(self, hidden: int, embed_norm: float, filler: Tensor, *, memory_dim: int = 0, latent_tokens: int = 8,
                 layers: int = 2, heads: int = 4, width: int = 0, gate_init: float = 0.0, copy_tokens: bool = False,
                 token_queries: bool = False):
        super().__init__()
        width = width or hidden
        if width % heads:
            raise ValueError(f"composer width {width} is not divisible by {heads} heads")
        self.latent_tokens, self.embed_norm, self.copy_tokens, self.hidden = latent_tokens, embed_norm, copy_tokens, hidden
        self.queries = nn.Parameter(torch.randn(latent_tokens, width) / math.sqrt(width))
        self.outcome = nn.Embedding(2, width)  # 0 = failure, 1 = success
        self.inp = nn.Linear(memory_dim or hidden, width)
        self.norm_in = nn.LayerNorm(width)
        self.layers = nn.ModuleList(ResamplerLayer(width, heads) for _ in range(layers))
        self.norm_out = nn.LayerNorm(width)
        self.out = nn.Linear(width, hidden)
        self.null = nn.Parameter(torch.zeros(1, 1, width))
        self.token_in = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, width)) if token_queries else None
        self.gate = nn.Parameter(torch.tensor(float(gate_init)))
        self.register_buffer("filler", filler.detach().clone().float().reshape(1, 1, hidden))  # [1, 1, H]

    def forward(self, memory: Tensor | None = None, memory_pad: Tensor | None = None,
                memory_success: Tensor | None = None, batch: int | None = None,
                attention: list[Tensor] | None = None, under: Tensor | None = None) -> Tensor:
        """memory: [b, M, F] features of the retrieved experiences' tokens (concatenated), memory_pad: [b, M]
        (True = padding), memory_success: [b, M] long (1 where the token belongs to a success). Returns the
        slots' values [b, K, H] (see the module doc). `attention`, if given a list, receives each layer's
        attention of the K queries over [null ; memory], [b, K, 1 + M] (for inspection). `under`: [b, K, H]
        the input embeddings of the context tokens under the slots (zeros past the context), for
        `token_queries`."""
        b = memory.shape[0] if memory is not None else batch
        q = self.queries.unsqueeze(0).expand(b, -1, -1)  # [b, K, D]
        if self.token_in is not None:
            if under is None:
                raise ValueError("a composer with token_queries needs `under`, the embeddings of the tokens under its slots")
            q = q + self.token_in(under.to(self.inp.weight.dtype))  # [b, K, D]
        mem = None
        if memory is not None:
            mem = self.norm_in(self.inp(memory.to(self.inp.weight.dtype)))  # [b, M, D]
            if memory_success is not None:
                mem = mem + self.outcome(memory_success)
            # a learned null slot every row can attend to: a trajectory that retrieved nothing reads only it
            mem = torch.cat([self.null.expand(b, -1, -1), mem], dim=1)  # [b, 1 + M, D]
            if memory_pad is not None:
                memory_pad = torch.cat([torch.zeros_like(memory_pad[:, :1]), memory_pad], dim=1)
        for layer in self.layers:
            q = layer(q, mem, memory_pad, attention)
        n = nn.functional.normalize(self.out(self.norm_out(q)), dim=-1) * self.embed_norm  # [b, K, H]
        added = torch.tanh(self.gate) * n
        return added if self.copy_tokens else self.filler.expand(b, self.latent_tokens, -1) + added


def slot_cosine(added: Tensor, present: Tensor) -> Tensor:
    """How alike the slots' additions are: per row, the mean cosine between the additions of two different
    present slots (1: one vector for every slot, the composer can only shift the whole context).
    added: [b, K, H] what the composer adds (before the base it is added to); present: [b, K] bool.
    Returns [b] float64, NaN for a row with fewer than two present slots or an all-zero addition (gate 0)."""
    unit = nn.functional.normalize(added.detach().double(), dim=-1) * present[..., None]  # [b, K, H]
    n = present.sum(-1).double()  # [b]
    total = unit.sum(1).pow(2).sum(-1) - unit.pow(2).sum((1, 2))  # [b] sum of cos over ordered pairs i != j
    silent = (added.detach().eq(0).all(-1) & present).any(-1)  # [b] a present slot adds nothing: no direction
    return torch.where((n >= 2) & ~silent, total / (n * (n - 1)).clamp(min=1), torch.full_like(n, math.nan))



class Compressor(nn.Module):
    """An in-sequence compressor (ICAE's design, docs/method.md): a trainable copy of the backbone's decoder
    reads the privileged context's tokens followed by K memory embeddings of its own, and the last hidden
    states at those K columns become the K slots the frozen teacher reads where the text would stand.

        x      = [e(c_1) .. e(c_L) ; m_1 .. m_K]               c: the context's tokens (left-padded), m: K learned
                                                               embeddings, each its own identity and position
        h_k    = Decoder_phi(x)[L + k]                         the copy's last hidden state at memory column k
        slot_k = s_k * mean|e| * normalize(W h_k + b)          W starts as the identity, s_k at 1 (kept in
                                                               [0.25, 4]): slots at the input embeddings' scale

    The deep backbone reads the text and the slots in one causal sequence, each slot has its own embedding
    and position, and the slots are far fewer than the text's tokens (K = 16 for two experiences of ~90
    tokens): what every working compressor shares (benchmarks/RESULTS.md, section 17, reads them).
    Trained by context distillation toward the text teacher (KL(pi_T(.|c) || pi_T(.|slots)) on the
    student's own trajectories), then by the privilege objective; the teacher's weights stay frozen.
    """

    def __init__(self, decoder: nn.Module, embed_norm: float, memory_init: Tensor, latent_tokens: int = 16):
        super().__init__()
        hidden = memory_init.shape[-1]
        self.decoder, self.latent_tokens, self.embed_norm = decoder, latent_tokens, embed_norm
        self.memory = nn.Parameter(memory_init.detach().clone().float().reshape(latent_tokens, hidden))  # [K, H]
        self.out = nn.Linear(hidden, hidden)
        with torch.no_grad():
            self.out.weight.copy_(torch.eye(hidden))
            self.out.bias.zero_()
        self.scale = nn.Parameter(torch.ones(latent_tokens))  # [K]

    def forward(self, ids: Tensor, mask: Tensor, attention: list[Tensor] | None = None) -> Tensor:
        """ids, mask: [G, L] the contexts' tokens, left-padded. Returns the slots [G, K, H]. `attention`, if given
        a list, receives the last layer's attention of the K memory columns over [context ; memory], [G, K, L + K]
        heads averaged (for inspection; needs the decoder's eager attention)."""
        from lopd.tokens import positions

        G, K = ids.shape[0], self.latent_tokens
        embeds = self.decoder.get_input_embeddings()(ids)  # [G, L, H]
        memory = self.memory.to(embeds.dtype).unsqueeze(0).expand(G, -1, -1)  # [G, K, H]
        x = torch.cat([embeds, memory], dim=1)  # [G, L + K, H]
        full = torch.cat([mask, torch.ones(G, K, dtype=mask.dtype, device=mask.device)], dim=1)  # [G, L + K]
        out = self.decoder(inputs_embeds=x, attention_mask=full, position_ids=positions(full),
                           output_attentions=attention is not None)
        if attention is not None:
            attention.append(out.attentions[-1][:, :, -K:].mean(1).detach())  # [G, K, L + K]
        h = out.last_hidden_state[:, -K:]
        scale = self.scale.clamp(0.25, 4.0)[None, :, None]  # [1, K, 1]
        return scale * self.embed_norm * nn.functional.normalize(self.out(h.float()), dim=-1)  # [G, K, H]


def memory_embeddings(table: Tensor, k: int, seed: int = 0) -> Tensor:
    """K distinct rows of the input-embedding table [V, H] plus 10% noise: the memory tokens' start, each
    its own identity at the embeddings' own scale (ICAE's N(0, 1) would be ~10x too large here)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(table.shape[0], generator=g)[:k]
    base = table[rows].detach().float()  # [K, H]
    noise = torch.randn(base.shape, generator=g) * base.norm(dim=-1, keepdim=True) * 0.1 / math.sqrt(base.shape[-1])
    return base + noise

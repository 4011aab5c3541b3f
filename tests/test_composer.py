"""latent/composer.py: at gate 0 the slots add nothing (copy mode) or are exactly the filler token; the
gate scales what the composer adds; attention over [null ; memory] for inspection; gradients reach every
part of the composer."""

import math

import pytest
import torch

from lopd.latent.composer import Composer

H, F, K = 12, 24, 5


def _composer(copy_tokens: bool, gate: float = 0.0) -> Composer:
    torch.manual_seed(0)
    return Composer(H, 2.0, torch.full((H,), 0.5), memory_dim=F, latent_tokens=K, layers=2, heads=2, width=8,
                    gate_init=gate, copy_tokens=copy_tokens)


def _memory(b=3, m=7):
    pad = torch.zeros(b, m, dtype=torch.bool)
    pad[0, 4:] = True  # row 0 has a shorter memory
    return torch.randn(b, m, F), pad, torch.randint(0, 2, (b, m))


def test_gate_zero_adds_nothing_over_the_context_and_gives_the_filler_otherwise():
    memory, pad, success = _memory()
    assert torch.equal(_composer(True)(memory, pad, success), torch.zeros(3, K, H))
    assert torch.equal(_composer(False)(memory, pad, success), torch.full((3, K, H), 0.5))
    assert torch.equal(_composer(False)(batch=2), torch.full((2, K, H), 0.5))  # no retrieval: a learned prefix


def test_the_gate_scales_unit_directions_of_the_embedding_norm():
    memory, pad, success = _memory()
    out = _composer(True, gate=0.7)(memory, pad, success)  # [3, K, H]
    torch.testing.assert_close(out.norm(dim=-1), torch.full((3, K), math.tanh(0.7) * 2.0))


def test_attention_covers_the_null_slot_and_the_unpadded_memory_only():
    memory, pad, success = _memory()
    attention: list[torch.Tensor] = []
    _composer(True, gate=0.5)(memory, pad, success, attention=attention)
    assert len(attention) == 2 and attention[-1].shape == (3, K, 1 + 7)
    torch.testing.assert_close(attention[-1].sum(-1), torch.ones(3, K))
    assert attention[-1][0, :, 1 + 4:].abs().max() == 0  # padding gets no attention


def test_every_parameter_gets_a_gradient_once_the_gate_is_open():
    memory, pad, success = _memory()
    composer = _composer(True, gate=0.3)
    composer(memory, pad, success).pow(2).sum().backward()
    missing = [n for n, p in composer.named_parameters() if p.grad is None or p.grad.abs().max() == 0]
    assert missing == []


def _token_composer(gate: float = 0.5) -> Composer:
    torch.manual_seed(0)
    return Composer(H, 2.0, torch.full((H,), 0.5), memory_dim=F, latent_tokens=K, layers=2, heads=2, width=8,
                    gate_init=gate, copy_tokens=True, token_queries=True)


def test_token_queries_give_each_slot_what_its_token_asks():
    """Slot k's query reads the embedding under it (the slots do not attend to each other): another token
    under slot 2 changes slot 2's value and no other; at gate 0 still nothing added; without `under`, one
    clear error."""
    memory, pad, success = _memory()
    under = torch.randn(3, K, H)  # [b, K, H]
    out = _token_composer()(memory, pad, success, under=under)  # [3, K, H]
    other = under.clone()
    other[:, 2] = torch.randn(3, H)
    moved = (_token_composer()(memory, pad, success, under=other) - out).abs().amax(dim=(0, 2))  # [K]
    assert moved[2] > 1e-3 and moved[[0, 1, 3, 4]].max() == 0
    assert torch.equal(_token_composer(gate=0.0)(memory, pad, success, under=under), torch.zeros(3, K, H))
    with pytest.raises(ValueError, match="under"):
        _token_composer()(memory, pad, success)
    composer = _token_composer()
    composer(memory, pad, success, under=under).pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in composer.token_in.parameters())


def test_slot_cosine_by_hand():
    from lopd.latent.composer import slot_cosine

    added = torch.tensor([[[1.0, 0.0], [0.0, 2.0], [3.0, 3.0], [5.0, 5.0]],  # row 0: slot 3 absent
                          [[1.0, 1.0], [2.0, 2.0], [-1.0, -1.0], [0.0, 0.0]],  # row 1: slot 3 absent
                          [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0]],  # row 2: slot 1 adds nothing
                          [[1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]])  # row 3: one present slot
    present = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    got = slot_cosine(added, present)
    r = 1 / math.sqrt(2)
    assert got[0].item() == pytest.approx((0 + r + r) / 3)  # pairs (0,1), (0,2), (1,2), each counted twice
    assert got[1].item() == pytest.approx((1 - 1 - 1) / 3)
    assert math.isnan(got[2].item()) and math.isnan(got[3].item())


def _compressor(tiny, k=4):
    import copy

    from lopd.latent.composer import Compressor, memory_embeddings

    model, tokenizer = tiny
    table = model.get_input_embeddings().weight.detach()
    torch.manual_seed(0)
    return Compressor(copy.deepcopy(model).get_decoder(), float(table.norm(dim=-1).mean()), memory_embeddings(table, k),
                      k), tokenizer, float(table.norm(dim=-1).mean())


def test_the_compressor_writes_k_distinct_slots_at_the_embeddings_scale(tiny):
    """K slots per context, of norm mean|e| (the scale the frozen teacher reads), distinct (each its own
    embedding and position: not one vector for every slot, as the resampler's 1.00), depending on the context,
    and on nothing else in the batch (left padding). Untrained, they still share a large common direction
    (mean pairwise cosine ~0.9 on the tiny policy); the context distillation is what spreads them."""
    from lopd.latent.composer import slot_cosine
    from lopd.rollout import left_pad

    comp, tok, norm = _compressor(tiny)
    texts = ["Successful calls for similar requests:\n- book a flight -> book_flight(date=\"07/02/2025\")",
             "Successful calls for similar requests:\n- wash the towels -> run_washer(cycle=\"B\")"]
    ids, mask = left_pad([tok(t, add_special_tokens=False)["input_ids"] for t in texts], tok.pad_token_id)
    slots = comp(ids, mask)  # [2, K, H]
    assert slots.shape == (2, 4, tiny[0].config.hidden_size)
    torch.testing.assert_close(slots.norm(dim=-1), torch.full((2, 4), norm), atol=1e-4, rtol=1e-4)
    assert float(slot_cosine(slots, torch.ones(2, 4, dtype=torch.bool)).max()) < 0.99
    assert (slots[0] - slots[1]).abs().max() > 1e-2  # what the context says changes the slots
    alone = comp(*left_pad([tok(texts[1], add_special_tokens=False)["input_ids"]], tok.pad_token_id))
    torch.testing.assert_close(alone[0], slots[1], atol=1e-5, rtol=1e-5)  # padding changes nothing


def test_every_compressor_parameter_gets_a_gradient(tiny):
    from lopd.rollout import left_pad

    comp, tok, _ = _compressor(tiny)
    ids, mask = left_pad([tok("a context", add_special_tokens=False)["input_ids"]], tok.pad_token_id)
    (comp(ids, mask) * torch.randn(1, 4, tiny[0].config.hidden_size)).sum().backward()
    missing = [n for n, p in comp.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert missing == []

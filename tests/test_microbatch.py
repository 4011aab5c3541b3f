"""microbatch.py: the padding-aware planner keeps every row once, within both limits, in its minibatch
order, for one kept forward or several; the kept bytes are measured (parameters excluded, cached, no
random numbers drawn); the budget turns into a token limit; and the update does not depend on it."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lopd import microbatch
from lopd.microbatch import activation_bytes_per_token, kept_bytes_per_token, largest_kept_bytes, plan, token_budget


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 100), st.integers(0, 200)), min_size=1, max_size=40),
       st.integers(0, 8), st.integers(0, 2000), st.booleans(), st.randoms(use_true_random=False))
def test_plan_keeps_every_row_once_within_the_limits(rows, max_rows, max_tokens, two_forwards, rng):
    prompts = torch.tensor([p for p, _, _ in rows])
    completions = torch.tensor([c for _, c, _ in rows])
    teacher_prompts = prompts + torch.tensor([x for _, _, x in rows])
    index = list(range(len(rows)))
    rng.shuffle(index)
    index = torch.tensor(index)
    groups = plan(torch.stack([prompts, teacher_prompts]) if two_forwards else prompts, completions, index,
                  max_rows, max_tokens)
    flat = [int(i) for g in groups for i in g]
    assert sorted(flat) == sorted(index.tolist())  # every row exactly once
    position = {int(i): p for p, i in enumerate(index.tolist())}
    for g in groups:
        g = g.tolist()
        assert [position[i] for i in g] == sorted(position[i] for i in g)  # minibatch order kept
        if max_rows:
            assert len(g) <= max_rows
        longest_c = max(int(completions[i]) for i in g)
        padded = len(g) * (max(int(prompts[i]) for i in g) + longest_c)
        if two_forwards:  # the teacher's padded forward counts too
            padded += len(g) * (max(int(teacher_prompts[i]) for i in g) + longest_c)
        assert not max_tokens or padded <= max_tokens or len(g) == 1
    if not max_rows and not max_tokens:
        assert len(groups) == 1 and groups[0].tolist() == index.tolist()  # nothing to plan: nothing changes


def test_the_plan_of_two_forwards_by_hand():
    # rows (prompt, teacher prompt, completion): (10, 30, 5) (8, 8, 5) (9, 40, 2)
    prompts, teacher, completions = torch.tensor([10, 8, 9]), torch.tensor([30, 8, 40]), torch.tensor([5, 5, 2])
    both = torch.stack([prompts, teacher])
    # sizes 10+30+2*5=50, 26, 9+40+2*2=53: row 2 first, then row 0 (2 x (10+5 + 40+5) = 120), then row 1
    assert [g.tolist() for g in plan(both, completions, torch.arange(3), 0, 120)] == [[0, 2], [1]]
    assert [g.tolist() for g in plan(both, completions, torch.arange(3), 0, 119)] == [[2], [0, 1]]  # 2 x (10+5 + 30+5) = 100
    assert [g.tolist() for g in plan(prompts, completions, torch.arange(3), 0, 45)] == [[0, 1, 2]]  # 3 x (10 + 5)

    assert plan(both, completions, torch.arange(3), 0, 0)[0].tolist() == [0, 1, 2]


def test_the_largest_micro_batch_by_hand(monkeypatch):
    """What one micro-batch keeps at most: every row padded together (3 x (10+5 + 40+5) = 180 tokens for the
    two forwards above), capped by the token limit, at the bytes per token of the longest row (its teacher prompt 40 + 2 = 42)."""
    lengths = []
    monkeypatch.setattr(microbatch, "kept_bytes_per_token", lambda model, n: lengths.append(n) or 7)
    prompts, teacher, completions = torch.tensor([10, 8, 9]), torch.tensor([30, 8, 40]), torch.tensor([5, 5, 2])
    both = torch.stack([prompts, teacher])
    assert largest_kept_bytes(None, both, completions, 0) == 7 * 180
    assert largest_kept_bytes(None, both, completions, 120) == 7 * 120
    assert largest_kept_bytes(None, prompts, completions, 0) == 7 * 3 * 15
    assert lengths == [42, 42, 15]
    assert largest_kept_bytes(None, prompts[:0], completions[:0], 0) == 0


def test_the_budget_scales_with_memory_and_halves_for_two_kept_forwards(tiny):
    model, _ = tiny
    for measure in (True, False):
        one = token_budget(model, torch.device("cpu"), 4.0, 200, 1, measure=measure)
        assert token_budget(model, torch.device("cpu"), 8.0, 200, 1, measure=measure) > 1.9 * one
        assert abs(token_budget(model, torch.device("cpu"), 4.0, 200, 2, measure=measure) - one / 2) <= 1
    assert activation_bytes_per_token(model, 400, 1) > activation_bytes_per_token(model, 200, 1)


def _saved_bytes_by_walking_the_graph(output, params) -> int:
    """The reference: every tensor the autograd graph behind `output` holds (its nodes' `_saved_*`
    attributes), each storage once, parameters excluded."""
    kept, seen, stack = {}, set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                for t in value if isinstance(value, (tuple, list)) else [value]:
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in params:
                        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        stack.extend(f for f, _ in node.next_functions)
    return sum(kept.values())


def test_kept_bytes_equal_the_autograd_graph_walked_are_cached_and_draw_no_random_numbers(tiny):
    import copy

    from lopd.tokens import decoder_and_head, positions

    model, _ = tiny
    model.train()
    state = torch.random.get_rng_state()
    kept = kept_bytes_per_token(model, 200)
    assert torch.equal(torch.random.get_rng_state(), state)  # the training stream is untouched
    decoder, _ = decoder_and_head(model)
    mask = torch.ones(2, 256, dtype=torch.long)
    mask[1, 0] = 0
    out = decoder(input_ids=torch.zeros(2, 256, dtype=torch.long), attention_mask=mask,
                  position_ids=positions(mask)).last_hidden_state
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert kept == _saved_bytes_by_walking_the_graph(out, params) // (2 * 256)  # 200 is measured at 256
    assert 0.5 * activation_bytes_per_token(model, 256) < kept < 2 * activation_bytes_per_token(model, 256)
    assert kept_bytes_per_token(model, 240) == kept  # one length bucket (193..256): measured once
    assert kept_bytes_per_token(model, 400) > kept  # attention rows grow with the length
    frozen = copy.deepcopy(model).requires_grad_(False)
    assert kept_bytes_per_token(frozen, 200) == 0  # nothing trainable: nothing is kept for a backward


def test_measuring_kept_bytes_leaves_no_tensor_alive(tiny):
    """The measuring forward's graph is freed: it used to save each tensor itself, a cycle through C++ that the
    garbage collector never frees, so every measured length leaked a whole forward (1.3 GiB at SmolLM2's 512
    tokens, and the update's peak climbed step by step)."""
    import gc

    from lopd import microbatch

    def live_bytes() -> int:
        gc.collect()
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in gc.get_objects()
                    if isinstance(t, torch.Tensor)}
        return sum(storages.values())

    model, _ = tiny
    model.train()
    microbatch._measured.pop(model, None)  # measured afresh, whatever other tests measured
    before = live_bytes()
    kept = [kept_bytes_per_token(model, n) for n in (300, 600)]
    assert all(k > 0 for k in kept)
    assert live_bytes() - before < 2**20, (live_bytes() - before) / 2**20  # a leak here is ~100-250 MiB


def test_a_tight_token_budget_gives_the_same_update(toolworld):
    from conftest import rollouts, session_for
    from lopd.update import update
    from lopd.models import trainable_parameters

    results = []
    for tokens in (0, 300):  # one micro-batch, or many small ones
        s = session_for(["algorithm.name=opsd", "rollout.tasks_per_step=4", "rollout.group_size=4",
                         "rollout.max_new_tokens=40", f"train.micro_batch_tokens={tokens}"], env=toolworld)
        s.optimizer = torch.optim.SGD(trainable_parameters(s.model), lr=0.1)
        s.scheduler = torch.optim.lr_scheduler.LambdaLR(s.optimizer, lambda step: 1.0)
        torch.manual_seed(5)
        batch = rollouts(s, list(toolworld.tasks("train")[:4]), [1.0, 0.0] * 8)
        metrics = update(s.model, s.algorithm, s.optimizer, s.scheduler, batch, s.algorithm.build_context(batch, 1), s.cfg)
        results.append(([p.detach().clone() for p in s.model.parameters()], metrics["loss/distill"]))
    for a, b in zip(results[0][0], results[1][0]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert abs(results[0][1] - results[1][1]) < 1e-6

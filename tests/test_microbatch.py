"""microbatch.py: the padding-aware planner keeps every row once, within both limits, in its minibatch
order; the memory estimate turns a budget into a token limit; and the update does not depend on it."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lopd.microbatch import activation_bytes_per_token, plan, token_budget


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 100)), min_size=1, max_size=40),
       st.integers(0, 8), st.integers(0, 2000), st.randoms(use_true_random=False))
def test_plan_keeps_every_row_once_within_the_limits(rows, max_rows, max_tokens, rng):
    prompts = torch.tensor([p for p, _ in rows])
    completions = torch.tensor([c for _, c in rows])
    index = list(range(len(rows)))
    rng.shuffle(index)
    index = torch.tensor(index)
    groups = plan(prompts, completions, index, max_rows, max_tokens)
    flat = [int(i) for g in groups for i in g]
    assert sorted(flat) == sorted(index.tolist())  # every row exactly once
    position = {int(i): p for p, i in enumerate(index.tolist())}
    for g in groups:
        g = g.tolist()
        assert [position[i] for i in g] == sorted(position[i] for i in g)  # minibatch order kept
        if max_rows:
            assert len(g) <= max_rows
        padded = len(g) * (max(int(prompts[i]) for i in g) + max(int(completions[i]) for i in g))
        assert not max_tokens or padded <= max_tokens or len(g) == 1
    if not max_rows and not max_tokens:
        assert len(groups) == 1 and groups[0].tolist() == index.tolist()  # nothing to plan: nothing changes


def test_the_budget_scales_with_memory_and_halves_for_two_kept_forwards(tiny):
    model, _ = tiny
    one = token_budget(model, torch.device("cpu"), 4.0, 200, 1)
    assert token_budget(model, torch.device("cpu"), 8.0, 200, 1) > 1.9 * one
    assert abs(token_budget(model, torch.device("cpu"), 4.0, 200, 2) - one / 2) <= 1
    assert activation_bytes_per_token(model, 400, 1) > activation_bytes_per_token(model, 200, 1)


def test_a_tight_token_budget_gives_the_same_update(toolworld):
    from conftest import rollouts, session_for
    from lopd.loop import update
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

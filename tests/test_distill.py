"""The text self-distillation methods (distill.py, opsd.py, sdpo.py, skill_sd.py): each baseline's privileged
context on hand-made batches, no distillation without a context, and the hybrid's policy gradient."""

import pytest
import torch

from lopd.algorithms import build_algorithm
from lopd.config import load_config
from lopd.envs.base import Task
from lopd.rollout import RolloutBatch
from lopd.losses import token_divergence
from lopd.tokens import TokenStats

V, H = 30, 6


def _pair(B=2, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    s_head = torch.nn.Linear(H, V, bias=False).double()
    t_head = torch.nn.Linear(H, V, bias=False).double()
    s_h = torch.randn(B, T, H, generator=g, dtype=torch.float64, requires_grad=True)
    t_h = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.float64)
    return (TokenStats(s_h, s_head, targets, mask, 1.0, chunk=2), TokenStats(t_h, t_head, targets, mask, 1.0, chunk=2))


def _hand_batch(toolworld):
    """Two groups of three: group 0 has one success (index 1), group 1 none."""
    tasks = [toolworld.tasks("train")[0]] * 3 + [toolworld.tasks("train")[1]] * 3
    texts = ["bad0", toolworld.reference(tasks[0]), "bad2", "bad3", "bad4", "bad5"]
    feedback = ["Parameter 'date' has the wrong value.", "Correct call.", "Missing parameter 'city'.", "f3", "f4", "f5"]
    z = torch.zeros(6, 1, dtype=torch.long)
    return RolloutBatch(prompt_ids=z, prompt_mask=z, completion_ids=z, completion_mask=z, sampler_logprobs=z.float(),
                        completions=texts, truncated=torch.zeros(6, dtype=torch.bool), tasks=tasks,
                        group=torch.tensor([0, 0, 0, 1, 1, 1]), rewards=torch.tensor([0, 1, 0, 0, 0, 0.0]),
                        success=torch.tensor([0, 1, 0, 0, 0, 0], dtype=torch.bool), feedback=feedback)


def _algorithm(name, tiny, toolworld, overrides=(), run=None):
    model, tok = tiny
    algo = build_algorithm(load_config(None, [f"algorithm.name={name}", *overrides]))
    algo.setup(policy=model, tokenizer=tok, env=toolworld, run=run)
    return algo


def test_opsd_context_is_the_reference_answer(toolworld, tiny):
    algo = _algorithm("opsd", tiny, toolworld)
    batch = _hand_batch(toolworld)
    ctx = algo.build_context(batch, 1)
    assert ctx.privileged == [f"Reference answer: {toolworld.reference(t)}" for t in batch.tasks]


def test_sdpo_context_feedback_sibling_and_mask(toolworld, tiny):
    algo = _algorithm("sdpo", tiny, toolworld)
    batch = _hand_batch(toolworld)
    texts = algo.build_context(batch, 1).privileged
    success_call = batch.completions[1]
    assert "Parameter 'date' has the wrong value." in texts[0] and success_call in texts[0] and "bad0" in texts[0]
    assert "Missing parameter 'city'." in texts[2] and success_call in texts[2]
    assert texts[1] is None  # the lone success is not reprompted with itself by default
    assert texts[3:] == [None, None, None]  # a group without success: masked out of distillation
    algo = _algorithm("sdpo", tiny, toolworld, ["algorithm.sdpo.reprompt_lone_success=true"])
    texts = algo.build_context(batch, 1).privileged
    assert texts[1] is not None and success_call in texts[1]


def test_skill_sd_learns_skills_from_successes_and_retrieves_them(toolworld, tiny, tmp_path):
    from lopd.runs import RunDir

    algo = _algorithm("skill_sd", tiny, toolworld, run=RunDir(tmp_path))
    batch = _hand_batch(toolworld)
    ctx = algo.build_context(batch, 1)
    assert ctx.privileged == [None] * 6  # an empty library gives no context
    metrics = algo.remember(batch, 1)
    assert metrics["context/skills"] == 1  # one success -> one skill; failures teach nothing
    texts = algo.build_context(batch, 2).privileged
    assert all(t is not None and batch.completions[1] in t for t in texts[:3])
    algo.remember(batch, 2)
    assert algo.library.size == 1  # deduplicated
    # the library persists in the run directory and a resume forgets skills from redone steps
    again = _algorithm("skill_sd", tiny, toolworld, run=RunDir(tmp_path))
    assert again.library.size == 1
    again.load_state_dict({}, 0)
    assert again.library.size == 0


def test_self_distillation_masks_trajectories_without_context(toolworld, tiny):
    algo = _algorithm("sdpo", tiny, toolworld)
    s, t = _pair(B=6, T=3)
    batch = _hand_batch(toolworld)
    ctx = algo.build_context(batch, 1)
    from lopd.update import whole_batch

    loss, metrics = whole_batch(algo.distill_terms(batch, ctx, s, t))
    per = token_divergence(s, t, "full")
    keep = torch.tensor([c is not None for c in ctx.privileged], dtype=torch.float64)[:, None]
    assert loss.item() == pytest.approx(((per * keep).sum() / (keep.sum() * 3)).item())
    assert metrics["context/coverage"] == pytest.approx(2 / 6)


def test_task_type_is_frozen_dataclass():
    t = Task("x", ({"role": "user", "content": "hi"},), None)
    with pytest.raises(Exception):
        t.id = "y"


def test_the_hybrid_policy_gradient_reaches_the_student(toolworld):
    """distill.coef = 0, pg_weight = 1: a self-distillation method's update is exactly GRPO's (a no-grad
    log-prob cached for a metric once hid the policy gradient from the student)."""
    from conftest import rollouts, session_for
    from lopd.models import trainable_parameters
    from lopd.update import update

    common = ["rollout.tasks_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=32"]
    grpo = session_for(["algorithm.name=grpo", *common], env=toolworld)
    hybrid = session_for(["algorithm.name=opsd", "algorithm.distill.coef=0.0", "algorithm.distill.pg_weight=1.0",
                          *common], env=toolworld)
    batch = rollouts(grpo, list(toolworld.tasks("train")[:2]), [1.0, 0.0, 0.0, 1.0] * 2)
    after = []
    for s in (grpo, hybrid):
        s.optimizer = torch.optim.SGD(trainable_parameters(s.model), lr=1.0)
        s.scheduler = torch.optim.lr_scheduler.LambdaLR(s.optimizer, lambda step: 1.0)
        before = [p.detach().clone() for p in s.model.parameters()]
        update(s.model, s.algorithm, s.optimizer, s.scheduler, batch, s.algorithm.build_context(batch, 1), s.cfg)
        after.append([p.detach() - b for p, b in zip(s.model.parameters(), before)])
    assert any(d.abs().max() > 0 for d in after[1])
    for a, b in zip(*after):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0)


def test_rows_per_group_draws_k_eligible_rows_of_each_group():
    from lopd.algorithms.distill import rows_per_group

    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
    eligible = torch.tensor([1, 1, 1, 1, 0, 1, 1, 1, 0, 0, 0, 1], dtype=torch.bool)
    seen = set()
    for seed in range(40):
        keep = rows_per_group(group, eligible, 2, torch.Generator().manual_seed(seed))
        assert not (keep & ~eligible).any()  # only rows with a context
        assert keep.view(3, 4).sum(-1).tolist() == [2, 2, 1]  # k, k, and the lone eligible row
        assert keep[11]
        seen.add(tuple(torch.nonzero(keep[:4]).flatten().tolist()))
        again = rows_per_group(group, eligible, 2, torch.Generator().manual_seed(seed))
        assert torch.equal(keep, again)  # the generator decides: the same draw on a resume
    assert len(seen) == 6  # every pair of group 0's four rows is drawn: C(4, 2)
    assert rows_per_group(group, eligible, 8, torch.Generator()).equal(eligible)  # k >= G: every eligible row


def test_rows_per_group_keeps_k_contexts_per_group_the_same_at_every_call(toolworld, tiny):
    algo = _algorithm("opsd", tiny, toolworld, ["algorithm.distill.rows_per_group=1"])
    batch = _hand_batch(toolworld)
    ctx = algo.build_context(batch, 1)
    assert ctx.has_context.view(2, 3).sum(-1).tolist() == [1, 1]
    assert [t is not None for t in ctx.privileged] == ctx.has_context.tolist()  # the others' teacher reads nothing
    assert torch.equal(algo.build_context(batch, 1).has_context, ctx.has_context)  # seeded by (train.seed, step)
    draws = {tuple(algo.build_context(batch, step).has_context.tolist()) for step in range(1, 20)}
    assert len(draws) > 1  # a new draw every step
    with pytest.raises(Exception, match="algorithm.distill.rows_per_group.*mask_without_context"):
        _algorithm("opsd", tiny, toolworld, ["algorithm.distill.rows_per_group=1", "algorithm.distill.mask_without_context=false"])


def test_skip_successes_distils_the_failures_only(toolworld, tiny):
    """`distill.skip_successes`: OPSD gives all six rows a context, so the term is the mean over the five failed
    rows' tokens; the success's tokens get no gradient from it; the teacher's gain on the success is still
    measured (its diagnostics read every row with a context)."""
    from lopd.update import whole_batch

    algo = _algorithm("opsd", tiny, toolworld, ["algorithm.distill.skip_successes=true"])
    s, t = _pair(B=6, T=3)
    batch = _hand_batch(toolworld)
    ctx = algo.build_context(batch, 1)
    assert ctx.has_context.all()
    loss, metrics = whole_batch(algo.distill_terms(batch, ctx, s, t))
    per = token_divergence(s, t, "full")  # [6, 3]
    failures = [0, 2, 3, 4, 5]
    assert loss.item() == pytest.approx(per[failures].mean().item(), rel=1e-12)
    assert metrics["context/coverage"] == pytest.approx(1.0)
    gain = (t.logprobs() - s.logprobs()).detach()  # [6, 3]
    assert metrics["context/teacher_gain_success"] == pytest.approx(gain[1].mean().item(), rel=1e-12)
    loss.backward()
    grad = s.hidden.grad  # [6, 3, H]
    assert grad[1].abs().max() == 0 and all(grad[i].abs().max() > 0 for i in failures)
    every, _ = whole_batch(_algorithm("opsd", tiny, toolworld).distill_terms(batch, ctx, s, t))  # the default
    assert every.item() == pytest.approx(per.mean().item(), rel=1e-12)

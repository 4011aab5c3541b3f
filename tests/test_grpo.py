"""A GRPO update changes the trained parameters and nothing else."""

import copy

import pytest
import torch

from conftest import rollouts, session_for
from lopd.models import trainable_parameters
from lopd.update import update


def _session(toolworld, overrides, lora: bool):
    return session_for(["rollout.tasks_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=40",
                        "optim.lr=1e-2", f"model.lora.enabled={str(lora).lower()}", *overrides], env=toolworld)


def _batch(s, env):
    return rollouts(s, list(env.tasks("train")[:4]), [1.0, 0.0] * 8)  # mixed groups: non-zero advantages


def _update(s, batch):
    return update(s.model, s.algorithm, s.optimizer, s.scheduler, batch, s.algorithm.build_context(batch, 1), s.cfg)


@pytest.mark.parametrize("lora", [False, True])
def test_grpo_step_changes_trained_parameters_and_nothing_else(toolworld, lora):
    s = _session(toolworld, ["algorithm.pg.kl_coef=0.1"], lora)
    model, frozen = s.model, s.algorithm.initial_policy
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    if lora:
        assert trained and all("lora_" in n for n in trained)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    frozen_before = copy.deepcopy(frozen.model.state_dict()) if not lora else None
    metrics = _update(s, _batch(s, toolworld))
    assert metrics["optim/grad_norm"] > 0 and "loss/kl_ref" in metrics
    after = dict(model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert changed and changed <= trained
    if not lora:
        assert changed == trained
    else:  # B starts at zero, so the first step moves every B (A's gradient is B^T ... = 0)
        assert {n for n in trained if "lora_B" in n} <= changed
    if lora:  # the reference is the adapter-disabled model: its weights are exactly the originals
        base = {n: p for n, p in model.named_parameters() if "lora_" not in n}
        assert all(torch.equal(before[n], p.detach()) for n, p in base.items())
    else:
        for k, v in frozen.model.state_dict().items():
            assert torch.equal(v, frozen_before[k])


def test_zero_advantage_batch_gives_zero_policy_gradient(toolworld):
    s = _session(toolworld, [], lora=False)
    batch = _batch(s, toolworld)
    batch.rewards = torch.ones(len(batch))
    before = [p.detach().clone() for p in s.model.parameters()]
    metrics = _update(s, batch)
    assert metrics["optim/grad_norm"] == 0
    assert all(torch.equal(b, p) for b, p in zip(before, s.model.parameters()))


def test_gradient_accumulation_equals_one_big_batch(toolworld):
    """micro_batch_size only changes memory, never the update (token-mean weighting is exact)."""
    results = []
    for micro in (64, 3):
        s = _session(toolworld, [f"train.micro_batch_size={micro}"], lora=False)
        s.optimizer = torch.optim.SGD(trainable_parameters(s.model), lr=0.1)
        s.scheduler = torch.optim.lr_scheduler.LambdaLR(s.optimizer, lambda step: 1.0)
        torch.manual_seed(5)
        _update(s, _batch(s, toolworld))
        results.append([p.detach().clone() for p in s.model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)

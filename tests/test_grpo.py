"""A GRPO update changes the trained parameters and nothing else."""

import copy

import pytest
import torch

from lopd.algorithms import build_algorithm
from lopd.config import load_config
from lopd.models import FrozenView, load_policy, trainable_parameters
from lopd.train import collect_rollouts, Timer, update


def _setup(overrides, lora: bool):
    cfg = load_config(None, ["rollout.tasks_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=40",
                             "optim.lr=1e-2", f"model.lora.enabled={str(lora).lower()}", *overrides])
    torch.manual_seed(0)
    model, tok = load_policy(cfg.model)
    return cfg, model, tok


def _batch(cfg, model, tok, env):
    batch = collect_rollouts(model, tok, env, list(env.tasks("train")[:4]), cfg, Timer())
    batch.rewards = torch.tensor([1.0, 0.0] * (len(batch) // 2))  # mixed groups: non-zero advantages
    return batch


@pytest.mark.parametrize("lora", [False, True])
def test_grpo_step_changes_trained_parameters_and_nothing_else(toolworld, lora):
    cfg, model, tok = _setup(["algorithm.pg.kl_coef=0.1"], lora)
    algo = build_algorithm(cfg)
    frozen = FrozenView(model)
    algo.setup(reference=frozen, policy=model, tokenizer=tok, env=toolworld)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    if lora:
        assert trained and all("lora_" in n for n in trained)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    frozen_before = copy.deepcopy(frozen.model.state_dict()) if not lora else None
    opt = torch.optim.AdamW(trainable_parameters(model), lr=cfg.optim.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    batch = _batch(cfg, model, tok, toolworld)
    metrics = update(model, algo, tok, opt, sched, batch, algo.build_context(batch), cfg)
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
    cfg, model, tok = _setup([], lora=False)
    algo = build_algorithm(cfg)
    batch = _batch(cfg, model, tok, toolworld)
    batch.rewards = torch.ones(len(batch))
    opt = torch.optim.SGD(trainable_parameters(model), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = update(model, algo, tok, opt, sched, batch, algo.build_context(batch), cfg)
    assert metrics["optim/grad_norm"] == 0
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_gradient_accumulation_equals_one_big_batch(toolworld):
    """micro_batch_size only changes memory, never the update (token-mean weighting is exact)."""
    results = []
    for micro in (64, 3):
        cfg, model, tok = _setup([f"train.micro_batch_size={micro}"], lora=False)
        algo = build_algorithm(cfg)
        torch.manual_seed(5)
        batch = _batch(cfg, model, tok, toolworld)
        opt = torch.optim.SGD(trainable_parameters(model), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        update(model, algo, tok, opt, sched, batch, algo.build_context(batch), cfg)
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)

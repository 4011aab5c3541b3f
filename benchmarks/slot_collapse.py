"""Does one LOPD update make every latent slot the same? (RESULTS.md section 4, "which part stops LOPD".)

On the tiny policy and ToolWorld: fill the experience bank with one batch, retrieve for a second, and measure
how alike the composer's additions to the slots are (`context/slot_cosine`: the mean pairwise cosine over the
slots that lie over a context, 1 = one vector for every slot) before and after one update, for learned
queries and `token_queries`, at three composer learning rates. The gate starts at 0.1 so the additions have a
direction to compare.

    python benchmarks/slot_collapse.py            # about a minute per row on one core
"""

from __future__ import annotations

import tempfile

import torch

from lopd.config import load_config
from lopd.envs.toolworld import ToolWorld, ToolWorldConfig
from lopd.latent.composer import slot_cosine
from lopd.session import build
from lopd.update import update
from lopd.rollout import collect


def rollouts(session, tasks, rewards):
    """A batch of the session's own rollouts of `tasks`, with `rewards` in place of the env's verdicts."""
    batch = collect(session.model, session.tokenizer, session.env, tasks, session.cfg.rollout)
    batch.rewards = torch.tensor(rewards, dtype=torch.float32)[: len(batch)]
    batch.success = batch.rewards > 0.5
    return batch


def alikeness(algorithm, batch, ctx) -> float:
    with torch.no_grad():
        under = algorithm.tokens_under_slots(batch.tasks, ctx.privileged)  # [B, K, H]: zeros where no slot lies
        values = algorithm.compose(ctx, under=under if algorithm.composer.token_in is not None else None)
        present = (under.abs().sum(-1) > 0) & ctx.has_context[:, None]  # [B, K]
        return float(slot_cosine(values, present).nanmean())


def main() -> None:
    env = ToolWorld(ToolWorldConfig(seed=0))
    tasks = list(env.tasks("train")[:4])
    print("| queries | composer lr | slot cosine before | after one update |\n|---|---:|---:|---:|")
    for token in (False, True):
        for lr in (1e-2, 1e-3, 1e-4):
            overrides = [f"run.dir={tempfile.mkdtemp(prefix='slot-collapse-')}", "algorithm.name=lopd",
                         "rollout.tasks_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=40",
                         "algorithm.lopd.latent_tokens=256", "algorithm.lopd.gate_init=0.1",
                         f"algorithm.lopd.composer_lr={lr}", f"algorithm.lopd.token_queries={str(token).lower()}",
                         "train.threads=1"]
            s = build(load_config(None, overrides), env=env)
            torch.manual_seed(3)
            s.algorithm.remember(rollouts(s, tasks, [1.0, 0.0] * 8), 1)
            batch = rollouts(s, tasks, [1.0, 0.0] * 8)  # every group mixed
            ctx = s.algorithm.build_context(batch, 2)
            before = alikeness(s.algorithm, batch, ctx)
            update(s.model, s.algorithm, s.optimizer, s.scheduler, batch, ctx, s.cfg)
            print(f"| {'token' if token else 'learned'} | {lr:g} | {before:.3f} | {alikeness(s.algorithm, batch, ctx):.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()

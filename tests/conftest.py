import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# `make test` runs the suite in pytest-xdist workers. Each worker gets its share of the cores, and so does
# every process it starts (OMP_NUM_THREADS is inherited): two workers of 2 threads on 2 cores spin-wait on
# each other. Runs that are compared bit for bit all use this one thread count (`small_overrides`).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, (os.cpu_count() or 1) // WORKERS)
if WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(THREADS)
    torch.set_num_threads(THREADS)


@pytest.fixture(scope="session")
def tiny():
    """The bundled tiny policy and its tokenizer (float32, CPU)."""
    from lopd.config import ModelConfig
    from lopd.models import load_policy

    torch.manual_seed(0)
    return load_policy(ModelConfig(name="tiny"))


@pytest.fixture(scope="session")
def toolworld():
    from lopd.envs.toolworld import ToolWorld, ToolWorldConfig

    return ToolWorld(ToolWorldConfig(seed=0))


def small_overrides(run_dir, **extra) -> list[str]:
    """A few-second training run on the tiny policy."""
    items = {
        "run.dir": str(run_dir), "run.checkpoint_every": 2, "run.progress": "false",
        "rollout.tasks_per_step": 2, "rollout.group_size": 4, "rollout.max_new_tokens": 48,
        "train.max_rollouts": 32, "eval.every_rollouts": 16, "eval.max_tasks": 4, "optim.lr": 1e-3,
        "env.toolworld.n_train": 40, "env.toolworld.n_test": 8, "env.toolworld.n_transfer": 8,
        "train.threads": THREADS,  # bit-identical comparisons need the same thread count in every process
    }
    items.update(extra)
    return [f"{k}={v}" for k, v in items.items()]


def session_for(overrides=(), env=None, run_dir=None):
    """A wired training session (`lopd.session.build`) on the tiny policy, seeded; its run directory (where
    LOPD's bank and Skill-SD's library live) is `run_dir` or a fresh temporary folder."""
    import tempfile

    from lopd.config import load_config
    from lopd.session import build

    items = list(overrides) + [f"run.dir={run_dir if run_dir is not None else tempfile.mkdtemp(prefix='lopd-test-')}"]
    return build(load_config(None, items), env=env)


def rollouts(session, tasks, rewards=None):
    """One batch of real rollouts of `tasks` from the session's policy; `rewards` overrides the env's
    verdicts (e.g. mixed groups, so advantages are non-zero)."""
    from lopd.rollout import collect

    batch = collect(session.model, session.tokenizer, session.env, tasks, session.cfg.rollout)
    if rewards is not None:
        batch.rewards = torch.tensor(rewards, dtype=torch.float32)[: len(batch)]
        batch.success = batch.rewards > 0.5
    return batch

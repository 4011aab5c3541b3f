import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


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
        "train.threads": 2,  # bit-identical comparisons need the same thread count in every process
    }
    items.update(extra)
    return [f"{k}={v}" for k, v in items.items()]

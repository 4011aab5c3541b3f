"""lopd: Latent On-Policy Self-Distillation (and GRPO, OPSD, SDPO, Skill-SD) for LLM agents.

    from lopd import load_config, train, evaluate, Env, Task, Score

    cfg = load_config("lopd", ["train.max_rollouts=512"])     # a bundled config name or a YAML path
    run_dir = train(cfg, env=MyEnv())                          # or env.name=my.module:MyEnv in cfg
    results = evaluate(run_dir, splits=["test"])               # the student alone, per split

docs/own_env.md: your own task; docs/method.md: the method and its formulas; docs/architecture.md: the code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["Env", "Score", "Task", "evaluate", "load_config", "train"]

if TYPE_CHECKING:
    from lopd.envs.base import Env, Score, Task


def __getattr__(name: str):  # lazy: `import lopd` stays cheap, and the CLI imports what it needs
    from lopd.quiet import silence_third_party

    if name in ("Env", "Score", "Task"):
        from lopd.envs import base

        return getattr(base, name)
    if name == "load_config":
        from lopd.config import load_config

        return load_config
    if name == "train":
        from lopd.loop import train

        silence_third_party()  # the API shows what the CLI shows: no Hugging Face progress bars
        return train
    if name == "evaluate":
        from lopd.evaluation import evaluate

        silence_third_party()
        return evaluate
    raise AttributeError(f"module 'lopd' has no attribute {name!r}")

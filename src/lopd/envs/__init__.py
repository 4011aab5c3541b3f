"""Task environments by name."""

from __future__ import annotations

from lopd.envs.base import DataError, Env, Score, Task
from lopd.envs.acebench import ACEBench
from lopd.envs.acebench_agent import ACEBenchAgent
from lopd.envs.bfcl import BFCL
from lopd.envs.humaneval import HumanEval
from lopd.envs.toolworld import ToolWorld
from lopd.envs.toolworld_episodes import ToolWorldEpisodes
from lopd.errors import ConfigError

ENVS = {
    "toolworld": lambda cfg: ToolWorld(cfg.toolworld),
    "toolworld_episodes": lambda cfg: ToolWorldEpisodes(cfg.toolworld),
    "bfcl": lambda cfg: BFCL(cfg.bfcl),
    "acebench": lambda cfg: ACEBench(cfg.acebench),
    "acebench_agent": lambda cfg: ACEBenchAgent(cfg.acebench),
    "humaneval": lambda cfg: HumanEval(cfg.humaneval),
}


def build_env(cfg) -> Env:
    """An env from an `EnvConfig`."""
    if cfg.name not in ENVS:
        raise ConfigError(f"env.name: '{cfg.name}' is not one of {', '.join(sorted(ENVS))}")
    return ENVS[cfg.name](cfg)


__all__ = ["DataError", "ENVS", "Env", "Score", "Task", "build_env"]

"""Algorithms by name. Each is one small file; the training loop looks them up here."""

from __future__ import annotations

from lopd.algorithms.base import Algorithm, Context
from lopd.algorithms.grpo import GRPO
from lopd.algorithms.lopd import LOPD, LOPDText
from lopd.algorithms.opsd import OPSD
from lopd.algorithms.sdpo import SDPO
from lopd.algorithms.skill_sd import SkillSD
from lopd.errors import ConfigError

REGISTRY: dict[str, type[Algorithm]] = {cls.name: cls for cls in [GRPO, OPSD, SDPO, SkillSD, LOPD, LOPDText]}


def build_algorithm(cfg) -> Algorithm:
    name = cfg.algorithm.name
    if name not in REGISTRY:
        raise ConfigError(f"algorithm.name: '{name}' is not one of {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name](cfg)


__all__ = ["Algorithm", "Context", "REGISTRY", "build_algorithm"]

"""`Choice`: the base of every enumerated config value (lopd.config, the envs' own settings)."""

from __future__ import annotations

import enum


class Choice(str, enum.Enum):
    """A config choice: a str enum that prints as its value (`f"{cfg.algorithm.name}"` is "grpo"). Every
    config value below `load_config` is its enum member, so no code needs `.value` or re-coercion; being a
    str, a member also equals its value ("token" == Aggregation.token)."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__

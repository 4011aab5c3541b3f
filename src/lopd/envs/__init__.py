"""Task environments: the bundled ones by name, and your own by import path.

    env.name=toolworld                                  a bundled env (its settings: env.toolworld.*)
    env.name=mypackage.tasks:UnitEnv                    a class or factory in an importable module
    env.name=examples/unit_converter.py:UnitConverter   ... or in a Python file (relative to the cwd)
    env.options.seed=3                                  keyword arguments for that class or factory

A plugin env only has to satisfy the `Env` protocol of `lopd.envs.base` (docs/own_env.md): `tasks(split)`
and `score(task, completion)`, plus `reference(task)` for OPSD and `step`/`score_episode` for multi-turn
episodes. Its import path is part of the run's config.yaml, so `lopd train RUN_DIR` resumes it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable

from lopd.envs.acebench import ACEBench
from lopd.envs.acebench_agent import ACEBenchAgent
from lopd.envs.base import DataError, Env, Score, Task
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
    """An env from an `EnvConfig`: a bundled name, or `module:attribute` called with `env.options`."""
    if ":" not in cfg.name:
        if cfg.name not in ENVS:
            raise ConfigError(f"env.name: '{cfg.name}' is not one of {', '.join(sorted(ENVS))}, nor an import path "
                              f"'package.module:ClassOrFactory' or 'path/to/file.py:ClassOrFactory' (docs/own_env.md)")
        return ENVS[cfg.name](cfg)
    factory = import_attribute(cfg.name, "env.name")
    options = dict(cfg.options or {})
    try:
        env = factory(**options)
    except TypeError as e:
        params = _parameters(factory)
        raise ConfigError(f"env.options: {cfg.name} does not accept {sorted(options)} ({e}); it takes "
                          f"{params or 'no arguments'}") from None
    return check_env(env, cfg.name)


def import_attribute(path: str, key: str) -> Callable[..., Any]:
    """The object `module:attribute` (or `file.py:attribute`) names; ConfigError naming `key` otherwise."""
    module_name, _, attribute = path.rpartition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{key}: '{path}' is not of the form 'package.module:ClassOrFactory'")
    if module_name.endswith(".py"):
        file = Path(module_name)
        if not file.is_file():
            raise ConfigError(f"{key}: '{path}': no such file {file.resolve()}")
        spec = importlib.util.spec_from_file_location(f"lopd_plugin_{file.stem}", file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[spec.name]
            raise ConfigError(f"{key}: importing {file} raised {type(e).__name__}: {e}") from None
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:  # as `python -m` would: the cwd is importable
            sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            raise ConfigError(f"{key}: cannot import module '{module_name}' ({e}; is it installed or in the "
                              f"current directory?)") from None
        except Exception as e:
            raise ConfigError(f"{key}: importing module '{module_name}' raised {type(e).__name__}: {e}") from None
    if not hasattr(module, attribute):
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise ConfigError(f"{key}: module '{module_name}' has no attribute '{attribute}' "
                          f"(it has: {', '.join(public[:12]) or 'nothing public'})")
    target = getattr(module, attribute)
    if not callable(target):
        raise ConfigError(f"{key}: '{path}' is a {type(target).__name__}, not a class or factory")
    return target


REQUIRED = ("tasks", "score")


def check_env(env: Any, where: str) -> Env:
    """`env` if it satisfies the Env protocol (at least `tasks` and `score`, or `step` and `score_episode`
    for a multi-turn env); ConfigError saying what is missing otherwise. A missing `name` is set to the
    class's name."""
    needed = ("tasks", "step", "score_episode") if hasattr(env, "step") else REQUIRED
    missing = [m for m in needed if not callable(getattr(env, m, None))]
    if missing:
        raise ConfigError(f"env.name: '{where}' built a {type(env).__name__}, which is not an Env: it has no "
                          f"method {', '.join(missing)} (see lopd.envs.base.Env and docs/own_env.md)")
    if not isinstance(getattr(env, "name", None), str):
        try:
            env.name = type(env).__name__
        except AttributeError:
            pass
    return env


def _parameters(factory) -> str:
    try:
        return ", ".join(p for p in inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        return ""


__all__ = ["DataError", "ENVS", "Env", "Score", "Task", "build_env", "check_env", "import_attribute"]

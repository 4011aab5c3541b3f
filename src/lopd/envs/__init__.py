"""Task environments: the bundled ones by name, and your own by import path.

    env.name=toolworld                                  a bundled env (its settings: env.toolworld.*)
    env.name=mypackage.tasks:UnitEnv                    a class or factory in an importable module
    env.name=examples/unit_converter.py:UnitConverter   ... or in a Python file (recorded as its absolute path)
    env.options.seed=3                                  keyword arguments for that class or factory

A plugin env only has to satisfy the `Env` protocol of `lopd.envs.base` (docs/own_env.md): `tasks(split)`
and `score(task, completion)`, plus `reference(task)` for OPSD and `step`/`score_episode` for multi-turn
episodes. What built the env is part of the run's config.yaml (`env.name`, `env.options`), in a form that
resumes from any working directory: a module path as is, a file as its absolute path, an object given to
`lopd.train(cfg, env=...)` as its class's home (`object_env_name`). A class defined in a script's
`__main__` (or inside a function) has no home another process can import: its run records it as
`__main__:Class`, and only that script can resume it, by passing the object again.
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

ENVS = {  # name -> (class, the EnvConfig section it is built from)
    "toolworld": (ToolWorld, "toolworld"),
    "toolworld_episodes": (ToolWorldEpisodes, "toolworld"),
    "bfcl": (BFCL, "bfcl"),
    "acebench": (ACEBench, "acebench"),
    "acebench_agent": (ACEBenchAgent, "acebench"),
    "humaneval": (HumanEval, "humaneval"),
}
PLUGIN_PREFIX = "lopd_plugin_"  # the module name a `file.py:Class` env is imported under


def build_env(cfg) -> Env:
    """An env from an `EnvConfig`: a bundled name, or `module:attribute` called with `env.options`."""
    if ":" not in cfg.name:
        if cfg.name not in ENVS:
            raise ConfigError(f"env.name: '{cfg.name}' is not one of {', '.join(sorted(ENVS))}, nor an import path "
                              f"'package.module:ClassOrFactory' or 'path/to/file.py:ClassOrFactory' (docs/own_env.md)")
        kind, section = ENVS[cfg.name]
        return kind(getattr(cfg, section))
    if not importable(cfg.name):
        cls = cfg.name.rpartition(":")[2].rpartition(".")[2]
        raise ConfigError(f"env.name: '{cfg.name}' is a class defined in a script's __main__ (or inside a function), "
                          f"which no other process can import: pass the object from that script again "
                          f"(`lopd.train(cfg, env={cls}(...))`, `lopd.evaluate(run_dir, env={cls}(...))`), or move "
                          f"the class into a module or file and set env.name=path/file.py:{cls}")
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
        spec = importlib.util.spec_from_file_location(f"{PLUGIN_PREFIX}{file.stem}", file)
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


def importable(name: str) -> bool:
    """False for an env recorded from a class with no importable home (`__main__:Class`, a class defined
    inside a function); True for a bundled name or an import path."""
    module, _, attribute = name.rpartition(":")
    return module != "__main__" and "<locals>" not in attribute


def resolved_env_name(name: str) -> str:
    """`env.name` as a run records it: `path/file.py:Class` with the file's absolute path (so the run resumes
    from any working directory); a bundled name or `module:Class` as is."""
    module, _, attribute = name.rpartition(":")
    if module.endswith(".py") and not Path(module).is_absolute():
        return f"{Path(module).resolve()}:{attribute}"
    return name


def object_env_name(env: Any, configured: str) -> str:
    """What built `env`, an object given to `lopd.train`/`lopd.evaluate`, as an `env.name`: a bundled env's
    name (`configured` if that names the same class), `module:Class` for a class in an importable module,
    `/abs/file.py:Class` for one imported from a file (`file.py:Class`), and `__main__:Class` (or
    `module:f.<locals>.Class`) for a class with no importable home, which `build_env` refuses to rebuild."""
    cls = type(env)
    bundled = [name for name, (kind, _) in ENVS.items() if kind is cls]
    if bundled:
        return configured if configured in bundled else bundled[0]
    module = sys.modules.get(cls.__module__)
    if cls.__module__.startswith(PLUGIN_PREFIX) and getattr(module, "__file__", None):
        return f"{Path(module.__file__).resolve()}:{cls.__qualname__}"
    return f"{cls.__module__}:{cls.__qualname__}"


def record_bundled_settings(env: Any, cfg) -> None:
    """A bundled env object's own settings (its `config`) into `cfg`'s section for it (`env.toolworld`, ...),
    so the run directory says which tasks it trained on."""
    kind, section = ENVS.get(cfg.name, (None, None))
    if kind is type(env) and isinstance(getattr(env, "config", None), type(getattr(cfg, section))):
        setattr(cfg, section, env.config)


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


__all__ = ["DataError", "ENVS", "Env", "Score", "Task", "build_env", "check_env", "import_attribute", "importable",
           "object_env_name", "resolved_env_name"]

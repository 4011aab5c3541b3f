"""A run wired together, and a run directory opened to be read.

    session = build(cfg)          env, policy + tokenizer, algorithm (its teachers, bank, composer), AdamW,
                                  rollout engine, run directory (locked; nothing written yet)
    state = restore(session)      the newest checkpoint that verifies, or a fresh `RunState`

and the small helpers those need: the device, the env's splits as one-line errors, the step's tasks and
the groups' sampling seeds (functions of the config and the step alone).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from lopd import dist, fsdp
from lopd.algorithms import REGISTRY, Algorithm, build_algorithm
from lopd.dist import World
from lopd.envs import Env, Task, build_env, object_env_name, record_bundled_settings, resolved_env_name
from lopd.errors import ConfigError, LopdError
from lopd.models import copies_of, load_policy, trainable_parameters
from lopd.prompts import encode_prompt
from lopd.runs import RunDir, refuse_another_run, run_dir_for
from lopd.schema import Config, RolloutEngine
from lopd.seeding import seed_everything
from lopd.tokens import set_prompt_sharing


@dataclass
class RunState:
    step: int = 0  # optimizer steps taken (one per rollout batch)
    rollouts: int = 0  # sampled trajectories so far: the budget
    tokens: int = 0  # generated completion tokens so far
    best: dict = field(default_factory=dict)  # split -> best held-out success
    bad_streak: int = 0  # consecutive steps skipped for a non-finite loss or gradient


@dataclass
class Session:
    """Everything a run needs, wired together: what `build` returns and `loop.fit` runs."""

    cfg: Config
    run: RunDir
    device: torch.device
    env: Env
    train_tasks: Sequence[Task]
    model: Any
    tokenizer: Any
    algorithm: Algorithm
    optimizer: torch.optim.Optimizer
    scheduler: Any
    total_steps: int
    world: World = World()  # this process's rank among the data-parallel ones
    engine: Any = None  # what samples the rollouts (lopd.engines: HFGenerate, RolloutSync)
    resumed_from: Path | None = None  # the checkpoint `restore` loaded
    resuming: bool = False  # the run directory existed before this process (a resume or an extension)


def tasks_for_step(tasks: Sequence[Task], step: int, per_step: int, seed: int) -> list[Task]:
    """The step's tasks: consecutive slices of seeded per-epoch permutations (a function of step only)."""
    out = []
    for i in range(step * per_step, (step + 1) * per_step):
        epoch, pos = divmod(i, len(tasks))
        order = torch.randperm(len(tasks), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        out.append(tasks[int(order[pos])])
    return out


def group_seed(seed: int, step: int, task: int) -> int:
    """The sampling seed of one group: a function of (train seed, step, task position) only."""
    return (seed * 1_000_003 + step * 10_007 + task) % 2**62


def build(cfg: Config, env: Env | None = None) -> Session:
    """Wire a run: env, policy, algorithm (with its teachers), optimizer. A config that fails here leaves no
    run behind; once it passes, this process holds the run directory's lock (`RunDir.acquire`) before the
    algorithm opens its files there. `env`: an Env object instead of `cfg.env`."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    set_prompt_sharing(cfg.train.share_prompts)
    per_step = cfg.rollout.tasks_per_step * cfg.rollout.group_size
    total_steps = cfg.train.max_rollouts // per_step
    if total_steps < 1:
        raise ConfigError(f"train.max_rollouts={cfg.train.max_rollouts} is less than one step's rollouts "
                          f"(rollout.tasks_per_step x rollout.group_size = {per_step})")
    world = dist.init(cfg.train.device)
    if cfg.rollout.tasks_per_step % world.size:
        raise ConfigError(f"rollout.tasks_per_step={cfg.rollout.tasks_per_step} does not split over {world.size} "
                          f"ranks (whole sampling groups stay on one rank)")
    device = dist.device_for(world, cfg.train.device)
    seed_everything(cfg.train.seed)
    env, run = bound_run(cfg, env, world)
    check_contract(cfg, env)
    train_tasks = env_tasks(env, cfg.env.train_split, "env.train_split")
    for split in cfg.env.eval_splits:  # fail now, not after an hour, on a bad split name or data file
        env_tasks(env, split, "env.eval_splits")
    if cfg.train.fsdp and world.distributed:
        check_shardable(cfg, env)
    model, tokenizer = load_policy(cfg.model, device)
    if cfg.train.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # Hugging Face checkpoints only in training mode; rollouts switch to eval and back
    algorithm = build_algorithm(cfg)
    if world.main:
        run.acquire()  # before the algorithm opens its bank or library there
    try:
        if not world.main:
            dist.barrier(world)  # rank 0 has opened (and repaired) the run's files: now read them
        algorithm.setup(policy=model, tokenizer=tokenizer, env=env, run=run, device=device)
        if world.main:
            dist.barrier(world)
    except BaseException:
        run.release()
        raise
    if cfg.train.fsdp and world.distributed:
        for module in [model, *copies_of(model)]:  # after setup: the teachers' weight copies exist now
            fsdp.shard(module, device)
    groups = [{"params": trainable_parameters(model), "lr": cfg.optim.lr}] + algorithm.param_groups()
    optimizer = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                  weight_decay=cfg.optim.weight_decay, fused=cfg.optim.fused or None)
    warmup = max(1, cfg.optim.warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    from lopd.engines import rollout_engine

    engine = rollout_engine(cfg, model, tokenizer, env, encode_prompt(tokenizer, train_tasks[0].messages))
    return Session(cfg, run, device, env, train_tasks, model, tokenizer, algorithm, optimizer, scheduler, total_steps,
                   world, engine)


def bound_run(cfg: Config, env: Env | None, world: World) -> tuple[Env, RunDir]:
    """The env and the run directory, bound to each other: what built the env goes into `cfg.env.name` (a
    file as its absolute path, a given object's class: `given_env`), and an existing run directory (a resume
    or an extension) refuses another env, or any key that may not change on resume, before anything is
    written (`runs.refuse_another_run`)."""
    cfg.env.name = resolved_env_name(cfg.env.name)
    if env is not None:
        env = given_env(cfg, env)
    run = RunDir(run_dir_for(cfg), writer=world.main)
    if run.exists():
        refuse_another_run(run, cfg)
    return (env if env is not None else build_env(cfg.env)), run


def check_contract(cfg: Config, env: Env) -> None:
    """What the configured algorithm needs of the env beyond `tasks` and `score` (`Algorithm.env_methods`,
    e.g. OPSD's `reference(task)`, optional everywhere else), refused before the first step."""
    for method, why in REGISTRY[cfg.algorithm.name].env_methods.items():
        if not callable(getattr(env, method, None)):
            raise ConfigError(f"algorithm.name: {cfg.algorithm.name} needs env.{method}(task) ({why}), and "
                              f"{type(env).__name__} has no {method} method: add one (docs/own_env.md) or train "
                              f"with another algorithm")


def check_shardable(cfg: Config, env: Env) -> None:
    """What `train.fsdp` does not cover, refused before the first step (see lopd/fsdp.py)."""
    if cfg.model.lora.enabled:
        raise ConfigError("train.fsdp: shards full fine-tunes; a LoRA run keeps its base weights replicated "
                          "(set model.lora.enabled=false, or train.fsdp=false)")
    if cfg.rollout.engine != RolloutEngine.hf:
        raise ConfigError("train.fsdp: rollouts must come from the trainer's model (rollout.engine=hf)")
    if hasattr(env, "step"):
        raise ConfigError(f"train.fsdp: {type(env).__name__} is multi-turn; sharded decoding needs single-turn envs")


def env_tasks(env: Env, split: str, key: str) -> Sequence[Task]:
    """`env.tasks(split)`, non-empty; any failure becomes one line naming the config key and the env."""
    try:
        tasks = env.tasks(split)
    except LopdError:
        raise
    except Exception as e:
        known = f" (its splits: {', '.join(env.splits())})" if callable(getattr(env, "splits", None)) else ""
        raise ConfigError(f"{key}: {type(env).__name__}.tasks('{split}') raised {type(e).__name__}: {e}{known}") from None
    if not tasks:
        raise ConfigError(f"{key}: {type(env).__name__} has no tasks in split '{split}'")
    return tasks


def given_env(cfg: Config, env: Env) -> Env:
    """An env object given to `train(cfg, env=...)` or `evaluate`, checked, and what built it recorded in
    the config (`env.name`: `object_env_name`; a bundled env's own settings in its section), so the run
    directory is bound to its task: `lopd train RUN_DIR` rebuilds it, or refuses to when its class has no
    importable home (a script's `__main__`), and a resume with another env is refused."""
    from lopd.envs import check_env

    check_env(env, type(env).__name__)
    cfg.env.name = object_env_name(env, cfg.env.name)
    record_bundled_settings(env, cfg.env)
    return env


def restore(session: Session) -> RunState:
    """The state of the newest checkpoint that verifies (weights, optimizer, scheduler, RNG, the algorithm's
    state), or a fresh one; either way, what the run wrote after that point is removed, the metrics rows are
    the checkpoint's own (so no torn or lost row survives), and stale temporary folders are gone."""
    run, state, world = session.run, RunState(), session.world
    if world.main:
        run.remove_stale()
    checkpoint = dist.broadcast(world, run.latest_checkpoint(warn_about=True) if world.main else None)
    saved: dict = {}
    if checkpoint is not None:
        saved = run.load_checkpoint(checkpoint, session.model, session.optimizer)
        session.scheduler.load_state_dict(saved["scheduler"])
        state = RunState(**saved["run"])
    session.algorithm.load_state_dict(saved.get("algorithm", {}), state.step)
    if world.main:
        rows = saved.get("metrics")
        if rows is None:  # a fresh start, or a checkpoint from before checkpoints held their rows
            rows = [r for r in run.read_metrics(warn_about=True) if r["step"] <= state.step] if checkpoint else []
        run.restore_metrics(rows)
        run.remove_after(state.step, state.rollouts)
    session.resumed_from = checkpoint
    dist.barrier(world)
    return state

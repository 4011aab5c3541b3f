"""The one training loop, for every algorithm.

    for each step, until the rollout budget is spent:
        rollout   sample G completions for each of the step's tasks from the current policy
        score     the env gives each a reward, a success flag and a feedback sentence
        context   the algorithm builds what it needs once per batch (advantages, privileged context)
        update    per micro-batch: the student's token stats -> algorithm.loss -> backward; optimizer steps
        remember  the algorithm stores what later batches retrieve (experiences, skills)
        evaluate  held-out splits, every `eval.every_rollouts` rollouts
        save      a checkpoint every `run.checkpoint_every` steps and at the end

Every phase is timed (`time/*`). Algorithms differ only in their own file; nothing here branches on
which one runs, or on whether it uses a teacher, a reference or latent tokens. `lopd train` on an
existing run directory resumes it bit for bit: weights, optimizer, scheduler, RNG states, budget
counters and the algorithm's own state come back from the checkpoint.

In parts, for tests and tools that want the wiring without the loop:
    session = build(cfg)          model, tokenizer, env, algorithm, optimizer, run directory (nothing written)
    state = restore(session)      the latest checkpoint's state, or a fresh one
    fit(session, state)           the loop
`train(cfg)` is the three in a row.

    lopd train --config configs/grpo.yaml train.max_rollouts=2048
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from lopd import dist, failpoints, fsdp, host_memory, microbatch
from lopd.algorithms import Algorithm, Context, build_algorithm
from lopd.dist import World
from lopd.config import Aggregation, AlgorithmName, Config, head_dtype_of, to_yaml
from lopd.envs import Env, Task, build_env
from lopd.errors import ConfigError, LopdError
from lopd.evaluation import evaluate
from lopd.models import load_policy, trainable_parameters
from lopd.prompts import encode_prompt
from lopd.rollout import RolloutBatch, collect
from lopd.run_io import Progress, Terminated, tensorboard_writer, terminated_as_interrupt
from lopd.runs import RunDir, seed_everything
from lopd.tokens import score_completions


@dataclass
class RunState:
    step: int = 0  # optimizer steps taken (one per rollout batch)
    rollouts: int = 0  # sampled trajectories so far: the budget
    tokens: int = 0  # generated completion tokens so far
    best: dict = field(default_factory=dict)  # split -> best held-out success
    bad_streak: int = 0  # consecutive steps skipped for a non-finite loss or gradient


class Timer:
    """Wall-clock seconds per named phase, and the phase's peak resident memory where the kernel can reset
    its high-water mark (Linux). On a GPU each phase ends with a synchronise, so queued kernels are charged
    to the phase that launched them."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.peaks: dict[str, float] = {}
        self.sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        tracked = host_memory.start_phase_peak()
        start = time.perf_counter()
        yield
        self.sync()
        self.seconds[f"time/{phase}"] = self.seconds.get(f"time/{phase}", 0.0) + time.perf_counter() - start
        peak = host_memory.phase_peak_gib() if tracked else None
        if peak is not None:
            key = f"memory/peak_rss_gib/{phase}"
            self.peaks[key] = max(self.peaks.get(key, 0.0), peak)

    @property
    def metrics(self) -> dict[str, float]:
        """`time/<phase>` seconds and `memory/peak_rss_gib/<phase>` GiB, for the row of the step."""
        return {**self.seconds, **self.peaks}


def run_dir_for(cfg: Config) -> Path:
    return Path(cfg.run.dir or f"runs/{AlgorithmName(cfg.algorithm.name).value}_"
                               f"{cfg.env.name.replace(':', '_').replace('.', '_').replace('/', '_')}"
                               f"_seed{cfg.train.seed}")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def tasks_for_step(tasks: Sequence[Task], step: int, per_step: int, seed: int) -> list[Task]:
    """The step's tasks: consecutive slices of seeded per-epoch permutations (a function of step only)."""
    out = []
    for i in range(step * per_step, (step + 1) * per_step):
        epoch, pos = divmod(i, len(tasks))
        order = torch.randperm(len(tasks), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        out.append(tasks[int(order[pos])])
    return out


def update(model, algorithm: Algorithm, optimizer, scheduler, batch: RolloutBatch, ctx: Context,
           cfg: Config, world: World = World()) -> dict[str, float]:
    """(extra + epochs) x minibatches optimizer steps over one rollout batch, with gradient accumulation.

    Data-parallel (`world`): `batch` is this rank's share of the step; minibatches are drawn from the global
    batch, each micro-batch is weighted by the global token (or sequence) count, and gradients are summed
    across ranks before clipping, so every rank takes the step one process would.
    Numerical guard: a micro-batch whose loss is not finite is not backpropagated, and an optimizer step
    whose loss or gradient norm is not finite (on any rank) is skipped (gradients dropped, no step, no
    scheduler step); `health/skipped_steps` and `health/nonfinite_losses` count them."""
    t, temp, head_dtype = cfg.train, cfg.rollout.temperature, head_dtype_of(cfg)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
    epochs = ctx.extra_passes + t.epochs_per_batch
    passes = epochs * t.minibatches
    device = params[0].device
    sharded = fsdp.is_sharded(model)
    first, local_n = world.rank * len(batch), len(batch)  # this rank's rows in the global batch
    kept_prompts = algorithm.kept_prompt_lengths(batch, ctx)  # [F, B] the forwards whose activations are kept
    used = batch.attention
    completion_len = torch.where(used.any(-1), used.shape[1] - used.flip(-1).float().argmax(-1), 0)  # [B] last attended + 1
    max_tokens = t.micro_batch_tokens or microbatch.token_budget(
        model, device, t.memory_budget_gib, int((kept_prompts + completion_len).max()), 1, measure=not sharded)
    sums: dict[str, float] = {}  # weighted by global weights: summed over ranks at the end
    shared = {"health/skipped_steps": 0.0, "optim/grad_norm": 0.0}  # identical on every rank
    bad_losses = 0.0
    for epoch in range(epochs):
        global_n = local_n * world.size
        order = torch.randperm(global_n) if t.minibatches > 1 else torch.arange(global_n)
        for mb_global in order.chunk(t.minibatches):
            mb_index = mb_global[(mb_global >= first) & (mb_global < first + local_n)] - first
            optimizer.zero_grad(set_to_none=True)
            rows, rows_ctx = batch.select(mb_index), ctx.select(mb_index)
            totals = dist.all_sum(world, algorithm.loss_totals(rows, rows_ctx))  # each term's denominator
            forwarded = mb_index[algorithm.live_rows(rows, rows_ctx)] if t.skip_zero_loss_rows else mb_index
            metric_total = dist.all_sum(world, {"w": _weight(batch.select(forwarded), cfg)})["w"]
            finite = True
            micros = microbatch.plan(kept_prompts, completion_len, forwarded, t.micro_batch_size, max_tokens)
            if not micros and len(mb_index):  # no row left to learn from: one row's exactly-zero gradient, so
                micros = [None]  # every parameter the loss reaches gets its 0, as if all rows had run
            if sharded:  # every rank runs as many forwards/backwards: the extra ones weigh nothing
                micros += [None] * (int(dist.all_max(world, len(micros))) - len(micros))
            for micro in micros:
                zero = micro is None
                if zero:
                    micro = mb_index[:1] if len(mb_index) else torch.zeros(1, dtype=torch.long)  # its loss x 0
                mb = batch.select(micro).trimmed().to(device)
                mctx = replace(ctx.select(micro).to(device).for_pass(epoch), totals=totals)
                student = score_completions(model, mb.prompt_ids, mb.prompt_mask, mb.completion_ids,
                                            mb.completion_mask, completion_attention=mb.completion_attention,
                                            temperature=temp, head_dtype=head_dtype)
                loss, metrics = algorithm.loss(mb, mctx, student)  # this micro-batch's share of the minibatch's
                w = 0.0 if zero else _weight(mb, cfg) / metric_total  # its weight in the update's metrics
                good = bool(torch.isfinite(loss.detach()))
                if not good:
                    finite = False
                    bad_losses += 0 if zero else 1  # a zero-weight stand-in repeats a row counted already
                    if not sharded:  # sharded: the backward still runs (its collectives); the step is skipped
                        continue
                if loss.requires_grad:  # a pass may train nothing (a frozen composer's composer-only pass)
                    (loss * 0.0 if zero else loss).backward()
                failpoints.reached("update")
                for k, v in metrics.items() if good else ():  # averaged over micro-batches (by weight) and passes
                    sums[k] = sums.get(k, 0.0) + v * w / passes
            finite = not dist.any_true(world, not finite)
            if sharded:  # FSDP has summed the layers' gradients; the replicated ones are summed here
                dist.sum_gradients(world, fsdp.replicated(params))
                norm = fsdp.clip_grad_norm_(params, max_norm)
            else:
                dist.sum_gradients(world, params)
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            if not finite or not bool(torch.isfinite(norm)):
                optimizer.zero_grad(set_to_none=True)
                shared["health/skipped_steps"] += 1
                continue
            shared["optim/grad_norm"] += float(norm) / passes
            optimizer.step()
            scheduler.step()
            algorithm.after_step()
    sums = dist.all_sum(world, {**sums, "health/nonfinite_losses": bad_losses})
    sums.update(shared)
    sums["optim/lr"] = scheduler.get_last_lr()[0]
    sums.update(algorithm.after_update(sums))
    return sums


def _weight(batch: RolloutBatch, cfg: Config) -> float:
    """A micro-batch's share of its minibatch under the configured aggregation (tokens or sequences)."""
    if Aggregation(cfg.algorithm.aggregation) is Aggregation.token:
        return float(batch.completion_mask.sum())
    return float(len(batch))


def batch_metrics(batch: RolloutBatch, cfg: Config) -> dict[str, float]:
    g = cfg.rollout.group_size
    success = batch.success.float().view(-1, g)  # [tasks, G]
    rewards = batch.rewards.view(-1, g)
    return {
        "reward/mean": float(batch.rewards.mean()),
        "reward/success": float(success.mean()),
        "reward/solved_groups": float((success.max(-1).values > 0).float().mean()),
        "reward/mixed_groups": float((rewards.std(-1) > 0).float().mean()) if g > 1 else 0.0,
        "rollout/length": float(batch.completion_mask.sum(-1).float().mean()),
        "rollout/truncated": float(batch.truncated.float().mean()),
    }


# ------------------------------------------------------------------------------ the run in parts


@dataclass
class Session:
    """Everything a run needs, wired together: what `build` returns and `fit` runs."""

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
    engine: Any = None  # a rollout engine other than HF generate (lopd.engines.RolloutSync), or None
    resumed_from: Path | None = None  # the checkpoint `restore` loaded
    resuming: bool = False  # the run directory existed before this process (a resume or an extension)


def build(cfg: Config, env: Env | None = None) -> Session:
    """Wire a run: env, policy, algorithm (with its teachers), optimizer. A config that fails here leaves no
    run behind; once it passes, this process holds the run directory's lock (`RunDir.acquire`) before the
    algorithm opens its files there. `env`: an Env object instead of `cfg.env`."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
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
    if env is not None:
        record_env(cfg, env)
    else:
        env = build_env(cfg.env)
    train_tasks = env_tasks(env, cfg.env.train_split, "env.train_split")
    for split in cfg.env.eval_splits:  # fail now, not after an hour, on a bad split name or data file
        env_tasks(env, split, "env.eval_splits")
    if cfg.train.fsdp and world.distributed:
        check_shardable(cfg, env)
    model, tokenizer = load_policy(cfg.model, device)
    if cfg.train.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # Hugging Face checkpoints only in training mode; rollouts switch to eval and back
    run = RunDir(run_dir_for(cfg), writer=world.main)
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
        from lopd.teacher import copies_of

        for module in [model, *copies_of(model)]:  # after setup: the teachers' weight copies exist now
            fsdp.shard(module, device)
    groups = [{"params": trainable_parameters(model), "lr": cfg.optim.lr}] + algorithm.param_groups()
    optimizer = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                  weight_decay=cfg.optim.weight_decay, fused=cfg.optim.fused or None)
    warmup = max(1, cfg.optim.warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    from lopd.engines import rollout_engine

    return Session(cfg, run, device, env, train_tasks, model, tokenizer, algorithm, optimizer, scheduler, total_steps,
                   world, rollout_engine(cfg, model, tokenizer))


def check_shardable(cfg: Config, env: Env) -> None:
    """What `train.fsdp` does not cover, refused before the first step (see lopd/fsdp.py)."""
    from lopd.config import RolloutEngine

    if cfg.model.lora.enabled:
        raise ConfigError("train.fsdp: shards full fine-tunes; a LoRA run keeps its base weights replicated "
                          "(set model.lora.enabled=false, or train.fsdp=false)")
    if RolloutEngine(cfg.rollout.engine) is not RolloutEngine.hf:
        raise ConfigError("train.fsdp: rollouts must come from the trainer's model (rollout.engine=hf)")
    if hasattr(env, "step"):
        raise ConfigError(f"train.fsdp: {type(env).__name__} is multi-turn; sharded decoding needs single-turn envs")


def env_tasks(env: Env, split: str, key: str) -> Sequence[Task]:
    """`env.tasks(split)`, non-empty; any failure becomes one line naming the config key and the env."""
    from lopd.errors import LopdError

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


def record_env(cfg: Config, env: Env) -> None:
    """An env object given to `train(cfg, env=...)`: its class's import path goes into the config (so the
    run directory resumes with `lopd train RUN_DIR`), unless it is a bundled env or from `__main__`."""
    from lopd.envs import check_env

    check_env(env, type(env).__name__)
    module = type(env).__module__
    if ":" not in cfg.env.name and not module.startswith("lopd.") and module != "__main__":
        cfg.env.name = f"{module}:{type(env).__qualname__}"


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


def train(cfg: Config, *, env: Env | None = None, stop_after: int | None = None, quiet: bool = False) -> Path:
    """Run (or resume) training; returns the run directory. `stop_after` ends this process after that
    many steps without a final checkpoint, as a crash would (tests use it)."""
    session = build(cfg, env)
    try:
        session.resuming = dist.broadcast(session.world, session.run.exists())
        if session.world.main:
            session.run.config_path.write_text(to_yaml(cfg))
        state = restore(session)
        return fit(session, state, stop_after=stop_after, quiet=quiet)
    finally:
        session.run.release()
        if session.engine is not None:
            session.engine.close()


def fit(session: Session, state: RunState, *, stop_after: int | None = None, quiet: bool = False) -> Path:
    """The loop, from `state` to the end of the budget. How the process ends (finished, crashed and why,
    interrupted) is recorded in the run's status.json; the next start reports it in resumes.log."""
    cfg, run, algorithm, model, world = session.cfg, session.run, session.algorithm, session.model, session.world
    main = world.main  # rank 0 evaluates, checkpoints and logs; every rank trains
    sharded = fsdp.is_sharded(model)  # then every forward is collective: all ranks evaluate, all gather checkpoints
    if main:
        run.begin(session.resumed_from, session.resuming)
        (run.path / "finished").unlink(missing_ok=True)
    purge = state.rollouts + 1 if session.resumed_from is not None else None
    writer = tensorboard_writer(run, cfg, purge_step=purge) if main else None
    history = run.read_metrics() if main else []
    per_group_seeds = cfg.rollout.seed_per_group or world.distributed
    pad, engine = session.tokenizer.pad_token_id, session.engine
    cpu_memory_returned = cfg.train.return_host_memory and session.device.type == "cpu"

    def log(row: dict) -> dict:
        row = {"step": state.step, "rollouts": state.rollouts, "tokens": state.tokens, **row}
        if not main:
            return row
        run.log(row)
        history.append(row)
        if writer is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and "/" in k:
                    writer.add_scalar(k, v, global_step=state.rollouts)
        return row

    def run_eval(timer: Timer) -> dict[str, float]:
        out = {}
        with timer("eval"):
            for split in cfg.env.eval_splits if main or sharded else []:  # sharded: every rank decodes
                result = evaluate(model, session.tokenizer, session.env, split, max_tasks=cfg.eval.max_tasks,
                                  temperature=cfg.eval.temperature, max_new_tokens=cfg.rollout.max_new_tokens,
                                  batch_size=cfg.eval.batch_size, seed=cfg.train.seed, max_turns=cfg.rollout.max_turns)
                if not main:
                    continue
                out.update(result.metrics())
                state.best[split] = max(state.best.get(split, 0.0), result.success)
                (run.path / "samples").mkdir(exist_ok=True)
                with open(run.path / "samples" / f"{split}_step{state.step:06d}.jsonl", "w") as f:
                    f.writelines(json.dumps(s) + "\n" for s in result.samples)
                failpoints.reached("eval")
            dist.barrier(world)  # the other ranks wait for rank 0's evaluation
        return out

    progress = Progress(cfg, session.total_steps, quiet or not cfg.run.progress or not main)
    steps_here = 0
    with terminated_as_interrupt():
        try:
            if state.step == 0:
                timer = Timer()
                log({"kind": "eval", **run_eval(timer), **timer.metrics})
            progress.start(state, history)
            while state.step < session.total_steps:
                timer = Timer()
                step = state.step + 1
                tasks = tasks_for_step(session.train_tasks, state.step, cfg.rollout.tasks_per_step, cfg.train.seed)
                mine = dist.share(tasks, world)  # whole groups: this rank's contiguous block of the step's tasks
                first = world.rank * len(mine)
                seeds = [group_seed(cfg.train.seed, step, first + i) for i in range(len(mine))] if per_group_seeds else None
                engine_metrics: dict[str, float] = {}
                if engine is not None:
                    with timer("sync"):
                        engine_metrics = engine.sync(model, encode_prompt(session.tokenizer, session.train_tasks[0].messages))
                batch = collect(model, session.tokenizer, session.env, mine, cfg.rollout, timer, seeds=seeds,
                                first_group=first, sampler=engine.sample if engine is not None else None)
                if engine is not None:
                    with timer("correct"):
                        engine_metrics.update(engine.correct(model, batch, cfg.train.micro_batch_size or 16,
                                                             head_dtype_of(cfg)))
                failpoints.reached("rollout")
                with timer("context"):
                    ctx = algorithm.build_context(batch, step)
                with timer("update"), host_memory.activations_returned(cpu_memory_returned):
                    metrics = update(model, algorithm, session.optimizer, session.scheduler, batch, ctx, cfg, world)
                everyone = RolloutBatch.concat(dist.gather(world, batch), pad)  # the whole step, in rank order
                with timer("remember"):
                    metrics.update(algorithm.remember(everyone, step))
                failpoints.reached("remember")
                prev = state.rollouts
                state.step = step
                state.rollouts += len(everyone)
                state.tokens += everyone.num_tokens
                state.bad_streak = state.bad_streak + 1 if metrics["health/skipped_steps"] else 0
                row = {"kind": "train", **batch_metrics(everyone, cfg), **dist.all_mean(world, {**ctx.metrics, **engine_metrics}),
                       **metrics}
                if session.device.type == "cuda":
                    row["memory/peak_gib"] = torch.cuda.max_memory_allocated(session.device) / 2**30
                row["memory/peak_rss_gib"] = host_memory.peak_rss_gib()
                every = cfg.eval.every_rollouts
                if state.step == session.total_steps or (every and state.rollouts // every > prev // every):
                    row.update({"kind": "train+eval", **run_eval(timer)})
                pending = None
                due = state.step % cfg.run.checkpoint_every == 0 or state.step == session.total_steps
                if due and (main or sharded):
                    with timer("checkpoint"):
                        gathered = fsdp.checkpoint_state(model, session.optimizer, algorithm) if sharded else None
                        if main:
                            pending = run.save_checkpoint(state.step, model, session.optimizer, {
                                "scheduler": session.scheduler.state_dict(),
                                "algorithm": gathered["algorithm"] if gathered else algorithm.state_dict(),
                                "run": vars(state)}, keep=cfg.run.keep_checkpoints, gathered=gathered)
                full = {"step": state.step, "rollouts": state.rollouts, "tokens": state.tokens, **row, **timer.metrics}
                if pending is not None:
                    pending.finish(history + [full])  # the checkpoint holds its own row ...
                log({**row, **timer.metrics})  # ... which reaches metrics.jsonl before the checkpoint is visible
                if pending is not None:
                    pending.commit()
                failpoints.reached("step.end")
                progress.update(state, row)
                if state.bad_streak >= cfg.train.max_bad_steps:
                    last = run.latest_checkpoint()
                    raise LopdError(f"step {state.step}: {state.bad_streak} steps in a row had a non-finite loss or "
                                    f"gradient and were skipped; stopping. The last good checkpoint is "
                                    f"{last.name if last else 'none'}: change the config (e.g. a lower optim.lr) "
                                    f"and resume with `lopd train {run.path}`")
                steps_here += 1
                if stop_after is not None and steps_here >= stop_after and state.step < session.total_steps:
                    if main:
                        run.end("interrupted", f"stop_after={stop_after} steps")
                    return run.path
        except KeyboardInterrupt as e:
            progress.stop()
            if main:
                run.end("interrupted", "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C")
                print(f"interrupted: resume with `lopd train {run.path}` (from the last checkpoint)")
            raise
        except BaseException as e:
            progress.stop()
            if main:
                run.end("crashed", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                                   f"(at step {state.step + 1})")
            raise
        finally:
            progress.stop()
            if writer is not None:
                writer.close()
    if main:
        from lopd.report import write_run_report

        write_run_report(run.path)
        run.end("finished")
        (run.path / "finished").write_text(str(cfg.train.max_rollouts))  # last: the run is complete
    dist.barrier(world)
    return run.path


def group_seed(seed: int, step: int, task: int) -> int:
    """The sampling seed of one group: a function of (train seed, step, task position) only."""
    return (seed * 1_000_003 + step * 10_007 + task) % 2**62

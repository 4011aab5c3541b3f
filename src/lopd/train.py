"""The one training loop, for every algorithm.

    for each step, until the rollout budget is spent:
        rollout   sample G completions for each of the step's tasks from the current policy
        score     the env gives each a reward, a success flag and a feedback sentence
        context   the algorithm builds what it needs once per batch (advantages, privileged context)
        update    per minibatch: student token stats (+ frozen reference / teacher) -> algorithm.loss
        evaluate  held-out splits, every `eval.every_rollouts` rollouts
        save      a checkpoint every `run.checkpoint_every` steps and at the end

Every phase is timed (`time/*`). Algorithms differ only in their own file; nothing here branches on
which one runs. `lopd train` on an existing run directory resumes it bit for bit: weights, optimizer,
scheduler, RNG states, budget counters and the algorithm's own state come back from the checkpoint.

    lopd train --config configs/grpo.yaml train.max_rollouts=2048
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch

from lopd.algorithms import Algorithm, Context, build_algorithm
from lopd.config import LopdConfig, to_yaml
from lopd.envs import Env, Task, build_env
from lopd.errors import ConfigError
from lopd.evaluate import evaluate
from lopd.models import FrozenView, load_policy, make_teacher, trainable_parameters
from lopd.prompts import encode_prompt
from lopd.rollout import RolloutBatch, collect, left_pad
from lopd.runs import RunDir, seed_everything
from lopd.tokens import score_completions


@dataclass
class RunState:
    step: int = 0  # optimizer steps taken (one per rollout batch)
    rollouts: int = 0  # sampled trajectories so far: the budget
    tokens: int = 0  # generated completion tokens so far
    best: dict = field(default_factory=dict)  # split -> best held-out success


class Timer:
    """Wall-clock seconds per named phase; on a GPU each phase ends with a synchronise, so queued kernels
    are charged to the phase that launched them."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.sync()
        self.seconds[f"time/{phase}"] = self.seconds.get(f"time/{phase}", 0.0) + time.perf_counter() - start


def run_dir_for(cfg: LopdConfig) -> Path:
    return Path(cfg.run.dir or f"runs/{cfg.algorithm.name}_{cfg.env.name}_seed{cfg.train.seed}")


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


def collect_rollouts(model, tokenizer, env: Env, tasks: Sequence[Task], cfg: LopdConfig, timer: Timer) -> RolloutBatch:
    return collect(model, tokenizer, env, tasks, cfg.rollout, timer)


def teacher_stats(teacher, tokenizer, batch: RolloutBatch, contexts: list[str | None] | None, temperature: float,
                  prefix: torch.Tensor | None = None):
    """The self-teacher re-scoring the batch's own completion tokens with its privileged context:
    text contexts go into the prompt (same chat template as the student's), latent ones in front of it."""
    if contexts is None:
        ids, mask = batch.prompt_ids, batch.prompt_mask
    else:
        prompts = [encode_prompt(tokenizer, t.messages, c) for t, c in zip(batch.tasks, contexts)]
        ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    with teacher.active() as model:
        stats = score_completions(model, ids, mask, batch.completion_ids, batch.completion_mask,
                                  completion_attention=batch.completion_attention, temperature=temperature,
                                  prefix_embeds=prefix)
    return stats.weights_detached()  # the head is evaluated later, outside `active()`


def update(model, algorithm: Algorithm, tokenizer, optimizer, scheduler, batch: RolloutBatch, ctx: Context,
           cfg: LopdConfig) -> dict[str, float]:
    """epochs x minibatches optimizer steps over one rollout batch, with gradient accumulation."""
    t, temp = cfg.train, cfg.rollout.temperature
    params = [p for group in optimizer.param_groups for p in group["params"]]
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
    passes = t.epochs_per_batch * t.minibatches
    device = params[0].device
    sums: dict[str, float] = {}
    for _ in range(t.epochs_per_batch):
        order = torch.randperm(len(batch)) if t.minibatches > 1 else torch.arange(len(batch))
        for mb_index in order.chunk(t.minibatches):
            optimizer.zero_grad(set_to_none=True)
            weight_total = _weight(batch.select(mb_index), cfg)
            for micro in mb_index.split(t.micro_batch_size):
                mb, mctx = batch.select(micro).trimmed().to(device), ctx.select(micro).to(device)
                student = score_completions(model, mb.prompt_ids, mb.prompt_mask, mb.completion_ids,
                                            mb.completion_mask, completion_attention=mb.completion_attention,
                                            temperature=temp)
                reference = teacher = None
                if algorithm.uses_reference:
                    with torch.no_grad():
                        reference = teacher_stats(algorithm.reference, tokenizer, mb, None, temp)
                if algorithm.uses_teacher:
                    prefix = algorithm.teacher_prefix(mb, mctx)  # [b, K, H] latent context, or None
                    with torch.set_grad_enabled(prefix is not None and prefix.requires_grad):
                        teacher = teacher_stats(algorithm.teacher, tokenizer, mb, mctx.texts, temp, prefix)
                loss, metrics = algorithm.loss(mb, mctx, student, teacher, reference)
                w = _weight(mb, cfg) / weight_total
                (loss * w).backward()
                for k, v in metrics.items():  # averaged over micro-batches (by weight) and passes
                    sums[k] = sums.get(k, 0.0) + v * w / passes
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            sums["optim/grad_norm"] = sums.get("optim/grad_norm", 0.0) + float(norm) / passes
            optimizer.step()
            scheduler.step()
            if algorithm.teacher is not None:
                algorithm.teacher.after_step()
    sums["optim/lr"] = scheduler.get_last_lr()[0]
    return sums


def _weight(batch: RolloutBatch, cfg: LopdConfig) -> float:
    """A micro-batch's share of its minibatch under the configured aggregation (tokens or sequences)."""
    mode = getattr(cfg.algorithm.aggregation, "value", cfg.algorithm.aggregation)
    return float(batch.completion_mask.sum()) if mode == "token" else float(len(batch))


def batch_metrics(batch: RolloutBatch, cfg: LopdConfig) -> dict[str, float]:
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


def train(cfg: LopdConfig, *, stop_after: int | None = None, quiet: bool = False) -> Path:
    """Run (or resume) training; returns the run directory. `stop_after` ends this process after that
    many steps without a final checkpoint, as a crash would (tests use it)."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    run = RunDir(run_dir_for(cfg))
    run.path.mkdir(parents=True, exist_ok=True)
    (run.path / "finished").unlink(missing_ok=True)
    run.config_path.write_text(to_yaml(cfg))
    device = pick_device(cfg.train.device)
    seed_everything(cfg.train.seed)

    env = build_env(cfg.env)
    train_tasks = env.tasks(cfg.env.train_split)
    for split in cfg.env.eval_splits:
        env.tasks(split)  # fail now, not after an hour, on a bad split name or data file
    model, tokenizer = load_policy(cfg.model, device)
    algorithm = build_algorithm(cfg)
    d = cfg.algorithm.distill
    needs_frozen = algorithm.uses_reference or (algorithm.uses_teacher and d.teacher.value == "frozen")
    reference = FrozenView(model) if needs_frozen else None
    teacher = make_teacher(model, d.teacher, d.ema_rate, reference) if algorithm.uses_teacher else None
    algorithm.setup(policy=model, tokenizer=tokenizer, env=env, run=run, reference=reference, teacher=teacher,
                    device=device)
    groups = [{"params": trainable_parameters(model), "lr": cfg.optim.lr}] + algorithm.param_groups()
    optimizer = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                  weight_decay=cfg.optim.weight_decay)
    warmup = max(1, cfg.optim.warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))

    per_step = cfg.rollout.tasks_per_step * cfg.rollout.group_size
    total_steps = cfg.train.max_rollouts // per_step
    if total_steps < 1:
        raise ConfigError(f"train.max_rollouts={cfg.train.max_rollouts} is less than one step's rollouts "
                         f"(rollout.tasks_per_step x rollout.group_size = {per_step})")
    state = RunState()
    checkpoint = run.latest_checkpoint()
    if checkpoint is not None:
        saved = run.load_checkpoint(checkpoint, model, optimizer)
        scheduler.load_state_dict(saved["scheduler"])
        algorithm.load_state_dict(saved["algorithm"])
        if teacher is not None:
            teacher.load_state_dict(saved.get("teacher", {}))
        state = RunState(**saved["run"])
    run.truncate_metrics(after_step=state.step if checkpoint is not None else -1)
    writer = _tensorboard(run, cfg, purge_step=state.step + 1 if checkpoint is not None else None)

    def log(row: dict) -> None:
        row = {"step": state.step, "rollouts": state.rollouts, "tokens": state.tokens, **row}
        run.log(row)
        if writer is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and "/" in k:
                    writer.add_scalar(k, v, global_step=state.rollouts)

    def run_eval(timer: Timer) -> dict[str, float]:
        out = {}
        with timer("eval"):
            for split in cfg.env.eval_splits:
                result = evaluate(model, tokenizer, env, split, max_tasks=cfg.eval.max_tasks,
                                  temperature=cfg.eval.temperature, max_new_tokens=cfg.rollout.max_new_tokens,
                                  batch_size=cfg.eval.batch_size, seed=cfg.train.seed, max_turns=cfg.rollout.max_turns)
                out.update(result.metrics())
                state.best[split] = max(state.best.get(split, 0.0), result.success)
                (run.path / "samples").mkdir(exist_ok=True)
                with open(run.path / "samples" / f"{split}_step{state.step:06d}.jsonl", "w") as f:
                    f.writelines(json.dumps(s) + "\n" for s in result.samples)
        return out

    def save() -> None:
        run.save_checkpoint(state.step, model, optimizer, {
            "scheduler": scheduler.state_dict(), "algorithm": algorithm.state_dict(),
            "teacher": teacher.state_dict() if teacher is not None and teacher.trained else {},
            "run": vars(state)}, keep=cfg.run.keep_checkpoints)

    progress = _Progress(cfg, total_steps, quiet or not cfg.run.progress)
    if state.step == 0:
        timer = Timer()
        log({"kind": "eval", **run_eval(timer), **timer.seconds})
    progress.start(state, run.read_metrics())
    steps_here = 0
    try:
        while state.step < total_steps:
            timer = Timer()
            tasks = tasks_for_step(train_tasks, state.step, cfg.rollout.tasks_per_step, cfg.train.seed)
            batch = collect_rollouts(model, tokenizer, env, tasks, cfg, timer)
            with timer("context"):
                ctx = algorithm.build_context(batch)
            with timer("update"):
                metrics = update(model, algorithm, tokenizer, optimizer, scheduler, batch, ctx, cfg)
            with timer("remember"):
                metrics.update(algorithm.after_update(batch))
            prev = state.rollouts
            state.step += 1
            state.rollouts += len(batch)
            state.tokens += batch.num_tokens
            row = {"kind": "train", **batch_metrics(batch, cfg), **metrics}
            if device.type == "cuda":
                row["memory/peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            every = cfg.eval.every_rollouts
            if state.step == total_steps or (every and state.rollouts // every > prev // every):
                row.update({"kind": "train+eval", **run_eval(timer)})
            if state.step % cfg.run.checkpoint_every == 0 or state.step == total_steps:
                with timer("checkpoint"):
                    save()
            log({**row, **timer.seconds})
            progress.update(state, row)
            steps_here += 1
            if stop_after is not None and steps_here >= stop_after and state.step < total_steps:
                return run.path
    except KeyboardInterrupt:
        progress.stop()
        print(f"interrupted: resume with `lopd train {run.path}` (from the last checkpoint)")
        raise
    finally:
        progress.stop()
        if writer is not None:
            writer.close()
    from lopd.report import write_run_report

    write_run_report(run.path)
    (run.path / "finished").write_text(str(cfg.train.max_rollouts))  # last: the run is complete
    return run.path


def _tensorboard(run: RunDir, cfg: LopdConfig, purge_step: int | None):
    if not cfg.run.tensorboard:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(run.path / "tb"), purge_step=purge_step)


class _Progress:
    """A rich progress bar: rollouts spent against the budget, train reward, latest held-out success."""

    def __init__(self, cfg: LopdConfig, total_steps: int, disabled: bool):
        self.cfg, self.total, self.disabled, self.bar = cfg, total_steps, disabled, None
        self.budget = total_steps * cfg.rollout.tasks_per_step * cfg.rollout.group_size
        self.fields = {"reward": "-", "held_out": "-"}

    def start(self, state: RunState, history: list[dict]) -> None:
        if self.disabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        for row in history:
            self._absorb(row)
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("rollouts  reward {task.fields[reward]}  held-out {task.fields[held_out]}"),
                            TimeElapsedColumn(), TimeRemainingColumn())
        self.bar.start()
        self.task = self.bar.add_task(self.cfg.algorithm.name, total=self.budget, completed=state.rollouts, **self.fields)

    def _absorb(self, row: dict) -> None:
        if "reward/mean" in row:
            self.fields["reward"] = f"{row['reward/mean']:.2f}"
        evals = [f"{k.split('/')[1]} {100 * v:.0f}%" for k, v in row.items() if k.startswith("eval/") and k.endswith("/success")]
        if evals:
            self.fields["held_out"] = " ".join(evals)

    def update(self, state: RunState, row: dict) -> None:
        self._absorb(row)
        if self.bar is not None:
            self.bar.update(self.task, completed=state.rollouts, **self.fields)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

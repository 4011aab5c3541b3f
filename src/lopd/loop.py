"""The one training loop, for every algorithm.

    for each step, until the rollout budget is spent:
        sample    G completions for each of the step's tasks from the current policy (`rollout.engine`)
        score     the env gives each a reward, a success flag and a feedback sentence
        context   the algorithm builds what it needs once per batch (advantages, privileged context)
        update    per micro-batch: the student's token stats -> algorithm.loss -> backward; optimizer steps
        remember  the algorithm stores what later batches retrieve (experiences, skills)
        evaluate  held-out splits, every `eval.every_rollouts` rollouts
        checkpoint  every `run.checkpoint_every` steps and at the end
        log       the step's row: metrics.jsonl, TensorBoard, the progress line

Every phase is timed (`time/*`, with its peak resident memory in `memory/peak_rss_gib/*`). Algorithms
differ only in their own file; nothing here branches on which one runs, on whether it uses a teacher, a
reference or latent tokens, or on which engine samples. `lopd train` on an existing run directory resumes
it bit for bit: weights, optimizer, scheduler, RNG states, budget counters and the algorithm's own state
come back from the checkpoint.

In parts (`lopd.session`), for tests and tools that want the wiring without the loop:
    session = build(cfg)          model, tokenizer, env, algorithm, optimizer, engine, run directory
    state = restore(session)      the latest checkpoint's state, or a fresh one
    fit(session, state)           the loop
`train(cfg)` is the three in a row.

    lopd train --config configs/grpo.yaml train.max_rollouts=2048
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from lopd import dist, failpoints, fsdp, host_memory
from lopd.config import to_yaml
from lopd.envs import Env
from lopd.errors import LopdError
from lopd.evaluation import evaluate_split
from lopd.quiet import silence_third_party
from lopd.report import flat_message, trailing_flat
from lopd.rollout import RolloutBatch
from lopd.runs import one_line_write_errors, warn
from lopd.run_io import Progress, Terminated, Timer, tensorboard_writer, terminated_as_interrupt
from lopd.schema import Config
from lopd.session import RunState, Session, build, group_seed, restore, tasks_for_step
from lopd.update import update

__all__ = ["fit", "train", "build", "restore", "RunState", "Session", "update"]


def train(cfg: Config, *, env: Env | None = None, stop_after: int | None = None, quiet: bool = False) -> Path:
    """Run (or resume) training; returns the run directory. `stop_after` ends this process after that
    many steps without a final checkpoint, as a crash would (tests use it)."""
    silence_third_party()
    session = build(cfg, env)  # refuses a resume under another env or config before anything is written
    try:
        session.resuming = dist.broadcast(session.world, session.run.exists())
        state = restore(session)
        if session.world.main:  # only now: a resume that fails to load leaves the run's own config.yaml
            session.run.write_config(to_yaml(cfg))
        return fit(session, state, stop_after=stop_after, quiet=quiet)
    finally:
        session.run.release()
        session.engine.close()


def fit(session: Session, state: RunState, *, stop_after: int | None = None, quiet: bool = False) -> Path:
    """The loop, from `state` to the end of the budget. How the process ends (finished, crashed and why,
    interrupted) is recorded in the run's status.json; the next start reports it in resumes.log."""
    loop = Loop(session, state, quiet)
    with terminated_as_interrupt(), loop.recording_how_it_ends():
        if state.step == 0:
            timer = Timer()
            row = {"kind": "eval", **loop.evaluate(timer), **timer.metrics}
            loop.log({**row, **memory_metrics(session.device)})  # the process's peak covers the eval phase's
        loop.progress.start(state, loop.history)
        steps_here = 0
        while state.step < session.total_steps:
            loop.step()
            steps_here += 1
            if stop_after is not None and steps_here >= stop_after and state.step < session.total_steps:
                loop.end("interrupted", f"stop_after={stop_after} steps")
                dist.barrier(session.world)  # no rank leaves (and closes the process group) while another works
                return session.run.path
        loop.finish()
    return session.run.path


class Loop:
    """One run's loop, phase by phase (`step`); the phases share only the session, the state and the
    step's timer and row."""

    def __init__(self, session: Session, state: RunState, quiet: bool):
        self.session, self.state, self.cfg, self.run = session, state, session.cfg, session.run
        self.main = session.world.main  # rank 0 evaluates, checkpoints and logs; every rank trains
        self.sharded = fsdp.is_sharded(session.model)  # every forward is collective: all ranks evaluate and gather
        self.progress = Progress(self.cfg, session.total_steps, quiet or not self.cfg.run.progress or not self.main)
        if self.main:
            resumed = self.run.begin(session.resumed_from, session.resuming)
            if resumed is not None and not quiet:  # a resume says so, where a fresh start says nothing
                start, previous = resumed
                print(f"resuming {self.run.path} from {start} ({state.rollouts} of {self.progress.budget} rollouts); "
                      f"previous process: {previous}", flush=True)
            with one_line_write_errors(self.run.finished_path):
                self.run.finished_path.unlink(missing_ok=True)
        purge = state.rollouts + 1 if session.resumed_from is not None else None
        self.writer = tensorboard_writer(self.run, self.cfg, purge_step=purge) if self.main else None
        self.history = self.run.read_metrics() if self.main else []
        self.warned_flat = False  # the stderr line about steps without reward variance: once per process

    def step(self) -> None:
        s, state, timer = self.session, self.state, Timer()
        step = state.step + 1
        batch, engine_metrics = self.sample(step, timer)
        with timer("context"):
            ctx = s.algorithm.build_context(batch, step)
        with timer("update"):  # returns freed host memory to the OS where its activations make it pay
            metrics = update(s.model, s.algorithm, s.optimizer, s.scheduler, batch, ctx, self.cfg, s.world)
        everyone = RolloutBatch.concat(dist.gather(s.world, batch), s.tokenizer.pad_token_id)  # the whole step
        with timer("remember"):
            metrics.update(s.algorithm.remember(everyone, step))
        failpoints.reached("remember")
        previous = state.rollouts
        state.step, state.rollouts, state.tokens = step, state.rollouts + len(everyone), state.tokens + everyone.num_tokens
        state.bad_streak = state.bad_streak + 1 if metrics["health/skipped_steps"] else 0
        row = {"kind": "train", **batch_metrics(everyone, self.cfg.rollout.group_size),
               **dist.all_mean(s.world, {**ctx.metrics, **engine_metrics}), **metrics}
        if self.evaluation_due(previous):
            row.update({"kind": "train+eval", **self.evaluate(timer)})
        row.update(memory_metrics(s.device))  # the process's peak so far, the evaluation's included
        self.checkpoint_and_log(row, timer)
        self.warn_if_flat()
        self.stop_if_unhealthy()

    def sample(self, step: int, timer: Timer) -> tuple[RolloutBatch, dict[str, float]]:
        """This rank's share of the step's groups, sampled and scored (`rollout`, `score` and the engine's
        own phases)."""
        s, cfg = self.session, self.cfg
        tasks = tasks_for_step(s.train_tasks, self.state.step, cfg.rollout.tasks_per_step, cfg.train.seed)
        mine = dist.share(tasks, s.world)  # whole groups: this rank's contiguous block of the step's tasks
        first = s.world.rank * len(mine)
        seeds = [group_seed(cfg.train.seed, step, first + i) for i in range(len(mine))] \
            if cfg.rollout.seed_per_group or s.world.distributed else None
        batch, metrics = s.engine.rollouts(s.model, mine, timer, seeds=seeds, first_group=first)
        failpoints.reached("rollout")
        return batch, metrics

    def evaluation_due(self, previous_rollouts: int) -> bool:
        every = self.cfg.eval.every_rollouts
        return self.state.step == self.session.total_steps or bool(
            every and self.state.rollouts // every > previous_rollouts // every)

    def evaluate(self, timer: Timer) -> dict[str, float]:
        """The held-out splits (rank 0; every rank when sharded), their completions saved under samples/."""
        s, cfg, out = self.session, self.cfg, {}
        with timer("eval"):
            for split in cfg.env.eval_splits if self.main or self.sharded else []:
                result = evaluate_split(s.model, s.tokenizer, s.env, split, max_tasks=cfg.eval.max_tasks,
                                        temperature=cfg.eval.temperature, max_new_tokens=cfg.rollout.max_new_tokens,
                                        batch_size=cfg.eval.batch_size, seed=cfg.train.seed,
                                        max_turns=cfg.rollout.max_turns)
                if not self.main:
                    continue
                out.update(result.metrics())
                self.state.best[split] = max(self.state.best.get(split, 0.0), result.success)
                self.run.write_samples(split, self.state.step, result.samples)
                failpoints.reached("eval")
            dist.barrier(s.world)  # the other ranks wait for rank 0's evaluation
        return out

    def checkpoint_and_log(self, row: dict, timer: Timer) -> None:
        """A checkpoint when due (it holds the step's own row), then the row itself: the row reaches
        metrics.jsonl before the checkpoint is visible, so a kill between the two redoes the step."""
        s, state = self.session, self.state
        pending = None
        due = state.step % self.cfg.run.checkpoint_every == 0 or state.step == s.total_steps
        if due and (self.main or self.sharded):
            with timer("checkpoint"):
                gathered = fsdp.checkpoint_state(s.model, s.optimizer, s.algorithm) if self.sharded else None
                if self.main:
                    pending = self.run.save_checkpoint(state.step, s.model, s.optimizer, {
                        "scheduler": s.scheduler.state_dict(),
                        "algorithm": gathered["algorithm"] if gathered else s.algorithm.state_dict(),
                        "run": vars(state)}, keep=self.cfg.run.keep_checkpoints, gathered=gathered)
        row = {**row, **timer.metrics}
        if pending is not None:
            pending.finish(self.history + [self.stamped(row)])
        self.log(row)
        if pending is not None:
            pending.commit()
        failpoints.reached("step.end")
        self.progress.update(state, row)

    def stamped(self, row: dict) -> dict:
        return {"step": self.state.step, "rollouts": self.state.rollouts, "tokens": self.state.tokens, **row}

    def log(self, row: dict) -> dict:
        """The row to metrics.jsonl and TensorBoard (rank 0)."""
        row = self.stamped(row)
        if not self.main:
            return row
        self.run.log(row)
        self.history.append(row)
        if self.writer is not None:
            self.writer.scalars(row, self.state.rollouts)
        return row

    def warn_if_flat(self) -> None:
        """After `train.flat_reward_steps` steps in a row in which no group's rewards differed, say so: on the
        progress line while it lasts, and in one stderr line (once per process) with the likely causes."""
        steps, after = trailing_flat(self.history), self.cfg.train.flat_reward_steps
        flat = bool(after) and len(steps) >= after
        self.progress.note(f"no reward variance for {len(steps)} steps" if flat else "")
        if flat and not self.warned_flat:
            self.warned_flat = True
            warn(flat_message(steps))  # (above the progress bar, which holds the terminal's last line)

    def stop_if_unhealthy(self) -> None:
        if self.state.bad_streak >= self.cfg.train.max_bad_steps:
            last = self.run.latest_checkpoint()
            raise LopdError(f"step {self.state.step}: {self.state.bad_streak} steps in a row had a non-finite loss or "
                            f"gradient and were skipped; stopping. The last good checkpoint is "
                            f"{last.name if last else 'none'}. A resume keeps the run's config and would meet the "
                            f"same steps: fix what overflows (the env, a loss term) and resume with "
                            f"`lopd train {self.run.path}`, or start a new run (e.g. with a lower optim.lr)")

    def end(self, how: str, detail: str = "") -> None:
        if self.main:
            self.run.end(how, detail)

    @contextmanager
    def recording_how_it_ends(self) -> Iterator[None]:
        failed = True
        try:
            yield
            failed = False
        except KeyboardInterrupt as e:
            self.progress.stop()
            self.end("interrupted", "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C")
            if self.main:
                print(f"interrupted: resume with `lopd train {self.run.path}` (from the last checkpoint)")
            raise
        except BaseException as e:
            self.progress.stop()
            self.end("crashed", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                                f"(at step {self.state.step + 1})")
            raise
        finally:  # after an error, a writer that cannot flush (the same full or read-only disk) stays quiet
            self.progress.stop()
            if self.writer is not None:
                self.writer.close(quiet=failed)

    def finish(self) -> None:
        """The whole budget is trained: the report, status "finished", and last the `finished` marker."""
        if self.main:
            from lopd.report import write_run_report

            write_run_report(self.run.path, self.cfg.train.flat_reward_steps)
            self.run.end("finished")
            self.run.mark_finished(self.cfg.train.max_rollouts)
        dist.barrier(self.session.world)


def batch_metrics(batch: RolloutBatch, group_size: int) -> dict[str, float]:
    """The step's rewards, their spread within groups, and the completions' lengths."""
    success = batch.success.float().view(-1, group_size)  # [tasks, G]
    rewards = batch.rewards.view(-1, group_size)
    return {
        "reward/mean": float(batch.rewards.mean()),
        "reward/success": float(success.mean()),
        "reward/solved_groups": float((success.max(-1).values > 0).float().mean()),
        "reward/mixed_groups": float((rewards.std(-1) > 0).float().mean()) if group_size > 1 else 0.0,
        "rollout/length": float(batch.completion_mask.sum(-1).float().mean()),
        "rollout/truncated": float(batch.truncated.float().mean()),
    }


def memory_metrics(device: torch.device) -> dict[str, float]:
    out = {"memory/peak_rss_gib": host_memory.peak_rss_gib()}
    if device.type == "cuda":
        out["memory/peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out

"""What a training process shows, hears and measures, apart from the loop's logic: the progress bar, the
TensorBoard writer, SIGTERM turned into an interrupt (so a killed run records how it ended), and the
phases' timer."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import torch

from lopd import host_memory
from lopd.config import Config
from lopd.runs import RunDir

if TYPE_CHECKING:
    from lopd.session import RunState


class Timer:
    """Wall-clock seconds per named phase, and the phase's peak resident memory (Linux; `host_memory.PhasePeaks`:
    the kernel's peak-RSS mark is never reset, so `/usr/bin/time -v` and cgroup accounting still see the
    process's true peak). On a GPU each phase ends with a synchronise, so queued kernels are charged to the
    phase that launched them."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.peaks: dict[str, float] = {}
        self.memory = host_memory.PhasePeaks()
        self.sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        tracked = self.memory.start(phase)
        start = time.perf_counter()
        try:
            yield
            self.sync()
        finally:
            peak = self.memory.stop(phase) if tracked else None
        self.seconds[f"time/{phase}"] = self.seconds.get(f"time/{phase}", 0.0) + time.perf_counter() - start
        if peak is not None:
            key = f"memory/peak_rss_gib/{phase}"
            self.peaks[key] = max(self.peaks.get(key, 0.0), peak)

    @property
    def metrics(self) -> dict[str, float]:
        """`time/<phase>` seconds and `memory/peak_rss_gib/<phase>` GiB, for the row of the step."""
        return {**self.seconds, **self.peaks}


class Terminated(KeyboardInterrupt):
    """SIGTERM, turned into an interrupt so the run records how it ended."""


@contextmanager
def terminated_as_interrupt() -> Iterator[None]:
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def tensorboard_writer(run: RunDir, cfg: Config, purge_step: int | None):
    if not cfg.run.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # metrics.jsonl holds every number anyway
        import warnings

        warnings.warn(f"run.tensorboard: {e}; writing metrics.jsonl only (pip install tensorboard, or "
                      f"run.tensorboard=false to silence this)")
        return None

    return SummaryWriter(log_dir=str(run.tensorboard_dir), purge_step=purge_step)


class Progress:
    """A rich progress bar: rollouts spent against the budget, train reward, latest held-out success."""

    def __init__(self, cfg: Config, total_steps: int, disabled: bool):
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
        self.task = self.bar.add_task(str(self.cfg.algorithm.name), total=self.budget, completed=state.rollouts, **self.fields)

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

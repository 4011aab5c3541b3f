"""What a training process shows and hears, apart from the loop's logic: the progress bar, the TensorBoard
writer, and SIGTERM turned into an interrupt (so a killed run records how it ended)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from lopd.config import AlgorithmName, Config
from lopd.runs import RunDir

if TYPE_CHECKING:
    from lopd.loop import RunState


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

    return SummaryWriter(log_dir=str(run.path / "tb"), purge_step=purge_step)


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
        self.task = self.bar.add_task(AlgorithmName(self.cfg.algorithm.name).value, total=self.budget, completed=state.rollouts, **self.fields)

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

"""What a training process shows, hears and measures, apart from the loop's logic: the progress bar, the
TensorBoard writer (whose failed writes are one line, like every write of a run), SIGTERM turned into an
interrupt (so a killed run records how it ended), and the phases' timer."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import torch

from lopd import host_memory
from lopd.runs import RunDir, one_line_write_errors
from lopd.schema import Config

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


def tensorboard_writer(run: RunDir, cfg: Config, purge_step: int | None) -> "TensorBoard | None":
    if not cfg.run.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # metrics.jsonl holds every number anyway
        import warnings

        warnings.warn(f"run.tensorboard: {e}; writing metrics.jsonl only (pip install tensorboard, or "
                      f"run.tensorboard=false to silence this)")
        return None

    with one_line_write_errors(run.tensorboard_dir):
        return TensorBoard(SummaryWriter(log_dir=str(run.tensorboard_dir), purge_step=purge_step), run)


class TensorBoard:
    """A SummaryWriter whose failed writes (a full or read-only disk) are one-line LopdErrors in the loop's
    thread. Its writer thread re-raises a failed write in that thread (a traceback on stderr) and again here
    at the next call: the first is silenced (`_quiet_writer_thread`), the second made one line."""

    def __init__(self, writer, run: RunDir):
        self.writer, self.run = writer, run
        _quiet_writer_thread()

    def scalars(self, row: dict, step: int) -> None:
        """Every numeric `section/name` value of the row, at x = `step` (rollouts)."""
        with one_line_write_errors(self.run.tensorboard_dir):
            for k, v in row.items():
                if isinstance(v, (int, float)) and "/" in k:
                    self.writer.add_scalar(k, v, global_step=step)

    def close(self, quiet: bool = False) -> None:
        """Flush and close; `quiet`: an error is already on its way, and a failure here would only repeat it."""
        try:
            with one_line_write_errors(self.run.tensorboard_dir):
                self.writer.close()
        except Exception:
            if not quiet:
                raise


def _quiet_writer_thread() -> None:
    """Install (once) a threading.excepthook that drops an OSError of TensorBoard's writer thread, which the
    writer raises again in the caller's thread, and passes everything else to the previous hook."""
    import threading

    previous = threading.excepthook
    if getattr(previous, "lopd_tensorboard", False):
        return

    def hook(args) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return
        previous(args)

    hook.lopd_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class Progress:
    """A rich progress bar: rollouts spent against the budget, train reward, latest held-out success."""

    def __init__(self, cfg: Config, total_steps: int, disabled: bool):
        self.cfg, self.total, self.disabled, self.bar = cfg, total_steps, disabled, None
        self.budget = total_steps * cfg.rollout.tasks_per_step * cfg.rollout.group_size
        self.fields = {"reward": "-", "held_out": "-", "note": ""}

    def start(self, state: RunState, history: list[dict]) -> None:
        if self.disabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        for row in history:
            self._absorb(row)
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("rollouts  reward {task.fields[reward]}  held-out {task.fields[held_out]}"
                                       "{task.fields[note]}"),
                            TimeElapsedColumn(), TimeRemainingColumn())
        self.bar.start()
        self.task = self.bar.add_task(str(self.cfg.algorithm.name), total=self.budget, completed=state.rollouts, **self.fields)

    def _absorb(self, row: dict) -> None:
        if "reward/mean" in row:
            self.fields["reward"] = f"{row['reward/mean']:.2f}"
        evals = [f"{k.split('/')[1]} {100 * v:.0f}%" for k, v in row.items() if k.startswith("eval/") and k.endswith("/success")]
        if evals:
            self.fields["held_out"] = " ".join(evals)

    def note(self, text: str) -> None:
        """A warning shown at the end of the line (e.g. no reward variance), or "" for none."""
        self.fields["note"] = f"  [yellow]{text}[/yellow]" if text else ""
        if self.bar is not None:
            self.bar.update(self.task, **self.fields)

    def update(self, state: RunState, row: dict) -> None:
        self._absorb(row)
        if self.bar is not None:
            self.bar.update(self.task, completed=state.rollouts, **self.fields)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

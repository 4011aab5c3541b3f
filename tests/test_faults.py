"""Fault injection with real processes: a run killed with SIGKILL at any of its failpoints (lopd/failpoints.py),
then resumed with a plain `lopd train RUN_DIR`, equals an uninterrupted run bit for bit: weights, optimizer,
experience bank, metrics rows (without time/*), evaluated samples. Plus: a damaged newest checkpoint is skipped
for the previous one, damaged metrics lines are replaced, a second trainer on a run is refused, a stale lock
does not block, a full or read-only disk says so in one line, and non-finite losses stop the run cleanly.

The fast cases run in `make test`; every (algorithm, failpoint) pair and kills at random moments are `slow`.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REFERENCE_EXTRA, assert_same, cli, reference_args, small_overrides, snapshot
from lopd.runs import RunDir

LOPD = [sys.executable, "-m", "lopd.cli"]
ALGORITHMS = list(REFERENCE_EXTRA)  # grpo, lopd: the canonical tiny runs of conftest.py


def _args(algorithm, run_dir):
    return reference_args(algorithm, run_dir)


def _lopd(args, failpoint=None, timeout=600, **kw):
    return cli(args, failpoint=failpoint, timeout=timeout, **kw)


@pytest.fixture(scope="module")
def reference(reference_runs):
    """Snapshots of the uninterrupted reference runs, read when a test first asks."""

    class Snapshots(dict):
        def __missing__(self, algorithm):
            self[algorithm] = snapshot(reference_runs[algorithm])
            return self[algorithm]

    return Snapshots()


def kill_and_resume(algorithm: str, failpoint: str, run_dir: Path) -> subprocess.CompletedProcess:
    killed = _lopd(_args(algorithm, run_dir), failpoint=failpoint)
    assert killed.returncode == -signal.SIGKILL, (failpoint, killed.returncode, killed.stderr[-1500:])
    return _lopd(["train", run_dir])


# (algorithm, failpoint:nth). The small run: 4 steps of 8 rollouts, checkpoints at steps 2 and 4, evaluations
# at 0, 16 and 32 rollouts (eval:1 is step 0's first split).
FAST = [
    ("lopd", "bank.append:1"),          # step 1's experiences: keys written, entries not (no checkpoint yet)
]  # every other failpoint, for every algorithm, is in SLOW (the default suite's 15 minutes)
SLOW = [(a, p) for a in ALGORITHMS for p in [
    "step.end:1", "rollout:1", "rollout:3", "update:2", "update:3", "remember:2", "bank.append:3", "eval:1",
    "eval:3", "metrics.write:2", "metrics.write:4", "checkpoint.write:1", "checkpoint.write:2",
    "checkpoint.rename:1", "checkpoint.rename:2", "checkpoint.after_rename:1", "step.end:3"]
    if a == "lopd" or not p.startswith(("bank", "remember"))]


@pytest.mark.parametrize("algorithm, failpoint", FAST)
def test_killed_at_a_failpoint_resumes_bit_for_bit(reference, tmp_path, algorithm, failpoint):
    resumed = kill_and_resume(algorithm, failpoint, tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same(snapshot(tmp_path / "run"), reference[algorithm])
    log = (tmp_path / "run" / "resumes.log").read_text().splitlines()
    assert len(log) == 1 and "left no exit record: killed" in log[0]
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp_*"))


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, failpoint", SLOW)
def test_every_failpoint_resumes_bit_for_bit(reference, tmp_path, algorithm, failpoint):
    resumed = kill_and_resume(algorithm, failpoint, tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same(snapshot(tmp_path / "run"), reference[algorithm])


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_killed_at_a_random_moment_resumes_bit_for_bit(reference, tmp_path, seed):
    """A parent sends SIGKILL after a random delay (possibly several times), then lets the run finish."""
    rng = random.Random(seed)
    algorithm = ["grpo", "lopd"][seed % 2]
    run_dir = tmp_path / "run"
    for _ in range(rng.randint(1, 3)):
        args = _args(algorithm, run_dir) if not RunDir(run_dir).exists() else ["train", run_dir]
        proc = subprocess.Popen(LOPD + [str(a) for a in args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "OMP_NUM_THREADS": "2"})
        time.sleep(rng.uniform(4.0, 25.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done = _lopd(["train", run_dir] if RunDir(run_dir).exists() else _args(algorithm, run_dir))
    assert done.returncode == 0, done.stderr[-2000:]
    assert_same(snapshot(run_dir), reference[algorithm])


@pytest.mark.slow  # 57 s; the failpoint kills that stay in make test resume from the newest checkpoint
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one(reference, tmp_path):
    run_dir = tmp_path / "run"
    assert _lopd(_args("grpo", run_dir)).returncode == 0
    newest = RunDir(run_dir).latest_checkpoint()
    optimizer = newest / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])  # cut in half
    resumed = _lopd(["train", run_dir])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    warnings = [line for line in resumed.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "step_000004 is damaged (optimizer.pt has" in warnings[0]
    assert_same(snapshot(run_dir), reference["grpo"])
    assert "resumed from step_000002" in (run_dir / "resumes.log").read_text()


def test_damaged_metrics_lines_are_reported_and_replaced(reference, tmp_path):
    run_dir = tmp_path / "run"
    killed = _lopd(_args("grpo", run_dir), failpoint="step.end:3")  # a checkpoint at step 2, step 3 logged
    assert killed.returncode == -signal.SIGKILL
    with open(run_dir / "metrics.jsonl", "ab") as f:
        f.write(b"42\n" + b"plain text garbage\n" + b'{"step": 9, "broken": \xff\xfe}\n')
    resumed = _lopd(["train", run_dir])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    warned = [line for line in resumed.stderr.splitlines() if "not a metrics row" in line]
    assert len(warned) == 3  # each bad line named once, with its line number
    assert_same(snapshot(run_dir), reference["grpo"])


def test_a_second_trainer_is_refused_and_a_stale_lock_does_not_block(tmp_path):
    run_dir = tmp_path / "run"
    args = _args("grpo", run_dir)[:-1] + ["train.max_rollouts=800", "eval.every_rollouts=0"]
    first = subprocess.Popen(LOPD + args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while not (run_dir / "status.json").is_file() and time.time() < deadline:
        time.sleep(0.2)
    second = _lopd(["train", run_dir], timeout=120)
    assert second.returncode == 2
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and f"is in use by pid {first.pid}" in lines[0], second.stderr
    first.send_signal(signal.SIGKILL)
    first.wait()
    third = _lopd(["train", run_dir, "train.max_rollouts=16"], timeout=300)  # the kernel released the lock
    assert third.returncode == 0, third.stderr[-2000:]


def _unshare_available() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _unshare_available(), reason="needs unprivileged user and mount namespaces (unshare)")
@pytest.mark.parametrize("size, expected", [("20M", "no space left on device while writing"),
                                            ("ro", "cannot write (read-only file system)")])
def test_a_full_or_read_only_disk_is_one_clear_line(tmp_path, size, expected):
    mount = tmp_path / "disk"
    mount.mkdir()
    options = "ro,size=1M" if size == "ro" else f"size={size}"
    command = " ".join([f"mount -t tmpfs -o {options} tmpfs {mount} &&", *LOPD, *_args("grpo", mount / "run"),
                        "&& echo finished; ls -a", str(mount / "run" / "checkpoints"), "2>/dev/null"])
    out = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", command], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "2"})
    lines = [line for line in out.stderr.strip().splitlines() if line.startswith("lopd: error:")]
    assert len(lines) == 1 and expected in lines[0], out.stderr[-2000:]
    assert ".tmp_step" not in out.stdout  # nothing half-written is left on the full disk


NAN_ENV = """
from lopd import Score
from lopd.envs.toolworld import ToolWorld, ToolWorldConfig


class NaNReward(ToolWorld):
    def __init__(self):
        super().__init__(ToolWorldConfig(n_train=40, n_test=8, n_transfer=8))

    def score(self, task, completion):
        s = super().score(task, completion)
        return Score(float("nan"), s.success, s.feedback)
"""


def test_non_finite_losses_skip_steps_and_stop_the_run_with_a_clear_message(tmp_path):
    """A reward function that returns NaN makes every loss non-finite: each step is skipped (the weights never
    see it), counted under health/*, and after train.max_bad_steps in a row the run stops, naming the step
    and the checkpoint to resume from."""
    (tmp_path / "nan_env.py").write_text(NAN_ENV)
    run_dir = tmp_path / "run"
    items = [i for i in small_overrides(run_dir, **{"train.max_bad_steps": 3, "train.max_rollouts": 48})
             if not i.startswith("env.")]
    out = _lopd(["train", "--config", "grpo", f"env.name={tmp_path / 'nan_env.py'}:NaNReward", *items])
    assert out.returncode == 2, out.stderr[-2000:]
    error = out.stderr.strip().splitlines()[-1]
    assert error.startswith("lopd: error: step 3: 3 steps in a row had a non-finite loss or gradient"), error
    assert "The last good checkpoint is step_000002" in error
    rows = [r for r in RunDir(run_dir).read_metrics() if r["kind"].startswith("train")]
    assert [r["health/skipped_steps"] for r in rows] == [1, 1, 1]
    assert [r["health/nonfinite_losses"] for r in rows] == [1, 1, 1]
    weights = load_file(RunDir(run_dir).latest_checkpoint() / "model" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "crashed" and "non-finite" in status["detail"]

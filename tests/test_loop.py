"""The loop end to end: the run directory, resume after a stop equals the uninterrupted run, the real CLI in
a subprocess, clear errors. The uninterrupted runs are the shared reference runs (conftest.py)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zygote
from conftest import assert_same, cli, copy_run, reference_config, small_overrides, snapshot
from lopd.config import load_config
from lopd.runs import RunDir
from lopd.loop import train

LOPD = [sys.executable, "-m", "lopd.cli"]


def _final_weights(run_dir: Path) -> dict:
    ckpt = RunDir(run_dir).latest_checkpoint()
    return load_file(ckpt / "model" / "model.safetensors")


@pytest.fixture(scope="module")
def resumed_grpo(tmp_path_factory) -> Path:
    """The canonical GRPO run, stopped after step 3 as a crash would (its checkpoint is step 2's: step 3's
    work is lost) and resumed, in this process."""
    run_dir = tmp_path_factory.mktemp("resumed") / "run"
    train(reference_config("grpo", run_dir), stop_after=3, quiet=True)
    assert RunDir(run_dir).latest_checkpoint().name == "step_000002"
    assert max(r["step"] for r in RunDir(run_dir).read_metrics()) == 3
    train(reference_config("grpo", run_dir), quiet=True)
    return run_dir


def test_resume_after_a_stop_equals_an_uninterrupted_run(reference_runs, resumed_grpo):
    """Weights, optimizer, rows (the lost step's rows replaced, not duplicated), samples: bit for bit."""
    assert_same(snapshot(resumed_grpo), snapshot(reference_runs["grpo"]))


def test_run_directory_holds_everything(reference_runs):
    path = reference_runs["grpo"]
    for name in ["config.yaml", "metrics.jsonl", "report.md", "curves.png", "finished", "status.json"]:
        assert (path / name).is_file(), name
    assert list((path / "tb").glob("events.out.tfevents.*"))
    ckpt = RunDir(path).latest_checkpoint()
    assert {"model", "optimizer.pt", "state.pt", "metrics.jsonl", "manifest.json"} <= {p.name for p in ckpt.iterdir()}
    state = torch.load(ckpt / "state.pt", weights_only=False)
    assert state["run"]["rollouts"] == 32 and state["run"]["step"] == 4
    rows = RunDir(path).read_metrics()
    evals = [r for r in rows if "eval/test/success" in r]
    assert [r["rollouts"] for r in evals] == [0, 16, 32]
    assert sorted(p.name for p in (path / "samples").iterdir()) == [
        f"{split}_step{step:06d}.jsonl" for split in ("test", "transfer") for step in (0, 2, 4)]
    train_rows = [r for r in rows if r["kind"].startswith("train")]
    assert all(k in train_rows[0] for k in ["reward/mean", "loss/pg", "time/rollout", "time/update", "tokens"])
    lengths = [r["rollout/length"] * 8 for r in train_rows]  # 8 trajectories per step
    assert train_rows[-1]["tokens"] == pytest.approx(sum(lengths))
    report = (path / "report.md").read_text()
    assert "| 32 |" in report  # the table has the final budget point
    assert load_config(path / "config.yaml").train.max_rollouts == 32
    assert json.loads((path / "status.json").read_text())["state"] == "finished"


def _run(args, **kw):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return zygote.run(LOPD + args, capture_output=True, text=True, env=env, **kw)


def test_cli_resume_extends_a_finished_run_and_eval_reads_it(reference_runs, tmp_path):
    """`lopd train RUN_DIR` with a larger budget continues the same run (the reference run itself was made by
    `lopd train --config`); `lopd eval --run` reads its newest checkpoint."""
    run_dir = copy_run(reference_runs["grpo"], tmp_path / "cli")
    n_rows = len(RunDir(run_dir).read_metrics())
    out = cli(["train", run_dir, "train.max_rollouts=48"])
    assert out.returncode == 0, out.stderr[-2000:]
    rows = RunDir(run_dir).read_metrics()
    assert len(rows) > n_rows and rows[-1]["rollouts"] == 48
    assert RunDir(run_dir).latest_checkpoint().name == "step_000006"
    assert "finished (the run is being extended)" in (run_dir / "resumes.log").read_text()
    out = cli(["eval", "--run", run_dir, "--split", "test", "eval.max_tasks=8"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| **all** |" in out.stdout and "step_000006" in out.stdout


@pytest.mark.slow  # tests/test_faults.py kills the CLI at named failpoints in the default suite
def test_cli_killed_mid_run_resumes_to_the_same_weights(tmp_path):
    reference = train(load_config("grpo", small_overrides(tmp_path / "ref", **{"train.max_rollouts": 48})), quiet=True)
    run_dir = tmp_path / "killed"
    args = ["train", "--config", "grpo", *small_overrides(run_dir, **{"train.max_rollouts": 48})]
    proc = zygote.Popen(LOPD + args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while RunDir(run_dir).latest_checkpoint() is None and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert RunDir(run_dir).latest_checkpoint() is not None
    out = _run(["train", str(run_dir)], timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    a, b = _final_weights(reference), _final_weights(run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("args, expected", [
    (["train", "--config", "grpo", "train.max_rollout=64"], "unknown config key 'train.max_rollout'"),
    (["train", "--config", "grpo", "model.name=/nonexistent/model"], "model.name: '/nonexistent/model'"),
    (["train", "--config", "nosuch"], "--config: 'nosuch'"),
    (["train", "--config", "grpo", "algorithm.name=ppo"], "bad value for 'algorithm.name': Invalid value 'ppo', expected one of"),
])
def test_cli_errors_are_one_clear_line(tmp_path, args, expected):
    out = _run(args + [f"run.dir={tmp_path / 'x'}"], timeout=300)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], out.stderr[-2000:]


def test_cli_malformed_data_row_is_one_clear_line(tmp_path, toolworld):
    data = tmp_path / "data"
    toolworld.export(data)
    lines = (data / "train.jsonl").read_text().splitlines()
    row = json.loads(lines[4])
    row["function"] = "not a list of tools"
    lines[4] = json.dumps(row)
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    out = _run(["train", "--config", "grpo", f"env.toolworld.data_dir={data}", f"run.dir={tmp_path / 'x'}"], timeout=300)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.jsonl: row 5" in lines[0], out.stderr[-2000:]


def test_help_lists_commands_and_config_keys():
    out = _run(["--help"])
    assert out.returncode == 0 and all(c in out.stdout for c in ["train", "eval", "demo"])
    out = _run(["train", "--help"])
    assert "train.max_rollouts" in out.stdout and "rollout budget" in out.stdout


def test_tensorboard_after_a_resume_keeps_every_point_once(resumed_grpo):
    """Scalars are logged by rollouts and a resume purges from the checkpoint's rollouts on, so the redone
    step replaces its first try and nothing before the resume is hidden."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(resumed_grpo / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == [8, 16, 24, 32]
    assert [e.step for e in events.Scalars("eval/test/success")] == [0, 16, 32]
    assert (resumed_grpo / "resumes.log").read_text().count("resumed from step_000002") == 1


CONSTANT_ENV = """
from lopd import Score, Task


class Constant:
    def tasks(self, split):
        return [Task(f"{split}-{i}", ({"role": "user", "content": f"Name the number {i}."},), str(i)) for i in range(3)]

    def score(self, task, completion):
        return Score(0.5, False, "Every answer gets the same.")
"""


def test_steps_without_reward_variance_are_said_out_loud(tmp_path):
    """A constant reward: after train.flat_reward_steps steps with no group's rewards differing, the progress
    line says so, stderr gets one line (once, however long it lasts) with the likely causes, and report.md
    has the warning."""
    (tmp_path / "constant.py").write_text(CONSTANT_ENV)
    run_dir = tmp_path / "run"
    out = cli(["train", "--config", "grpo", f"env.name={tmp_path / 'constant.py'}:Constant", "env.eval_splits=test",
               f"run.dir={run_dir}", "train.max_rollouts=12", "rollout.tasks_per_step=1", "rollout.group_size=4",
               "rollout.max_new_tokens=8", "eval.max_tasks=1", "train.flat_reward_steps=2", "run.progress=true"])
    assert out.returncode == 0, out.stderr[-2000:]
    warnings = [line for line in out.stderr.splitlines() if line.startswith("lopd: warning:")]
    assert warnings == ["lopd: warning: steps 1-2: no group had any reward variance (reward/mixed_groups = 0), so "
                        "every advantage is 0 and the policy gradient had no signal; likely causes: the policy scores "
                        "the same on every rollout (a model that does not know the task's format: docs/own_env.md "
                        "says what the bundled models know), a reward that is constant, or rollout.group_size=1"], out.stderr[-2000:]
    assert "no reward variance for 3 steps" in out.stdout  # the progress line's last state
    report = (run_dir / "report.md").read_text()
    assert "Learning signal: 0% of groups had reward variance (mean over steps). **Warning**: steps 1-3: no group " \
           "had any reward variance" in report
    assert "Peak memory: " in report and "| update |" in report

"""Fault injection with real processes: a run killed with SIGKILL at any of its failpoints (lopd/failpoints.py),
then resumed with a plain `lopd train RUN_DIR`, equals an uninterrupted run bit for bit: weights, optimizer,
experience bank, metrics rows (without time/*), evaluated samples. Plus: a damaged newest checkpoint is skipped
for the previous one, damaged metrics lines are replaced, a second trainer on a run is refused, a stale lock
does not block, a full or read-only disk (at the start or mid-run) says so in one line, a resume that would
change what the checkpoint holds is refused before anything is written, a NaN reward stops at the env's
boundary, non-finite losses stop the run cleanly, and a teacher that calls a token impossible is one defined
(floored, counted) case.

The fast cases run in `make test`; every (algorithm, failpoint) pair and kills at random moments are `slow`.
"""

import json
import math
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

import zygote
from conftest import REFERENCE_EXTRA, assert_same, cli, copy_run, reference_args, small_overrides, snapshot
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
    ("lopd", "bank.append:3"),          # step 3's experiences: keys written, entries not; the checkpoint of step 2
]  # every other failpoint, for every algorithm, is in SLOW (the default suite's 15 minutes)
SLOW = [(a, p) for a in ALGORITHMS for p in [
    "step.end:1", "rollout:1", "rollout:3", "update:2", "update:3", "remember:2", "bank.append:1", "eval:1",
    "eval:3", "metrics.write:2", "metrics.write:4", "checkpoint.write:1", "checkpoint.write:2",
    "checkpoint.rename:1", "checkpoint.rename:2", "checkpoint.after_rename:1", "step.end:3"]
    if a == "lopd" or not p.startswith(("bank", "remember"))]


@pytest.mark.parametrize("algorithm, failpoint", FAST)
def test_killed_at_a_failpoint_with_damaged_metrics_resumes_bit_for_bit(reference, tmp_path, algorithm, failpoint):
    """Killed mid-step, the metrics file's tail then damaged (a bare number, text, invalid UTF-8): the resume
    names each bad line once, with its line number, replaces them by the checkpoint's rows, and ends equal to
    the uninterrupted run: weights, optimizer, rows, samples, and LOPD's composer, lambda (moved by dual
    ascent) and bank (the redone step's experiences not stored twice)."""
    run_dir = tmp_path / "run"
    if algorithm == "lopd":
        assert reference[algorithm]["algorithm"]["lambda"] != 1.0 and reference[algorithm]["algorithm"]["composer"]
    killed = _lopd(_args(algorithm, run_dir), failpoint=failpoint)
    assert killed.returncode == -signal.SIGKILL, (failpoint, killed.returncode, killed.stderr[-1500:])
    with open(run_dir / "metrics.jsonl", "ab") as f:
        f.write(b"42\n" + b"plain text garbage\n" + b'{"step": 9, "broken": \xff\xfe}\n')
    resumed = _lopd(["train", run_dir])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    warned = [line for line in resumed.stderr.splitlines() if "not a metrics row" in line]
    assert len(warned) == 3  # each bad line named once, with its line number
    assert_same(snapshot(run_dir), reference[algorithm])
    log = (run_dir / "resumes.log").read_text().splitlines()
    assert len(log) == 1 and "left no exit record: killed" in log[0]
    assert not list((run_dir / "checkpoints").glob(".tmp_*"))
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
        proc = zygote.Popen(LOPD + [str(a) for a in args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "OMP_NUM_THREADS": "2"})
        time.sleep(rng.uniform(0.5, 8.0))  # a run takes ~5 s (GRPO) to ~10 s (LOPD) here: start-up, step, checkpoint
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


def test_a_second_trainer_is_refused_and_a_stale_lock_does_not_block(tmp_path):
    run_dir = tmp_path / "run"
    args = _args("grpo", run_dir)[:-1] + ["train.max_rollouts=800", "eval.every_rollouts=0"]
    first = zygote.Popen(LOPD + args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
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
    third = _lopd(["train", run_dir, "train.max_rollouts=8"], timeout=300)  # the kernel released the lock
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


def test_a_nan_reward_stops_the_run_at_the_envs_boundary_in_one_line(tmp_path):
    """Caught where the score enters the batch (here: the first evaluation), naming the task, not steps later as
    a "non-finite loss" that blames the optimizer."""
    (tmp_path / "nan_env.py").write_text(NAN_ENV)
    run_dir = tmp_path / "run"
    items = [i for i in small_overrides(run_dir, **{"train.max_rollouts": 8}) if not i.startswith("env.")]
    out = _lopd(["train", "--config", "grpo", f"env.name={tmp_path / 'nan_env.py'}:NaNReward", *items])
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith("lopd: error: NaNReward.score(task 'test-0') returned the non-finite reward nan")
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "crashed" and "non-finite reward" in status["detail"]


class PoisonedRewards:
    """An engine whose batches' rewards turn NaN after the env's boundary: what the update's guard is for."""

    def __init__(self, engine):
        self.engine = engine

    def rollouts(self, model, tasks, timer, **kw):
        batch, metrics = self.engine.rollouts(model, tasks, timer, **kw)
        batch.rewards = torch.full_like(batch.rewards, float("nan"))
        return batch, metrics

    def close(self):
        self.engine.close()


def test_non_finite_losses_skip_steps_and_stop_the_run_with_a_clear_message(tmp_path):
    """Every loss non-finite: each step is skipped (the weights never see it), counted under health/*, and
    after train.max_bad_steps in a row the run stops, naming the step and the checkpoint to resume from."""
    from conftest import session_for
    from lopd.errors import LopdError
    from lopd.loop import fit, restore

    run_dir = tmp_path / "run"
    session = session_for(small_overrides(run_dir, **{"train.max_bad_steps": 3, "train.max_rollouts": 48,
                                                      "eval.every_rollouts": 0, "rollout.max_new_tokens": 16}),
                          run_dir=run_dir)
    session.engine = PoisonedRewards(session.engine)
    with pytest.raises(LopdError) as stopped:
        fit(session, restore(session), quiet=True)
    error = str(stopped.value)
    assert error.startswith("step 3: 3 steps in a row had a non-finite loss or gradient"), error
    assert "The last good checkpoint is step_000002" in error
    rows = [r for r in RunDir(run_dir).read_metrics() if r["kind"].startswith("train")]
    assert [r["health/skipped_steps"] for r in rows] == [1, 1, 1]
    assert [r["health/nonfinite_losses"] for r in rows] == [1, 1, 1]
    weights = load_file(RunDir(run_dir).latest_checkpoint() / "model" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "crashed" and "non-finite" in status["detail"]


def _files(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Every file of a run directory with its size and modification time: what a refused command must not touch."""
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(run_dir.rglob("*"))
            if p.is_file()}


REFUSED = [
    ("model.name=smollm2-135m", "model.name is tiny in this run, smollm2-135m here"),
    ("algorithm.name=lopd", "algorithm.name is grpo in this run, lopd here"),
    ("model.lora.enabled=true", "model.lora.enabled is false in this run, true here"),
    ("algorithm.lopd.layers=3", "algorithm.lopd.layers is 2 in this run, 3 here"),
    ("rollout.group_size=2", "rollout.group_size is 4 in this run, 2 here"),
    ("env.toolworld.n_train=41", "this run trains on env 'toolworld', and this process has env 'toolworld' (and "
                                 "env.toolworld.n_train differ)"),
]


@pytest.mark.parametrize("override, key", REFUSED, ids=[o.partition("=")[0] for o, _ in REFUSED])
def test_a_resume_that_would_change_the_checkpoint_is_refused_before_anything_is_written(reference_runs, tmp_path,
                                                                                          override, key):
    """Refused in one line naming the key and the keys that may change; the run directory is untouched (its
    config.yaml included), and the run then resumes unchanged (the reference run's step 4 is redone from step
    2's checkpoint, bit for bit)."""
    run_dir = copy_run(reference_runs["grpo"], tmp_path / "run")
    shutil.rmtree(RunDir(run_dir).latest_checkpoint())  # as if killed before step 4's checkpoint was renamed
    (run_dir / "finished").unlink()
    before = _files(run_dir)
    refused = _lopd(["train", run_dir, override])
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr[-2000:]
    assert f"lopd: error: {run_dir}: {key}" in lines[0], lines[0]
    if not override.startswith("env."):
        assert "keys that may change on resume: train.max_rollouts, " in lines[0] and "eval.*" in lines[0]
    assert _files(run_dir) == before
    if override == "model.name=smollm2-135m":  # the run itself is intact: it resumes as if nothing happened
        resumed = _lopd(["train", run_dir])
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert_same(snapshot(run_dir), snapshot(reference_runs["grpo"]))


@pytest.mark.skipif(not _unshare_available(), reason="needs unprivileged user and mount namespaces (unshare)")
@pytest.mark.parametrize("read_only", ["run", "samples"])
def test_a_run_directory_that_turns_read_only_mid_run_is_one_line(tmp_path, read_only):
    """At step 1's failpoint the run directory (or its samples/) is bind-mounted read-only onto itself, in a
    mount namespace of the run's own. The next write (step 1's row, or its evaluated samples) fails: one line, no
    traceback; status.json says "crashed" where it can still be written, and where it cannot, the lock file
    (open for writing since the start) holds the record, which the next start reads."""
    run_dir = tmp_path / "run"
    target = run_dir if read_only == "run" else run_dir / "samples"
    budget = 16 if read_only == "run" else 8  # "run": no evaluation at step 1, so the row is the first write
    args = ["train", "--config", "grpo", *small_overrides(run_dir, **{
        "train.max_rollouts": budget, "eval.every_rollouts": 0, "rollout.max_new_tokens": 16, "eval.max_tasks": 2})]
    env = {**os.environ, "OMP_NUM_THREADS": "2", "LOPD_FAILPOINT": "remember:1",
           "LOPD_FAILPOINT_RUN": f"mount --bind {target} {target} && mount -o remount,bind,ro {target}"}
    out = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", *LOPD, *args], capture_output=True,
                         text=True, timeout=600, env=env)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    written = "metrics.jsonl" if read_only == "run" else "samples/test_step000001.jsonl"
    assert lines[0] == f"lopd: error: {run_dir / written}: cannot write (read-only file system)"
    status = json.loads((run_dir / "status.json").read_text())
    if read_only == "samples":
        assert status["state"] == "crashed" and "read-only file system" in status["detail"]
    else:  # status.json could not be written; the lock file says how the process ended
        assert status["state"] == "running"
        recorded = RunDir(run_dir).read_status()
        assert recorded["state"] == "crashed" and "read-only file system" in recorded["detail"]


def _heads(V: int = 6, H: int = 3, seed: int = 0):
    """A student head and a teacher head with the same weights, the teacher's with a -inf bias on tokens 0 and 3:
    the teacher calls them impossible where the student gives them mass."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    student, teacher = torch.nn.Linear(H, V).double(), torch.nn.Linear(H, V).double()
    with torch.no_grad():
        for head in (student, teacher):
            head.weight.copy_(weight)
            head.bias.zero_()
        teacher.bias[[0, 3]] = -math.inf
    return student, teacher


@pytest.mark.parametrize("estimator", ["full", "topk", "sampled", "jsd"])
def test_a_teacher_with_minus_inf_logits_where_the_student_has_mass_is_floored_and_counted(estimator):
    """The true KL is +inf there (and the naive gradient NaN): the loss is finite, its gradient finite and
    moving the student's mass off the impossible tokens, and every trained token the teacher calls impossible
    is counted (what `health/teacher_impossible` reports)."""
    from lopd.losses import LOG_FLOOR, impossible, token_divergence
    from lopd.tokens import TokenStats

    s_head, t_head = _heads()
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[0, 1, 3, 2], [1, 0, 4, 5]])  # tokens 0 and 3 sampled by the student: 3 times
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float64)
    student = TokenStats(hidden, s_head, targets, mask, 1.0, chunk=2)
    teacher = TokenStats(hidden.detach(), t_head, targets, mask, 1.0, chunk=2).detached()
    per_token = token_divergence(student, teacher, estimator, topk=3, alpha=0.5)
    loss = (per_token * mask).sum()
    (grad,) = torch.autograd.grad(loss, hidden)
    assert torch.isfinite(per_token).all() and torch.isfinite(grad).all()
    assert loss.item() > 0
    counted = impossible(teacher.logprobs(), mask)
    assert counted.sum().item() == 3 and counted[0, 0] == 1 and counted[0, 2] == 1 and counted[1, 1] == 1
    if estimator == "full":  # exactly KL(student || teacher) with the teacher's zeros floored at exp(LOG_FLOOR)
        log_p = torch.log_softmax(s_head(hidden.detach()), -1)
        log_q = torch.log_softmax(t_head(hidden.detach()), -1).clamp(min=LOG_FLOOR)
        torch.testing.assert_close(per_token.detach() * mask, (log_p.exp() * (log_p - log_q)).sum(-1) * mask)
    if estimator != "topk":  # (topk's tail bucket lumps the impossible tokens with possible ones)
        # a small step along the gradient moves the student's mass off the tokens the teacher calls impossible
        p_before = torch.softmax(s_head(hidden.detach()), -1)[..., [0, 3]].sum()
        p_after = torch.softmax(s_head(hidden.detach() - 1e-3 * grad), -1)[..., [0, 3]].sum()
        assert p_after < p_before


def test_what_may_change_on_resume(tmp_path, monkeypatch):
    """The budget, evaluation, logging, device and memory keys may change; a file-path env named relatively
    or absolutely is the same env; anything else is a change, an env option that one side lacks included."""
    from lopd.config import load_config
    from lopd.runs import _UNSET, config_changes

    monkeypatch.chdir(tmp_path)
    saved = load_config("grpo", ["env.name=my_env.py:MyEnv", "env.options.n=3"])
    same = load_config("grpo", [f"env.name={tmp_path / 'my_env.py'}:MyEnv", "env.options.n=3",
                                "train.max_rollouts=99", "eval.max_tasks=1", "eval.every_rollouts=8",
                                "env.eval_splits=val", "run.dir=elsewhere", "run.progress=false", "train.threads=1",
                                "train.device=cpu", "train.micro_batch_size=2", "train.memory_budget_gib=1.5"])
    assert config_changes(saved, same) == []
    other = load_config("grpo", ["env.name=my_env.py:MyEnv", "env.options.seed=1", "optim.lr=0.5",
                                 "rollout.temperature=0.7"])
    assert config_changes(saved, other) == [("env.options.n", 3, _UNSET), ("env.options.seed", _UNSET, 1),
                                            ("optim.lr", 3e-4, 0.5), ("rollout.temperature", 1.0, 0.7)]


TRAIN_POLICY = [sys.executable, str(Path(__file__).parents[1] / "scripts" / "train_tiny_policy.py"),
                "--examples", "2000", "--steps", "45", "--hidden", "64", "--layers", "2", "--heads", "2",
                "--checkpoint-every", "10", "--eval-every", "45"]  # 32 batches an epoch: the kill may land in either


@pytest.mark.slow  # ~60 s: two short pre-training runs of a 64-wide policy
def test_the_policy_pretraining_script_killed_mid_run_resumes_to_the_same_weights(tmp_path):
    """scripts/train_tiny_policy.py (the bundled policy's recipe, an hour or more on 2 cores): SIGKILL after its
    second checkpoint, then the same command, gives the uninterrupted run's weights and evaluation; a resume
    with another recipe is refused in one line naming the flag."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2"}
    whole = subprocess.run(TRAIN_POLICY + ["--out", str(tmp_path / "whole")], capture_output=True, text=True, env=env)
    assert whole.returncode == 0, whole.stderr[-2000:]
    out = tmp_path / "killed"
    proc = subprocess.Popen(TRAIN_POLICY + ["--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    state = out / "checkpoint" / "state.pt"
    while proc.poll() is None and not (state.exists() and torch.load(state, weights_only=False)["step"] >= 20):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (out / "model.safetensors").exists()  # the first evaluation (and save) is at the last step
    resumed = subprocess.run(TRAIN_POLICY + ["--out", str(out)], capture_output=True, text=True, env=env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "whole" / "model.safetensors").read_bytes()
    logs = [json.loads((d / "training_log.json").read_text())["eval"] for d in (out, tmp_path / "whole")]
    assert logs[0] == logs[1]
    refused = subprocess.run(TRAIN_POLICY + ["--out", str(out), "--lr", "1e-3"], capture_output=True, text=True, env=env)
    assert refused.returncode != 0
    assert refused.stderr.strip().splitlines()[-1] == f"{state}: written with --lr 0.003, not 0.001; run with the same recipe to resume, or use another --out"

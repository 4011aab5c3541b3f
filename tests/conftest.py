"""Shared fixtures. The expensive ones are trained once per `make test` and read by every test that needs
them (torchtune's pattern): `reference_runs` holds one uninterrupted tiny GRPO and one tiny LOPD run, made
through the real CLI, which the resume, fault-injection, run-directory, inspect and CLI tests compare
against or read (copy one before changing it)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zygote

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# `make test` runs the suite in pytest-xdist workers. Each worker gets its share of the cores, and so does
# every process it starts (OMP_NUM_THREADS is inherited): two workers of 2 threads on 2 cores spin-wait on
# each other. Runs that are compared bit for bit all use this one thread count (`small_overrides`).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, (os.cpu_count() or 1) // WORKERS)
if WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(THREADS)
    torch.set_num_threads(THREADS)


# `make test` hands whole files to its 2 workers in collection order (--dist loadfile --no-loadscope-reorder;
# xdist's own reorder puts the files with the most tests first, which left the fewest-but-longest last, one
# worker idle for the tail). The longest files go first, as measured (seconds of tests, `--junitxml`,
# 2026-12-04); the rest keep their order after them. Longest first keeps the tail short.
LONGEST_FIRST = ["test_faults.py", "test_plugin_env.py", "test_update.py", "test_lopd.py", "test_compare.py",
                 "test_loop.py", "test_dist.py", "test_pretrain.py", "test_humaneval.py"]


def pytest_sessionfinish(session):
    zygote.shutdown()  # this process's warm process for CLI runs (tests/zygote.py)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order is kept


@pytest.fixture(scope="session")
def tiny():
    """The bundled tiny policy and its tokenizer (float32, CPU)."""
    from lopd.models import load_policy
    from lopd.schema import ModelConfig

    torch.manual_seed(0)
    return load_policy(ModelConfig(name="tiny"))


@pytest.fixture(scope="session")
def toolworld():
    from lopd.envs.toolworld import ToolWorld, ToolWorldConfig

    return ToolWorld(ToolWorldConfig(seed=0))


def small_overrides(run_dir, **extra) -> list[str]:
    """A few-second training run on the tiny policy."""
    items = {
        "run.dir": str(run_dir), "run.checkpoint_every": 2, "run.progress": "false",
        "rollout.tasks_per_step": 2, "rollout.group_size": 4, "rollout.max_new_tokens": 48,
        "train.max_rollouts": 32, "eval.every_rollouts": 16, "eval.max_tasks": 4, "optim.lr": 1e-3,
        "env.toolworld.n_train": 40, "env.toolworld.n_test": 8, "env.toolworld.n_transfer": 8,
        "train.threads": THREADS,  # bit-identical comparisons need the same thread count in every process
    }
    items.update(extra)
    return [f"{k}={v}" for k, v in items.items()]


_SESSIONS: list = []  # sessions built by the current test (their run-directory locks are released after it)
_SESSION_ROOT: list[Path] = []  # a pytest-managed folder for the run directories of `session_for`


@pytest.fixture(scope="session", autouse=True)
def _session_root(tmp_path_factory):
    _SESSION_ROOT.append(tmp_path_factory.mktemp("sessions"))
    yield


@pytest.fixture(autouse=True)
def _release_sessions():
    yield
    while _SESSIONS:
        _SESSIONS.pop().run.release()
    from lopd.tokens import set_prompt_sharing

    set_prompt_sharing(True)  # a session built with train.share_prompts=false set it for the whole process


def session_for(overrides=(), env=None, run_dir=None, config=None):
    """A wired training session (`lopd.session.build`) of `config` (default: the bundled default) on the
    tiny policy, seeded; its run directory (where
    LOPD's bank and Skill-SD's library live) is `run_dir` or a fresh folder under pytest's temporary root
    (removed with it); its lock is released when the test ends."""
    import tempfile

    from lopd.config import load_config
    from lopd.session import build

    folder = run_dir if run_dir is not None else tempfile.mkdtemp(prefix="session-", dir=_SESSION_ROOT[0])
    session = build(load_config(config, list(overrides) + [f"run.dir={folder}"]), env=env)
    _SESSIONS.append(session)
    return session


def rollouts(session, tasks, rewards=None):
    """One batch of real rollouts of `tasks` from the session's policy; `rewards` overrides the env's
    verdicts (e.g. mixed groups, so advantages are non-zero)."""
    from lopd.rollout import collect

    batch = collect(session.model, session.tokenizer, session.env, tasks, session.cfg.rollout)
    if rewards is not None:
        batch.rewards = torch.tensor(rewards, dtype=torch.float32)[: len(batch)]
        batch.success = batch.rewards > 0.5
    return batch


# ------------------------------------------------------------------------------ the shared reference runs

LOPD_CLI = [sys.executable, "-m", "lopd.cli"]
REFERENCE_EXTRA = {  # the canonical tiny runs: 4 steps of 8 rollouts, checkpoints at 2 and 4, evaluations at 0, 16, 32
    "grpo": {},
    # LOPD with dual ascent on, the gate open, and partial-credit rewards (so that groups with a context also
    # have reward variance, and lambda moves)
    "lopd": {"algorithm.lopd.latent_tokens": 64, "algorithm.lopd.dual_lr": 0.5, "algorithm.lopd.gate_init": 0.5,
             "env.toolworld.reward": "partial"},
    "lopd_pretrained": {},  # LOPD's selection: the bundled pre-trained compressor's 16 slots, frozen
}


def reference_args(algorithm: str, run_dir) -> list[str]:
    """The CLI arguments of the canonical tiny run of `algorithm` (a killed or stopped copy uses the same)."""
    return ["train", "--config", algorithm, *small_overrides(run_dir, **REFERENCE_EXTRA[algorithm])]


def reference_config(algorithm: str, run_dir):
    """The canonical run's config, for training it in this process (`lopd.train`)."""
    from lopd.cli import resolve_train_config

    args = reference_args(algorithm, run_dir)
    return resolve_train_config(args[2], args[3:])


def cli(args, failpoint=None, timeout=600, **kw) -> subprocess.CompletedProcess:
    """`lopd ARGS` in a subprocess (with LOPD_FAILPOINT set to `failpoint`, if given)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2"}
    env.pop("LOPD_FAILPOINT", None)
    if failpoint:
        env["LOPD_FAILPOINT"] = failpoint
    return zygote.run(LOPD_CLI + [str(a) for a in args], capture_output=True, text=True, env=env, timeout=timeout, **kw)


class ReferenceRuns:
    """`runs["grpo"]`: the finished canonical run's directory, trained through the CLI on first use. Shared by
    the pytest-xdist workers (one trains it under a file lock, the others wait and read it); never changed
    by a test (copy it with `copy_run` first)."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def __getitem__(self, algorithm: str) -> Path:
        from filelock import FileLock

        run_dir = self.root / algorithm
        with FileLock(str(self.root / f"{algorithm}.lock")):
            if not (run_dir / "finished").is_file():
                shutil.rmtree(run_dir, ignore_errors=True)
                done = cli(reference_args(algorithm, run_dir))
                assert done.returncode == 0, done.stderr[-2000:]
                assert "report:" in done.stdout
        return run_dir


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory, worker_id) -> ReferenceRuns:
    base = tmp_path_factory.getbasetemp()
    return ReferenceRuns((base.parent if worker_id != "master" else base) / "reference_runs")


def copy_run(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("lock"))
    return target


def snapshot(run_dir: Path) -> dict:
    """Everything a resumed run must reproduce exactly: the newest checkpoint's weights and optimizer, the
    metrics rows (without time/* and memory/*), the experience bank, the evaluated samples."""
    from safetensors.torch import load_file

    from lopd.runs import RunDir

    run = RunDir(run_dir)
    ckpt = run.latest_checkpoint()
    weights = load_file(next((ckpt / "model").glob("*.safetensors")))
    optimizer = torch.load(ckpt / "optimizer.pt", weights_only=False)
    rows = [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))} for r in run.read_metrics()]
    bank = (run.bank_dir / "entries.jsonl").read_text() if run.bank_dir.is_dir() else None
    samples = {p.name: p.read_text() for p in sorted(run.samples_dir.glob("*.jsonl"))}
    state = torch.load(ckpt / "state.pt", weights_only=False)
    return {"checkpoint": ckpt.name, "weights": weights, "optimizer": optimizer, "rows": rows, "bank": bank,
            "samples": samples, "algorithm": state["algorithm"]}


def assert_same(a: dict, b: dict) -> None:
    """Bit for bit: weights, optimizer state, rows, bank, samples and the algorithm's state (composer, lambda)."""
    assert a["checkpoint"] == b["checkpoint"]
    assert a["weights"].keys() == b["weights"].keys()
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i] if torch.is_tensor(sa[i][k]))
    assert a["rows"] == b["rows"]
    assert a["bank"] == b["bank"]
    assert a["samples"] == b["samples"]
    for k, v in a["algorithm"].get("composer", {}).items():
        assert torch.equal(v, b["algorithm"]["composer"][k]), k
    assert a["algorithm"].get("lambda") == b["algorithm"].get("lambda")

"""Your own env, as docs/own_env.md writes it: examples/unit_converter.py trained end to end through the CLI
(`env.name=file.py:Class`, resumed from another working directory) and the Python API, resumed with a plain
`lopd train RUN_DIR`; an env defined in a script's `__main__` bound to its run (resumed by the script, refused
without it or with another env); the Env contract as the code needs it (no `reference()` but for OPSD; a
`score()` that raises or returns NaN stops the run in one line naming the task, and the run resumes); and the
one-line errors of a bad import path, a class that is not an Env, and an env whose tasks() raises."""

import json
import os
import sys
from pathlib import Path

import pytest

import zygote
from conftest import small_overrides

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "unit_converter.py"
PLUGIN = f"{EXAMPLE}:UnitConverter"


def lopd(*args, cwd=ROOT, env=None):
    return zygote.run([sys.executable, "-m", "lopd.cli", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "2", **(env or {})}, timeout=600)


def _small(run_dir, **extra):
    items = small_overrides(run_dir, **{"env.name": PLUGIN, "env.options.n": 40, "env.eval_splits": "[test]",
                                        "rollout.max_new_tokens": 32, **extra})
    return [i for i in items if not i.startswith("env.toolworld")]


def _rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("algorithm", [pytest.param("grpo", marks=pytest.mark.slow), "lopd"])
def test_cli_trains_and_resumes_a_plugin_env(tmp_path, algorithm):
    """Named by a path relative to the working directory, recorded as the file's absolute path: the run
    resumes from anywhere."""
    run_dir = tmp_path / "run"
    relative = "examples/unit_converter.py:UnitConverter"
    done = lopd("train", "--config", algorithm, *_small(run_dir, **{"train.max_rollouts": 8, "env.name": relative}))
    assert done.returncode == 0, done.stderr[-2000:]
    assert (run_dir / "finished").read_text() == "8"
    assert "env:\n  name: " + PLUGIN in (run_dir / "config.yaml").read_text()
    # a plain `lopd train RUN_DIR`, from another directory, rebuilds the env from config.yaml and extends the run
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    more = lopd("train", run_dir, "train.max_rollouts=16", cwd=elsewhere)
    assert more.returncode == 0, more.stderr[-2000:]
    assert f"resuming {run_dir} from step_000001 (8 of 16 rollouts); previous process: finished" in more.stdout
    rows = _rows(run_dir)
    assert [r["step"] for r in rows if r["kind"] != "eval"] == [1, 2]
    assert any("eval/test/success" in r for r in rows)
    assert (run_dir / "finished").read_text() == "16"


def test_python_api_trains_evaluates_and_the_cli_resumes(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    from unit_converter import UnitConverter

    import lopd

    cfg = lopd.load_config("grpo", [i for i in _small(tmp_path / "api", **{"train.max_rollouts": 8})
                                    if not i.startswith("env.")] + ["env.eval_splits=test", "env.options.n=40"])
    run_dir = lopd.train(cfg, env=UnitConverter(n=40), quiet=True)
    assert (run_dir / "finished").is_file()
    saved = (run_dir / "config.yaml").read_text()
    assert "name: unit_converter:UnitConverter" in saved  # the object's import path is recorded
    results = lopd.evaluate(run_dir, env=UnitConverter(n=40), splits=["test"])
    assert results[0].split == "test" and results[0].n == 4 and "step_000001" in results[0].checkpoint
    resumed = lopd_cli_resume(run_dir)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (run_dir / "finished").read_text() == "16"


def lopd_cli_resume(run_dir):
    path = os.pathsep.join(p for p in [str(EXAMPLE.parent), os.environ.get("PYTHONPATH", "")] if p)
    return lopd("train", run_dir, "train.max_rollouts=16", env={"PYTHONPATH": path})


BROKEN = '''
class NotAnEnv:
    def tasks(self, split):
        return []

class Raises:
    def tasks(self, split):
        raise RuntimeError("the data server is down")
    def score(self, task, completion):
        return None
'''


@pytest.mark.parametrize("name, expected", [
    ("no_such_module:Env", "env.name: cannot import module 'no_such_module'"),
    ("broken.py:Missing", "/broken.py' has no attribute 'Missing'"),  # named by its absolute path
    ("broken.py:NotAnEnv", "is not an Env: it has no method score"),
    ("broken.py:Raises", "env.train_split: Raises.tasks('train') raised RuntimeError: the data server is down"),
])
def test_bad_plugins_fail_in_one_line_naming_the_key(tmp_path, monkeypatch, capsys, name, expected):
    from lopd.cli import main

    (tmp_path / "broken.py").write_text(BROKEN)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", "grpo", f"env.name={name}", f"run.dir={tmp_path / 'run'}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lopd: error: ") and expected in lines[0], lines
    assert not (tmp_path / "run" / "config.yaml").exists()  # a rejected config leaves no run behind


def test_options_the_factory_does_not_take_are_named(tmp_path, capsys):
    from lopd.cli import main

    assert main(["train", "--config", "grpo", f"env.name={PLUGIN}", "env.options.colour=red",
                 f"run.dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err
    assert "env.options: " in err and "colour" in err and "n, seed" in err


SCRIPT = """
import sys

import lopd
from lopd import Score, Task


class Echo:  # defined in the script's __main__, and without reference(): only OPSD needs one
    def tasks(self, split):
        words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"]
        rows = [Task(f"{split}-{i}", ({"role": "user", "content": f"Say {w}."},), w) for i, w in enumerate(words)]
        return rows if split == "train" else rows[:2]

    def score(self, task, completion):
        said = task.answer in completion
        return Score(float(said) + 0.5 * (len(completion) % 2), said, "Said it." if said else "Did not say it.")


class Other(Echo):
    pass


if __name__ == "__main__":
    budget, which = sys.argv[1], sys.argv[2]
    cfg = lopd.load_config("grpo", [f"train.max_rollouts={budget}", "rollout.tasks_per_step=2", "rollout.group_size=4",
                                    "rollout.max_new_tokens=8", "eval.max_tasks=2", "env.eval_splits=test",
                                    "run.progress=false", "run.checkpoint_every=1", *sys.argv[3:]])
    print("run directory:", lopd.train(cfg, env={"echo": Echo, "other": Other}[which]()))
"""


def _script(tmp_path, *args):
    return zygote.run([sys.executable, str(tmp_path / "train_echo.py"), *map(str, args)], cwd=tmp_path,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"}, timeout=600)


def test_an_env_from_a_scripts_main_is_bound_to_its_run(tmp_path):
    """The README's Python pattern: the run is named after the class and records it as `__main__:Echo`; the
    script resumes it by passing the object again; `lopd train RUN_DIR` cannot rebuild it and says how to
    resume, in one line; the script with another env on the same run directory is refused in one line. The
    env has no reference(): it trains and evaluates all the same."""
    (tmp_path / "train_echo.py").write_text(SCRIPT)
    first = _script(tmp_path, 8, "echo")
    assert first.returncode == 0, first.stderr[-2000:]
    run_dir = tmp_path / "runs" / "grpo_Echo_seed0"
    assert "name: __main__:Echo" in (run_dir / "config.yaml").read_text()
    samples = [json.loads(line) for line in (run_dir / "samples" / "test_step000001.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and all(s["reference"] is None for s in samples)
    config = (run_dir / "config.yaml").read_bytes()

    refused = lopd("train", "runs/grpo_Echo_seed0", "train.max_rollouts=16", cwd=tmp_path)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr[-2000:]
    assert "'__main__:Echo' is a class defined in a script's __main__" in lines[0]
    assert "lopd.train(cfg, env=Echo(...))" in lines[0]

    other = _script(tmp_path, 16, "other", "run.dir=runs/grpo_Echo_seed0")
    assert other.returncode != 0
    assert other.stderr.strip().splitlines()[-1].endswith(
        "runs/grpo_Echo_seed0: this run trains on env '__main__:Echo', and this process has env '__main__:Other': "
        "a run never continues on another task; start another run (another run.dir) for it"), other.stderr[-2000:]
    assert (run_dir / "config.yaml").read_bytes() == config  # neither refusal wrote anything

    again = _script(tmp_path, 16, "echo")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming runs/grpo_Echo_seed0 from step_000001 (8 of 16 rollouts); previous process: finished" in again.stdout
    assert [r["step"] for r in _rows(run_dir) if r["kind"] != "eval"] == [1, 2]
    assert (run_dir / "finished").read_text() == "16"


class NoReference:
    def tasks(self, split):
        from lopd import Task

        return [Task(f"{split}-0", ({"role": "user", "content": "Say hi."},), "hi")]

    def score(self, task, completion):
        from lopd import Score

        return Score(1.0, True, "Fine.")


def test_opsd_refuses_an_env_without_reference_before_anything_is_written(tmp_path):
    import lopd
    from lopd.errors import ConfigError

    cfg = lopd.load_config("opsd", [f"run.dir={tmp_path / 'run'}", "env.eval_splits=test"])
    with pytest.raises(ConfigError) as refused:
        lopd.train(cfg, env=NoReference(), quiet=True)
    assert str(refused.value) == ("algorithm.name: opsd needs env.reference(task) (its teacher reads each task's "
                                  "reference answer), and NoReference has no reference method: add one "
                                  "(docs/own_env.md) or train with another algorithm")
    assert not (tmp_path / "run").exists()


RAISES_ONCE = '''
from pathlib import Path

from lopd import Score, Task


class RaisesOnce:
    """Raises in the 2nd step's scoring (after 2 evaluated and 8 trained completions), once: a marker file
    says it did, so the resumed run scores normally."""

    def __init__(self, marker: str):
        self.marker, self.calls = Path(marker), 0

    def tasks(self, split):
        return [Task(f"{split}-{i}", ({"role": "user", "content": f"Count to {i}."},), str(i)) for i in range(4)]

    def score(self, task, completion):
        self.calls += 1
        if self.calls == 11 and not self.marker.exists():
            self.marker.write_text("raised")
            raise ValueError("cannot parse the reply\\nits second line")
        return Score(float(task.answer in completion), task.answer in completion, "Checked.")
'''


def test_a_score_that_raises_is_one_line_marks_the_run_crashed_and_it_resumes(tmp_path):
    (tmp_path / "raises_once.py").write_text(RAISES_ONCE)
    run_dir = tmp_path / "run"
    args = ["train", "--config", "grpo", f"env.name={tmp_path / 'raises_once.py'}:RaisesOnce",
            f"env.options.marker={tmp_path / 'marker'}", "env.eval_splits=test", f"run.dir={run_dir}",
            "train.max_rollouts=16", "rollout.tasks_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=8",
            "eval.max_tasks=2", "run.checkpoint_every=1", "run.progress=false"]
    crashed = lopd(*args)
    lines = crashed.stderr.strip().splitlines()
    assert crashed.returncode == 2 and len(lines) == 1, crashed.stderr[-2000:]
    assert lines[0].startswith("lopd: error: RaisesOnce.score(task 'train-"), lines[0]
    assert lines[0].endswith("raised ValueError: cannot parse the reply"), lines[0]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "crashed" and "EnvError: RaisesOnce.score(task" in status["detail"]
    resumed = lopd("train", run_dir)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "from step_000001 (8 of 16 rollouts); previous process: crashed: EnvError: RaisesOnce.score(" in resumed.stdout
    assert (run_dir / "finished").read_text() == "16"


class Flaky:
    """Scores as `how` says: raise, NaN, inf, or no Score; `score_many` and `score_episode` alike."""

    def __init__(self, how: str):
        self.how = how

    def tasks(self, split):
        from lopd import Task

        return [Task(f"unit-{i}", ({"role": "user", "content": "Convert 3 km to m."},), "3000") for i in range(2)]

    def verdict(self):
        from lopd import Score

        if self.how == "raise":
            raise KeyError("target")
        if self.how == "none":
            return None
        return Score(float(self.how), False, "Wrong.")

    def score(self, task, completion):
        return self.verdict()


class FlakyMany(Flaky):
    def score_many(self, pairs):
        return [] if self.how == "short" else [self.verdict() for _ in pairs]


class FlakyEpisodes(Flaky):
    def step(self, task, history):
        return None

    def score_episode(self, task, history):
        return self.verdict()


BOUNDARY = [
    (Flaky("raise"), "Flaky.score(task 'unit-0') raised KeyError: 'target'"),
    (Flaky("nan"), "Flaky.score(task 'unit-0') returned the non-finite reward nan: rewards must be finite numbers"),
    (Flaky("inf"), "Flaky.score(task 'unit-0') returned the non-finite reward inf: rewards must be finite numbers"),
    (Flaky("none"), "Flaky.score(task 'unit-0') returned NoneType 'None', not a Score(reward, success, feedback)"),
    (FlakyMany("raise"), "FlakyMany.score_many(4 completions of tasks 'unit-0', 'unit-1') raised KeyError: "
                         "'target'"),
    (FlakyMany("nan"), "FlakyMany.score_many(task 'unit-0') returned the non-finite reward nan"),
    (FlakyMany("short"), "FlakyMany.score_many(4 completions of tasks 'unit-0', 'unit-1') returned 0 scores "
                         "for 4 completions"),
    (FlakyEpisodes("raise"), "FlakyEpisodes.score_episode(task 'unit-0') raised KeyError: 'target'"),
    (FlakyEpisodes("nan"), "FlakyEpisodes.score_episode(task 'unit-0') returned the non-finite reward nan"),
]


@pytest.mark.parametrize("env, expected", BOUNDARY, ids=[f"{type(e).__name__}-{e.how}" for e, _ in BOUNDARY])
def test_an_env_score_that_raises_or_is_not_finite_is_one_line_naming_the_task(tiny, env, expected):
    """The boundary where scores enter a RolloutBatch (training and evaluation alike)."""
    from lopd.errors import EnvError
    from lopd.rollout import sample_and_score

    model, tokenizer = tiny
    with pytest.raises(EnvError) as failed:
        sample_and_score(model, tokenizer, env, env.tasks("train"), group_size=2, max_new_tokens=4, max_turns=1)
    message = str(failed.value)
    assert len(message.splitlines()) == 1 and message.startswith(expected), message

"""Your own env, as docs/own_env.md writes it: examples/unit_converter.py trained end to end through the CLI
(`env.name=file.py:Class`) and the Python API, resumed with a plain `lopd train RUN_DIR`, and the one-line
errors of a bad import path, a class that is not an Env, and an env whose tasks() raises."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import small_overrides

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "unit_converter.py"
PLUGIN = f"{EXAMPLE}:UnitConverter"


def lopd(*args, cwd=ROOT, env=None):
    return subprocess.run([sys.executable, "-m", "lopd.cli", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "2", **(env or {})}, timeout=600)


def _small(run_dir, **extra):
    items = small_overrides(run_dir, **{"env.name": PLUGIN, "env.options.n": 40, "env.eval_splits": "[test]",
                                        "rollout.max_new_tokens": 32, **extra})
    return [i for i in items if not i.startswith("env.toolworld")]


def _rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("algorithm", [pytest.param("grpo", marks=pytest.mark.slow), "lopd"])
def test_cli_trains_and_resumes_a_plugin_env(tmp_path, algorithm):
    run_dir = tmp_path / "run"
    done = lopd("train", "--config", algorithm, *_small(run_dir, **{"train.max_rollouts": 16}))
    assert done.returncode == 0, done.stderr[-2000:]
    assert (run_dir / "finished").read_text() == "16"
    assert "env:\n  name: " + PLUGIN in (run_dir / "config.yaml").read_text()
    # a plain `lopd train RUN_DIR` rebuilds the env from the import path in config.yaml, and extends the run
    more = lopd("train", run_dir, "train.max_rollouts=24")
    assert more.returncode == 0, more.stderr[-2000:]
    rows = _rows(run_dir)
    assert [r["step"] for r in rows if r["kind"] != "eval"] == [1, 2, 3]
    assert any("eval/test/success" in r for r in rows)
    assert (run_dir / "finished").read_text() == "24"


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
    return lopd("train", run_dir, "train.max_rollouts=16", env={"PYTHONPATH": str(EXAMPLE.parent)})


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
    ("broken.py:Missing", "env.name: module 'broken.py' has no attribute 'Missing'"),
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

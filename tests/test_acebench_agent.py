"""ACEBench agent_multi_step: the simulated phone, ground-truth replay, perturbations, the episode driver.

No model runs here. The tests that read the benchmark's data skip when it is not found (`resolve_data_dir`).
"""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lopd.envs import ENVS, build_env
from lopd.envs.acebench import ACEBenchConfig, resolve_data_dir
from lopd.envs.acebench_agent import (
    FINISH, GROUND_TRUTH_REPLAY_FAILS, MILESTONE_FIXES, NUDGE, SPLITS, ACEBenchAgent, assistant_replies,
    corrected_milestone, in_order, milestone_alternatives, parse_step, play, process_official, render_step, same,
)
from lopd.envs.acebench_scenarios import Phone
from lopd.envs.base import DataError, Env
from lopd.envs.calls import Call, ParseFailure, parse_calls
from lopd.errors import ConfigError


def _data_available() -> bool:
    try:
        resolve_data_dir()
    except DataError:
        return False
    return True


needs_data = pytest.mark.skipif(not _data_available(), reason="ACEBench data not found")
MODES = ("official", "strict")
# Milestone alternatives other than the first that cannot reach the ground truth: rows 8 and 9's second one
# reads and deletes messages before logging the device in (it starts logged out).
OTHER_ALTERNATIVES_FAILING = {("agent_multi_step_8", 1), ("agent_multi_step_9", 1)}


@pytest.fixture(scope="module")
def env():
    return ACEBenchAgent(ACEBenchConfig(mode="strict"))


@pytest.fixture(scope="module")
def tasks(env):
    return {t.id: t for t in env.tasks("all")}


def _modes(env, task, history) -> dict[str, bool]:
    return {mode: s.success for mode, s in env.score_modes(task, history).items()}


def _episode(env, task, replies: list[str]) -> list[dict]:
    """The history an agent writing `replies` (then finishing) would have, the env answering each turn."""
    history = list(task.messages)
    for reply in replies:
        history.append({"role": "assistant", "content": reply})
        history += env.step(task, history) or []
    return history + [{"role": "assistant", "content": FINISH}]


def _steps(task) -> list[str]:
    return [render_step(s) for s in corrected_milestone(task)]


# ------------------------------------------------------------------------------------- the phone


def test_messages_capacity_ids_and_dates():
    phone = Phone(("BaseApi", "MessageApi"), {"BaseApi": {"wifi": True, "logged_in": True}})
    hi = {"sender_name": "Eve", "receiver_name": "Frank", "message": "hi"}
    assert phone.call("send_message", hi)["status"] is False  # the inbox is full
    assert phone.call("get_latest_message_id", {})["message_id"] == 4  # by date (2024-09-09), not by id
    assert phone.call("get_earliest_message_id", {})["message_id"] == 3  # 2023-12-05
    assert phone.call("delete_message", {"message_id": 6})["status"]
    assert phone.call("delete_message", {"message_id": "5"})["status"] is False  # ids are integers
    assert phone.call("send_message", hi)["status"]
    inbox = phone.state()["MessageApi"]["inbox"]
    assert list(inbox) == ["1", "2", "3", "4", "5", "7"]  # the next id after the highest used: 6 is not reused
    assert inbox["7"] == {"sender_id": "USR100", "receiver_id": "USR101", "message": "hi"}  # no time
    assert phone.call("get_latest_message_id", {})["status"] is False  # an undated message: no ordering by date
    found = phone.call("search_messages", {"user_name": "Isaac", "keyword": "CALL"})
    assert [m["id"] for m in found["messages"]] == [5]


def test_device_switches_gate_the_apps():
    phone = Phone(("BaseApi", "MessageApi", "FoodPlatform"), {"BaseApi": {"wifi": False, "logged_in": False}})
    grace_to_helen = {"sender_name": "Grace", "receiver_name": "Helen"}
    assert phone.call("view_messages_between_users", grace_to_helen)["status"] is False
    assert phone.call("search_messages", {"user_name": "Helen", "keyword": "tea"})["status"]  # needs no login
    assert phone.call("login_food_platform", {"username": "Eve", "password": "password123"})["status"] is False
    phone.call("turn_on_wifi", {})
    assert phone.call("login_food_platform", {"username": "Eve", "password": "nope"})["status"] is False
    assert phone.call("login_food_platform", {"username": "Eve", "password": "password123"})["status"]
    assert phone.call("login_food_platform", {"username": "Eve", "password": "password123"})["status"] is False
    order = {"username": "Eve", "merchant_name": "Domino's", "items": [{"product": "Margherita Pizza", "quantity": 2}]}
    assert phone.call("add_food_delivery_order", order)["status"]  # ordering needs the platform login only
    assert phone.state()["FoodPlatform"]["users"]["Eve"]["balance"] == 500.0 - 136.0
    phone.call("login_device", {})
    assert phone.call("view_messages_between_users", grace_to_helen)["status"]
    assert phone.state()["BaseApi"] == {"wifi": True, "logged_in": True}


def test_food_orders_check_menu_quantity_and_balance():
    phone = Phone(("BaseApi", "FoodPlatform"), {"BaseApi": {"wifi": True}})
    phone.call("login_food_platform", {"username": "Jack", "password": "password654"})
    too_dear = {"username": "Jack", "merchant_name": "Jiutian BBQ", "items": [{"product": "Korean Grilled Beef"}]}
    assert phone.call("add_food_delivery_order", too_dear)["status"] is False  # 128 > 120
    for items in ([{"product": "Grilled Pork Belly", "quantity": 0}],
                  [{"product": "Grilled Pork Belly", "quantity": "1"}], [{"product": "Pork Belly", "quantity": 1}]):
        assert phone.call("add_food_delivery_order", {**too_dear, "items": items})["status"] is False
    assert "error" in phone.call("add_food_delivery_order", {**too_dear, "items": [5]})  # not an object
    assert phone.call("check_balance", {"user_name": "Jack"}) == 120.0 and phone.state()["FoodPlatform"]["orders"] == []
    assert phone.call("get_products", {"merchant_name": "Heytea"})[1] == {"product": "Four Seasons Spring Milk Tea",
                                                                          "price": 22.0}


def test_calls_that_cannot_run_get_an_error():
    listed = ("turn_on_wifi", "send_message", "search_reminders", "add_reminder")
    phone = Phone(("BaseApi", "ReminderApi"), {"BaseApi": {"wifi": True, "logged_in": True}}, allowed=listed)
    assert "error" in phone.call("view_all_reminders", {})  # not listed
    assert "error" in phone.call("search_reminders", {"keyword": "x"})  # listed, but the benchmark's app has none
    assert "error" in phone.call("send_message", {"sender_name": "Eve", "receiver_name": "Frank", "message": "x"})
    assert "error" in phone.call("add_reminder", {"title": "x"})  # missing arguments
    assert "error" in phone.call("add_reminder", {"title": "x", "description": "y", "time": "z", "when": 1})
    assert phone.call("add_reminder", {"title": "x", "description": "y", "time": "z"})["status"]
    assert phone.state()["ReminderApi"]["reminder_list"]["4"]["reminder_id"] == 4
    with pytest.raises(ValueError, match="Travel"):
        Phone(("BaseApi", "Travel"), {})


# ---------------------------------------------------------------------------------------- data


@needs_data
def test_rows_splits_and_registration(env, tasks):
    assert len(tasks) == 20 and set(env.splits()) == set(SPLITS)
    assert isinstance(env, Env) and "acebench_agent" in ENVS
    from lopd.schema import EnvConfig
    assert isinstance(build_env(EnvConfig(name="acebench_agent")), ACEBenchAgent)
    train, test = env.tasks("train"), env.tasks("test")
    train_ids, test_ids = {t.id for t in train}, {t.id for t in test}
    assert train_ids | test_ids == set(tasks) and not train_ids & test_ids
    assert not {t.meta["row"]["question"] for t in train} & {t.meta["row"]["question"] for t in test}  # by question
    assert [t.id for t in ACEBenchAgent(ACEBenchConfig(seed=0)).tasks("train")] == [t.id for t in train]
    assert len({tuple(t.id for t in ACEBenchAgent(ACEBenchConfig(seed=s)).tasks("train")) for s in range(6)}) > 1
    assert env.tasks("agent_multi_step") == env.tasks("all")
    task = tasks["agent_multi_step_0"]
    assert [m["role"] for m in task.messages] == ["system", "user"] and FINISH in task.messages[0]["content"]
    assert '"name": "add_food_delivery_order"' in task.messages[0]["content"] and task.category == "agent_multi_step"
    with pytest.raises(ConfigError, match="simulated user"):
        env.tasks("agent_multi_turn")
    with pytest.raises(ConfigError, match="no split"):
        env.tasks("normal_atom_bool")
    with pytest.raises(ConfigError):
        ACEBenchAgent(ACEBenchConfig(mode="loose"))


@needs_data
def test_every_milestone_step_parses(tasks):
    for task in tasks.values():
        for steps in milestone_alternatives(task):
            for step in steps:
                assert not isinstance(parse_step(step), ParseFailure), (task.id, step)
    assert isinstance(parse_calls("[add_reminder(title='Today's spending')]"), ParseFailure)  # the data's quoting
    assert parse_step("[add_reminder(title='Today's spending')]")[0].arguments == {"title": "Today's spending"}


@needs_data
def test_malformed_agent_row_is_a_data_error(tmp_path):
    data = resolve_data_dir()
    (tmp_path / "possible_answer").mkdir()
    shutil.copy(data / "possible_answer" / "data_agent_multi_step.json", tmp_path / "possible_answer")
    rows = [json.loads(line) for line in (data / "data_agent_multi_step.json").read_text().splitlines() if line]
    rows[3]["involved_classes"] = ["BaseApi", "Bank"]
    (tmp_path / "data_agent_multi_step.json").write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DataError, match=r"data_agent_multi_step.json:4: key 'involved_classes'"):
        ACEBenchAgent(ACEBenchConfig(data_dir=str(tmp_path))).tasks("all")


# ------------------------------------------------------------------------------ ground-truth replay


@needs_data
def test_milestone_replay_reproduces_the_ground_truth_except_the_listed_rows(env, tasks):
    failing = {mode: set() for mode in MODES}
    for task in tasks.values():
        for k, steps in enumerate(milestone_alternatives(task)):
            ok = _modes(env, task, env.milestone_history(task, steps))
            if k == 0:
                for mode in MODES:
                    if not ok[mode]:
                        failing[mode].add(task.id)
            else:
                assert all(ok.values()) == ((task.id, k) not in OTHER_ALTERNATIVES_FAILING), (task.id, k, ok)
    assert failing["official"] == failing["strict"] == set(GROUND_TRUTH_REPLAY_FAILS)
    assert set(MILESTONE_FIXES) == set(GROUND_TRUTH_REPLAY_FAILS) and len(GROUND_TRUTH_REPLAY_FAILS) == 8


@needs_data
def test_corrected_milestones_reproduce_every_ground_truth(env, tasks):
    for task in tasks.values():
        history = env.milestone_history(task)  # the corrected milestone, one step a reply
        assert _modes(env, task, history) == {"official": True, "strict": True}, task.id
        report = env.report(task, history)
        assert report["success"] == {"official": True, "strict": True} and report["process_official"] == 1.0
        assert env.reference(task).split("\n") == _steps(task)
        assert all(not isinstance(parse_calls(line), ParseFailure) for line in env.reference(task).split("\n"))


@needs_data
def test_one_reply_with_every_call_scores_like_the_episode(env, tasks):
    task = tasks["agent_multi_step_2"]  # nothing in its milestone depends on an observation
    calls = ", ".join(step[1:-1] for step in _steps(task))
    assert env.score(task, f"[{calls}]").success
    assert not env.score(task, "I would log in and order the pork belly.").success


# ------------------------------------------------------------------------------------ perturbations


def _perturbed(env, task, edit) -> dict[str, bool]:
    return _modes(env, task, _episode(env, task, edit(_steps(task))))


@needs_data
def test_wrong_argument_values_fail(env, tasks):
    task = tasks["agent_multi_step_2"]
    assert _perturbed(env, task, lambda s: [x.replace('"quantity": 1', '"quantity": 2') for x in s]) == \
        {"official": False, "strict": False}  # 2 x 78 > 120: no order, balance untouched
    task = tasks["agent_multi_step_4"]
    assert _perturbed(env, task, lambda s: [x.replace("afternoon's meeting", "afternoon meeting") for x in s]) == \
        {"official": False, "strict": False}
    to_grace = lambda s: [x.replace('receiver_name="Frank"', 'receiver_name="Grace"') for x in s]  # noqa: E731
    assert _perturbed(env, task, to_grace) == {"official": False, "strict": False}
    task = tasks["agent_multi_step_0"]  # the reminder text: official never checks rows 0-1's "ReminderAPI" class
    assert _perturbed(env, task, lambda s: [x.replace("88.0 yuan", "88 yuan") for x in s]) == \
        {"official": True, "strict": False}


@needs_data
def test_a_missing_call_fails(env, tasks):
    for task_id in ("agent_multi_step_3", "agent_multi_step_5", "agent_multi_step_10", "agent_multi_step_18"):
        task = tasks[task_id]
        for i in range(len(_steps(task))):
            edited = lambda s, i=i: s[:i] + s[i + 1:]
            if any(name in _steps(task)[i] for name in ("get_", "view_", "search_")):
                continue  # a read-only call: leaving it out changes no state
            assert _perturbed(env, task, edited) == {"official": False, "strict": False}, (task_id, i)
    task = tasks["agent_multi_step_1"]  # leaving out its reminder: only strict sees it ("ReminderAPI" is unchecked)
    assert _perturbed(env, task, lambda s: s[:-1]) == {"official": True, "strict": False}


@needs_data
def test_an_extra_destructive_call_fails(env, tasks):
    task = tasks["agent_multi_step_6"]
    wrong = {"official": False, "strict": False}
    assert _perturbed(env, task, lambda s: s + ["[delete_message(message_id=1)]"]) == wrong
    extra_order = ('[add_food_delivery_order(username="Isaac", merchant_name="Heytea", '
                   'items=[{"product": "Cheese Milk Tea"}])]')
    assert _perturbed(env, task, lambda s: s + [extra_order]) == wrong
    # an extra message to someone else: the released rule only checks the ground truth's keys, strict sees it
    task = tasks["agent_multi_step_19"]  # 5 messages left, room for one more
    extra = '[send_message(sender_name="Isaac", receiver_name="Jack", message="bye")]'
    assert _perturbed(env, task, lambda s: s + [extra]) == {"official": True, "strict": False}


@needs_data
def test_wrong_order_fails_where_it_matters(env, tasks):
    task = tasks["agent_multi_step_5"]  # [get_latest, delete 4, send]: sending into a full inbox fails
    assert _perturbed(env, task, lambda s: [s[2], s[0], s[1]]) == {"official": False, "strict": False}
    task = tasks["agent_multi_step_3"]  # [login, order]: ordering before logging in fails
    assert _perturbed(env, task, lambda s: s[::-1]) == {"official": False, "strict": False}
    task = tasks["agent_multi_step_7"]  # the order and the messages are independent: either order is right
    steps = _steps(task)
    swapped = [steps[0], *steps[2:], steps[1]]
    assert _modes(env, task, _episode(env, task, swapped)) == {"official": True, "strict": True}


@needs_data
def test_unparseable_or_finishing_output_ends_the_episode_and_scores_wrong(env, tasks):
    task = tasks["agent_multi_step_3"]
    for reply in ("Sure! Let me log in first.", "", "[login_food_platform(username='Jack', password=password654)]",
                  f"{FINISH} [login_food_platform(username='Jack', password='password654')]"):
        history = [*task.messages, {"role": "assistant", "content": reply}]
        assert env.step(task, history) is None
        verdicts = env.score_modes(task, history)
        assert not verdicts["official"].success and not verdicts["strict"].success
    history = [*task.messages, {"role": "assistant", "content": "I cannot help."}]
    assert "no reply was ever parsed" in env.score_modes(task, history)["official"].feedback
    assert play(task, ["[turn_on_wifi()]", "done", "[login_food_platform(username='Jack', password='password654')]"]
                ).phone.state()["FoodPlatform"]["logged_in_users"] == []  # nothing runs after the episode ended


@needs_data
def test_with_nudge_a_reply_without_calls_is_answered_and_the_episode_goes_on(tasks):
    env = ACEBenchAgent(ACEBenchConfig(mode="official"), nudge=True)  # ACEBench's own loop
    task = tasks["agent_multi_step_3"]
    history = [*task.messages, {"role": "assistant", "content": "Which dish would you like?"}]
    (obs,) = env.step(task, history)
    assert obs == {"role": "tool", "content": NUDGE}
    history = _episode(env, task, ["Which dish would you like?", *_steps(task)])
    assert [m["content"] for m in history if m["role"] == "tool"][0] == NUDGE
    assert env.score_episode(task, history).success and env.report(task, history)["process"] == 1.0
    history = [*task.messages, {"role": "assistant", "content": "Which dish?"}]
    assert "no reply was ever parsed" in env.score_episode(task, history).feedback


# ---------------------------------------------------------------------------------- episode driver


@needs_data
def test_step_feeds_results_back_and_finish_ends(env, tasks):
    task = tasks["agent_multi_step_4"]  # Wi-Fi off, inbox full
    history = [*task.messages, {"role": "assistant", "content": "[get_latest_message_id()]"}]
    (obs,) = env.step(task, history)
    assert obs["role"] == "tool" and json.loads(obs["content"])[0]["message_id"] == 4
    history += [obs, {"role": "assistant", "content": '[delete_message(message_id=4), send_message(sender_name="Eve", '
                                                      'receiver_name="Frank", message="x")]'}]
    results = json.loads(env.step(task, history)[0]["content"])
    assert results[0]["status"] and results[1]["status"] is False and "Wi-Fi" in results[1]["message"]
    history += [{"role": "tool", "content": "ignored"}, {"role": "assistant", "content": FINISH}]
    assert env.step(task, history) is None
    score = env.score_episode(task, history)
    # the milestone starts with turn_on_wifi, never made: ACEBench's scan for it runs to the end, nothing matches
    assert score.reward == 0.0 and "0 of 4 milestone calls made in order" in score.feedback
    assert env.step(task, list(task.messages)) is None  # nothing to answer yet


@needs_data
def test_replay_is_deterministic_and_history_driven(env, tasks):
    task = tasks["agent_multi_step_14"]
    history = env.milestone_history(task)
    again = ACEBenchAgent(ACEBenchConfig(mode="strict")).milestone_history(task)
    assert history == again  # same observations from a fresh env
    state = play(task, assistant_replies(history)).phone.state()
    assert state == play(task, assistant_replies(history)).phone.state()
    assert env.report(task, history) == env.report(task, again)
    # interleaving another episode of the same task changes nothing: the state lives in the history
    other = [*task.messages, {"role": "assistant", "content": "[login_device()]"}]
    env.step(task, other)
    assert env.milestone_history(task) == history
    tool_turns = [m for m in history if m["role"] == "tool"]
    assert len(tool_turns) == len(_steps(task)) and history[-1]["content"] == FINISH


# ------------------------------------------------------------------------------------- process


def test_process_matching_is_acebench_s_greedy_scan():
    assert in_order(["a", "b", "c"], ["a", "c"]) == 2
    assert in_order(["a", "x", "c"], ["a", "b", "c"]) == 1  # a missed milestone consumes the rest of the scan
    assert in_order([], ["a"]) == 0 and in_order(["a"], []) == 0
    alternatives = [["[a()]", "[b()]", "[c()]"], ["[a()]", "[c()]"]]
    assert process_official(["[a()] ", "[c()]"], alternatives, success=False) == 1.0
    assert process_official(["[a()]", "[b()]"], alternatives, success=False) == 0.667
    assert process_official(["[b()]", "[c()]"], alternatives, success=False) == 0.0  # "[a()]" never found
    assert process_official([], alternatives, success=True) == 1.0
    assert same({"a": [1, 2.0]}, {"a": [1, 2.0]}) and not same(1, 1.0) and not same(True, 1) and not same([1], [1, 2])


# ------------------------------------------------------------------------------------ hostile output

_HOSTILE = ["{(1, 2): 3}", "{1, 2}", "b'x'", "1e999", "-5", "[[[[[[[[1]]]]]]]]", "'\\u00e9\\n\\t'", "None",
            "{'product': {'a': 1}}", "[{'product': ['x'], 'quantity': True}]", "''"]


@needs_data
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=80), hostile=st.sampled_from(_HOSTILE), row=st.integers(0, 19), where=st.integers(0, 40))
def test_any_reply_gets_an_encodable_answer_and_a_verdict(env, tasks, text, hostile, row, where):
    task = tasks[f"agent_multi_step_{row}"]
    calls = [c for s in _steps(task) for c in parse_calls(s)]  # the right calls, one value made hostile
    slots = [(i, key) for i, c in enumerate(calls) for key in c.arguments]
    i, key = slots[where % len(slots)]
    calls[i] = Call(calls[i].name, {**calls[i].arguments, key: "__HOSTILE__"})
    poisoned = "[" + ", ".join(c.render() for c in calls) + "]"
    poisoned = poisoned.replace('"__HOSTILE__"', hostile)
    assert not isinstance(parse_calls(poisoned), ParseFailure), poisoned
    for reply in (text, poisoned, f"[{text}]"):
        history = [*task.messages, {"role": "assistant", "content": reply}]
        answer = env.step(task, history)
        if answer is not None:
            assert [m["role"] for m in answer] == ["tool"]
            json.loads(answer[0]["content"])
            answer[0]["content"].encode("utf-8")
        for score in env.score_modes(task, history).values():
            assert score.reward in (0.0, 1.0) and isinstance(score.feedback, str)
            score.feedback.encode("utf-8")
        json.dumps(env.report(task, history))

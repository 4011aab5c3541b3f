"""ACEBench `agent_multi_step`: multi-turn episodes against a simulated phone, scored by the phone's end state.

    env = ACEBenchAgent(ACEBenchConfig(mode="official"))      # the env registered as `acebench_agent`
    task = env.tasks("agent_multi_step")[0]
    env.step(task, history)           # [tool message with the last reply's call results], or None: episode over
    env.score_episode(task, history)  # Score: reward 1/0 on the end state; feedback: first difference + process
    env.score_modes(task, history)    # {"official": Score, "strict": Score}
    env.report(task, history)         # both verdicts, both process scores, the calls made (for reports)
    env.reference(task)               # the milestone calls, one step a line (a corrected milestone, see below)

Tasks: the 20 rows of `data_agent_multi_step.json` (English). A task's messages are a system prompt (our own
wording of ACEBench's multi-step agent prompt: one API step at a time in `[ApiName(key='value')]` form, read the
execution results, reply "finish conversation" when done; then the row's function schemas as JSON, one a line)
and the user's question. Splits: `agent_multi_step` = `all` (20 rows), and `train`/`test`: a seeded split whose
units are the 7 distinct questions (rows differ only by Wi-Fi / login start state), `train_fraction` of them in
`train`, ordered by a stable hash of seed and unit.

Episodes: `step(task, history)` replays every assistant reply of `history` on a fresh `Phone` built from the
row (`lopd.envs.acebench_scenarios`), so an episode's state is a deterministic function of its history and
scoring replays it exactly. A reply is parsed with `lopd.envs.calls.parse_calls`; its calls run in order and
their results come back as one `tool` message (a JSON list, one result per call). A reply containing "finish
conversation" ends the episode without running anything (as in ACEBench); so does a reply with no parsable
call, unless the env is built with `nudge=True`: then, as in ACEBench's loop, such a reply is answered "do not
ask me questions, solve it with what you know" and the episode goes on. ACEBench stops after 20 agent turns;
here the rollout's `max_turns` bounds the episode.

Scoring (`ACEBenchConfig.mode`): success = the end state equals the ground truth; reward 1/0.
- `official`, the released evaluator's rule: there must be an end state at all (some reply parsed into calls);
  the ground truth's class count must equal the row's; each ground-truth class is compared with the app of the
  same, case-sensitive name, and a class no app is named after is skipped (rows 0-1 spell theirs "ReminderAPI",
  so their reminders are never checked); every saved attribute of that app must be in the ground truth; a
  dict-valued attribute (inbox, reminder_list, users) passes when every key of the ground truth's dict is there
  with an equal value, extra keys pass (so an extra message or a message that should have been deleted goes
  unnoticed); other attributes must be equal (Python ==).
- `strict`: every class (names matched case-insensitively), every attribute, every key exact, types included.
Process score (feedback, `report`): the milestone calls matched in order. `process`: call by call (name and
arguments), scanned greedily in order as ACEBench does (a milestone call never found consumes the rest of the
scan), the best of the row's milestone alternatives. `process_official`: ACEBench's
process accuracy, the same matching on the raw reply strings against the raw milestone strings (so quoting
matters), and 1.0 for a row that is right end to end.

Ground-truth replay (tested): playing each row's milestone calls (its first alternative) as the episode's
replies reproduces the ground-truth end state in both modes for 12 of the 20 rows. The 8 others cannot be
reproduced because their milestone itself is wrong (`GROUND_TRUTH_REPLAY_FAILS`):
- rows 0, 1: it orders 'Super Supreme', not on Domino's menu (the ground truth's order is 'Super Supreme Pizza');
- rows 12, 13: it never calls login_food_platform, so the order fails (the ground truth has Helen logged in);
- rows 14-17: it deletes message 3 (the earliest) and sends '... 198.0 yuan.' with a period, where the ground
  truth deleted message 4 (the most recent, as the question asks) and has no period; row 16's also never
  logs the device in, which starts logged out.
With the edits of `MILESTONE_FIXES` (`corrected_milestone`) all 20 reproduce it in both modes. Of the other
alternatives, rows 8 and 9's second one fails too (it reads and deletes messages before logging the device
in). Quirks a correct model meets:
rows 14-17's ground truth sends "The price of the purchased goods is 198.0 yuan" without the final period the
reminder's quoted text has; row 19's ground truth deletes message 4 although the inbox has room after deleting
message 5 (row 18, the same question, does not), which only `strict` notices; rows 0-1's milestone strings and
several others are not valid Python (an unescaped apostrophe in 'Domino's'), which we parse leniently.

`agent_multi_turn` is not served: its user is an LLM (GPT-4o in the released code) playing a persona that
withholds details until asked; see docs/acebench.md.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from lopd.envs.acebench import ACEBenchConfig, load_category, resolve_data_dir
from lopd.envs.acebench_scenarios import CLASSES, Phone, jsonable
from lopd.envs.base import DataError, Score, Task, check_mode_and_fraction, hash_split
from lopd.envs.calls import Call, ParseFailure, parse_calls
from lopd.errors import ConfigError

CATEGORY = "agent_multi_step"
SPLITS = (CATEGORY, "all", "train", "test")
MODES = ("official", "strict")
FINISH = "finish conversation"
NUDGE = "Do not ask me questions: solve the task with the information you have, by calling the APIs."
MULTI_TURN_REASON = ("agent_multi_turn needs a simulated user (an LLM playing a persona that reveals details only "
                     "when asked); lopd has no faithful scripted one, see docs/acebench.md")

AGENT_STEP_PROMPT = (
    "You are an AI assistant that carries out the user's request by calling the APIs below, one step at a time. "
    "After each of your replies the execution results of its calls come back; use them to decide the next step.\n"
    "1. When you have what an API call needs, reply with the call only, as a Python list: "
    "[ApiName(key1='value1', key2='value2', ...)], with the real API name, parameter names and values. Separate "
    "several calls with commas: [ApiName(key1='value1'), OtherApi(key1='value1')]. Write nothing else: no "
    "explanation, no comment, no results of the calls.\n"
    "2. A parameter is optional unless its description says otherwise: include the parameters the request gives "
    "and leave out the others. When a parameter's description prescribes no format, use the user's own words.\n"
    "3. When the task takes several steps that depend on each other, do them in order and read each step's "
    "results before the next. As a rule, call one API at a time.\n"
    f"When you believe the task is done, reply \"{FINISH}\"."
)

# Rows whose milestone, replayed as it is written, cannot reach the ground truth; each with the edits
# (old text -> new text, on the milestone's steps joined by newlines) after which it does.
_SUPREME = ("the milestone orders 'Super Supreme', which Domino's menu does not have (the ground truth's order is "
            "'Super Supreme Pizza'), so the order fails and Eve keeps her 500.0")
_NO_LOGIN = ("the milestone never calls login_food_platform, so add_food_delivery_order fails (Helen is not logged "
             "in to the platform) while the ground truth has her logged in with the order placed")
_EARLIEST = ("the milestone deletes message 3 (get_earliest_message_id) and sends '... 198.0 yuan.' with a final "
             "period; the ground truth deleted message 4, the most recent, as the question asks, and holds the "
             "text without the period")
_EARLIEST_LOGGED_OUT = (_EARLIEST + "; besides, it never calls login_device although the device starts logged out, "
                        "so viewing the reminder, deleting and sending all fail")
_SUPREME_FIX = (("'product': 'Super Supreme'", "'product': 'Super Supreme Pizza'"),)
_LOGIN_FIX = (("[add_food_delivery_order(username='Helen'",
               "[login_food_platform(username='Helen', password='password321')]\n"
               "[add_food_delivery_order(username='Helen'"),)
_EARLIEST_FIX = (("[get_earliest_message_id()]", "[get_latest_message_id()]"),
                 ("[delete_message(message_id=3)]", "[delete_message(message_id=4)]"),
                 ("198.0 yuan.'", "198.0 yuan'"))
GROUND_TRUTH_REPLAY_FAILS: dict[str, str] = {
    "agent_multi_step_0": _SUPREME, "agent_multi_step_1": _SUPREME,
    "agent_multi_step_12": _NO_LOGIN, "agent_multi_step_13": _NO_LOGIN,
    "agent_multi_step_14": _EARLIEST, "agent_multi_step_15": _EARLIEST,
    "agent_multi_step_16": _EARLIEST_LOGGED_OUT, "agent_multi_step_17": _EARLIEST,
}
MILESTONE_FIXES: dict[str, tuple[tuple[str, str], ...]] = {
    "agent_multi_step_0": _SUPREME_FIX, "agent_multi_step_1": _SUPREME_FIX,
    "agent_multi_step_12": _LOGIN_FIX, "agent_multi_step_13": _LOGIN_FIX,
    "agent_multi_step_14": _EARLIEST_FIX, "agent_multi_step_15": _EARLIEST_FIX,
    "agent_multi_step_16": (("[view_reminder_by_title(", "[login_device()]\n[view_reminder_by_title("), *_EARLIEST_FIX),
    "agent_multi_step_17": _EARLIEST_FIX,
}


# ---------------------------------------------------------------------------------- milestones

_APOSTROPHE = re.compile(r"(?<=[A-Za-z])'(?=[A-Za-z])")  # the ' of Domino's, Don't: inside a word, not a quote


def parse_step(text: str) -> list[Call] | ParseFailure:
    """A milestone step's calls. The data writes some as invalid Python ('Domino's'): on a parse failure, an
    apostrophe between two letters is escaped and the step parsed again."""
    calls = parse_calls(text)
    if isinstance(calls, ParseFailure):
        calls = parse_calls(_APOSTROPHE.sub(r"\\'", text))
    return calls


def milestone_alternatives(task: Task) -> list[list[str]]:
    """The row's milestone as alternatives, each a list of step strings ("[f(a=1)]", one reply each)."""
    steps = task.meta["possible_answer"].get("mile_stone") or []
    if steps and all(isinstance(s, list) for s in steps):
        return [list(s) for s in steps]
    return [list(steps)]


def corrected_milestone(task: Task) -> list[str]:
    """The first milestone alternative with the row's `MILESTONE_FIXES` applied (unchanged for other rows)."""
    steps = milestone_alternatives(task)[0]
    text = "\n".join(s.strip() for s in steps)
    for old, new in MILESTONE_FIXES.get(task.id, ()):
        if old not in text:
            raise DataError(f"{task.meta['source']}: milestone fix for {task.id} does not apply ('{old}' not found)")
        text = text.replace(old, new)
    return text.split("\n")


def render_step(step: str) -> str:
    """A milestone step as valid Python call syntax: [f(a="x"), g()]."""
    calls = parse_step(step)
    if isinstance(calls, ParseFailure):
        raise ValueError(f"milestone step {step!r} does not parse: {calls.reason}")
    return "[" + ", ".join(c.render() for c in calls) + "]"


def milestone_calls(steps: Sequence[str]) -> list[Call]:
    return [c for s in steps for c in parse_step(s) or []]


# ------------------------------------------------------------------------------------- episodes


@dataclass
class Episode:
    """An episode replayed on a fresh phone. `sent`: the replies handed to execution (ACEBench's process list:
    every reply but one that finishes); `calls`: the calls parsed from them, in order; `results`: per sent
    reply, its calls' results (None: it did not parse); `over`: the last reply ended the episode."""

    phone: Phone
    sent: list[str] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    results: list[list[Any] | None] = field(default_factory=list)
    over: bool = False


def new_phone(task: Task) -> Phone:
    """The row's phone at the start: its apps, its Wi-Fi/login, its listed functions, its reminders."""
    row = task.meta["row"]
    return Phone(row["involved_classes"], row.get("initial_config") or {},
                 allowed=[f["name"] for f in row["function"]], todo_list=_has_todo_list(task))


def _has_todo_list(task: Task) -> bool:
    """Whether the row's reminder app starts with the "To-do list": as its ground truth says (rows 0-1's holds
    only two reminders before the new one, rows 14-17's holds the To-do list)."""
    for entry in task.answer:
        for name, attrs in entry.items():
            if name.lower() == "reminderapi":
                return any(r.get("title") == "To-do list" for r in attrs.get("reminder_list", {}).values())
    return True


def assistant_replies(history: Sequence[dict]) -> list[str]:
    return [str(m.get("content") or "") for m in history if m.get("role") == "assistant"]


def play(task: Task, replies: Sequence[str], nudge: bool = False) -> Episode:
    """Replay `replies` (the assistant turns, in order) on a fresh phone; stops at the reply that ends it:
    one with "finish conversation", or without `nudge` one that does not parse into calls."""
    episode = Episode(new_phone(task))
    for reply in replies:
        if FINISH in reply:
            episode.over = True
            break
        episode.sent.append(reply)
        calls = parse_calls(reply)
        if isinstance(calls, ParseFailure):
            episode.results.append(None)
            if nudge:
                continue
            episode.over = True
            break
        episode.calls += calls
        episode.results.append([episode.phone.call(c.name, c.arguments) for c in calls])
    return episode


def render_results(results: list[Any]) -> str:
    return json.dumps(jsonable(results), ensure_ascii=False)


# ---------------------------------------------------------------------------------------- scoring


def _short(value: Any, limit: int = 160) -> str:
    text = json.dumps(jsonable(value), ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def official_differences(state: dict[str, dict], truth: list[dict], executed: bool) -> list[str]:
    """Why the released evaluator would reject this end state (empty: it accepts). `executed`: whether any
    reply was parsed into calls (without one the released code has no end state and counts the row wrong)."""
    if not executed:
        return ["no reply was ever parsed into calls, so there is no end state"]
    if len(truth) != len(state):
        return [f"the ground truth has {len(truth)} classes, the scenario {len(state)}"]
    out = []
    for entry in truth:
        (name, expected), = entry.items()
        if name not in state:  # matched by exact name only; an unmatched class is not checked
            continue
        for attr, value in state[name].items():
            if attr not in expected:
                out.append(f"{name}.{attr} is not in the ground truth")
                continue
            want = expected[attr]
            if isinstance(want, dict):  # only the ground truth's keys are checked
                for key, item in want.items():
                    if key not in value:
                        out.append(f"{name}.{attr}[{key!r}] is missing (expected {_short(item)})")
                    elif item != value[key]:
                        out.append(f"{name}.{attr}[{key!r}] is {_short(value[key])}, expected {_short(item)}")
            elif want != value:
                out.append(f"{name}.{attr} is {_short(value)}, expected {_short(want)}")
    return out


def same(a: Any, b: Any) -> bool:
    """Deep equality that also tells bool, int and float apart (1 is not 1.0 is not True)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _diff(path: str, got: Any, want: Any) -> list[str]:
    """Where `got` differs from `want`, as sentences naming the path (empty: the same)."""
    if isinstance(got, dict) and isinstance(want, dict):
        out = [f"{path}[{k!r}] is missing (expected {_short(want[k])})" for k in want if k not in got]
        out += [f"{path}[{k!r}] = {_short(got[k])} is not in the ground truth" for k in got if k not in want]
        return out + [d for k in want if k in got for d in _diff(f"{path}[{k!r}]", got[k], want[k])]
    if isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        return [d for i, (x, y) in enumerate(zip(got, want)) for d in _diff(f"{path}[{i}]", x, y)]
    return [] if same(got, want) else [f"{path} is {_short(got)}, expected {_short(want)}"]


def strict_differences(state: dict[str, dict], truth: list[dict]) -> list[str]:
    """Every difference between the end state and the ground truth: classes (case-insensitive names),
    attributes, keys and values, types included (empty: the same)."""
    expected = {name.lower(): (name, attrs) for entry in truth for name, attrs in entry.items()}
    names = {name.lower(): name for name in state}
    if expected.keys() != names.keys():
        return [f"the ground truth covers {sorted(n for n, _ in expected.values())}, the scenario {sorted(state)}"]
    out = []
    for key, (name, attrs) in expected.items():
        out += _diff(name, state[names[key]], attrs)
    return out


def in_order(made: Sequence[Any], wanted: Sequence[Any], equal=lambda a, b: a == b) -> int:
    """How many of `wanted` occur in `made` in order, matched greedily (ACEBench's milestone matching)."""
    matched, i = 0, 0
    for target in wanted:
        while i < len(made):
            i += 1
            if equal(made[i - 1], target):
                matched += 1
                break
    return matched


def _same_call(a: Call, b: Call) -> bool:
    return a.name == b.name and same(a.arguments, b.arguments)


def process_calls(calls: Sequence[Call], alternatives: Sequence[Sequence[str]]) -> tuple[int, int]:
    """(matched, total): milestone calls made in order, call by call, for the best alternative."""
    best = (0, 0, -1.0)
    for steps in alternatives:
        wanted = milestone_calls(steps)
        matched = in_order(calls, wanted, _same_call)
        fraction = matched / len(wanted) if wanted else 1.0
        if fraction > best[2]:
            best = (matched, len(wanted), fraction)
    return best[0], best[1]


def process_official(sent: Sequence[str], alternatives: Sequence[Sequence[str]], success: bool) -> float:
    """ACEBench's process accuracy of one row: 1.0 when right end to end, else the best alternative's share of
    milestone strings found in order among the replies (both stripped, compared as strings), 3 decimals."""
    if success:
        return 1.0
    made = [s.strip() for s in sent]
    scores = [in_order(made, [s.strip() for s in steps]) / len(steps) if steps else 1.0 for steps in alternatives]
    return round(max(scores), 3)


# ------------------------------------------------------------------------------------------ env


def _agent_messages(row: dict) -> tuple[dict, ...]:
    tools = "\n".join(json.dumps(t, ensure_ascii=False) for t in row["function"])
    return ({"role": "system", "content": f"{AGENT_STEP_PROMPT}\n\nAPI specifications:\n{tools}"},
            {"role": "user", "content": row["question"].strip()})


def _check_agent_task(task: Task) -> None:
    """DataError naming the row's file:line and key when an agent row or its answer is malformed."""
    where, row = task.meta["source"], task.meta["row"]
    if not isinstance(row.get("initial_config", {}), dict):
        raise DataError(f"{where}: key 'initial_config' should be an object")
    involved = row.get("involved_classes")
    if not isinstance(involved, list) or not involved or any(c not in CLASSES for c in involved):
        raise DataError(f"{where}: key 'involved_classes' should list apps among {', '.join(CLASSES)}, "
                        f"got {involved!r}")
    truth = task.answer
    if not isinstance(truth, list) or not all(isinstance(e, dict) and len(e) == 1 for e in truth):
        raise DataError(f"{where} (answer): key 'ground_truth' should be a list of {{class: state}} objects")
    for steps in milestone_alternatives(task):
        for step in steps:
            if not isinstance(step, str) or isinstance(parse_step(step), ParseFailure):
                raise DataError(f"{where} (answer): key 'mile_stone' has a step that does not parse: {step!r}")


class ACEBenchAgent:
    """The `agent_multi_step` rows as multi-turn episodes (see the module docstring)."""

    name = "acebench_agent"

    def __init__(self, config: ACEBenchConfig | None = None, nudge: bool = False):
        self.config = config or ACEBenchConfig()
        self.nudge = nudge  # answer a reply without calls with NUDGE instead of ending the episode (ACEBench's loop)
        self.mode = check_mode_and_fraction("acebench", self.config.mode, MODES, self.config.train_fraction)
        self._data_dir: Path | None = None
        self._tasks: list[Task] | None = None

    @property
    def data_dir(self) -> Path:
        if self._data_dir is None:
            self._data_dir = resolve_data_dir(self.config.data_dir)
        return self._data_dir

    def splits(self) -> Sequence[str]:
        return SPLITS

    def all_tasks(self) -> list[Task]:
        if self._tasks is None:
            loaded = load_category(self.data_dir, CATEGORY)
            tasks = [replace(t, messages=_agent_messages(t.meta["row"])) for t in loaded]
            for task in tasks:
                _check_agent_task(task)
            self._tasks = tasks
        return self._tasks

    def tasks(self, split: str) -> Sequence[Task]:
        if split in (CATEGORY, "all"):
            return self.all_tasks()
        if split in ("train", "test"):
            tasks = self.all_tasks()
            first = {}  # question -> id of its first row: the split unit
            for t in tasks:
                first.setdefault(t.meta["row"]["question"], t.id)
            unit = {t.id: first[t.meta["row"]["question"]] for t in tasks}
            train = hash_split(unit, self.config.seed, self.config.train_fraction, salt="acebench_agent",
                               groups=unit.get, round_half_up=True)
            return [t for t in tasks if (t.id in train) == (split == "train")]
        if split == "agent_multi_turn":
            raise ConfigError(f"acebench_agent: {MULTI_TURN_REASON}")
        raise ConfigError(f"acebench_agent has no split '{split}' (splits: {', '.join(SPLITS)})")

    # -- episodes

    def step(self, task: Task, history: list[dict]) -> list[dict] | None:
        """The execution results of the last assistant reply as a `tool` message, or None when it ends the
        episode ("finish conversation", or no parsable call; with `nudge` the latter gets NUDGE)."""
        replies = assistant_replies(history)
        if not replies:
            return None
        episode = play(task, replies, self.nudge)
        if episode.over:
            return None
        last = episode.results[-1]
        return [{"role": "tool", "content": NUDGE if last is None else render_results(last)}]

    def milestone_history(self, task: Task, steps: Sequence[str] | None = None) -> list[dict]:
        """The episode an agent making exactly `steps` (default: the corrected milestone) would have: each
        step as a reply in valid Python syntax, the env's observations, then "finish conversation"."""
        history = list(task.messages)
        for step in corrected_milestone(task) if steps is None else steps:
            history.append({"role": "assistant", "content": render_step(step)})
            history += self.step(task, history) or []
        history.append({"role": "assistant", "content": FINISH})
        return history

    # -- scoring

    def verdict(self, task: Task, history: Sequence[dict], mode: str) -> Score:
        episode = play(task, assistant_replies(history), self.nudge)
        return self._score(task, episode, mode)

    def _score(self, task: Task, episode: Episode, mode: str) -> Score:
        if mode not in MODES:
            raise ValueError(f"unknown scoring mode '{mode}' (modes: {', '.join(MODES)})")
        state = episode.phone.state()
        if mode == "official":
            diffs = official_differences(state, task.answer, any(r is not None for r in episode.results))
        else:
            diffs = strict_differences(state, task.answer)
        matched, total = process_calls(episode.calls, milestone_alternatives(task))
        process = f"{matched} of {total} milestone calls made in order"
        if not diffs:
            return Score(1.0, True, f"The end state matches the ground truth ({mode}); {process}.")
        more = f" (and {len(diffs) - 1} more differences)" if len(diffs) > 1 else ""
        return Score(0.0, False, f"The end state differs ({mode}): {diffs[0]}{more}; {process}.")

    def score_episode(self, task: Task, history: Sequence[dict]) -> Score:
        return self.verdict(task, history, self.mode)

    def score_modes(self, task: Task, episode: str | Sequence[dict]) -> dict[str, Score]:
        """Both verdicts of an episode's messages (or of one reply given as a string)."""
        played = play(task, [episode] if isinstance(episode, str) else assistant_replies(episode), self.nudge)
        return {mode: self._score(task, played, mode) for mode in MODES}

    def score(self, task: Task, completion: str) -> Score:
        """One reply taken as the whole episode (its calls run in order, then the end state is compared)."""
        return self._score(task, play(task, [completion], self.nudge), self.mode)

    def report(self, task: Task, history: Sequence[dict]) -> dict:
        """One episode's figures: end-state verdicts in both modes, both process scores, what was called."""
        episode = play(task, assistant_replies(history), self.nudge)
        verdicts = {mode: self._score(task, episode, mode) for mode in MODES}
        alternatives = milestone_alternatives(task)
        matched, total = process_calls(episode.calls, alternatives)
        return {
            "id": task.id, "turns": len(assistant_replies(history)),
            "calls": [c.render() for c in episode.calls],
            "success": {mode: s.success for mode, s in verdicts.items()},
            "feedback": {mode: s.feedback for mode, s in verdicts.items()},
            "process": round(matched / total, 3) if total else 1.0,
            "process_official": process_official(episode.sent, alternatives, verdicts["official"].success),
        }

    def reference(self, task: Task) -> str:
        """The (corrected) milestone calls, one step a line, in valid Python call syntax."""
        return "\n".join(render_step(s) for s in corrected_milestone(task))

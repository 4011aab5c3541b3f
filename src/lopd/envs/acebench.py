"""ACEBench (English): tool-use tasks scored the released evaluator's way (`official`) or strictly.

    env = ACEBench(ACEBenchConfig(mode="strict"))
    task = env.tasks("normal_atom_bool")[0]
    env.score(task, '[ProteinRichMealPlanner_generateList(meal_type="dinner")]')  # Score in the configured mode
    env.score_modes(task, reply)   # {"official": Score, "strict": Score}, for side-by-side reports
    env.reference(task)            # the ground truth written as the policy should write it

Data: the benchmark's `data_<category>.json` and `possible_answer/data_<category>.json` files (JSON lines),
by default from `<repo>/../shared/data/acebench/en`. Each row becomes a `Task` whose messages are a system
prompt (instructions modelled on ACEBench's official English prompts, the time or user profile when the
row has one, the tool list as JSON, one tool a line) followed by the row's transcript split into turns:
"user:" lines are user turns, "system:" lines are the assistant's earlier turns (consecutive turns of one
role are joined). ACEBench's own prompt instead puts the whole transcript in one user message.

Splits: every category name (`normal_atom_bool`, `special_incomplete`, `agent_multi_step`, ...), the groups
`normal`, `special`, `agent`, `all` (normal + special: agent rows are not scored here, see below), and
`train`/`test`: a seeded split of the normal and special rows, stratified by category, `train_fraction`
of each category's units in `train`, the units ordered by a stable hash of seed and id. A unit is a row,
except in the normal multi-turn categories where it is a whole conversation (ids `<category>_<conv>_<turn>`),
because a later turn's transcript holds the answers of the earlier ones.

Scoring (rules in `lopd.envs.acebench_checker`): `official` reproduces the released evaluator's verdict,
`strict` compares exactly. Agent categories are multi-turn, so a single reply cannot be scored: here their
tasks score 0 with a reason saying so, and they are left out of `all`, `train` and `test`. `agent_multi_step`
is served as episodes against a simulated phone by `lopd.envs.acebench_agent.ACEBenchAgent` (env
`acebench_agent`, scored by the end state); `agent_multi_turn` needs an LLM playing the user, which lopd lacks.

Reporting: `category_results` turns per-task success into per-category (rows, accuracy) the released way
(a normal multi-turn conversation counts only when all its turns are right); `summary` weights categories by
row count; `leaderboard_summary` is the released spreadsheet's formula.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from lopd.envs.acebench_checker import (
    PHRASES, answer_candidates, call_name, official_normal, official_special, strict_normal, strict_special,
)
from lopd.envs.base import DataError, ScoringMode, Score, Task, check_mode_and_fraction, hash_split, read_jsonl, require_keys
from lopd.envs.calls import Call
from lopd.errors import ConfigError

NORMAL = (
    "normal_single_turn_single_function", "normal_single_turn_parallel_function",
    "normal_multi_turn_user_adjust", "normal_multi_turn_user_switch",
    "normal_similar_api", "normal_preference",
    "normal_atom_bool", "normal_atom_enum", "normal_atom_number", "normal_atom_list",
    "normal_atom_object_deep", "normal_atom_object_short",
)
SPECIAL = ("special_incomplete", "special_error_param", "special_irrelevant")
AGENT = ("agent_multi_step", "agent_multi_turn")
CATEGORIES = NORMAL + SPECIAL + AGENT
GROUPS = {"normal": NORMAL, "special": SPECIAL, "agent": AGENT, "all": NORMAL + SPECIAL}
SPLITS = CATEGORIES + tuple(GROUPS) + ("train", "test")
MODES = ("official", "strict")
AGENT_REASON = ("ACEBench agent rows are multi-turn and a single reply scores 0 here: agent_multi_step is scored "
                "as episodes by the env acebench_agent; agent_multi_turn needs an LLM user, not implemented.")
DEFAULT_DATA = Path("shared") / "data" / "acebench" / "en"

# Rows whose own ground truth, written as `reference` writes it, fails the released evaluator (and so the
# `official` mode): no normally written reply can earn them there. The tests assert exactly these fail.
_SPACED_LIST = ("a list nested in an object holds strings with spaces; the released evaluator deletes all whitespace "
                "from the reply, then compares that list's repr as a substring, spaces included")
_EMPTY_LIST = "an array parameter whose answer is [] fails the released nested type check for every list"
_ITEMLESS_ARRAY = ("an array schema without 'items' is checked as a list of objects, so the answer's list of strings "
                   "cannot pass")
_PADDED_NAMES = ("the answer's missing-parameter names carry stray spaces ('propertyDetails ', ' rentalManagement ') "
                 "that the reply must contain literally")
OFFICIAL_GROUND_TRUTH_FAILS: dict[str, str] = {
    "normal_single_turn_single_function_31": _SPACED_LIST, "normal_single_turn_single_function_39": _SPACED_LIST,
    "normal_single_turn_single_function_46": _SPACED_LIST, "normal_single_turn_single_function_47": _SPACED_LIST,
    "normal_single_turn_single_function_52": _SPACED_LIST, "normal_single_turn_single_function_53": _SPACED_LIST,
    "normal_single_turn_single_function_56": _SPACED_LIST, "normal_single_turn_single_function_94": _SPACED_LIST,
    "normal_single_turn_parallel_function_3": _SPACED_LIST, "normal_single_turn_parallel_function_4": _SPACED_LIST,
    "normal_single_turn_parallel_function_11": _SPACED_LIST, "normal_single_turn_parallel_function_40": _SPACED_LIST,
    "normal_single_turn_parallel_function_46": _SPACED_LIST, "normal_single_turn_parallel_function_54": _SPACED_LIST,
    "normal_single_turn_parallel_function_64": _SPACED_LIST, "normal_single_turn_parallel_function_71": _SPACED_LIST,
    "normal_single_turn_parallel_function_85": _SPACED_LIST, "normal_single_turn_parallel_function_86": _SPACED_LIST,
    "normal_single_turn_parallel_function_90": _SPACED_LIST, "normal_single_turn_parallel_function_95": _SPACED_LIST,
    "normal_single_turn_parallel_function_99": _SPACED_LIST, "normal_multi_turn_user_adjust_3_0": _SPACED_LIST,
    "normal_multi_turn_user_adjust_4_0": _SPACED_LIST, "normal_multi_turn_user_adjust_13_0": _SPACED_LIST,
    "normal_multi_turn_user_adjust_14_0": _SPACED_LIST, "normal_multi_turn_user_adjust_15_0": _SPACED_LIST,
    "normal_multi_turn_user_adjust_15_2": _SPACED_LIST, "normal_multi_turn_user_adjust_16_0": _SPACED_LIST,
    "normal_multi_turn_user_adjust_24_0": _SPACED_LIST, "normal_multi_turn_user_adjust_29_0": _SPACED_LIST,
    "normal_multi_turn_user_adjust_38_0": _SPACED_LIST, "normal_multi_turn_user_adjust_43_0": _SPACED_LIST,
    "normal_multi_turn_user_adjust_45_0": _SPACED_LIST, "normal_multi_turn_user_adjust_48_0": _SPACED_LIST,
    "normal_multi_turn_user_switch_6_0": _SPACED_LIST, "normal_multi_turn_user_switch_8_0": _SPACED_LIST,
    "normal_multi_turn_user_switch_10_1": _SPACED_LIST, "normal_multi_turn_user_switch_11_0": _SPACED_LIST,
    "normal_multi_turn_user_switch_15_1": _SPACED_LIST, "normal_multi_turn_user_switch_20_0": _SPACED_LIST,
    "normal_multi_turn_user_switch_25_0": _SPACED_LIST, "normal_multi_turn_user_switch_31_1": _SPACED_LIST,
    "normal_multi_turn_user_switch_33_0": _SPACED_LIST, "normal_multi_turn_user_switch_35_0": _SPACED_LIST,
    "normal_multi_turn_user_switch_40_0": _SPACED_LIST, "normal_multi_turn_user_switch_43_0": _SPACED_LIST,
    "normal_multi_turn_user_switch_45_0": _SPACED_LIST, "normal_multi_turn_user_switch_45_1": _SPACED_LIST,
    "normal_similar_api_43": _SPACED_LIST, "normal_similar_api_49": _SPACED_LIST,
    "normal_atom_object_deep_0": _SPACED_LIST, "normal_atom_object_deep_4": _SPACED_LIST,
    "normal_atom_object_deep_8": _SPACED_LIST, "normal_atom_object_deep_13": _SPACED_LIST,
    "normal_atom_object_deep_14": _SPACED_LIST, "normal_atom_object_deep_23": _SPACED_LIST,
    "normal_atom_object_deep_24": _SPACED_LIST, "normal_atom_object_deep_26": _SPACED_LIST,
    "normal_atom_object_deep_30": _SPACED_LIST, "normal_atom_object_deep_32": _SPACED_LIST,
    "normal_atom_object_deep_34": _SPACED_LIST, "normal_atom_object_deep_39": _SPACED_LIST,
    "normal_atom_object_deep_43": _SPACED_LIST, "normal_atom_object_deep_45": _SPACED_LIST,
    "normal_atom_object_deep_46": _SPACED_LIST, "normal_atom_object_deep_48": _SPACED_LIST,
    "normal_atom_object_deep_49": _SPACED_LIST, "normal_single_turn_parallel_function_42": _EMPTY_LIST,
    "normal_preference_40": _ITEMLESS_ARRAY, "special_incomplete_0": _PADDED_NAMES,
}


@dataclass
class ACEBenchConfig:
    data_dir: str = ""  # "" = <repo>/../shared/data/acebench/en, searched from the package and from cwd
    mode: ScoringMode = ScoringMode.strict  # official: the released evaluator's verdict; strict: exact values (training reward)
    train_fraction: float = 0.5  # share of each category's rows (conversations) in `train`
    seed: int = 0  # seeds the train/test split


# ------------------------------------------------------------------------------------ prompts

_FORMAT = (
    "Write them as a Python list of calls: [ApiName(key1='value1', key2='value2', ...)], with the real API "
    "name, parameter names and values. Separate several requests with commas: "
    "[ApiName(key1='value1', ...), OtherApi(key1='value1', ...)]."
)
NORMAL_PROMPT = (
    "You are an AI assistant that makes API requests. Using the API specifications below and the conversation "
    "so far, write the API request(s) the assistant should make next.\n"
    f"{_FORMAT} The reply must start with \"[\" and end with \"]\" and contain nothing else: no explanation, "
    "no comment, no results of the calls.\n"
    "A parameter is optional unless its description says otherwise: include the parameters the user mentions "
    "and leave out the ones the user does not mention.\n"
    "When a parameter's description prescribes no format for its value, use the user's own words.\n"
    "If an API takes no parameters, write [ApiName()] and invent no parameter names."
)
PREFERENCE_PROMPT = (
    "You are an AI assistant that makes API requests. Using the API specifications below, the conversation so "
    "far and the user's profile, write the API request(s) the assistant should make next.\n"
    f"{_FORMAT} The reply must start with \"[\" and end with \"]\" and contain nothing else: no explanation, "
    "no comment, no results of the calls.\n"
    "A parameter is optional unless its description says otherwise: include the parameters the user or the "
    "profile mentions and leave out the others.\n"
    "When a parameter's description prescribes no format for its value, take the value from the user's words "
    "or the profile.\n"
    "If an API takes no parameters, write [ApiName()] and invent no parameter names."
)
SPECIAL_PROMPT = (
    "You are an AI assistant that makes API requests. Using the API specifications below and the conversation "
    "so far, decide what the assistant should do next.\n"
    "1. If the user's request is clear and complete and the APIs can serve it: write the API request(s). "
    f"{_FORMAT} Call every API that serves the request; when a parameter's description prescribes no format, "
    "use the user's own words. Write nothing else.\n"
    "2. If the request is unclear, incomplete or wrong, or beyond what the APIs can do, say so in exactly one "
    "of these forms:\n"
    "   (1) A value the user gave does not fit the type or form the API defines: "
    f"[\"{PHRASES['error_param']} (value) for the parameters (key) in the conversation history.\"]\n"
    "   (2) The user left out details the API requires: "
    f"[\"{PHRASES['incomplete']} (key1, key2, ...) for the api (ApiName)\"], naming the missing parameters "
    "and the API.\n"
    "   (3) The APIs cannot do what the user asks: "
    "[\"Due to the limitations of the function, I cannot solve this problem.\"]\n"
    "   Check them in this order: first whether (1) applies, and tell (1) and (2) apart with care."
)
AGENT_PROMPT = NORMAL_PROMPT + "\nWhen you believe the task is done, reply \"finish conversation\"."

_ROLE_LINE = re.compile(r"^(user|system):[ \t]?(.*)$")


def parse_transcript(text: str) -> list[dict]:
    """Split a "user: ...\\nsystem: ..." transcript into chat turns; "system" turns are the assistant's."""
    turns: list[list[str]] = []
    for line in text.split("\n"):
        m = _ROLE_LINE.match(line)
        if m:
            turns.append(["user" if m.group(1) == "user" else "assistant", m.group(2)])
        elif turns:
            turns[-1][1] += "\n" + line
        elif line.strip():
            turns.append(["user", line])
    messages: list[dict] = []
    for role, content in turns:
        content = content.strip()
        if not content:
            continue
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n" + content
        else:
            messages.append({"role": role, "content": content})
    return messages


def system_prompt(category: str, row: dict) -> str:
    if category in SPECIAL:
        head = SPECIAL_PROMPT
    elif category == "normal_preference":
        head = PREFERENCE_PROMPT
    elif category in AGENT:
        head = AGENT_PROMPT
    else:
        head = NORMAL_PROMPT
    parts = [head]
    if row.get("time"):
        parts.append(str(row["time"]))
    if category == "normal_preference":
        parts.append("User profile:\n" + str(row.get("profile", "")))
    parts.append("API specifications:\n" + "\n".join(json.dumps(t, ensure_ascii=False) for t in row["function"]))
    return "\n\n".join(parts)


def task_messages(category: str, row: dict) -> tuple[dict, ...]:
    turns = parse_transcript(row["question"]) or [{"role": "user", "content": row["question"]}]
    return ({"role": "system", "content": system_prompt(category, row)}, *turns)


# ---------------------------------------------------------------------------------- data files


def resolve_data_dir(configured: str = "") -> Path:
    """The folder holding data_<category>.json and possible_answer/; DataError if there is none."""
    if configured:
        path = Path(configured).expanduser()
        if not (path / "possible_answer").is_dir():
            raise DataError(f"env.acebench.data_dir: {path} has no ACEBench data (no possible_answer/ folder)")
        return path
    candidates: list[Path] = []
    here = Path(__file__).resolve()
    if len(here.parents) > 3:
        candidates.append(here.parents[3].parent / DEFAULT_DATA)  # src/lopd/envs/acebench.py -> <repo>/..
    cwd = Path.cwd().resolve()
    for base in (cwd, *cwd.parents):
        candidates += [base.parent / DEFAULT_DATA, base / DEFAULT_DATA]
    for path in dict.fromkeys(candidates):
        if (path / "possible_answer").is_dir():
            return path
    raise DataError(f"ACEBench data not found: set env.acebench.data_dir (looked for <repo>/../{DEFAULT_DATA} "
                    f"from {here.parents[0]} and from {cwd})")


def _check_row(row: dict, category: str, where: str) -> None:
    require_keys(row, ("id", "question", "function") + (("profile",) if category == "normal_preference" else ()), where)
    if not isinstance(row["id"], str) or not row["id"].startswith(category + "_"):
        raise DataError(f"{where}: key 'id': {row['id']!r} is not an id of category {category}")
    if not isinstance(row["question"], str):
        raise DataError(f"{where}: key 'question' should be a transcript string, got {type(row['question']).__name__}")
    tools = row["function"]
    if not isinstance(tools, list) or not tools:
        raise DataError(f"{where}: key 'function' should be a non-empty list of tools")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise DataError(f"{where}: key 'function[{i}]' should be a tool with a string 'name'")
        schema = tool.get("parameters", tool.get("arguments"))
        if not isinstance(schema, dict):
            raise DataError(f"{where}: key 'function[{i}]' ({tool['name']}) has no 'parameters' "
                            "(or 'arguments') schema")


def _check_answer(truth: Any, category: str, tools: list[dict], where: str) -> None:
    names = [t["name"] for t in tools]
    if category in NORMAL:
        candidates = answer_candidates(truth)
        if not candidates or not all(isinstance(c, dict) and c for c in candidates):
            raise DataError(f"{where}: key 'ground_truth' should be {{api: {{param: value}}}} "
                            "or a non-empty list of them")
        for candidate in candidates:
            for key, args in candidate.items():
                if not isinstance(args, dict):
                    raise DataError(f"{where}: key 'ground_truth.{key}' should be an object of arguments")
                if call_name(key, names) not in names:
                    raise DataError(f"{where}: key 'ground_truth.{key}' calls an API that is not among the row's "
                                    f"functions ({', '.join(names)})")
    elif category == "special_irrelevant":
        if not isinstance(truth, str):
            raise DataError(f"{where}: key 'ground_truth' should be the decline sentence")
    elif category in SPECIAL:
        if not isinstance(truth, dict) or not truth or not all(
                isinstance(v, list) and v and all(isinstance(x, str) for x in v) for v in truth.values()):
            raise DataError(f"{where}: key 'ground_truth' should be {{name: [strings]}}")
        if category == "special_incomplete" and len(truth) != 1:
            raise DataError(f"{where}: key 'ground_truth' should name exactly one API")


def load_category(data_dir: Path, category: str) -> list[Task]:
    """The tasks of one category; a malformed file raises DataError naming file, line and key."""
    rows_path = data_dir / f"data_{category}.json"
    answers_path = data_dir / "possible_answer" / f"data_{category}.json"
    answers: dict[str, tuple[int, dict]] = {}
    for lineno, answer in read_jsonl(answers_path, with_lines=True):
        where = f"{answers_path}:{lineno}"
        require_keys(answer, ("id", "ground_truth"), where)
        if answer["id"] in answers:
            raise DataError(f"{where}: key 'id': {answer['id']!r} repeats line {answers[answer['id']][0]}")
        answers[answer["id"]] = (lineno, answer)
    tasks, seen = [], set()
    for lineno, row in read_jsonl(rows_path, with_lines=True):
        where = f"{rows_path}:{lineno}"
        _check_row(row, category, where)
        if row["id"] in seen:
            raise DataError(f"{where}: key 'id': {row['id']!r} occurs twice")
        seen.add(row["id"])
        if row["id"] not in answers:
            raise DataError(f"{where}: no ground truth for id {row['id']!r} in {answers_path}")
        answer_line, answer = answers[row["id"]]
        _check_answer(answer["ground_truth"], category, row["function"], f"{answers_path}:{answer_line}")
        meta = {"row": row, "possible_answer": answer, "source": where, "tools": row["function"]}
        tasks.append(Task(row["id"], task_messages(category, row), answer["ground_truth"], category, meta))
    return tasks


# ---------------------------------------------------------------------------------- splitting


def split_unit(task_id: str, category: str) -> str:
    """What the train/test split keeps together: a conversation in the normal multi-turn categories."""
    return task_id.rsplit("_", 1)[0] if category.startswith("normal_multi_turn") else task_id


# ------------------------------------------------------------------------------------ scoring


def verdict(task: Task, completion: str, mode: str) -> Score:
    """One task's Score in one mode."""
    if mode not in MODES:
        raise ValueError(f"unknown scoring mode '{mode}' (modes: {', '.join(MODES)})")
    category = task.category
    if category in AGENT:
        return Score(0.0, False, AGENT_REASON)
    if category in SPECIAL:
        kind = category.removeprefix("special_")
        return (official_special if mode == "official" else strict_special)(kind, completion, task.answer)
    tools = task.meta["row"]["function"]
    return (official_normal if mode == "official" else strict_normal)(tools, completion, task.answer)


def _render_call(name: str, args: dict) -> str:
    return Call(name, args).render()


def reference_text(task: Task) -> str:
    """The ground truth written as the policy should write it."""
    category, truth = task.category, task.answer
    if category in NORMAL:
        names = [t["name"] for t in task.meta["row"]["function"]]
        first = answer_candidates(truth)[0]
        return "[" + ", ".join(_render_call(call_name(k, names), v) for k, v in first.items()) + "]"
    if category == "special_irrelevant":
        return '["Due to the limitations of the function, I cannot solve this problem."]'
    if category == "special_incomplete":
        ((api, missing),) = truth.items()
        return f'["{PHRASES["incomplete"]} ({", ".join(m.strip() for m in missing)}) for the api ({api})"]'
    if category == "special_error_param":
        values = ", ".join(v.strip() for vs in truth.values() for v in vs)
        params = ", ".join(truth)
        return f'["{PHRASES["error_param"]} ({values}) for the parameters ({params}) in the conversation history."]'
    steps = task.meta.get("possible_answer", {}).get("mile_stone") or []
    if steps and isinstance(steps[0], list):
        steps = steps[0]
    return "\n".join(map(str, steps))


# -------------------------------------------------------------------------------------- env


class ACEBench:
    name = "acebench"

    def __init__(self, config: ACEBenchConfig | None = None):
        self.config = config or ACEBenchConfig()
        self.mode = check_mode_and_fraction("acebench", self.config.mode, MODES, self.config.train_fraction)
        self._data_dir: Path | None = None
        self._categories: dict[str, list[Task]] = {}

    @property
    def data_dir(self) -> Path:
        if self._data_dir is None:
            self._data_dir = resolve_data_dir(self.config.data_dir)
        return self._data_dir

    def splits(self) -> Sequence[str]:
        return SPLITS

    def category(self, name: str) -> list[Task]:
        if name not in CATEGORIES:
            raise ConfigError(f"acebench has no category '{name}' (categories: {', '.join(CATEGORIES)})")
        if name not in self._categories:
            self._categories[name] = load_category(self.data_dir, name)
        return self._categories[name]

    def tasks(self, split: str) -> Sequence[Task]:
        if split in CATEGORIES:
            return self.category(split)
        if split in GROUPS:
            return [t for name in GROUPS[split] for t in self.category(name)]
        if split in ("train", "test"):
            return self._train_test(split)
        raise ConfigError(f"acebench has no split '{split}' (splits: {', '.join(SPLITS)})")

    def _train_test(self, split: str) -> list[Task]:
        tasks = self.tasks("all")
        category = {t.id: t.category for t in tasks}
        train = hash_split(category, self.config.seed, self.config.train_fraction, salt="acebench",
                           strata=category.get, groups=lambda task_id: split_unit(task_id, category[task_id]),
                           round_half_up=True)
        return [t for t in tasks if (t.id in train) == (split == "train")]

    def score(self, task: Task, completion: str) -> Score:
        return verdict(task, completion, self.mode)

    def score_modes(self, task: Task, completion: str) -> dict[str, Score]:
        return {mode: verdict(task, completion, mode) for mode in MODES}

    def reference(self, task: Task) -> str:
        return reference_text(task)


# ------------------------------------------------------------------------------------ reports


def category_of(task_id: str) -> str:
    """The category of an ACEBench id (the longest category name that prefixes it)."""
    matches = [c for c in CATEGORIES if task_id.startswith(c + "_")]
    if not matches:
        raise ValueError(f"'{task_id}' is not an ACEBench id")
    return max(matches, key=len)


def category_results(successes: Mapping[str, bool]) -> dict[str, tuple[int, float]]:
    """Per-category (rows, accuracy) from {task id: success}, aggregated like the released evaluator:
    in the normal multi-turn categories accuracy counts conversations whose turns are all right."""
    by_category: dict[str, dict[str, list[bool]]] = {}
    for task_id, ok in successes.items():
        category = category_of(task_id)
        by_category.setdefault(category, {}).setdefault(split_unit(task_id, category), []).append(bool(ok))
    out = {}
    for category, units in by_category.items():
        rows = sum(len(v) for v in units.values())
        out[category] = (rows, sum(all(v) for v in units.values()) / len(units))
    return out


def summary(results: Mapping[str, tuple[int, float]]) -> float:
    """Overall accuracy from {category: (rows, accuracy)}, each category weighted by its row count."""
    total = sum(n for n, _ in results.values())
    return sum(n * acc for n, acc in results.values()) / total if total else 0.0


def leaderboard_summary(results: Mapping[str, tuple[int, float]]) -> float:
    """The released spreadsheet's "Summary": unweighted means of the normal, special and agent categories
    (a missing category counts 0), mixed 0.578 / 0.2676 / 0.1545, rounded to 3 decimals like the original."""

    def mean(names: Sequence[str]) -> float:
        return round(sum(results.get(n, (0, 0.0))[1] for n in names) / len(names), 3)

    return round(0.578 * mean(NORMAL) + 0.2676 * mean(SPECIAL) + 0.1545 * mean(AGENT), 3)

"""BFCL: the Berkeley Function-Calling Leaderboard's single-turn AST categories, scored two ways.

Data. The `bfcl-eval` package ships the question files and the possible-answer files as JSON lines
(`bfcl_eval/data/BFCL_v4_<category>.json`, `.../possible_answer/BFCL_v4_<category>.json`); we read
them through `importlib.resources` and import nothing else of the package (its dependencies clash
with ours): `pip install --no-deps bfcl-eval`. A possible answer lists, per expected call, the
acceptable values of every parameter: `{"f": {"x": [1, 1.0], "unit": ["cm", ""]}}`, where ""
means "may be omitted". Categories: simple_python (BFCL v3's `simple`), multiple, parallel,
parallel_multiple, irrelevance, and their live_* counterparts plus live_relevance.

Prompt. BFCL's prompt mode (its default system prompt: persona, task, the Python-call output format,
the functions as indented JSON with "Note that the provided function is in Python 3 syntax." added to
every description), prepended to a system message the row may carry, then the question's messages.
The model answers `[func(a=1), other.fn(b="x")]`.

Scoring (rules and code in `lopd.envs.bfcl_checker`): `official` reproduces the verdict of BFCL's
released evaluator (bfcl_eval 2026.3.23); `strict`, the training reward, requires that verdict *and*
exact values, so a strict success is always an official success.

`reference(task)` renders one acceptable answer: the first acceptable value of every parameter, leaving
out parameters that may be omitted unless the schema requires them. Rows whose possible answers fail
their own checker are listed in docs/bfcl.md. Not supported: the executable, Java, JavaScript,
multi-turn, memory, web-search and format-sensitivity categories.

    env = BFCL(BFCLConfig(mode="strict"))
    task = env.tasks("simple_python")[0]
    env.score(task, "[calculate_triangle_area(base=10, height=5)]")  # -> Score(1.0, True, ...)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Sequence

from lopd.envs.base import DataError, ScoringMode, Score, Task, check_mode_and_fraction, hash_split, read_jsonl
from lopd.envs.bfcl_checker import _find_doc, _fits, score_official, score_strict
from lopd.envs.bfcl_checker import decode_official, decode_strict, standardise  # noqa: F401  (re-exported)
from lopd.errors import ConfigError

PACKAGE = "bfcl_eval"
PACKAGE_VERSION = "2026.3.23"  # the version whose data and checker this module was written against
FILE_PREFIX = "BFCL_v4_"
INSTALL_HINT = f"pip install --no-deps bfcl-eval=={PACKAGE_VERSION}"

AST_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple",
                  "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
IRRELEVANCE_CATEGORIES = ("irrelevance", "live_irrelevance")
RELEVANCE_CATEGORIES = ("live_relevance",)
CATEGORIES = AST_CATEGORIES + IRRELEVANCE_CATEGORIES + RELEVANCE_CATEGORIES
ALIASES = {"simple": "simple_python"}  # BFCL v3 names
MODES = ("official", "strict")
SPLITS = ("all", "train", "test")

# ------------------------------------------------------------------------------------ config


@dataclass
class BFCLConfig:
    categories: list[str] = field(default_factory=lambda: list(CATEGORIES))  # the categories `all` and train/test draw from
    mode: ScoringMode = ScoringMode.strict  # official: BFCL's released checker's verdict; strict: that and exact values
    train_fraction: float = 0.5  # share of every category that goes to `train`, the rest to `test`
    seed: int = 0  # of the train/test split


def canonical_category(name: str) -> str | None:
    name = ALIASES.get(name, name)
    return name if name in CATEGORIES else None


def category_kind(category: str) -> str:
    """irrelevance | relevance | parallel | multiple | simple (how BFCL's runner dispatches)."""
    if "irrelevance" in category:
        return "irrelevance"
    if "relevance" in category:
        return "relevance"
    if "parallel" in category:
        return "parallel"
    if "multiple" in category:
        return "multiple"
    return "simple"


# -------------------------------------------------------------------------------------- data


def _data_root():
    from importlib import resources

    try:
        return resources.files(PACKAGE) / "data"
    except ModuleNotFoundError:
        raise DataError(f"the BFCL data package '{PACKAGE}' is not installed; run: {INSTALL_HINT}") from None


def _read_rows(relative: str, required: Sequence[str]) -> list[dict]:
    """JSON lines from the package's data folder; a bad line raises DataError naming file, line, key."""
    path = _data_root().joinpath(*relative.split("/"))
    hint = f"BFCL data, written for {PACKAGE} {PACKAGE_VERSION}: {INSTALL_HINT}"
    rows = []
    for lineno, row in read_jsonl(path, required, with_lines=True, missing_hint=hint):
        row["_where"] = f"{path}:{lineno}"
        rows.append(row)
    return rows


def _check_question(row: dict) -> None:
    where = row["_where"]
    turns = row["question"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, list) for t in turns):
        raise DataError(f"{where}: key 'question' must be a non-empty list of turns (lists of messages)")
    for message in (m for t in turns for m in t):
        if not isinstance(message, dict) or not {"role", "content"} <= message.keys():
            raise DataError(f"{where}: key 'question' holds a message without 'role' and 'content'")
    functions = row["function"]
    if not isinstance(functions, list):
        raise DataError(f"{where}: key 'function' must be a list of function docs")
    for f in functions:
        parameters = f.get("parameters") if isinstance(f, dict) else None
        if not isinstance(parameters, dict) or "name" not in f or not isinstance(parameters.get("properties"), dict):
            raise DataError(f"{where}: key 'function' holds a doc without 'name' or 'parameters.properties'")


def _check_answer(row: dict, functions: list[dict]) -> None:
    where = row["_where"]
    names = {f["name"] for f in functions}
    truth = row["ground_truth"]
    if not isinstance(truth, list) or not truth:
        raise DataError(f"{where}: key 'ground_truth' must be a non-empty list of calls")
    for call in truth:
        if not (isinstance(call, dict) and len(call) == 1 and isinstance(next(iter(call.values())), dict)):
            raise DataError(f"{where}: key 'ground_truth' holds an entry that is not {{name: {{param: [values]}}}}")
        (name, params), = call.items()
        if name not in names:
            raise DataError(f"{where}: key 'ground_truth' calls '{name}', which is not among the row's functions")
        for param, values in params.items():
            if not isinstance(values, list):
                raise DataError(f"{where}: key 'ground_truth.{name}.{param}' must be a list of acceptable values")


@lru_cache(maxsize=None)
def load_category(category: str) -> tuple[Task, ...]:
    """Every row of one category as Tasks (read once per process)."""
    questions = _read_rows(f"{FILE_PREFIX}{category}.json", ("id", "question", "function"))
    kind = category_kind(category)
    answers: list[dict | None] = [None] * len(questions)
    if kind not in ("irrelevance", "relevance"):
        answers = _read_rows(f"possible_answer/{FILE_PREFIX}{category}.json", ("id", "ground_truth"))
        if len(answers) != len(questions):
            raise DataError(f"{answers[-1]['_where'] if answers else category}: {len(answers)} possible answers "
                            f"for {len(questions)} questions")
    tasks = []
    for q, a in zip(questions, answers):
        _check_question(q)
        truth: list = []
        if a is not None:
            if a["id"] != q["id"]:
                raise DataError(f"{a['_where']}: key 'id' is '{a['id']}', the question in its place is '{q['id']}'")
            _check_answer(a, q["function"])
            truth = a["ground_truth"]
        messages = task_messages(q["question"], q["function"])
        meta = {"functions": q["function"], "tools": q["function"], "kind": kind, "source": q["_where"]}
        tasks.append(Task(str(q["id"]), messages, truth, category, meta))
    return tuple(tasks)


# ------------------------------------------------------------------------------------ prompt

# BFCL's default prompt-mode system prompt (plaintext template, classic style, Python output format,
# functions as JSON), reproduced so that a model sees what the leaderboard shows it.
SYSTEM_PROMPT = (
    "You are an expert in composing functions."
    "You are given a question and a set of possible functions. Based on the question, you will need to make "
    "one or more function/tool calls to achieve the purpose. If none of the functions can be used, point it "
    "out. If the given question lacks the parameters required by the function, also point it out."
    "\n\n"
    "You should only return the function calls in your response.\n\n"
    "If you decide to invoke any of the function(s), you MUST put it in the format of "
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)].  "
    "You SHOULD NOT include any other text in the response."
    "\n\n"
    "At each turn, you should try your best to complete the tasks requested by the user within the current "
    "turn. Continue to output functions to call until you have fulfilled the user's request to the best of "
    "your ability. Once you have no more functions to call, the system will consider the current turn "
    "complete and proceed to the next turn or task."
    "\n\n"
    "Here is a list of functions in json format that you can invoke.\n{functions}\n"
)
PYTHON_HINT = " Note that the provided function is in Python 3 syntax."


def system_prompt(functions: Sequence[dict]) -> str:
    docs = [{**f, "description": f.get("description", "") + PYTHON_HINT} for f in functions]
    return SYSTEM_PROMPT.replace("{functions}", json.dumps(docs, indent=4))


def task_messages(question: list[list[dict]], functions: Sequence[dict]) -> tuple[dict, ...]:
    """System prompt (merged into the row's own system message, as BFCL does), then every turn."""
    messages = [{"role": m["role"], "content": m["content"]} for turn in question for m in turn]
    prompt = system_prompt(functions)
    if messages and messages[0]["role"] == "system":
        messages[0] = {"role": "system", "content": prompt + "\n\n" + messages[0]["content"]}
    else:
        messages.insert(0, {"role": "system", "content": prompt})
    return tuple(messages)


# ------------------------------------------------------------------------------- reference


def render_value(value: Any) -> str:
    """A Python literal; strings with JSON escapes (valid in Python) in double quotes."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(render_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{render_value(k)}: {render_value(v)}" for k, v in value.items()) + "}"
    return repr(value)  # int, float (keeps "2.0"), bool, None


def render_call(name: str, arguments: dict) -> str:
    return f"{name}(" + ", ".join(f"{k}={render_value(v)}" for k, v in arguments.items()) + ")"


def first_choice(options: list) -> Any:
    """The reference's choice: "" (leave out) where that is acceptable, else the first value."""
    return "" if "" in options else options[0]


def _chosen(options: list, schema: dict, required: bool, pick: Callable[[list], Any]) -> tuple[bool, Any]:
    """(include the parameter, its value). `pick` returning "" leaves an optional parameter out; a
    parameter the schema requires is always written, from its non-"" values where it has any."""
    if not options:
        return False, None  # nothing acceptable to write
    pool = [o for o in options if o != ""] if required else options
    option = pick(pool) if pool else ""  # a required parameter whose only acceptable value is "": write ""
    if option == "" and not required:
        return False, None
    type_name = schema.get("type")
    items = schema.get("items") or {}
    if type_name == "dict" and isinstance(option, dict):
        return True, _chosen_dict(option, pick)
    if type_name in ("array", "tuple") and items.get("type") == "dict" and isinstance(option, list):
        return True, [_chosen_dict(o, pick) if isinstance(o, dict) else o for o in option]
    return True, option


def _chosen_dict(answer: dict, pick: Callable[[list], Any]) -> dict:
    """A possible-answer dict (key -> acceptable plain values); keys whose pick is "" are left out."""
    out = {}
    for key, options in answer.items():
        value = pick(options) if isinstance(options, list) and options else ""
        if value != "":
            out[key] = value
    return out


def answer_calls(answer: list[dict], functions: Sequence[dict],
                 pick: Callable[[list], Any] = first_choice) -> list[tuple[str, dict]]:
    """One acceptable answer as (name, arguments): `pick` chooses among the acceptable values.

    Two data quirks are steered around: a parameter the schema requires is written even where ""
    (omission) is listed as acceptable, and one the schema lacks is left out where it may be."""
    calls = []
    for expected in answer:
        (name, acceptable), = expected.items()
        parameters = _find_doc(functions, name)["parameters"]
        required = set(parameters.get("required", []))
        arguments = {}
        for param, options in acceptable.items():
            if param not in parameters["properties"] and "" in options:
                continue  # any value would be an unexpected parameter
            schema = parameters["properties"].get(param) or {}
            include, value = _chosen(options, schema, param in required, pick)
            if include:
                arguments[param] = value
        calls.append((name, arguments))
    return calls


def _placeholder(schema: dict) -> Any:
    if "default" in schema and _fits(schema["default"], schema.get("type")):
        return schema["default"]
    if schema.get("enum"):
        return schema["enum"][0]
    return {"string": "", "integer": 0, "float": 0.0, "boolean": False, "array": [], "tuple": [],
            "dict": {}}.get(schema.get("type"), "")


def render_answer(calls: list[tuple[str, dict]]) -> str:
    return "[" + ", ".join(render_call(name, args) for name, args in calls) + "]"


# ------------------------------------------------------------------------------------- env


class BFCL:
    """The BFCL env: categories, `all`, and a seeded stratified `train`/`test` split."""

    name = "bfcl"

    def __init__(self, config: BFCLConfig | None = None):
        self.config = config or BFCLConfig()
        c = self.config
        self.mode = check_mode_and_fraction("bfcl", c.mode, MODES, c.train_fraction)
        self.categories: list[str] = []
        for name in c.categories:
            category = canonical_category(name)
            if category is None:
                raise ConfigError(f"env.bfcl.categories: '{name}' is not one of {', '.join(CATEGORIES)}")
            if category not in self.categories:
                self.categories.append(category)
        self._train_ids: set[str] | None = None

    def splits(self) -> Sequence[str]:
        return (*self.categories, *SPLITS)

    def tasks(self, split: str) -> Sequence[Task]:
        category = canonical_category(split)
        if category is not None:
            return load_category(category)
        if split not in SPLITS:
            raise ConfigError(f"bfcl has no split '{split}' (splits: {', '.join(self.splits())})")
        every = [t for c in self.categories for t in load_category(c)]
        if split == "all":
            return every
        train = self._train()
        return [t for t in every if (t.id in train) == (split == "train")]

    def _train(self) -> set[str]:
        """Per category, the `train_fraction` of rows with the smallest seeded hash of their id."""
        if self._train_ids is None:
            category = {t.id: t.category for c in self.categories for t in load_category(c)}
            self._train_ids = hash_split(category, self.config.seed, self.config.train_fraction, salt="bfcl",
                                         strata=category.get)
        return self._train_ids

    def score(self, task: Task, completion: str) -> Score:
        return self.score_modes(task, completion)[self.mode]

    def score_modes(self, task: Task, completion: str) -> dict[str, Score]:
        official = score_official(task, completion)
        return {"official": official, "strict": score_strict(task, completion, official)}

    def reference(self, task: Task) -> str:
        kind = task.meta["kind"]
        if kind == "irrelevance" or not task.meta["functions"]:
            return "None of the provided functions can be used for this request."
        if kind == "relevance":  # no ground truth: a schema-complete call to the first function
            doc = task.meta["functions"][0]
            props = doc["parameters"]["properties"]
            required = [p for p in doc["parameters"].get("required", []) if p in props]
            return render_answer([(doc["name"], {p: _placeholder(props[p]) for p in required})])
        return render_answer(answer_calls(task.answer, task.meta["functions"]))

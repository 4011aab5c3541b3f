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

`official` mode reproduces the verdict of BFCL's released evaluator (bfcl_eval 2026.3.23,
`model_handler/utils.py:default_decode_ast_prompting` and `eval_checker/ast_eval/ast_checker.py`),
re-implemented here from its rules:
  decoding  strip backticks, newlines and spaces from both ends, wrap in [...] if not already, strip
            quotes, parse as a Python expression; a single call or a list of calls. Keyword arguments
            only (positional ones are silently dropped); a bare name is read as its string, a call
            without keywords as its source text, a call with keywords as {name: {args}}, `-c` of a
            constant c as -c, a subscript as its source text, arithmetic on constants is computed.
  counting  simple categories: exactly one call; multiple: as many calls as expected (one);
            parallel*: as many calls as expected, matched in any order, greedily (each expected call,
            in order, takes the first still-unmatched output call that passes it).
  a call    name equal to the expected one (dotted names kept: prompt mode); every schema-required
            parameter present; every given parameter in the schema and in the possible answer;
            every possible-answer parameter given unless "" is acceptable; then per value:
  types     the schema type (string, integer, float, boolean, array, tuple, dict, any=string) must
            match exactly (bool is not an integer), except: an int is turned into a float for a float
            parameter; a tuple into a list for a tuple parameter; a value of the same type as the
            first acceptable value is accepted as "a variable" and then compared exactly. Array items
            are type-checked one level deep against the items' type (no int-for-float there), and
            not at all when "" (omission) is acceptable.
  values    strings: standardised (lowercased; spaces and , . / - _ * ^ removed; ' read as ") then
            compared with the standardised acceptable strings; lists: ordered, string items
            standardised, other items by Python ==; dicts: every key must be acceptable and its value
            (standardised if a string) among the key's acceptable values, missing keys only where ""
            is acceptable; lists of dicts: same length and every dict as above, in order; anything
            else: membership by Python == (so 1 == 1.0 == True).
  relevance irrelevance categories: success iff the output does *not* decode to at least one call
            (text, an empty list, or something unparseable all pass; a call to any name fails);
            live_relevance: success iff it does.

`strict` mode (the training reward) requires the official verdict *and* its own exact checks, so a
strict success is always an official success:
  decoding  the same wrapping, then literal values only (`lopd.envs.calls.parse_calls`): no
            positional arguments, no bare names, no arithmetic, no nested calls.
  matching  as many calls as expected, matched to the expected ones in any order (a perfect
            matching, not greedy).
  types     the schema type, with int accepted for float (also inside arrays and dicts), bool never a
            number; or the type of an acceptable value (the data's "variables" and None).
  values    strings stripped of surrounding whitespace and compared case-sensitively; numbers by
            value (a float never matches an int unless the schema says float); bools, None exactly;
            lists in order; dicts key by key. "" in the acceptable values means the parameter may be
            omitted (and, for a string, be the empty string).
  relevance irrelevance: no call found by either decoder; live_relevance: at least one call, every one
            to an offered function with its required parameters and schema-typed values.

`reference(task)` renders one acceptable answer: the first acceptable value of every parameter, leaving
out parameters that may be omitted unless the schema requires them. Rows whose possible answers fail
their own checker are listed in docs/bfcl.md. Not supported: the executable, Java, JavaScript,
multi-turn, memory, web-search and format-sensitivity categories.

    env = BFCL(BFCLConfig(mode="strict"))
    task = env.tasks("simple_python")[0]
    env.score(task, "[calculate_triangle_area(base=10, height=5)]")  # -> Score(1.0, True, ...)
"""

from __future__ import annotations

import ast
import hashlib
import json
import operator
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Sequence

from lopd.envs.base import DataError, Score, Task
from lopd.envs.calls import Call, ParseFailure, parse_calls
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
    categories: list[str] = field(default_factory=lambda: list(CATEGORIES))
    mode: str = "strict"  # official: BFCL's released checker's verdict; strict: that and exact values
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
    if not path.is_file():
        raise DataError(f"{path}: no such BFCL data file (written for {PACKAGE} {PACKAGE_VERSION}: {INSTALL_HINT})")
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        for key in required:
            if key not in row:
                raise DataError(f"{path}:{lineno}: missing key '{key}'")
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
        meta = {"functions": q["function"], "kind": kind, "source": q["_where"]}
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


# ---------------------------------------------------------------------------------- decoding

MAX_OUTPUT_CHARS = 100_000  # longer outputs are not parsed (both modes)
_MAX_POWER = 10_000  # arithmetic guards for the official decoder's evaluation of constant expressions
_MAX_SEQUENCE = 100_000


class _Undecodable(Exception):
    pass


def bfcl_wrap(text: str) -> str:
    """BFCL's prompt-mode pre-processing: trim backticks/newlines/spaces, wrap in [...], strip quotes."""
    text = text.strip("`\n ")
    if not text.startswith("["):
        text = "[" + text
    if not text.endswith("]"):
        text = text + "]"
    return text.strip().strip("'")


def decode_official(text: str) -> list[Call] | ParseFailure:
    """Decode like BFCL's prompt-mode decoder (see the module docstring). Never raises."""
    if not isinstance(text, str):
        return ParseFailure("output is not text")
    if len(text) > MAX_OUTPUT_CHARS:
        return ParseFailure(f"output longer than {MAX_OUTPUT_CHARS} characters")
    try:
        body = ast.parse(bfcl_wrap(text), mode="eval").body
        nodes = [body] if isinstance(body, ast.Call) else getattr(body, "elts", None)
        if nodes is None:
            return ParseFailure("not a call or a list of calls")
        if not all(isinstance(n, ast.Call) for n in nodes):
            return ParseFailure("the list holds something other than function calls")
        return [_loose_call(n) for n in nodes]
    except _Undecodable as e:
        return ParseFailure(str(e))
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError, OverflowError):
        return ParseFailure("not a Python call expression")


def _loose_name(func: ast.expr) -> str:
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return ".".join(reversed(parts))


def _loose_call(node: ast.Call) -> Call:
    # positional arguments are dropped; `**x` becomes a parameter named "**" (never acceptable)
    return Call(_loose_name(node.func), {kw.arg or "**": _loose_value(kw.value) for kw in node.keywords})


def _loose_value(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant):
        return "..." if node.value is Ellipsis else node.value
    if isinstance(node, ast.UnaryOp):  # BFCL negates the operand's constant, whatever the operator
        if not isinstance(node.operand, ast.Constant):
            raise _Undecodable("unsupported unary expression")
        try:
            return -node.operand.value
        except TypeError:
            raise _Undecodable("cannot negate this constant") from None
    if isinstance(node, ast.List):
        return [_loose_value(v) for v in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_loose_value(v) for v in node.elts)
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise _Undecodable("'**' inside a dict")
        return {_loose_value(k): _loose_value(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.BinOp):
        return _constant_expression(node)
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call):
        if not node.keywords:
            return ast.unparse(node)
        call = _loose_call(node)
        return {call.name: call.arguments}
    if isinstance(node, ast.Subscript):
        return ast.unparse(node.value) + "[" + ast.unparse(node.slice) + "]"
    raise _Undecodable(f"unsupported value ({type(node).__name__})")


def _guarded_pow(a: Any, b: Any) -> Any:
    if isinstance(b, (int, float)) and abs(b) > _MAX_POWER:
        raise _Undecodable("exponent too large to evaluate")
    return operator.pow(a, b)


def _guarded_mul(a: Any, b: Any) -> Any:
    for seq, n in ((a, b), (b, a)):
        if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int) and len(seq) * max(n, 0) > _MAX_SEQUENCE:
            raise _Undecodable("repetition too long to evaluate")
    return operator.mul(a, b)


def _guarded_lshift(a: Any, b: Any) -> Any:
    if isinstance(b, int) and b > _MAX_POWER:
        raise _Undecodable("shift too large to evaluate")
    return operator.lshift(a, b)


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: _guarded_mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: _guarded_pow, ast.LShift: _guarded_lshift,
    ast.RShift: operator.rshift, ast.BitOr: operator.or_, ast.BitAnd: operator.and_, ast.BitXor: operator.xor,
}
_UNARY: dict[type, Callable[[Any], Any]] = {
    ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_, ast.Invert: operator.invert,
}


def _constant_expression(node: ast.expr) -> Any:
    """Evaluate arithmetic on literals, as BFCL's decoder does with eval (we never run model text).

    Names, calls and attributes inside an expression are not evaluated: the value is undecodable
    (BFCL's eval would fail on a name too; it would call a builtin, which we do not)."""
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _constant_expression(node.left), _constant_expression(node.right)
        try:
            return _BINARY[type(node.op)](left, right)
        except (ArithmeticError, TypeError, ValueError) as e:
            raise _Undecodable(f"arithmetic fails ({type(e).__name__})") from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        try:
            return _UNARY[type(node.op)](_constant_expression(node.operand))
        except (ArithmeticError, TypeError) as e:
            raise _Undecodable(f"arithmetic fails ({type(e).__name__})") from None
    if isinstance(node, (ast.Constant, ast.List, ast.Tuple, ast.Dict, ast.Set)):
        try:
            return ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            raise _Undecodable("not a constant expression") from None
    raise _Undecodable("arithmetic on something other than literals")


def decode_strict(text: str) -> list[Call] | ParseFailure:
    """BFCL's wrapping, then literal values only (`parse_calls`). Never raises."""
    if not isinstance(text, str):
        return ParseFailure("output is not text")
    if len(text) > MAX_OUTPUT_CHARS:
        return ParseFailure(f"output longer than {MAX_OUTPUT_CHARS} characters")
    return parse_calls(bfcl_wrap(text))


# ------------------------------------------------------------------------ official checker

_PY_TYPES: dict[str, type] = {"string": str, "integer": int, "float": float, "boolean": bool,
                              "array": list, "tuple": list, "dict": dict, "any": str}
_STANDARDISE = re.compile(r"[ ,./\-_*^]")


def standardise(text: str) -> str:
    """BFCL's string normalisation: drop spaces and , . / - _ * ^, lowercase, ' -> "."""
    return _STANDARDISE.sub("", text).lower().replace("'", '"')


def _std(value: Any) -> Any:
    return standardise(value) if type(value) is str else value


def _first_type(acceptable: Any) -> type | None:
    """Type of the first acceptable value that is not the omission marker ""."""
    for value in acceptable:
        if value != "":
            return type(value)
    return None


def _describe(value: Any) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int too long to print
        return f"a {type(value).__name__} too long to show"
    return text if len(text) <= 80 else text[:77] + "..."


def _official_type_ok(value: Any, acceptable: list, expected: type, nested: type | None) -> tuple[bool, bool]:
    """(type accepted, value is "a variable"): BFCL's one-level type check."""
    answer_type = _first_type(acceptable)
    is_variable = answer_type is not None and answer_type is not expected
    if type(value) is expected:
        if nested is None:
            return True, is_variable
        for alternative in acceptable:  # the items must fit one acceptable list (anything fits a non-list)
            if type(alternative) is not list or all(_official_item_ok(v, alternative, nested) for v in value):
                return True, is_variable
        return False, is_variable
    return answer_type is not None and type(value) is answer_type, True


def _official_item_ok(item: Any, alternative: list, nested: type) -> bool:
    answer_type = _first_type(alternative)
    return type(item) is nested or (answer_type is not None and type(item) is answer_type)


def _official_dict_ok(value: dict, acceptable: list) -> bool:
    return any(alt != "" and _official_one_dict_ok(value, alt) for alt in acceptable)


def _official_one_dict_ok(value: Any, alternative: Any) -> bool:
    if not isinstance(value, dict) or not isinstance(alternative, dict):
        return False
    for key, item in value.items():
        if key not in alternative or not isinstance(alternative[key], (list, str)):
            return False
        if _std(item) not in [_std(a) for a in alternative[key]]:
            return False
    return all(key in value or "" in options for key, options in alternative.items())


def _official_list_of_dicts_ok(value: list, acceptable: list) -> bool:
    for alternative in acceptable:
        if not isinstance(alternative, (list, str)) or len(value) != len(alternative):
            continue
        if all(_official_one_dict_ok(v, a) for v, a in zip(value, alternative)):
            return True
    return False


def _official_list_ok(value: list, acceptable: list) -> bool:
    got = [_std(v) for v in value]
    return any(isinstance(alt, (list, str)) and got == [_std(a) for a in alt] for alt in acceptable)


def _official_value_ok(value: Any, acceptable: list, expected: type, nested: type | None) -> bool:
    if expected is dict:
        return _official_dict_ok(value, acceptable)
    if expected is list and nested is dict:
        return _official_list_of_dicts_ok(value, acceptable)
    if expected is str:
        return _std(value) in [_std(a) for a in acceptable if type(a) is str]
    if expected is list:
        return _official_list_ok(value, acceptable)
    return value in acceptable


def official_call_fault(call: Call, expected: dict, doc: dict) -> str | None:
    """The first fault BFCL's checker finds in one call against one possible answer, or None."""
    (name, acceptable), = expected.items()
    if call.name != doc["name"]:
        return f"Wrong function: expected a call to '{doc['name']}', got '{call.name}'."
    properties = doc["parameters"]["properties"]
    for param in doc["parameters"].get("required", []):
        if param not in call.arguments:
            return f"Missing parameter '{param}' (required by '{name}')."
    for param, value in call.arguments.items():
        if param not in properties or param not in acceptable:
            return f"Unexpected parameter '{param}' in the call to '{name}'."
        fault = _official_param_fault(param, value, acceptable[param], properties[param])
        if fault:
            return fault
    for param, options in acceptable.items():
        if param not in call.arguments and "" not in options:
            return f"Missing parameter '{param}' (the request specifies it)."
    return None


def _official_param_fault(param: str, value: Any, acceptable: list, schema: dict) -> str | None:
    type_name = schema.get("type")
    expected = _PY_TYPES.get(type_name)
    if expected is None:
        return f"Parameter '{param}' has a schema type ({type_name}) BFCL's checker does not know."
    nested = None
    if type_name in ("array", "tuple"):
        nested = _PY_TYPES.get(schema.get("items", {}).get("type"))
        if nested is None:
            return f"Parameter '{param}' has an item type BFCL's checker does not know."
    if type_name == "tuple" and type(value) is tuple:
        value = list(value)
    if type_name == "float" and type(value) is int:
        try:
            value = float(value)
        except OverflowError:
            return f"Wrong value for '{param}': {_describe(value)} is out of range."
    type_ok, is_variable = _official_type_ok(value, acceptable, expected, nested)
    if not type_ok:
        return f"Wrong type for '{param}': expected {type_name}, got {type(value).__name__} ({_describe(value)})."
    ok = value in acceptable if is_variable else _official_value_ok(value, acceptable, expected, nested)
    return None if ok else f"Wrong value for '{param}': {_describe(value)}."


def _find_doc(functions: Sequence[dict], name: str) -> dict:
    return next((f for f in functions if f["name"] == name), {"name": name, "parameters": {"properties": {}}})


def _count_fault(got: int, want: int) -> str:
    return f"Wrong number of calls: expected {want}, got {got}."


def official_fault(calls: list[Call], answer: list[dict], functions: Sequence[dict], kind: str) -> str | None:
    """BFCL's AST verdict for decoded calls: None when correct, else the first fault it finds."""
    if len(calls) != len(answer):
        return _count_fault(len(calls), len(answer))
    if kind == "simple":
        return official_call_fault(calls[0], answer[0], functions[0])
    if kind == "multiple":
        return official_call_fault(calls[0], answer[0], _find_doc(functions, next(iter(answer[0]))))
    stray = _stray_call_fault(calls, answer)
    if stray:
        return stray
    matched: set[int] = set()
    for expected in answer:  # greedy: each expected call takes the first unmatched output call it accepts
        doc = _find_doc(functions, next(iter(expected)))
        faults = {}
        for i, call in enumerate(calls):
            if i in matched:
                continue
            faults[i] = official_call_fault(call, expected, doc)
            if faults[i] is None:
                matched.add(i)
                break
        else:
            return _unmatched_fault(doc["name"], calls, faults)
    return None


def _stray_call_fault(calls: list[Call], answer: list[dict]) -> str | None:
    """A call to a function no expected call names can match nothing: say so first."""
    expected = list(dict.fromkeys(next(iter(e)) for e in answer))
    for call in calls:
        if call.name not in expected:
            return f"Wrong function: '{call.name}' is not among the expected calls ({', '.join(expected)})."
    return None


def _unmatched_fault(name: str, calls: list[Call], faults: dict[int, str | None]) -> str:
    same_name = [i for i in faults if calls[i].name == name]
    if same_name:
        return f"No call matches the expected call to '{name}': {faults[same_name[0]]}"
    got = ", ".join(sorted({calls[i].name for i in faults})) or "nothing"
    return f"Wrong function: expected a call to '{name}', the remaining calls are to {got}."


# --------------------------------------------------------------------------- strict checker


def _fits(value: Any, type_name: str | None) -> bool:
    """Strict schema type: int is accepted for float, bool is never a number, tuple is a list only for tuple."""
    if type_name == "string":
        return isinstance(value, str)
    if type_name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if type_name == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if type_name == "boolean":
        return isinstance(value, bool)
    if type_name == "array":
        return isinstance(value, list)
    if type_name == "tuple":
        return isinstance(value, (list, tuple))
    if type_name == "dict":
        return isinstance(value, dict)
    return True  # any, or a type the schema does not name


def _strict_type_fault(param: str, value: Any, schema: dict, acceptable: list) -> str | None:
    type_name = schema.get("type")
    answer_types = {type(a) for a in acceptable if a != ""}
    if not _fits(value, type_name) and type(value) not in answer_types:
        return f"Wrong type for '{param}': expected {type_name}, got {type(value).__name__} ({_describe(value)})."
    items = schema.get("items") or {}
    if isinstance(value, (list, tuple)) and items.get("type") and _fits(value, type_name):
        item_types = {type(i) for a in acceptable if isinstance(a, list) for i in a}
        for i, item in enumerate(value):
            if not _fits(item, items["type"]) and type(item) not in item_types:
                return (f"Wrong type for '{param}[{i}]': expected {items['type']}, "
                        f"got {type(item).__name__} ({_describe(item)}).")
    return None


def strict_equal(value: Any, answer: Any, schema: dict | None = None) -> bool:
    """Exact equality after normalisation: strings stripped (case kept), numbers by value (int for float)."""
    type_name = (schema or {}).get("type")
    if isinstance(answer, bool) or isinstance(value, bool):
        return type(value) is bool and type(answer) is bool and value == answer
    if answer is None or value is None:
        return answer is None and value is None
    if isinstance(answer, (int, float)):
        if not isinstance(value, (int, float)):
            return False
        if isinstance(value, float) and isinstance(answer, int) and type_name != "float":
            return False  # a float never stands for an int
        return value == answer
    if isinstance(answer, str):
        return isinstance(value, str) and value.strip() == answer.strip()
    if isinstance(answer, list):
        if not isinstance(value, list) and not (type_name == "tuple" and isinstance(value, tuple)):
            return False
        items = (schema or {}).get("items")
        return len(value) == len(answer) and all(strict_equal(v, a, items) for v, a in zip(value, answer))
    if isinstance(answer, dict):
        properties = (schema or {}).get("properties") or {}
        return (isinstance(value, dict) and value.keys() == answer.keys()
                and all(strict_equal(value[k], answer[k], properties.get(k)) for k in answer))
    return False


def _strict_alternatives_dict(value: Any, answer: dict, schema: dict) -> bool:
    """A dict against a possible-answer dict whose values are lists of acceptable values."""
    if not isinstance(value, dict) or not value.keys() <= answer.keys():
        return False
    properties = schema.get("properties") or {}
    for key, options in answer.items():
        if not isinstance(options, list):
            return False
        if key not in value:
            if "" not in options:
                return False
        elif not any(_strict_option(value[key], o, properties.get(key) or {}) for o in options):
            return False
    return True


def _strict_option(value: Any, option: Any, schema: dict) -> bool:
    if option == "":
        return value == "" and schema.get("type") in ("string", "any", None)
    return strict_equal(value, option, schema)


def strict_value_ok(value: Any, option: Any, schema: dict) -> bool:
    """One parameter value against one acceptable value of the possible answer (dicts: alternatives)."""
    type_name = schema.get("type")
    items = schema.get("items") or {}
    if option == "":
        return _strict_option(value, option, schema)
    if type_name == "dict" and isinstance(option, dict):
        return _strict_alternatives_dict(value, option, schema)
    if type_name in ("array", "tuple") and items.get("type") == "dict" and isinstance(option, list):
        return (isinstance(value, (list, tuple)) and len(value) == len(option)
                and all(isinstance(o, dict) and _strict_alternatives_dict(v, o, items) for v, o in zip(value, option)))
    return strict_equal(value, option, schema)


def strict_call_fault(call: Call, expected: dict, doc: dict) -> str | None:
    """The first fault of one call against one possible answer under strict rules, or None."""
    (name, acceptable), = expected.items()
    if call.name != name:
        return f"Wrong function: expected a call to '{name}', got '{call.name}'."
    properties = doc["parameters"]["properties"]
    for param in doc["parameters"].get("required", []):
        if param not in call.arguments:
            return f"Missing parameter '{param}' (required by '{name}')."
    for param, value in call.arguments.items():
        if param not in properties or param not in acceptable:
            return f"Unexpected parameter '{param}' in the call to '{name}'."
        schema = properties[param]
        fault = _strict_type_fault(param, value, schema, acceptable[param])
        if fault:
            return fault
        if not any(strict_value_ok(value, option, schema) for option in acceptable[param]):
            return f"Wrong value for '{param}': {_describe(value)}."
    for param, options in acceptable.items():
        if param not in call.arguments and "" not in options:
            return f"Missing parameter '{param}' (the request specifies it)."
    return None


def _perfect_matching(ok: list[list[bool]]) -> list[int | None]:
    """ok[i][j]: expected i accepts output j. Returns, per expected call, its output index (or None)."""
    owner: dict[int, int] = {}  # output j -> expected i

    def augment(i: int, seen: set[int]) -> bool:
        for j, fits in enumerate(ok[i]):
            if fits and j not in seen:
                seen.add(j)
                if j not in owner or augment(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    for i in range(len(ok)):
        augment(i, set())
    by_expected: list[int | None] = [None] * len(ok)
    for j, i in owner.items():
        by_expected[i] = j
    return by_expected


def strict_fault(calls: list[Call], answer: list[dict], functions: Sequence[dict]) -> str | None:
    """Strict verdict for literal calls: as many as expected, matched in any order, exact values."""
    if len(calls) != len(answer):
        return _count_fault(len(calls), len(answer))
    stray = _stray_call_fault(calls, answer) if len(answer) > 1 else None
    if stray:
        return stray
    docs = [_find_doc(functions, next(iter(expected))) for expected in answer]
    faults = [[strict_call_fault(c, expected, doc) for c in calls] for expected, doc in zip(answer, docs)]
    matching = _perfect_matching([[f is None for f in row] for row in faults])
    for i, j in enumerate(matching):
        if j is None:
            if len(answer) == 1:
                return faults[0][0]
            unmatched = {k: faults[i][k] for k in range(len(calls)) if k not in matching}
            return _unmatched_fault(docs[i]["name"], calls, unmatched)
    return None


def strict_relevance_fault(calls: list[Call], functions: Sequence[dict]) -> str | None:
    """live_relevance under strict rules: every call to an offered function, schema-complete and typed."""
    docs = {f["name"]: f for f in functions}
    for call in calls:
        if call.name not in docs:
            return f"Wrong function: '{call.name}' is not among the offered functions."
        parameters = docs[call.name]["parameters"]
        for param in parameters.get("required", []):
            if param not in call.arguments:
                return f"Missing parameter '{param}' (required by '{call.name}')."
        for param, value in call.arguments.items():
            schema = parameters["properties"].get(param)
            if schema is None:
                return f"Unexpected parameter '{param}' in the call to '{call.name}'."
            fault = _strict_type_fault(param, value, schema, [])
            if fault:
                return fault
    return None


# -------------------------------------------------------------------------------- verdicts

CORRECT_AST = "Correct call(s)."
CORRECT_IRRELEVANCE = "Correct: no function call, none of the functions fits the request."
CORRECT_RELEVANCE = "Correct: a function call was made."


def _score(fault: str | None, correct: str) -> Score:
    return Score(1.0, True, correct) if fault is None else Score(0.0, False, fault)


def _has_call(decoded: list[Call] | ParseFailure) -> bool:
    return not isinstance(decoded, ParseFailure) and len(decoded) > 0


def _call_made_fault(decoded: list[Call]) -> str:
    names = ", ".join(dict.fromkeys(c.name for c in decoded))
    return f"Wrong number of calls: expected none (no function fits the request), got a call to {names}."


def score_official(task: Task, completion: str) -> Score:
    kind = task.meta["kind"]
    decoded = decode_official(completion)
    if kind == "irrelevance":
        return _score(_call_made_fault(decoded) if _has_call(decoded) else None, CORRECT_IRRELEVANCE)
    if kind == "relevance":
        fault = None if _has_call(decoded) else "Wrong number of calls: expected at least one call, got none."
        return _score(fault, CORRECT_RELEVANCE)
    if isinstance(decoded, ParseFailure):
        return Score(0.0, False, f"Unparseable output: {decoded.reason}.")
    return _score(official_fault(decoded, task.answer, task.meta["functions"], kind), CORRECT_AST)


def score_strict(task: Task, completion: str, official: Score | None = None) -> Score:
    official = official or score_official(task, completion)
    kind = task.meta["kind"]
    decoded = decode_strict(completion)
    if kind == "irrelevance":
        fault = _call_made_fault(decoded) if _has_call(decoded) else None
        return _score(fault, CORRECT_IRRELEVANCE) if fault or official.success else official
    if kind == "relevance" and not official.success:
        return official  # no call at all
    if isinstance(decoded, ParseFailure):
        return Score(0.0, False, f"Unparseable output: {decoded.reason}.")
    if kind == "relevance":
        fault = strict_relevance_fault(decoded, task.meta["functions"])
        correct = CORRECT_RELEVANCE
    else:
        fault = strict_fault(decoded, task.answer, task.meta["functions"])
        correct = CORRECT_AST
    if fault is None and not official.success:
        fault = f"BFCL's checker rejects it: {official.feedback}"
    return _score(fault, correct)


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
        if c.mode not in MODES:
            raise ConfigError(f"env.bfcl.mode: '{c.mode}' is not one of {', '.join(MODES)}")
        if not 0.0 <= c.train_fraction <= 1.0:
            raise ConfigError(f"env.bfcl.train_fraction: {c.train_fraction} is not between 0 and 1")
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
            self._train_ids = set()
            for category in self.categories:
                ids = sorted((t.id for t in load_category(category)), key=self._hash)
                self._train_ids.update(ids[: round(self.config.train_fraction * len(ids))])
        return self._train_ids

    def _hash(self, task_id: str) -> str:
        return hashlib.sha256(f"bfcl/{self.config.seed}/{task_id}".encode()).hexdigest()

    def score(self, task: Task, completion: str) -> Score:
        return self.score_modes(task, completion)[self.config.mode]

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

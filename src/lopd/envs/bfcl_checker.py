"""BFCL verdicts in two modes: `official` (the released evaluator's rules) and `strict` (the training reward).

Both take a task of `lopd.envs.bfcl` and the model's raw completion and return a `Score` (reward 1 or 0
and one sentence naming the fault). Neither ever raises on a completion; outputs longer than
`MAX_OUTPUT_CHARS` are not parsed.

`official` mode reproduces the verdict of BFCL's released evaluator (bfcl_eval 2026.3.23,
`model_handler/utils.py:default_decode_ast_prompting` and `eval_checker/ast_eval/ast_checker.py`),
re-implemented here from its rules:
  decoding  strip backticks, newlines and spaces from both ends, wrap in [...] if not already, strip
            quotes, parse as a Python expression; a single call or a list of calls. Keyword arguments
            only (positional ones are silently dropped); a bare name is read as its string, a call
            without keywords as its source text, a call with keywords as {name: {args}}, `-c` of a
            constant c as -c, a subscript as its source text, arithmetic on constants is computed
            (a value that would exceed 100,000 bits or items is not: it decodes as `TooLarge`, which
            keeps the call a call and matches nothing).
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
            matching, not greedy). Without one, the feedback names the first call left out of a
            maximum matching and its fault against the closest expected call left out.
  types     the schema type, with int accepted for float (also inside arrays and dicts), bool never a
            number; or the type of an acceptable value (the data's "variables" and None).
  values    strings stripped of surrounding whitespace and compared case-sensitively; numbers by
            value (a float never matches an int unless the schema says float); bools, None exactly;
            lists in order; dicts key by key. "" in the acceptable values means the parameter may be
            omitted (and, for a string, be the empty string).
  relevance irrelevance: no call found by either decoder; live_relevance: at least one call, every one
            to an offered function with its required parameters and schema-typed values.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

from lopd.envs.base import Score, Task, bipartite_matching
from lopd.envs.bfcl_decode import decode_official, decode_strict
from lopd.envs.calls import Call, ParseFailure

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


def _call_fault(call: Call, expected: dict, doc: dict, name_from_doc: bool,
                param_fault: Callable[[str, Any, list, dict], str | None]) -> str | None:
    """The first fault of one call against one possible answer, checked the way both modes do: the
    function's name (the doc's with `name_from_doc`, else the answer's), the parameters the schema
    requires, every given parameter (in the schema and the answer, then `param_fault(param, value,
    acceptable values, schema)`), and the answer's parameters that may not be omitted."""
    (name, acceptable), = expected.items()
    want = doc["name"] if name_from_doc else name
    if call.name != want:
        return f"Wrong function: expected a call to '{want}', got '{call.name}'."
    properties = doc["parameters"]["properties"]
    for param in doc["parameters"].get("required", []):
        if param not in call.arguments:
            return f"Missing parameter '{param}' (required by '{name}')."
    for param, value in call.arguments.items():
        if param not in properties or param not in acceptable:
            return f"Unexpected parameter '{param}' in the call to '{name}'."
        fault = param_fault(param, value, acceptable[param], properties[param])
        if fault:
            return fault
    for param, options in acceptable.items():
        if param not in call.arguments and "" not in options:
            return f"Missing parameter '{param}' (the request specifies it)."
    return None


def official_call_fault(call: Call, expected: dict, doc: dict) -> str | None:
    """The first fault BFCL's checker finds in one call against one possible answer, or None."""
    return _call_fault(call, expected, doc, True, _official_param_fault)


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


def _strict_param_fault(param: str, value: Any, acceptable: list, schema: dict) -> str | None:
    fault = _strict_type_fault(param, value, schema, acceptable)
    if fault:
        return fault
    if not any(strict_value_ok(value, option, schema) for option in acceptable):
        return f"Wrong value for '{param}': {_describe(value)}."
    return None


def strict_call_fault(call: Call, expected: dict, doc: dict) -> str | None:
    """The first fault of one call against one possible answer under strict rules, or None."""
    return _call_fault(call, expected, doc, False, _strict_param_fault)


def strict_fault(calls: list[Call], answer: list[dict], functions: Sequence[dict]) -> str | None:
    """Strict verdict for literal calls: as many as expected, matched in any order, exact values."""
    if len(calls) != len(answer):
        return _count_fault(len(calls), len(answer))
    stray = _stray_call_fault(calls, answer) if len(answer) > 1 else None
    if stray:
        return stray
    docs = [_find_doc(functions, next(iter(expected))) for expected in answer]
    faults = [[strict_call_fault(c, expected, doc) for c in calls] for expected, doc in zip(answer, docs)]
    matching = bipartite_matching([[f is None for f in row] for row in faults])
    if None not in matching:
        return None
    if len(answer) == 1:
        return faults[0][0]
    return _closest_unmatched_fault(calls, answer, docs, faults, matching)


def _strict_mismatches(call: Call, expected: dict, doc: dict) -> int:
    """How far a call is from an expected call of the same function: parameters unexpected, missing
    (and not omissible) or with a wrong value."""
    (_, acceptable), = expected.items()
    properties = doc["parameters"]["properties"]
    wrong = sum(param not in properties or param not in acceptable
                or _strict_param_fault(param, value, acceptable[param], properties[param]) is not None
                for param, value in call.arguments.items())
    return wrong + sum(param not in call.arguments and "" not in options for param, options in acceptable.items())


def _closest_unmatched_fault(calls: list[Call], answer: list[dict], docs: list[dict],
                             faults: list[list[str | None]], matching: list[int | None]) -> str:
    """The fault of the first call left out of a maximum matching, against the closest expected call of
    its function left out too: the call that is actually wrong (comparing the first unmatched expected
    call with the first unmatched call can blame a right value of another call)."""
    free = [i for i, j in enumerate(matching) if j is None]
    taken = set(matching)
    for k, call in enumerate(calls):
        rows = [i for i in free if next(iter(answer[i])) == call.name] if k not in taken else []
        if rows:
            i = min(rows, key=lambda r: _strict_mismatches(call, answer[r], docs[r]))
            return f"Call {k + 1} ({call.name}) matches no expected call: {faults[i][k]}"
    i = free[0]  # no unmatched call is to an unmatched expected call's function
    return _unmatched_fault(docs[i]["name"], calls, {k: faults[i][k] for k in range(len(calls)) if k not in taken})


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

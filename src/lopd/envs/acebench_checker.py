"""ACEBench verdicts in two modes: `official` (the released evaluator's rules) and `strict`.

Both take the model's raw reply and a row's ground truth and return a `Score` (reward 1 or 0 and one
sentence). Neither ever raises on a model reply.

official: our own implementation of the rules of ACEBench's released `eval_main.py` and
`model_eval/checker.py` (commit e6db74b), quirks included, so a number computed here is comparable with
the leaderboard (the reply is read by `lopd.envs.acebench_decode`). The rules, for the normal categories:
  * All whitespace is removed from the reply, then it is parsed as a Python expression that must be a
    list (or tuple/set) of calls. Keyword arguments only are read (positional ones are dropped); a bare
    name reads as its text (`x=true` gives "true"), a nested call as {name: {args}}, arithmetic on
    literals is computed, a unary operator negates its literal operand (`+5` reads as -5).
  * Several calls: the multiset of function names must equal the answer's (answer keys lose a `_<n>`
    suffix: `f_1`, `f_2` are two calls of `f`); each answer call needs one same-named reply call that
    passes the call check (several answer calls may use the same reply call). Several possible answers
    (a list): one must pass.
  * A call: the API's schema is the first tool whose name is a *substring* of the answer key. Every
    required parameter must be given; every given parameter must occur in the answer (optional answer
    parameters may be left out). Each value is type-checked against the schema type mapped to a Python
    type (`number` maps to int, `float` accepts an int, "true"/"false" strings pass as booleans), with an
    escape: a value of the answer's type passes the type check and then skips the value check.
  * Values: strings match when the answer, standardised (lower-cased, spaces and , . / - _ * ^ removed),
    is a substring of the standardised reply; numbers and booleans are checked by type only; lists of
    scalars must equal the answer element-wise after standardising strings; objects need the same keys,
    nested objects recurse, other fields match when `str(answer)` is a substring of `str(value)`
    (so a list inside an object compares its repr: spaces in its strings can never match, because the
    reply lost its whitespace); lists of objects compare in order, object by object; an array without an
    `items` schema counts as a list of objects.
  * Where the released evaluator raises an exception (e.g. an `objectArray` parameter, an iteration over
    a number) we count the reply as wrong and say so.
  * Hostile replies are refused before they can hang or crash the checker, each with its reason: a null
    byte, a lone surrogate, nesting deeper than `lopd.envs.calls.MAX_DEPTH` levels, arithmetic building an
    int of over 100,000 bits or a string/list of over 100,000 items (eval would take seconds or gigabytes).
Special categories look for fixed phrases in the raw reply: incomplete needs "Missing necessary
parameters", the API name and every missing parameter name as substrings; error_param needs "There is
incorrect value" and every wrong value as substrings (parameter names are not checked); irrelevant needs
"the limitations of the function".

strict: a training reward that cannot be earned by a wrong answer.
  * Normal categories: the reply (surrounding whitespace aside) must be `[call, ...]` in Python syntax with
    literal keyword arguments only (`lopd.envs.calls.parse_calls`). The calls must match one possible
    answer one-to-one in any order: same names, exactly the answer's parameters (no missing optional
    ones, no extra ones), values equal after normalisation: strings stripped of surrounding whitespace,
    otherwise exact (case, punctuation, no substrings); numbers by value, an int accepted for a float
    but not a float for an int; booleans and None by identity; lists in order; objects with the same keys.
    Without a one-to-one match, the feedback names the first reply call left out of a maximum matching
    ("Call 3 (ApiName): ...", the API spelled as its schema does) and its fault against the closest answer
    call left out.
  * Special categories: the reply, optionally wrapped as ["..."], must not contain a tool call nor the
    phrase of another special category (no hedging). incomplete: exactly one
    "Missing necessary parameters (p1, p2) for the api (Name)" whose parameter set equals the answer's and
    whose API is the answer's; error_param: exactly one
    "There is incorrect value (v1, v2) for the parameters (k1, k2)" whose comma-separated values equal the
    answer's values (as a multiset) and whose parameter set equals the answer's; irrelevant: the phrase
    "the limitations of the function". Names and values may be quoted; they are compared stripped.
"""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter
from typing import Any, Iterable, Sequence

from lopd.envs.acebench_decode import MAX_CHARS, official_decode
from lopd.envs.base import Score, bipartite_matching
from lopd.envs.calls import Call, ParseFailure, parse_calls

SPECIAL_KINDS = ("incomplete", "error_param", "irrelevant")
PHRASES = {
    "incomplete": "Missing necessary parameters",
    "error_param": "There is incorrect value",
    "irrelevant": "the limitations of the function",
}

_SUFFIX = re.compile(r"_\d+$")
_STANDARDIZE = re.compile(r"[ ,./\-_*^]")


def _ok(text: str) -> Score:
    return Score(1.0, True, text)


def _wrong(text: str) -> Score:
    return Score(0.0, False, text)


def _short(value: Any, limit: int = 60) -> str:
    """A value's repr for feedback, clipped to `limit` characters; an int too long to print is described."""
    try:
        text = repr(value)
    except ValueError:  # "Exceeds the limit (4300 digits) for integer string conversion", possibly nested
        return "a number too long to show"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def answer_candidates(ground_truth: Any) -> list[dict]:
    """The possible answers of a normal row: one dict {api_key: {param: value}} per alternative."""
    return list(ground_truth) if isinstance(ground_truth, list) else [ground_truth]


def call_name(key: str, tool_names: Iterable[str]) -> str:
    """The API an answer key calls: the key itself if it is a tool, else the key without `_<n>`."""
    names = set(tool_names)
    if key in names:
        return key
    return _SUFFIX.sub("", key)


# ===================================================================================== official


class _Crash(Exception):
    """A point where the released evaluator raises instead of giving a verdict."""


_OFFICIAL_TYPES: dict[str, type] = {
    "string": str, "any": str,
    "integer": int, "int": int, "number": int,  # "number" maps to int: a float only passes by the answer-type escape
    "float": float,
    "boolean": bool,
    "array": list, "tuple": list, "list": list, "objectArray": list, "list(string)": list, "list(enum)": list,
    "object": dict, "dict": dict,
    "enum": enumerate,  # matches no value: enum-typed values pass only by the answer-type escape
}
_NESTED_TYPES = {"array", "tuple", "list(string)", "list(enum)", "object", "objectArray"}


def standardize(text: str) -> str:
    """The released evaluator's string normal form: some punctuation and spaces dropped, lower case."""
    return _STANDARDIZE.sub("", text).lower().replace("'", '"')


def _official_type(value: Any, answer: Any, expected: type, nested: type | None) -> tuple[bool, bool]:
    """(type check passes, value check skipped): the released type rule, answer-type escape included."""
    answer_type = None if answer == "" else type(answer)  # "" marks an optional parameter
    skip = answer_type is not None and answer_type is not expected
    if value == "true":
        value = True
    if value == "false":
        value = False
    nested_failed = False
    if type(value) is expected:
        if nested is None:
            return True, skip
        for item in answer:  # a non-iterable answer raises here, as in the released code
            fits = True
            if type(item) is list:
                fits = all(_official_type(v, item, nested, None)[0] for v in value)
            if fits:
                return True, skip
        nested_failed = True
    if answer_type is not None and (type(value) is answer_type or answer == value):
        return not nested_failed, True
    return False, skip


def _official_dict(value: Any, answer: Any) -> bool:
    if not isinstance(value, dict):
        return False
    if not isinstance(answer, dict):
        raise _Crash("an object compared with a non-object answer")
    if len(value) != len(answer):
        return False
    for key, got in value.items():
        if got == "true":
            got = True
        if got == "false":
            got = False
        if key not in answer:
            return False
        want = answer[key]
        if isinstance(want, dict):
            if not _official_dict(got, want):
                return False
            continue
        got_norm = standardize(got) if type(got) is str else got
        want_norm = standardize(want) if type(want) is str else want
        if str(want_norm) not in str(got_norm):
            return False
    return True


def _official_list_of_dicts(value: list, answer: Any) -> bool:
    if len(value) != len(answer):
        return False
    return all(_official_dict(value[i], answer[i]) for i in range(len(value)))


def _official_list(value: list, answer: Any) -> bool:
    got = [standardize(x) if type(x) is str else x for x in value]
    want = [standardize(answer[i]) if type(answer[i]) is str else answer[i] for i in range(len(answer))]
    return got == want


def _official_call(tool: dict | None, name: str, args: dict, answer: dict) -> str | None:
    """Why one reply call fails one answer call under the released rules, or None."""
    if tool is None:
        raise _Crash("no tool of the row matches the answer's API")
    schema = tool["parameters"]
    if args == {} and schema == {}:
        return None
    if args == {} or schema == {}:
        return f"'{name}' is called without arguments" if args == {} else f"'{name}' takes no arguments"
    if answer == schema["properties"]:
        return None
    if answer == {}:
        return f"'{name}' should be called without arguments"
    if tool["name"] != name:
        return f"the answer's schema belongs to '{tool['name']}', not '{name}'"
    properties, required = schema["properties"], schema["required"]
    for param in required:
        if param not in args:
            return f"required parameter '{param}' of '{name}' is missing"
    for param, value in args.items():
        if param not in properties or param not in answer:
            return f"parameter '{param}' of '{name}' is not expected"
        type_name = properties[param]["type"]
        expected = _OFFICIAL_TYPES[type_name]
        nested = None
        if type_name in _NESTED_TYPES:
            try:
                nested_name = properties[param]["items"]["type"]
            except Exception:
                nested_name = "string" if "string" in type_name else "enum" if "enum" in type_name else "dict"
            nested = _OFFICIAL_TYPES[nested_name]
        if type_name == "tuple" and type(value) is tuple:
            value = list(value)
        if type_name == "float" and type(value) is int:
            value = float(value)
        passes, skip = _official_type(value, answer[param], expected, nested)
        if not passes:
            return f"parameter '{param}' of '{name}' has the wrong type ({type(value).__name__})"
        if skip:
            continue
        want = answer[param]
        if expected is dict:
            right = _official_dict(value, want)
        elif expected is list and nested is dict:
            if type_name == "objectArray":
                if len(value) != len(want):
                    return f"parameter '{param}' of '{name}' has the wrong number of objects"
                if value and want:
                    raise _Crash("objectArray parameters break the released checker")
            right = _official_list_of_dicts(value, want)
        elif expected is str:
            right = standardize(want) in standardize(value)
        elif expected is list:
            right = _official_list(value, want)
        else:  # numbers and booleans: the type check was all
            right = True
        if not right:
            return f"parameter '{param}' of '{name}' has the wrong value {_short(value)}"
    return None


def _first_tool(tools: Sequence[dict], key: str) -> dict | None:
    return next((t for t in tools if t["name"] in key), None)  # substring, as the released lookup does


def _official_candidate(tools: Sequence[dict], calls: list[tuple[str, dict]], answer: dict) -> str | None:
    if len(calls) != len(answer):
        return f"expected {len(answer)} call(s), got {len(calls)}"
    keys = list(answer)
    names = [_SUFFIX.sub("", k) for k in keys]
    got, want = Counter(n for n, _ in calls), Counter(names)
    for n in got:
        if n not in want:
            return f"'{n}' is not among the answer's calls"
    for n in want:
        if n not in got:
            return f"the answer's call of '{n}' is missing"
    for n, count in got.items():
        if count != want[n]:
            return f"'{n}' is called {count} time(s), expected {want[n]}"
    for key, name in zip(keys, names):
        tool = _first_tool(tools, key)
        fault = None
        for reply_name, args in calls:
            if reply_name != name:
                fault = f"no call of '{name}' matches the answer"
                continue
            fault = _official_call(tool, name, args, answer[key])
            if fault is None:
                break
        if fault is not None:
            return fault
    return None


def official_normal(tools: Sequence[dict], text: str, ground_truth: Any) -> Score:
    """The released evaluator's verdict on a normal-category reply."""
    calls = official_decode(text)
    if isinstance(calls, str):
        return _wrong(f"Not a list of calls under the released rules: {calls}.")
    first_fault = None
    try:
        for answer in answer_candidates(ground_truth):
            fault = _official_candidate(tools, calls, answer)
            if fault is None:
                return _ok("Correct under the released ACEBench rules.")
            first_fault = first_fault or fault
    except Exception as e:  # _Crash or what the released code would raise at the same point
        return _wrong(f"The released evaluator raises an error on this reply ({type(e).__name__}: {e}); counted wrong.")
    return _wrong(first_fault[0].upper() + first_fault[1:] + ".")


def official_special(kind: str, text: str, ground_truth: Any) -> Score:
    """The released evaluator's verdict on a special-category reply: fixed phrases as substrings."""
    if kind not in SPECIAL_KINDS:
        raise ValueError(f"unknown special kind {kind!r}")
    if not isinstance(text, str):
        return _wrong("The reply is not text.")
    phrase = PHRASES[kind]
    if kind == "irrelevant":
        if phrase not in text:
            return _wrong(f"The reply does not say '{phrase}'.")
        return _ok("Declined under the released ACEBench rules.")
    for name, values in ground_truth.items():
        if phrase not in text:
            return _wrong(f"The reply does not say '{phrase}'.")
        if kind == "incomplete" and name not in text:
            return _wrong("The reply does not name the API that lacks parameters.")
        for value in values:
            if value not in text:
                what = "a missing parameter" if kind == "incomplete" else "an incorrect value"
                return _wrong(f"The reply does not name {what} the user gave or left out.")
    return _ok("Correct under the released ACEBench rules.")


# ======================================================================================= strict


def strict_value_fault(got: Any, want: Any, where: str) -> str | None:
    """Why `got` is not `want` after strict normalisation, or None."""
    if isinstance(want, bool) or want is None:
        return None if got is want else f"'{where}' has the wrong value {_short(got)}"
    if isinstance(want, int):
        if type(got) is not int:
            return f"'{where}' should be an integer, got {type(got).__name__}"
        return None if got == want else f"'{where}' has the wrong value {_short(got)}"
    if isinstance(want, float):
        if type(got) not in (int, float):
            return f"'{where}' should be a number, got {type(got).__name__}"
        same = got == want or (math.isnan(want) and math.isnan(got))
        return None if same else f"'{where}' has the wrong value {_short(got)}"
    if isinstance(want, str):
        if not isinstance(got, str):
            return f"'{where}' should be a string, got {type(got).__name__}"
        return None if got.strip() == want.strip() else f"'{where}' has the wrong value {_short(got)}"
    if isinstance(want, list):
        if not isinstance(got, list):
            return f"'{where}' should be a list, got {type(got).__name__}"
        if len(got) != len(want):
            return f"'{where}' should have {len(want)} item(s), got {len(got)}"
        for i, (g, w) in enumerate(zip(got, want)):
            if fault := strict_value_fault(g, w, f"{where}[{i}]"):
                return fault
        return None
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return f"'{where}' should be an object, got {type(got).__name__}"
        return strict_args_fault(got, want, where + ".")
    return None if got == want else f"'{where}' has the wrong value {_short(got)}"


def strict_args_fault(got: dict, want: dict, prefix: str = "") -> str | None:
    for key in want:
        if key not in got:
            return f"parameter '{prefix}{key}' is missing"
    for key in got:
        if key not in want:
            return f"parameter '{prefix}{key}' was not asked for"
    for key, value in want.items():
        if fault := strict_value_fault(got[key], value, prefix + str(key)):
            return fault
    return None


def _strict_candidate(calls: list[Call], answer: dict, tool_names: set[str]) -> str | None:
    """Why `calls` fail one possible answer under strict rules (a sentence without its period), or None."""
    wanted = [(call_name(k, tool_names), v) for k, v in answer.items()]
    if len(calls) != len(wanted):
        return f"Expected {len(wanted)} call(s), got {len(calls)}"
    for call in calls:
        if call.name not in tool_names:
            return f"'{call.name}' is not one of the available APIs"
    got, want = Counter(c.name for c in calls), Counter(n for n, _ in wanted)
    for name in got:
        if got[name] > want[name]:
            return f"'{name}' is called more often than the request needs"
    for name in want:
        if got[name] < want[name]:
            return f"A call of '{name}' is missing"
    faults = [[None if c.name != n else strict_args_fault(c.arguments, a) for c in calls] for n, a in wanted]
    compatible = [[c.name == n and f is None for c, f in zip(calls, row)] for (n, _), row in zip(wanted, faults)]
    matching = bipartite_matching(compatible)
    if None not in matching:  # every answer call has its own reply call
        return None
    return _unmatched_call_fault(calls, wanted, faults, matching)


def _mismatches(got: dict, want: dict) -> int:
    """How far a call's arguments are from an answer call's: parameters missing or extra, plus wrong values."""
    shared = got.keys() & want.keys()
    return len(got.keys() ^ want.keys()) + sum(strict_value_fault(got[k], want[k], str(k)) is not None for k in shared)


def _unmatched_call_fault(calls: list[Call], wanted: list[tuple[str, dict]], faults: list[list[str | None]],
                          matching: list[int | None]) -> str:
    """The fault of the first reply call left out of a maximum matching, against the closest answer call
    that is left out too (same API, fewest mismatches): the call that is actually wrong, not a right call
    compared with another call's answer. The API is named as the schema spells it."""
    free_rows = [i for i, j in enumerate(matching) if j is None]
    taken = set(matching)
    for j, call in enumerate(calls):
        if j in taken:
            continue
        rows = [i for i in free_rows if wanted[i][0] == call.name]
        if rows:  # the per-API counts agree, so an unmatched call has an unmatched answer call of its API
            i = min(rows, key=lambda r: _mismatches(call.arguments, wanted[r][1]))
            where = call.name if len(calls) == 1 else f"Call {j + 1} ({call.name})"
            return f"{where}: {faults[i][j]}"
    return "The calls do not match the answer one to one"


def _quiet_parse(text: str) -> list[Call] | ParseFailure:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return parse_calls(text)


def strict_normal(tools: Sequence[dict], text: str, ground_truth: Any) -> Score:
    """Strict verdict on a normal-category reply (see the module docstring)."""
    if not isinstance(text, str):
        return _wrong("The reply is not text.")
    body = text.strip()
    if not (body.startswith("[") and body.endswith("]")):
        return _wrong("The reply must be a list of calls in square brackets: [ApiName(key=value, ...)].")
    calls = _quiet_parse(body)
    if isinstance(calls, ParseFailure):
        return _wrong(f"Unparseable calls: {calls.reason}.")
    tool_names = {t["name"] for t in tools}
    first_fault = None
    for answer in answer_candidates(ground_truth):
        fault = _strict_candidate(calls, answer, tool_names)
        if fault is None:
            return _ok("Correct calls.")
        first_fault = first_fault or fault
    return _wrong(first_fault + ".")  # no capitalising: the sentence may start with an API's name


_WRAPPED = re.compile(r"""^\[\s*(["'])(.*)\1\s*\]$|^(["'])(.*)\3$""", re.S)
# A call with a keyword argument inside text: `name(key=`. The name is matched from the start of its run of
# word characters and dots, possessively, so each run is scanned once (49,000 letters took 6-19 s before).
_EMBEDDED_CALL = re.compile(r"(?<![\w.])([\w.]*+)\(\s*[A-Za-z_]\w*\s*=")
_NAME_START = re.compile(r"[A-Za-z_]")
_INCOMPLETE = re.compile(r"Missing necessary parameters \(([^()]*)\) for the api \(([^()]*)\)")
_ERROR_PARAM = re.compile(r"There is incorrect value \((.*?)\) for the parameters? \(([^()]*)\)", re.S)


def _unwrap(text: str) -> str:
    body = text.strip()
    m = _WRAPPED.match(body)
    if m:
        body = (m.group(2) if m.group(1) else m.group(4)).strip()
    return body


def _has_call(text: str) -> bool:
    calls = _quiet_parse(text)
    return (not isinstance(calls, ParseFailure) and len(calls) > 0) or _has_embedded_call(text)


def _has_embedded_call(text: str) -> bool:
    """Whether `text` holds `name(key=` where name is [A-Za-z_][\\w.]*: a run of word characters and dots
    with a letter or underscore in it (the name starts there) right before the parenthesis."""
    return any(_NAME_START.search(m.group(1)) for m in _EMBEDDED_CALL.finditer(text))


def _items(text: str) -> list[str]:
    """Comma-separated names or values, stripped of whitespace and of one pair of quotes."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if len(item) >= 2 and item[0] == item[-1] and item[0] in "'\"`":
            item = item[1:-1].strip()
        if item:
            out.append(item)
    return out


def strict_special(kind: str, text: str, ground_truth: Any) -> Score:
    """Strict verdict on a special-category reply (see the module docstring)."""
    if kind not in SPECIAL_KINDS:
        raise ValueError(f"unknown special kind {kind!r}")
    if not isinstance(text, str):
        return _wrong("The reply is not text.")
    if len(text) > MAX_CHARS:
        return _wrong(f"The reply is longer than {MAX_CHARS} characters.")
    body = _unwrap(text)
    if _has_call(body):
        return _wrong("The request cannot be carried out as asked, so the reply must not call an API.")
    for other, phrase in PHRASES.items():
        if other != kind and phrase in body:
            return _wrong(f"The reply also says '{phrase}': it must give one diagnosis.")
    phrase = PHRASES[kind]
    if kind == "irrelevant":
        if phrase not in body:
            return _wrong(f"The reply does not say '{phrase}'.")
        return _ok("Correctly declined.")
    pattern = _INCOMPLETE if kind == "incomplete" else _ERROR_PARAM
    found = pattern.findall(body)
    if len(found) != 1:
        form = ("Missing necessary parameters (p1, p2) for the api (ApiName)" if kind == "incomplete"
                else "There is incorrect value (value) for the parameters (key)")
        return _wrong(f"The reply must contain exactly one '{form}'." if found else f"The reply does not say '{form}'.")
    first, second = found[0]
    if kind == "incomplete":
        ((api, missing),) = ground_truth.items()
        if _items(second) != [api]:
            return _wrong("The reply names the wrong API.")
        if set(_items(first)) != {m.strip() for m in missing} or len(_items(first)) != len(set(_items(first))):
            return _wrong("The reply names the wrong missing parameters.")
        return _ok("Correctly named the missing parameters.")
    want_values = sorted(v for values in ground_truth.values() for value in values for v in _items(value))
    if sorted(_items(first)) != want_values:
        return _wrong("The reply names the wrong incorrect values.")
    names = _items(second)
    if set(names) != set(ground_truth) or len(names) != len(set(names)):
        return _wrong("The reply names the wrong parameters.")
    return _ok("Correctly named the incorrect values.")

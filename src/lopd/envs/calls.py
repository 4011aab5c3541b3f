"""Parse tool calls written as Python call syntax, the format ACEBench and BFCL use.

    book_flight(origin="PAR", date="2025-03-05")           one call
    [get_weather(city="Paris"), get_time(zone="CET")]       several calls

`parse_calls` never raises: any text gives either a list of `Call`s or a `ParseFailure` whose
`reason` says why, so a reward function can turn it into reward 0 with a sentence.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Any

MAX_CHARS = 20_000  # longer outputs are rejected before parsing (ast on huge input is slow)

_FENCE = re.compile(r"^```[a-zA-Z]*\s*\n?(.*?)\n?```$", re.S)


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict[str, Any]

    def render(self) -> str:
        args = ", ".join(f"{k}={render_value(v)}" for k, v in self.arguments.items())
        return f"{self.name}({args})"


@dataclass(frozen=True)
class ParseFailure:
    reason: str

    def __bool__(self) -> bool:  # a failure is falsy, a list of calls is truthy when non-empty
        return False


def render_value(value: Any) -> str:
    """Python-literal rendering with double-quoted strings (what the policy is taught to write)."""
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, float) and value.is_integer():
        return repr(value)  # keeps "2.0": the type is part of the answer
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(render_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{render_value(k)}: {render_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def render_calls(calls: list[Call]) -> str:
    if len(calls) == 1:
        return calls[0].render()
    return "[" + ", ".join(c.render() for c in calls) + "]"


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted_name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _one_call(node: ast.expr) -> Call | ParseFailure:
    if not isinstance(node, ast.Call):
        return ParseFailure(f"expected a function call, found {type(node).__name__.lower()}")
    name = _dotted_name(node.func)
    if name is None:
        return ParseFailure("the called object is not a plain function name")
    if node.args:
        return ParseFailure(f"{name}: positional arguments are not allowed, name every argument")
    arguments: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            return ParseFailure(f"{name}: '**' arguments are not allowed")
        if kw.arg in arguments:
            return ParseFailure(f"{name}: argument '{kw.arg}' given twice")
        try:
            arguments[kw.arg] = ast.literal_eval(kw.value)
        except Exception:  # ValueError, TypeError, RecursionError, MemoryError: all mean "not a literal"
            return ParseFailure(f"{name}: the value of '{kw.arg}' is not a literal")
    return Call(name, arguments)


def parse_calls(text: str) -> list[Call] | ParseFailure:
    """Parse model output into calls. Never raises."""
    if not isinstance(text, str):
        return ParseFailure("output is not text")
    text = text.strip()
    if not text:
        return ParseFailure("empty output, no tool call")
    if len(text) > MAX_CHARS:
        return ParseFailure(f"output longer than {MAX_CHARS} characters")
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    try:
        tree = ast.parse(text, mode="eval")
    except Exception:  # SyntaxError, ValueError (null bytes), RecursionError, MemoryError
        return ParseFailure("not a Python call expression")
    body = tree.body
    nodes = body.elts if isinstance(body, (ast.List, ast.Tuple)) else [body]
    if not nodes:
        return ParseFailure("empty list of calls")
    calls = []
    for node in nodes:
        call = _one_call(node)
        if isinstance(call, ParseFailure):
            return call
        calls.append(call)
    return calls

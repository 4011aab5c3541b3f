"""Parse tool calls written as Python call syntax, the format ACEBench and BFCL use.

    book_flight(origin="PAR", date="2025-03-05")           one call
    [get_weather(city="Paris"), get_time(zone="CET")]       several calls

`parse_calls` never raises: any text gives either a list of `Call`s or a `ParseFailure` whose
`reason` says why, so a reward function can turn it into reward 0 with a sentence.

Hostile output is refused before it can hurt a checker downstream, each with its own reason: more than
`MAX_CHARS` characters, a null byte or a lone surrogate (text no encoder accepts), nesting deeper than
`MAX_DEPTH` levels (recursive code further on would overflow the stack), and integers of more than
`MAX_INT_DIGITS` digits (Python refuses to print them: any feedback showing one would raise).
"""

from __future__ import annotations

import ast
import re
import warnings
from dataclasses import dataclass
from typing import Any

MAX_CHARS = 20_000  # longer outputs are rejected before parsing (ast on huge input is slow)
MAX_DEPTH = 100  # deepest syntax tree accepted; the benchmarks' own answers nest at most 10 deep
MAX_INT_DIGITS = 1_000  # longest integer accepted (Python prints ints of at most 4,300 digits)

_FENCE = re.compile(r"^```[a-zA-Z]*\s*\n?(.*?)\n?```$", re.S)
_SURROGATE = re.compile("[\ud800-\udfff]")
_INT_LIMIT = 10**MAX_INT_DIGITS
NESTING_REASON = f"nesting deeper than {MAX_DEPTH} levels"


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


def nesting_exceeds(node: ast.AST, limit: int = MAX_DEPTH) -> bool:
    """Whether the syntax tree under `node` is more than `limit` nodes deep (walked without recursion)."""
    stack = [(node, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return False


def parse_expression(text: str) -> ast.expr | ParseFailure:
    """`text` parsed as one Python expression, or why not: null bytes, lone surrogates and nesting get a
    reason of their own (Python's parser reports them as a syntax, encoding or memory error)."""
    if "\x00" in text:
        return ParseFailure("the output contains a null byte")
    if _SURROGATE.search(text):
        return ParseFailure("the output contains a lone surrogate (not valid Unicode)")
    try:
        with warnings.catch_warnings():  # e.g. "invalid escape sequence" in a string literal
            warnings.simplefilter("ignore")
            tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        if "too many nested" in str(e.msg):  # the tokenizer's limit of 200 open brackets
            return ParseFailure(NESTING_REASON)
        if "integer string conversion" in str(e.msg):  # a decimal literal of over 4,300 digits
            return ParseFailure(f"an integer longer than {MAX_INT_DIGITS} digits")
        return ParseFailure("not a Python call expression")
    except (RecursionError, MemoryError):  # the parser's own stack: nesting without brackets (- - - 1)
        return ParseFailure(NESTING_REASON)
    except ValueError:  # what else the parser may raise on odd input (null bytes on older Pythons)
        return ParseFailure("not a Python call expression")
    if nesting_exceeds(tree.body):
        return ParseFailure(NESTING_REASON)
    return tree.body


def value_fault(value: Any) -> str | None:
    """What makes a parsed literal unusable downstream, or None: an integer longer than `MAX_INT_DIGITS`
    digits (printing it raises ValueError) or a string with a lone surrogate (encoding it raises)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return f"an integer longer than {MAX_INT_DIGITS} digits" if abs(value) >= _INT_LIMIT else None
    if isinstance(value, str):
        return "a string with a lone surrogate (not valid Unicode)" if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        children = [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple, set, frozenset)):
        children = list(value)
    else:
        return None
    return next((fault for fault in map(value_fault, children) if fault), None)


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
        if fault := value_fault(arguments[kw.arg]):
            return ParseFailure(f"{name}: the value of '{kw.arg}' holds {fault}")
    return Call(name, arguments)


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted_name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


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
    body = parse_expression(text)
    if isinstance(body, ParseFailure):
        return body
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

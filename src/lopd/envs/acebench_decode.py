"""Reading an ACEBench reply the way its released evaluator does (`official` mode of
`lopd.envs.acebench_checker`, whose docstring gives the rules): all whitespace removed, parsed as a Python list
of calls, keyword arguments only, bare names as their text, nested calls as {name: {args}}, arithmetic on
literals computed under size guards, a unary operator negating its literal operand. Never raises on a reply."""

from __future__ import annotations

import ast
from typing import Any

from lopd.envs.base import dotted_name
from lopd.envs.calls import ParseFailure, parse_expression

MAX_CHARS = 50_000  # longer replies are wrong in both modes (parsing huge input is slow)
MAX_ITEMS = 100_000  # longest string, list or tuple the official decoder's arithmetic may build
MAX_BITS = 100_000  # largest integer (in bits) it may build

_BINOPS = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
    ast.Pow: lambda a, b: a ** b, ast.LShift: lambda a, b: a << b, ast.RShift: lambda a, b: a >> b,
    ast.BitOr: lambda a, b: a | b, ast.BitXor: lambda a, b: a ^ b, ast.BitAnd: lambda a, b: a & b,
}
_UNARY = {ast.USub: lambda a: -a, ast.UAdd: lambda a: +a, ast.Not: lambda a: not a, ast.Invert: lambda a: ~a}


def _too_large(op: ast.operator, left: Any, right: Any) -> bool:
    """Whether `left op right` would build a sequence of over MAX_ITEMS items or an int of over MAX_BITS
    bits (eval would take seconds or gigabytes: '[1]*9999*9999', "'a'*9999 + 'a'*9999 + ...")."""
    ints = all(isinstance(x, int) for x in (left, right))
    if isinstance(op, ast.Mult):
        if ints:
            return left.bit_length() + right.bit_length() > MAX_BITS
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(count, int):
                return len(seq) * max(count, 0) > MAX_ITEMS
    if isinstance(op, ast.Add) and all(isinstance(x, (str, bytes, list, tuple)) for x in (left, right)):
        return len(left) + len(right) > MAX_ITEMS
    return False


def _arith(node: ast.expr) -> Any:
    """Compute arithmetic on literals, which the released evaluator hands to eval(); nothing else."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_arith(e) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_arith(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _arith(node.left), _arith(node.right)
        numbers = all(isinstance(x, (int, float, complex)) for x in (left, right))
        if isinstance(node.op, (ast.Pow, ast.LShift)) and numbers and (
                abs(right) > 4096 or (isinstance(left, int) and left.bit_length() * abs(right) > MAX_BITS)):
            raise ValueError("exponent too large to evaluate")
        if isinstance(node.op, ast.Mult) and not numbers:
            count = left if isinstance(left, int) else right
            if isinstance(count, int) and count > 10_000:
                raise ValueError("repetition too large to evaluate")
        if _too_large(node.op, left, right):
            raise ValueError("value too large to evaluate")
        return _BINOPS[type(node.op)](left, right)
    raise ValueError(f"cannot evaluate {type(node).__name__} safely")


def _official_value(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant):
        return "..." if node.value is Ellipsis else node.value
    if isinstance(node, ast.UnaryOp):
        operand = node.operand  # the released evaluator negates the operand's literal, whatever the operator
        if not isinstance(operand, ast.Constant):
            raise ValueError("unary operator on a non-literal")
        return -operand.value
    if isinstance(node, ast.List):
        return [_official_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("'**' inside a dict")
        return {_official_value(k): _official_value(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.BinOp):
        return _arith(node)
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call):
        return {dotted_name(node.func): _official_args(node)}
    if isinstance(node, ast.Tuple):
        return tuple(_official_value(e) for e in node.elts)
    if isinstance(node, ast.Subscript):
        return ast.unparse(node.value) + "[" + ast.unparse(node.slice) + "]"
    raise ValueError(f"unsupported expression {type(node).__name__}")


def _official_args(node: ast.Call) -> dict:
    return {kw.arg: _official_value(kw.value) for kw in node.keywords}  # positional arguments are dropped


def official_decode(text: Any) -> list[tuple[str, dict]] | str:
    """The reply as [(api name, arguments)] read the released evaluator's way, or why it cannot be read."""
    if not isinstance(text, str):
        return "the reply is not text"
    if len(text) > MAX_CHARS:
        return f"the reply is longer than {MAX_CHARS} characters"
    body = parse_expression("".join(text.split()))  # warnings ("invalid decimal literal") are silenced there
    if isinstance(body, ParseFailure):
        return body.reason
    try:
        if not isinstance(body, (ast.List, ast.Tuple, ast.Set)):
            return "the reply is not a list of calls"
        calls = []
        for node in body.elts:
            if not isinstance(node, ast.Call):
                return "an element of the list is not a call"
            calls.append((dotted_name(node.func), _official_args(node)))
        return calls
    except Exception as e:  # ValueError (arithmetic guards), TypeError, RecursionError, MemoryError: not readable
        return f"it does not parse ({type(e).__name__})"

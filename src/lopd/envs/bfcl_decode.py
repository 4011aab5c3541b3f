"""Decoding a BFCL completion into calls, in the two modes of `lopd.envs.bfcl_checker` (whose docstring gives
the rules): `decode_official` as BFCL's released evaluator decodes (keyword arguments, bare names, arithmetic on
constants under size guards), `decode_strict` literal values only. Neither raises on any completion."""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass
from typing import Any, Callable

from lopd.envs.base import dotted_name
from lopd.envs.calls import Call, ParseFailure, parse_calls

MAX_OUTPUT_CHARS = 100_000  # longer outputs are not parsed (both modes)
_MAX_BITS = 100_000  # arithmetic guards for the official decoder's evaluation of constant expressions:
_MAX_SEQUENCE = 100_000  # the largest int (bits) and the longest str/bytes/list/tuple it builds


class _Undecodable(Exception):
    pass


class _TooLargeError(Exception):
    """Raised by the arithmetic guards: the expression's value would exceed _MAX_BITS or _MAX_SEQUENCE."""


@dataclass(frozen=True)
class TooLarge:
    """The value of a constant expression too large to evaluate here ('2**99999', '(3**10000)**10000',
    "'a'*99999 + 'a'*99999 + ..."), which BFCL's eval would compute (for seconds, or gigabytes). It keeps
    the call a call, as BFCL reads it (an irrelevance row fails, a relevance row passes), and it equals
    no acceptable value: its type is no schema type, so the call gets a wrong-type fault."""

    source: str  # the expression, clipped

    def __repr__(self) -> str:
        return f"{self.source} (too large to evaluate)"


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


def _loose_call(node: ast.Call) -> Call:
    # positional arguments are dropped; `**x` becomes a parameter named "**" (never acceptable)
    return Call(dotted_name(node.func), {kw.arg or "**": _loose_value(kw.value) for kw in node.keywords})


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
        try:
            return _constant_expression(node)
        except _TooLargeError:
            source = ast.unparse(node)
            return TooLarge(source if len(source) <= 40 else source[:37] + "...")
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


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _guarded_pow(a: Any, b: Any) -> Any:
    """a ** b, unless it is an int of over about _MAX_BITS bits ((3**10000)**10000 took 98 s). Other
    powers are cheap: floats and complex numbers overflow (OverflowError, as under eval) or round."""
    if _is_int(a) and _is_int(b) and b > 0 and abs(a) > 1 and (a.bit_length() - 1) * b > _MAX_BITS:
        raise _TooLargeError
    return operator.pow(a, b)


def _guarded_mul(a: Any, b: Any) -> Any:
    """a * b, unless it builds an int of over _MAX_BITS bits or a sequence of over _MAX_SEQUENCE items."""
    if _is_int(a) and _is_int(b) and a.bit_length() + b.bit_length() > _MAX_BITS:
        raise _TooLargeError
    for seq, n in ((a, b), (b, a)):
        if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int) and len(seq) * max(n, 0) > _MAX_SEQUENCE:
            raise _TooLargeError
    return operator.mul(a, b)


def _guarded_add(a: Any, b: Any) -> Any:
    """a + b, unless it joins two sequences into one of over _MAX_SEQUENCE items (a chain is quadratic)."""
    if all(isinstance(x, (str, bytes, list, tuple)) for x in (a, b)) and len(a) + len(b) > _MAX_SEQUENCE:
        raise _TooLargeError
    return operator.add(a, b)


def _guarded_lshift(a: Any, b: Any) -> Any:
    """a << b, unless it is an int of over _MAX_BITS bits."""
    if _is_int(a) and _is_int(b) and a and a.bit_length() + b > _MAX_BITS:
        raise _TooLargeError
    return operator.lshift(a, b)


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: _guarded_add, ast.Sub: operator.sub, ast.Mult: _guarded_mul, ast.Div: operator.truediv,
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

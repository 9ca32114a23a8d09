"""The calculator tool of the agentic example: find a tool call in a small model's reply, evaluate it safely.

A 135M model does not emit well-formed tool calls reliably, so two shapes are accepted: a line
`CALC: <expr>` (also `calc(<expr>)`, `Calculator: <expr>`, with anything after an `=` dropped, since the
model often writes the answer it guesses), or a JSON object naming the calculator
(`{"tool": "calculator", "expression": "3 + 4"}`, or OpenAI's `{"name": ..., "arguments": {...}}`).
Expressions are evaluated by walking their syntax tree (numbers, + - * / // % **, unary signs and
parentheses only; never `eval`), with bounds on length, exponents and magnitude. Every value, the
operands of every operation included, stays within MAX_MAGNITUDE, so the largest number ever built is
MAX_MAGNITUDE ** MAX_EXPONENT (about 1,150 digits): no expression can hang or fill memory. Every failure,
whatever a model wrote, is a CalcError.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from collections.abc import Callable

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**18
TOOL_NAMES = frozenset({"calc", "calculator"})

_CALC_LINE = re.compile(r"^[\s`*>]*calc(?:ulator)?(?=[\s:(*])[\s*]*[:(]?[\s*]*(?P<expr>[^\n]*)$",
                        re.IGNORECASE | re.MULTILINE)
_TIMES = re.compile(r"(?<=[\d)])\s*[xX×]\s*(?=[\d(])")
_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    """The expression is not arithmetic the calculator evaluates, or its value is out of bounds."""


def _clean(expr: str) -> str:
    """The expression part of what the model wrote: a guessed `= result` and wrapping quotes dropped."""
    expr = expr.split("=", 1)[0].strip().strip("`\"'").strip()
    if expr.endswith(")") and expr.count(")") > expr.count("("):  # the close of `calc(...)`
        expr = expr[:-1].rstrip()
    return expr


def _json_calls(text: str) -> list[dict]:
    """Every JSON object in `text`, in order."""
    decoder, found, i = json.JSONDecoder(), [], text.find("{")
    while i >= 0:
        try:
            obj, end = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):  # RecursionError: brackets nested ~1000 deep
            end = i + 1
        else:
            if isinstance(obj, dict):
                found.append(obj)
        i = text.find("{", end)
    return found


def _json_expression(call: dict) -> str | None:
    """The expression of a JSON calculator call, or None when `call` is not one."""
    name = call.get("tool", call.get("name"))
    if not isinstance(name, str) or name.lower() not in TOOL_NAMES:
        return None
    args = call.get("arguments", call)
    if isinstance(args, str):  # OpenAI tool calls carry their arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return args
    if not isinstance(args, dict):
        return None
    expr = next((args[k] for k in ("expression", "expr", "input") if k in args), None)
    return str(expr) if isinstance(expr, (str, int, float)) else None


def parse_tool_call(text: str) -> str | None:
    """The expression of the first calculator call in `text` (a `CALC:` line or a JSON call), or None."""
    line = _CALC_LINE.search(text)
    candidates = [(line.start(), _clean(line.group("expr")))] if line else []
    for call in _json_calls(text):
        expr = _json_expression(call)
        if expr is not None:
            candidates.append((text.find("{"), _clean(expr)))
            break
    candidates = [c for c in candidates if c[1]]
    return min(candidates)[1] if candidates else None


def _checked(value: float) -> float:
    # An int is compared as an int: one too large for a float (999999999999999999 ** 64) is out of range too.
    in_range = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    if not in_range or abs(value) > MAX_MAGNITUDE:
        shown = f"({len(str(abs(value)))} digits)" if isinstance(value, int) else repr(value)
        raise CalcError(f"the value {shown} is out of the calculator's range (|x| <= {MAX_MAGNITUDE:.0e})")
    return value


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalcError(f"the exponent {right:g} is over the calculator's limit of {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except OverflowError:  # a float result past 1.8e308 (1e18 ** 64.0)
            raise CalcError(f"the value of {ast.unparse(node)!r} is out of the calculator's range "
                            f"(|x| <= {MAX_MAGNITUDE:.0e})") from None
        return _checked(value)
    raise CalcError(f"{ast.unparse(node)!r} is not arithmetic: use numbers, + - * / // % ** and parentheses")


def evaluate(expr: str) -> int | float:
    """The value of an arithmetic expression (`x`/`×` and `^` are read as * and **); CalcError otherwise."""
    if len(expr) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"the expression has {len(expr)} characters, over the limit of {MAX_EXPRESSION_CHARS}")
    text = _TIMES.sub("*", expr.replace("÷", "/").replace("^", "**")).replace(",", "")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # what the parser raises on any text
        raise CalcError(f"cannot read {expr!r} as arithmetic") from None
    value = _eval(tree.body)  # at most MAX_EXPRESSION_CHARS deep: far within the recursion limit
    return int(value) if isinstance(value, float) and value.is_integer() else value


def format_value(value: int | float) -> str:
    """The calculator's answer as the model reads it: an integer, or at most 6 decimals."""
    return str(value) if isinstance(value, int) else f"{value:.6f}".rstrip("0").rstrip(".")

"""The `calculator` built-in: one tool that works out arithmetic, for math datasets where copying its result into the
answer is what earns the reward. Parsed, never `eval`ed: only numbers and arithmetic operators get through."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_BITS = 4096  # the largest power worked out: 9**9**9 would take the rollout child's CPU for minutes
_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """Work out an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 12"
    """
    try:
        value = _value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as error:
        return f"error: {error}"
    if isinstance(value, float) and value.is_integer() and math.isfinite(value):
        return str(int(value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def _value(node: ast.expr) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(left) > 1 and math.log2(abs(left)) * abs(right) > MAX_BITS:
            raise ValueError("the power is too large to work out")
        return _BINARY[type(node.op)](left, right)
    raise ValueError("only numbers, + - * / // % ** and parentheses are understood")


TOOLS = [calculate]
